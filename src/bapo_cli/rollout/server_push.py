"""One server's weight push (`ServerPool._push_one`): in one HTTP call where the server can, else
in five.

The five calls: `/pause?mode=...`, the reload through the worker extension (`/collective_rpc`),
`/reset_prefix_cache?reset_running_requests=true`, `/update_weight_version`, `/resume`. Each is a
round trip through vLLM's API process to its engine core, and for the tiny model they are the
whole cost of a push (docs/benchmarks.md). vLLM's engine core runs a `collective_rpc` as a utility
call between two engine steps, so a method of the worker extension that reloads, resets the
prefix cache and stamps the version inside that call does what pause(keep) ... resume does:
nothing is scheduled in between, running requests are re-prefilled by the new weights. It can do
so where the engine core runs in the worker's process (one worker per server: vLLM's
UniProcExecutor, the case for tensor_parallel_size 1) and, for a push that must not cut a response
(`mode` wait, or abort on a revived server), while nothing is running; otherwise it answers
`fused: false`, having done nothing, and the five calls follow (`vllm_ext.bapo_push`).

Delta versions (`rollout.weights_delta`): the server is sent the chain of versions from the one it
holds; a server that does not hold its start (it came back) answers `need_full` and is sent the
chain from the newest full version.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from bapo_cli.rollout import weights_delta, weights_fs
from bapo_cli.rollout.claims import check_reload
from bapo_cli.rollout.lease import LEASE_S, LeaseLost, LeaseRefused
from bapo_cli.rollout.server_check import ServerTaken
from bapo_cli.rollout.server_http import HTTPStatus, ServerError, call

# the pool and its servers are rollout.servers' ServerPool and Server (which imports this module)
ServerPool = Server = Any

PUSH_TIMEOUT_S = 600.0  # a reload of a large model from a network filesystem
CLOSE_TIMEOUT_S = 2.0


class PushMissed(ServerError):
    """A server answered a reload without having read the version written; one line."""


def push_one(
    pool: ServerPool, server: Server, directory: Path | None, version: int, mode: str
) -> None:
    """Load `version` (in `directory`; None: the server's start weights are it) into `server`,
    reset its prefix cache, stamp the version, never leaving it paused (module docstring)."""
    url = server.url

    def push_call(path: str, body: Any = None) -> Any:  # long, watched, ended by close()
        return call(url, "POST", path, body, PUSH_TIMEOUT_S, cancel=pool.closed, watch=pool.watch)

    held = server.version if server.alive else None  # a server that came back: not known
    capable = bool(server.info and server.info.get("push"))
    fused = capable and pool.fuse and bool(server.info and server.info.get("fuse"))
    if fused and _chain_push(pool, push_call, url, directory, version, mode, held, fuse=True):
        pool.pushes["fused"] += 1
        server.version = version
        return
    push_call(f"/pause?mode={mode}")
    try:
        if directory is not None:  # None: the server's own start weights are version 0
            if capable:
                _chain_push(pool, push_call, url, directory, version, mode, held, fuse=False)
            else:
                _reload(pool, url, directory, version, push_call)
        reset = push_call("/reset_prefix_cache?reset_running_requests=true")
        if not (isinstance(reset, dict) and reset.get("success", False)):
            raise HTTPStatus(500, f"{url} could not reset its prefix cache")
        push_call("/update_weight_version", {"new_version": str(version)})
    finally:  # never left paused; asked briefly once the pool is closed (a stop waits)
        wait_s = CLOSE_TIMEOUT_S if pool.closed.is_set() else pool.check_timeout_s
        with contextlib.suppress(ServerError):
            call(url, "POST", "/resume", None, wait_s)
    pool.pushes["five calls"] += 1
    server.version = version


def _chain_push(
    pool: ServerPool,
    push_call: Any,
    url: str,
    directory: Path | None,
    version: int,
    mode: str,
    held: int | None,
    *,
    fuse: bool,
) -> bool:
    """`bapo_push` with the chain from `held`, then, if the server does not hold its start, from
    the newest full version. Whether it was done (always, unless `fuse` and the server cannot)."""
    tried: list[list[int]] = []
    for start in (held, None):
        versions = _versions(directory, version, start)
        if versions in tried:
            continue
        tried.append(versions)
        body = _body(pool, directory, version, mode, versions, fuse)
        answers = _results(push_call("/collective_rpc", body))
        if fuse and not all(a.get("fused") for a in answers):
            if answers and all(a.get("need_full") for a in answers):
                continue
            return False
        if answers and all(a.get("need_full") for a in answers):
            continue
        if directory is not None:
            _check(pool, url, answers, directory)
        return True
    raise PushMissed(
        f"the generation server {url} could not load version {version}: it holds no version a "
        "chain of deltas starts from"
    )


def _versions(directory: Path | None, version: int, held: int | None) -> list[int]:
    if directory is None:
        return []
    return weights_delta.chain(held, version, weights_delta.kinds_on_disk(directory.parent))


def _body(
    pool: ServerPool,
    directory: Path | None,
    version: int,
    mode: str,
    versions: list[int],
    fuse: bool,
) -> dict[str, Any]:
    who = pool.claims.reload_args() if pool.claims is not None else ["", ""]
    root = directory.parent if directory is not None else None
    spec = {
        "steps": [[str(weights_fs.version_dir(root, v)), v] for v in versions] if root else [],
        "version": version,
        "mode": mode,
        "fuse": fuse,
        "keep": pool.keep_held,
        "run": who[0],
        "nonce": who[1],
        "base": pool.base or "",
        "lease_s": LEASE_S,
    }
    return {"method": "bapo_push", "args": [json.dumps(spec)]}


def _results(answer: Any) -> list[dict[str, Any]]:
    answers = (answer.get("results") if isinstance(answer, dict) else None) or []
    return [a for a in answers if isinstance(a, dict)]


def _check(pool: ServerPool, url: str, answers: list[dict[str, Any]], directory: Path) -> None:
    """ServerTaken if the lease table refused the load or another holder came in between,
    PushMissed if what the server read is not what was written (the marker's fingerprint)."""
    try:
        missed = check_reload(pool.claims, url, answers, weights_fs.read_marker(directory))
    except (LeaseRefused, LeaseLost) as exc:
        raise ServerTaken(str(exc)) from None
    if missed is not None:
        raise PushMissed(missed)


def _reload(pool: ServerPool, url: str, directory: Path, version: int, push_call: Any) -> None:
    """A server whose extension predates `bapo_push`: one full version through `bapo_reload`."""
    who = pool.claims.reload_args() if pool.claims is not None else ["", ""]
    args = [str(directory), str(version), *who, pool.base or "", str(LEASE_S)]
    answer = push_call("/collective_rpc", {"method": "bapo_reload", "args": args})
    _check(pool, url, _results(answer), directory)
