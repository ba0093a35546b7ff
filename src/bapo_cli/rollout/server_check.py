"""A generation server's start-up check, asked by the pool (`rollout.servers.ServerPool`) at start
and when a down server comes back: it answers, serves the run's model (`rollout.identity`) in a
window that holds the run's, offers the generate route and, for a run that claims its servers,
is claimed (`rollout.claims`). Each refusal is one line.

Not answering is not a refusal: `ServerDown` (no health, or a connection lost mid-check) is a
server that may come back (`ServerPool.check` with a quorum starts without it); any other
`ServerError` is a server that answers wrongly (another model, no extension, held by another
run), which waiting does not fix.
"""

from __future__ import annotations

import time
from typing import Any

from bapo_cli.rollout import identity, server_auth
from bapo_cli.rollout.claims import Claims
from bapo_cli.rollout.lease import LeaseRefused
from bapo_cli.rollout.serve import EXTENSION
from bapo_cli.rollout.server_answers import model_info
from bapo_cli.rollout.server_http import HTTPStatus, ServerError, ServerFault, Unreachable, call

GENERATE = "/inference/v1/generate"
PAUSED_POLL_S = 1.0  # how often a paused server is asked whether it resumed


class ServerDown(ServerError):
    """A server that does not answer its check (`why`: how it failed): down, not refused."""

    def __init__(self, line: str, why: str) -> None:
        super().__init__(line)
        self.why = why


class ServerTaken(ServerError):
    """Another run holds a server (or held it since this run's last renewal); one line."""


def check_server(
    url: str,
    *,
    expect: identity.ModelIdentity | None,
    max_model_len: int | None,
    claims: Claims | None,
    timeout_s: float,
) -> dict[str, Any]:
    """The server's model info (`bapo_model_info`) once every check passed; `ServerDown` when
    it does not answer, another ServerError (one line) when it answers wrongly."""

    def ask(method: str, path: str, body: Any = None) -> Any:
        try:
            return call(url, method, path, body, timeout_s)
        except (Unreachable, ServerFault) as exc:
            line = (
                f"the generation server {url} failed its check at {method} {path} ({exc}); "
                "restart it with `bapo serve` or drop it from rollout.servers"
            )
            if isinstance(exc, Unreachable):  # it stopped answering: down, not refused
                raise ServerDown(line, f"{exc} at {method} {path}") from None
            raise ServerError(line) from None

    try:
        call(url, "GET", "/health", None, timeout_s)
    except (Unreachable, ServerFault, HTTPStatus) as exc:
        raise ServerDown(
            f"cannot reach the generation server {url} ({exc}); start one there with "
            "`bapo serve --port PORT` or fix rollout.servers",
            str(exc),
        ) from None
    try:
        info = model_info(url, ask("POST", "/collective_rpc", {"method": "bapo_model_info"}))
    except HTTPStatus as exc:
        if exc.status == 401:
            raise ServerError(server_auth.refused(url)) from None
        raise ServerError(
            f"the server {url} cannot describe its model (HTTP {exc.status} from "
            "/collective_rpc); start it with `bapo serve`, or run vLLM with "
            f"VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {EXTENSION}"
        ) from None
    wrong = identity.mismatch(url, info, expect)
    if wrong is not None:
        raise ServerError(wrong)
    if max_model_len is not None:
        window = _served_window(ask)
        if window is not None and window < max_model_len:
            raise ServerError(
                f"the server {url} holds {window} tokens per sequence, less than the run's "
                f"model.max_model_len={max_model_len}; restart it with "
                f"--max-model-len {max_model_len} or lower the run's"
            )
    try:  # an empty body: 400/422 when the route is on, 403 (or 404) when it is off
        ask("POST", GENERATE, {})
    except HTTPStatus as exc:
        if exc.status in (403, 404):
            raise ServerError(
                f"the server {url} does not offer {GENERATE} (HTTP {exc.status}); start it "
                "with `bapo serve`, or run vLLM with --enable-scale-out"
            ) from None
    if claims is not None:
        try:
            answered = claims.claim(url)
        except LeaseRefused as exc:
            raise ServerTaken(str(exc)) from None
        if not answered:
            raise ServerError(
                f"the server {url} cannot be claimed for this run (no answer to bapo_claim); "
                "restart it with this bapo-cli's `bapo serve`"
            )
    return info


def refuse_paused(url: str, wait_s: float, timeout_s: float) -> None:
    """ServerError if the server stays paused for `wait_s` (a push takes seconds): what it is
    asked would wait for a resume that may never come (a trainer killed mid-push). Refused,
    not resumed: a live run may be pushing to it, and a resume mid-reload would let its
    requests run on half-loaded weights. A server without the dev routes cannot be asked."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            answer = call(url, "GET", "/is_paused", None, timeout_s)
        except HTTPStatus:
            return
        if not (isinstance(answer, dict) and answer.get("is_paused") is True):
            return
        if time.monotonic() >= deadline:
            raise ServerError(
                f"the generation server {url} is paused and stayed paused for "
                f"{wait_s:g} s (a weight push that never finished: its trainer stopped "
                "mid-push?), so it would answer nothing; if no run uses it, resume it with "
                f"`curl -X POST {url}/resume` and run again"
            )
        time.sleep(min(PAUSED_POLL_S, wait_s))


def _served_window(ask: Any) -> int | None:
    """The served model's context window (`/v1/models`), or None if it does not say."""
    try:
        window = ask("GET", "/v1/models")["data"][0]["max_model_len"]
    except (HTTPStatus, KeyError, IndexError, TypeError):
        return None
    if isinstance(window, int) and not isinstance(window, bool) and window > 0:
        return window
    return None
