"""A token for a generation server's routes, the weight routes included: `BAPO_SERVER_TOKEN`.

A server started with dev mode on (`bapo serve`) lets whoever reaches its port pause it, abort
its requests and load other weights into it (`/pause`, `/collective_rpc`, ...). vLLM's own token
(`--api-key`, `VLLM_API_KEY`) does not close those: its middleware guards only paths that start
with /v1, /v2, /inference or /cohere (vllm/entrypoints/serve/middleware/authenticate.py,
`GUARDED_PREFIX`, 0.32), and every dev route lies outside them. So when `BAPO_SERVER_TOKEN` is
set, `bapo serve` adds this module's `RequireToken` to the server through vLLM's `--middleware`
flag: every route but `/health` then answers 401 unless the request carries `Authorization:
Bearer <token>`. The client (rollout.servers: the trainer, `bapo eval eval.server=URL`) sends
that header whenever the variable is set in its own environment.

The token lives in the environment, never on a command line (`ps` shows those to every user);
this process masks it in everything it prints or records (redact.remember). It crosses the
network in clear text: plain HTTP. This module is imported by vLLM's API server process: the
standard library and redact only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

from bapo_cli import redact

TOKEN_ENV = "BAPO_SERVER_TOKEN"
MIDDLEWARE = "bapo_cli.rollout.server_auth.RequireToken"  # vLLM's --middleware takes its path
MIN_CHARS = 16
OPEN_PATHS = ("/health",)  # liveness, for `bapo serve`'s wait and the pool's revive probe
REFUSED = {"error": f"Unauthorized: this server needs Authorization: Bearer ${TOKEN_ENV}"}


class TokenError(ValueError):
    """A token that cannot be used; the message is one line."""


def token() -> str | None:
    """The token this process's environment holds (masked from here on), or None when unset."""
    value = os.environ.get(TOKEN_ENV) or None
    redact.remember(value)
    return value


def checked_token() -> str | None:
    """`token()`, refused in one line when it is too short to be a secret or holds characters an
    HTTP header cannot carry."""
    value = token()
    if value is None:
        return None
    if len(value) < MIN_CHARS or not all(33 <= ord(c) <= 126 for c in value):
        raise TokenError(
            f"{TOKEN_ENV} must be at least {MIN_CHARS} visible ASCII characters, no spaces "
            "(python -c 'import secrets; print(secrets.token_urlsafe())' makes one)"
        )
    return value


def refused(url: str) -> str:
    """The one line for a server that answered 401."""
    return (
        f"the server {url} refused the request (HTTP 401): it was started with a token; set "
        f"{TOKEN_ENV} to the same token in this process's environment (docs/secrets.md)"
    )


def bearer() -> dict[str, str]:
    """The header every request to a server carries: the token, when the environment holds one."""
    value = token()
    return {"authorization": f"Bearer {value}"} if value else {}


class RequireToken:
    """ASGI middleware (vLLM adds it with `--middleware`): 401 for any request but `OPEN_PATHS`
    without `Authorization: Bearer <$BAPO_SERVER_TOKEN>`; a websocket is closed instead. The
    token is read when the server builds its app; a server started without one refuses to
    start."""

    def __init__(self, app: Any) -> None:
        secret = os.environ.get(TOKEN_ENV)
        if not secret:
            raise TokenError(f"{MIDDLEWARE} needs the token in ${TOKEN_ENV}")
        self.app = app
        self.digest = hashlib.sha256(secret.encode()).digest()

    def allowed(self, scope: dict[str, Any]) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS:
            return True
        for name, value in scope.get("headers", []):
            if name.lower() == b"authorization":
                scheme, _, given = value.decode("latin-1").partition(" ")
                offered = hashlib.sha256(given.encode("latin-1")).digest()
                return scheme.lower() == "bearer" and hmac.compare_digest(offered, self.digest)
        return False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            body = json.dumps(REFUSED).encode()
            length = str(len(body)).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", length)]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})
