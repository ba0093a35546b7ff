"""The server token (`BAPO_SERVER_TOKEN`, rollout/server_auth.py) without a server: the ASGI
middleware `bapo serve` hands vLLM, called the way an ASGI server calls it; the client's header;
the token masked; vLLM's own `--api-key` leaving the dev routes open (why the middleware exists).
With a real server: tests/servers/test_serve_lifecycle.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from bapo_cli import redact
from bapo_cli.rollout import server_auth

TOKEN = "k8Jx-2_qLw9ZtYb3VmN0"
# the dev routes a weight push and the start-up check use (rollout/servers.py, weights_transfer.py)
DEV_ROUTES = ["/collective_rpc", "/pause", "/resume", "/reset_prefix_cache"]
DEV_ROUTES += ["/update_weight_version"]


def _request(path: str, headers: dict[str, str] | None = None, **scope) -> tuple[int, dict]:
    """One HTTP request through the middleware to an app that answers 200 {"ok": true}."""
    sent: list[dict] = []

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"ok": true}'})

    async def send(message) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": "POST", "path": path, "headers": raw, **scope}
    asyncio.run(server_auth.RequireToken(app)(scope, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"])


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(server_auth.TOKEN_ENV, TOKEN)
    return TOKEN


@pytest.mark.parametrize("path", [*DEV_ROUTES, "/inference/v1/generate", "/v1/models", "/x"])
def test_every_route_but_health_needs_the_token(token: str, path: str) -> None:
    assert _request(path) == (401, server_auth.REFUSED)
    assert _request(path, {"Authorization": "Bearer wrong-token-of-enough-length"})[0] == 401
    assert _request(path, {"Authorization": f"Basic {token}"})[0] == 401  # the scheme counts
    assert _request(path, {"Authorization": f"Bearer {token}"}) == (200, {"ok": True})
    assert _request(path, {"authorization": f"bearer {token}"}) == (200, {"ok": True})


def test_health_is_open_and_a_root_path_is_seen_through(token: str) -> None:
    assert _request("/health") == (200, {"ok": True})
    assert _request("/api/health", root_path="/api") == (200, {"ok": True})
    assert _request("/api/pause", root_path="/api")[0] == 401
    assert _request("/health/x")[0] == 401


def test_a_websocket_without_the_token_is_closed_and_lifespan_passes(token: str) -> None:
    sent, reached = [], []

    async def app(scope, receive, send) -> None:
        reached.append(scope["type"])

    async def send(message) -> None:
        sent.append(message)

    middleware = server_auth.RequireToken(app)
    asyncio.run(middleware({"type": "websocket", "path": "/v1/realtime"}, None, send))
    asyncio.run(middleware({"type": "lifespan"}, None, send))
    assert sent == [{"type": "websocket.close", "code": 1008}]
    assert reached == ["lifespan"]


def test_a_server_started_without_the_token_refuses_to_build_the_middleware(monkeypatch) -> None:
    monkeypatch.delenv(server_auth.TOKEN_ENV, raising=False)
    with pytest.raises(server_auth.TokenError, match=r"needs the token in \$BAPO_SERVER_TOKEN"):
        server_auth.RequireToken(lambda *a: None)


@pytest.mark.parametrize("value", ["short", "with a space inside it", "tab\there-and-long-enough"])
def test_a_token_unfit_for_a_header_or_too_short_is_refused(monkeypatch, value: str) -> None:
    monkeypatch.setenv(server_auth.TOKEN_ENV, value)
    with pytest.raises(server_auth.TokenError) as info:
        server_auth.checked_token()
    assert str(info.value) == (
        "BAPO_SERVER_TOKEN must be at least 16 visible ASCII characters, no spaces (python -c "
        "'import secrets; print(secrets.token_urlsafe())' makes one)"
    )


def test_the_client_sends_the_token_and_masks_it(token: str, monkeypatch) -> None:
    assert server_auth.bearer() == {"authorization": f"Bearer {token}"}
    assert server_auth.checked_token() == token
    assert redact.text(f"got {token} back") == "got *** back"
    monkeypatch.setenv(server_auth.TOKEN_ENV, "")  # set but empty: no token
    assert server_auth.bearer() == {} and server_auth.checked_token() is None


@pytest.mark.vllm
def test_vllms_own_api_key_leaves_the_dev_routes_open() -> None:
    """vLLM 0.32's `--api-key` guards paths under a few prefixes only: none of the dev routes a
    push uses. If this fails, vLLM changed and docs/secrets.md should say what it now covers."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.serve.middleware.authenticate import GUARDED_PREFIX

    assert "/inference/v1/generate".startswith(GUARDED_PREFIX)
    assert [r for r in DEV_ROUTES if r.startswith(GUARDED_PREFIX)] == []
