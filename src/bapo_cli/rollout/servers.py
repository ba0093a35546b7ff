"""Generation on N vLLM servers (`rollout.servers=[URL, ...]`): requests spread over them, each
token's engine log-prob and weight version kept, dead servers' requests re-sent to the others,
weights pushed to every server.

    pool = ServerPool(["http://127.0.0.1:8001", "http://127.0.0.1:8002"],
                      expect=identity.model_identity(model_dir), weights_dir="/shared/weights")
    pool.start(version=0)                # each answers, serves the run's model; labelled 0
    gens = pool.generate(requests, params, seeds, eos_ids)   # Generation + per-token versions
    pool.publish(model.named_parameters(), version=7, interrupt=False)

Requests go to `POST /inference/v1/generate` (vLLM's token-in/token-out route,
`--enable-scale-out`): prompt ids in, sampled ids out with each one's log-prob
(`processed_logprobs`: the distribution sampled from) and the weight-version spans they were
sampled under. So the version of a token is the server's own record, not a guess from when the
request was sent: a response that a weight push interrupted carries both versions, each on its
own tokens.

Spreading: each request goes to the live server with the fewest requests in flight (at most
`max_in_flight` each); vLLM batches what a server holds. One request per sample, each with its
own seed, so the n samples of a prompt may land on different servers.

Failures. A server whose connection fails (refused, reset, timed out) or that answers 5xx is
marked down; every request it held is sent again, whole, to the others (its partial tokens were
never returned, so nothing reaches the trainer twice: each request has exactly one result, from
the one server that completed it). With no server left, `ServerError`. A server that is down is
asked `GET /health` every `revive_s`; once it answers, it is checked again (same model) and given
the newest weights version before it takes requests.

Weights (`publish`, the filesystem transport): the trainer writes the version under
`weights_dir` (`weights_fs.write_version`, atomic), then every live server, in parallel, is
paused (`mode=keep` freezes running requests under staleness.interrupt, `wait` lets them finish),
reloads in place (`/collective_rpc bapo_reload`, vllm_ext.BapoWorkerExtension), resets its prefix
cache with the running requests (their KV was computed by the old weights: they are re-prefilled;
vLLM 0.32's pause does it by default, asked again so the guarantee does not hang on that), stamps
the version (`/update_weight_version N`) and resumes; then the versions every server has left
behind are deleted (the newest is kept for a server that comes back). A push is checked by the
log-probs it changes (the probe), never by the calls returning: vLLM's NCCL path answers success
off CUDA and moves nothing.

Start-up (`check`): every URL answers; its model has the run's architecture, vocabulary and
shapes (`rollout.identity`); its context window holds the run's; the generate route is on; with
an `owner`, it is claimed (`rollout.claims`: one training run at a time) until `close`. Each
refusal is one line naming the URL and what to do. A reload that another holder refuses, or
whose answer lacks the written version's fingerprint, stops the push (`ServerTaken`,
`PushMissed`) instead of marking the server down.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bapo_cli.rollout import identity, weights_fs
from bapo_cli.rollout.base import (
    FINISH_BUDGET,
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    Request,
    SamplingParams,
)
from bapo_cli.rollout.claims import Claims, Owner, check_reload
from bapo_cli.rollout.lease import LEASE_S, LeaseLost, LeaseRefused
from bapo_cli.rollout.serve import EXTENSION

GENERATE = "/inference/v1/generate"
CHECK_TIMEOUT_S = 10.0  # start-up questions and weight pushes on a healthy server take < 1 s
REQUEST_TIMEOUT_S = 600.0  # one response; a server silent this long is treated as dead
PUSH_TIMEOUT_S = 600.0  # a reload of a large model from a network filesystem
REVIVE_S = 2.0  # how often a down server is asked whether it is back
POLL_S = 0.2


class ServerError(RuntimeError):
    """A generation server that cannot be used (or none left); `str()` is one line."""


class Unreachable(ServerError):
    """The connection failed: refused, reset, timed out."""


class NoServerLeft(ServerError):
    """Every server of the pool is down."""


class PoolClosed(ServerError):
    """`close()` was called while requests were waiting: their answers are not wanted."""


class ServerTaken(ServerError):
    """Another run holds a server (or held it since this run's last renewal); one line."""


class PushMissed(ServerError):
    """A server answered a reload without having read the version written; one line."""


@dataclass
class Server:
    url: str
    alive: bool = False
    version: int | None = None  # the weights version it holds (None: not yet known)
    in_flight: int = 0
    completed: int = 0  # requests it finished (for the spread metric and the tests)
    resent: int = 0  # requests taken from it when it went down
    next_probe: float = 0.0
    last_error: str = ""
    info: dict[str, Any] | None = None  # its worker extension's bapo_model_info, at the check


@dataclass
class ServedGeneration(Generation):
    """A Generation (with the version of each token) and the server that made it."""

    server: str = ""


def validate_url(url: str) -> str:
    """A server URL as given (`http://host:port`, no path); ServerError if it is not one."""
    parsed = urllib.parse.urlsplit(url)
    if (
        parsed.scheme not in ("http", "https")
        or not parsed.hostname
        or parsed.path not in ("", "/")
    ):
        raise ServerError(
            f"rollout.servers: {url!r} is not a server URL; give http://HOST:PORT (as printed by "
            "`bapo serve`)"
        )
    return url.rstrip("/")


class ServerPool:
    """The trainer's handle on N generation servers (see the module docstring)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        expect: identity.ModelIdentity | None = None,
        max_model_len: int | None = None,
        weights_dir: Path | str | None = None,
        max_in_flight: int = 128,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        revive_s: float = REVIVE_S,
        owner: Owner | None = None,
        base: str | None = None,
        stamped: bool = True,
    ) -> None:
        if not urls:
            raise ServerError("rollout.servers is empty; give one URL or more (bapo serve)")
        seen = [validate_url(u) for u in urls]
        if len(set(seen)) != len(seen):
            raise ServerError(f"rollout.servers names a server twice ({seen}); list each once")
        self.servers = [Server(u) for u in seen]
        self.expect = expect
        self.max_model_len = max_model_len
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.max_in_flight = max_in_flight
        self.request_timeout_s = request_timeout_s
        self.revive_s = revive_s
        self.version = 0  # the newest version published (what a server that comes back gets)
        self.published: Path | None = None  # its directory
        # pushes and revivals change which weights a server holds: one at a time (a revival
        # must not load an older version while a push from another thread loads the newest)
        self.lock = threading.RLock()
        # a revived server's running requests: aborted (its own, already re-sent), or let finish
        # when other processes send it requests too (data-parallel ranks share the servers)
        self.revive_mode = "abort"
        self.closed = threading.Event()  # close(): generate() stops waiting for answers
        self.events: list[str] = []  # one line per server going down or coming back
        # who holds the servers (None: claims nothing, and a server a run holds refuses its
        # pushes); `base`: the fingerprint of the model pushed weights derive from, recorded
        # by the server for `bapo eval` (weights_fs.model_fingerprint)
        self.claims = Claims(owner, self.rpc) if owner is not None else None
        self.base = base
        self.stamped = stamped  # False: the tokens' weight versions are not read (bapo eval)

    # ------------------------------------------------------------------------------ start-up

    def start(self, version: int, directory: Path | None = None) -> None:
        """Check every server (`check`), then label the weights they hold `version`: the run's
        start weights (directory None: what the servers loaded at their start) or the version
        written in `directory` (a resumed run), loaded first."""
        self.check()
        self.push(directory, version, interrupt=False)

    def check(self) -> None:
        """Every server answers and serves the run's model (and, with an owner, is claimed; the
        claims are renewed from then on); ServerError (one line) otherwise."""
        for server in self.servers:
            self._check_one(server)
            server.alive = True
        if self.claims is not None:
            self.claims.start(lambda: [s.url for s in self.servers if s.alive])

    def _check_one(self, server: Server) -> None:
        url = server.url
        try:
            call(url, "GET", "/health", timeout=CHECK_TIMEOUT_S)
        except Unreachable as exc:
            raise ServerError(
                f"cannot reach the generation server {url} ({exc}); start one there with "
                "`bapo serve --port PORT` or fix rollout.servers"
            ) from None
        try:
            info = call(
                url, "POST", "/collective_rpc", {"method": "bapo_model_info"}, CHECK_TIMEOUT_S
            )["results"][0]
        except HTTPStatus as exc:
            raise ServerError(
                f"the server {url} cannot describe its model (HTTP {exc.status} from "
                "/collective_rpc); start it with `bapo serve`, or run vLLM with "
                f"VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {EXTENSION}"
            ) from None
        wrong = identity.mismatch(url, info, self.expect)
        if wrong is not None:
            raise ServerError(wrong)
        server.info = info
        if self.max_model_len is not None:
            window = identity.served_window(url, call)
            if window is not None and window < self.max_model_len:
                raise ServerError(
                    f"the server {url} holds {window} tokens per sequence, less than the run's "
                    f"model.max_model_len={self.max_model_len}; restart it with "
                    f"--max-model-len {self.max_model_len} or lower the run's"
                )
        try:  # an empty body: 400/422 when the route is on, 403 (or 404) when it is off
            call(url, "POST", GENERATE, {}, CHECK_TIMEOUT_S)
        except HTTPStatus as exc:
            if exc.status in (403, 404):
                raise ServerError(
                    f"the server {url} does not offer {GENERATE} (HTTP {exc.status}); start it "
                    "with `bapo serve`, or run vLLM with --enable-scale-out"
                ) from None
        if self.claims is not None:
            try:
                answered = self.claims.claim(url)
            except LeaseRefused as exc:
                raise ServerTaken(str(exc)) from None
            if not answered:
                raise ServerError(
                    f"the server {url} cannot be claimed for this run (no answer to bapo_claim); "
                    "restart it with this bapo-cli's `bapo serve`"
                )

    def rpc(self, url: str, method: str, args: list[str]) -> list[dict[str, Any]] | None:
        """Every worker's answer to one extension method (`rollout.claims`' rpc), None when the
        server does not answer it."""
        try:
            answer = call(url, "POST", "/collective_rpc", {"method": method, "args": args})
        except ServerError:
            return None
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
            return None
        return results or None

    def confirm(self) -> None:
        """Renew the claims now; ServerTaken (one line) if a server was held by another run or
        process since the last renewal: what it sampled since may be another run's."""
        if self.claims is None:
            return
        lost = self.claims.renew([s.url for s in self.servers if s.alive])
        if lost is not None:
            raise ServerTaken(lost)

    # ---------------------------------------------------------------------------- generation

    def generate(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        seeds: Sequence[int],
        eos_ids: Sequence[int] = (),
        *,
        ignore_eos: bool = False,
    ) -> list[ServedGeneration]:
        """One ServedGeneration per request, in order, spread over the live servers; a request
        whose server dies is sent again to another. ServerError when none is left.

        `ignore_eos`: every response runs to its max_tokens (end tokens are sampled and kept,
        the distribution is unchanged): fixed-length responses for benchmarks and for tests that
        need a response to be running at a given moment."""
        out: list[ServedGeneration | None] = [None] * len(requests)
        todo: deque[int] = deque(range(len(requests)))
        running: dict[Future, tuple[int, Server]] = {}
        workers = max(1, self.max_in_flight * len(self.servers))
        ex = ThreadPoolExecutor(max_workers=min(workers, 256), thread_name_prefix="bapo-gen")
        try:
            while todo or running:
                if self.closed.is_set():
                    raise PoolClosed("the server pool was closed")
                self._revive_due()
                while todo:
                    server = self._least_loaded()
                    if server is None:
                        break
                    i = todo.popleft()
                    body = _generate_body(requests[i], params, seeds[i], eos_ids, ignore_eos)
                    server.in_flight += 1
                    future = ex.submit(
                        call, server.url, "POST", GENERATE, body, self.request_timeout_s
                    )
                    running[future] = (i, server)
                if not running:
                    if not any(s.alive for s in self.servers):
                        self._all_down()
                    time.sleep(POLL_S)  # every live server is full: cannot happen, but wait
                    continue
                done, _ = wait(list(running), timeout=self.revive_s, return_when=FIRST_COMPLETED)
                for future in done:
                    i, server = running.pop(future)
                    server.in_flight -= 1
                    try:
                        answer = future.result()
                    except (Unreachable, HTTPStatus) as exc:
                        if isinstance(exc, HTTPStatus) and exc.status < 500:
                            raise ServerError(
                                f"the server {server.url} refused a request: {exc}"
                            ) from None
                        self._down(server, exc)
                        server.resent += 1
                        todo.appendleft(i)  # whole, to another server
                        continue
                    if out[i] is not None:  # a request has one result: never reached
                        raise RuntimeError(f"request {i} answered twice")
                    out[i] = _served(answer, requests[i].max_tokens, server.url, self.stamped)
                    server.completed += 1
        finally:  # closed: do not wait for answers nobody will read
            ex.shutdown(wait=not self.closed.is_set(), cancel_futures=True)
        return [g for g in out if g is not None]

    def _least_loaded(self) -> Server | None:
        live = [s for s in self.servers if s.alive and s.in_flight < self.max_in_flight]
        return min(live, key=lambda s: s.in_flight) if live else None

    def _down(self, server: Server, exc: Exception) -> None:
        if server.alive:
            server.alive = False
            server.last_error = str(exc)
            server.next_probe = time.monotonic() + self.revive_s
            self.events.append(f"down {server.url}: {exc}")

    def _all_down(self) -> None:
        detail = "; ".join(f"{s.url}: {s.last_error or 'down'}" for s in self.servers)
        raise NoServerLeft(f"every generation server is down ({detail})")

    def _revive_due(self) -> None:
        now = time.monotonic()
        for server in self.servers:
            if not server.alive and now >= server.next_probe:
                server.next_probe = now + self.revive_s
                self.revive(server)

    def revive(self, server: Server) -> bool:
        """A down server that answers again: checked (same model), given the newest weights,
        then used. False while it is still down."""
        with self.lock:
            try:
                self._check_one(server)
                self._load_revived(server)
            except ServerTaken as exc:  # back, but another run holds it now
                server.last_error = str(exc)
                return False
            except (ServerError, HTTPStatus):
                return False  # still down: `last_error` keeps why it went down
            server.alive = True
        self.events.append(f"back {server.url} at version {self.version}")
        return True

    def _load_revived(self, server: Server) -> None:
        """Bring a server that came back to the newest version (a pool that does not push,
        `staleness.servers.FollowerPool`, waits for the one that does)."""
        self._push_one(server, self.published, self.version, mode=self.revive_mode)

    def held_version(self, server: Server) -> int:
        """The weights version a server stamps on what it samples now (one token)."""
        sampling = {"max_tokens": 1, "ignore_eos": True, "detokenize": False}
        body = {"token_ids": [0], "sampling_params": sampling}
        answer = call(server.url, "POST", GENERATE, body, CHECK_TIMEOUT_S)
        return _token_versions(answer["choices"][0].get("weight_versions"), 1, server.url)[0]

    # ------------------------------------------------------------------------------- weights

    def publish(
        self, named: Iterable[tuple[str, torch.Tensor]], version: int, *, interrupt: bool
    ) -> dict[str, float]:
        """Write `version` under weights_dir and load it into every live server (see the module
        docstring); the old versions are removed. Returns seconds: write, push (slowest
        server), total. A server that fails the push is marked down (it catches up when it comes
        back); ServerError if none took it."""
        if self.weights_dir is None:
            raise ServerError("publish needs a weights directory (staleness.weights=filesystem)")
        t0 = time.perf_counter()
        directory = weights_fs.write_version(named, self.weights_dir, version)
        t1 = time.perf_counter()
        self.push(directory, version, interrupt=interrupt)
        t2 = time.perf_counter()
        weights_fs.cleanup(self.weights_dir, keep_from=version)
        return {"write_s": t1 - t0, "push_s": t2 - t1, "total_s": time.perf_counter() - t0}

    def push(self, directory: Path | None, version: int, *, interrupt: bool) -> None:
        """Load the version in `directory` into every live server, in parallel."""
        with self.lock:
            self.published, self.version = directory, version
            live = [s for s in self.servers if s.alive]
            mode = "keep" if interrupt else "wait"
            with ThreadPoolExecutor(max_workers=max(1, len(live))) as ex:
                futures = {ex.submit(self._push_one, s, directory, version, mode): s for s in live}
                for future, server in futures.items():
                    try:
                        future.result()
                    except (Unreachable, HTTPStatus) as exc:
                        self._down(server, exc)
            if not any(s.alive for s in self.servers):
                self._all_down()

    def close(self) -> None:
        """Stop waiting: a `generate` in another thread raises PoolClosed within `revive_s`.
        Requests still running are aborted on their servers (`pause?mode=abort`, `resume`), so
        this process does not wait at exit for answers nobody will read (Python joins the
        request threads at exit)."""
        self.closed.set()
        for server in self.servers:
            if server.alive and server.in_flight > 0:
                with contextlib.suppress(ServerError):
                    call(server.url, "POST", "/pause?mode=abort", None, CHECK_TIMEOUT_S)
                    call(server.url, "POST", "/resume", None, CHECK_TIMEOUT_S)
        if self.claims is not None:  # the servers are free for the next run at once
            self.claims.release([s.url for s in self.servers])

    def _push_one(self, server: Server, directory: Path | None, version: int, mode: str) -> None:
        url = server.url
        call(url, "POST", f"/pause?mode={mode}", None, PUSH_TIMEOUT_S)
        try:
            if directory is not None:  # None: the server's own start weights are version 0
                self._reload(url, directory, version)
            reset = call(
                url,
                "POST",
                "/reset_prefix_cache?reset_running_requests=true",
                None,
                PUSH_TIMEOUT_S,
            )
            if not reset.get("success", False):
                raise HTTPStatus(500, f"{url} could not reset its prefix cache")
            call(
                url, "POST", "/update_weight_version", {"new_version": str(version)}, PUSH_TIMEOUT_S
            )
        finally:
            with contextlib.suppress(ServerError):
                call(url, "POST", "/resume", None, CHECK_TIMEOUT_S)
        server.version = version

    def _reload(self, url: str, directory: Path, version: int) -> None:
        """One server reloads `version` for this pool's owner; ServerTaken if the lease table
        refuses it or another holder came in between, PushMissed if what it read is not what
        was written (the marker's fingerprint)."""
        who = self.claims.reload_args() if self.claims is not None else ["", ""]
        args = [str(directory), str(version), *who, self.base or "", str(LEASE_S)]
        body = {"method": "bapo_reload", "args": args}
        answers = call(url, "POST", "/collective_rpc", body, PUSH_TIMEOUT_S).get("results") or []
        try:
            missed = check_reload(self.claims, url, answers, weights_fs.read_marker(directory))
        except (LeaseRefused, LeaseLost) as exc:
            raise ServerTaken(str(exc)) from None
        if missed is not None:
            raise PushMissed(missed)

    def probe(self, token_ids: Sequence[int]) -> dict[str, tuple[int, list[float]]]:
        """Each live server's log-probs of `token_ids[1:]` given the tokens before (a fixed probe
        prompt; its prompt log-probs at temperature 1), with the weights version it holds: what
        a weight push is checked by (equal to the trainer's, different from the last version)."""
        body = {
            "token_ids": list(token_ids),
            "sampling_params": {
                "max_tokens": 1,
                "temperature": 1.0,
                "prompt_logprobs": 0,
                "logprobs": 0,
                "seed": 0,
                "detokenize": False,
            },
        }
        out = {}
        for server in (s for s in self.servers if s.alive):
            answer = call(server.url, "POST", GENERATE, body, CHECK_TIMEOUT_S)
            rows = answer["prompt_logprobs"][1:]
            logprobs = [
                float(row[str(t)]["logprob"]) for row, t in zip(rows, token_ids[1:], strict=True)
            ]
            versions = _token_versions(answer["choices"][0].get("weight_versions"), 1, server.url)
            out[server.url] = (versions[0], logprobs)
        return out

    # ------------------------------------------------------------------------------- metrics

    def spread(self) -> dict[str, int]:
        """Requests completed per server since the pool started."""
        return {s.url: s.completed for s in self.servers}


# ------------------------------------------------------------------------------------- HTTP


class HTTPStatus(ServerError):
    """The server answered with an error status."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxies


def call(url: str, method: str, path: str, body: Any = None, timeout: float = 10.0) -> Any:
    """One JSON request; the decoded answer ({} when empty). Unreachable for connection
    failures, HTTPStatus for error answers."""
    data = None if body is None else json.dumps(body).encode()
    if method == "POST" and data is None:
        data = b""
    req = urllib.request.Request(
        url + path, data=data, method=method, headers={"content-type": "application/json"}
    )
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300].replace("\n", " ")
        raise HTTPStatus(exc.code, detail) from None
    except urllib.error.URLError as exc:
        raise Unreachable(_reason(exc.reason)) from None
    except (http.client.HTTPException, OSError) as exc:  # reset, disconnected, timed out
        raise Unreachable(_reason(exc)) from None
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise HTTPStatus(502, f"not JSON: {raw[:100]!r}") from None


def _reason(exc: Any) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def _generate_body(
    req: Request, params: SamplingParams, seed: int, eos_ids: Sequence[int], ignore_eos: bool
) -> dict[str, Any]:
    """The request for one sample: prompt + partial response as ids, the run's sampling."""
    sampling: dict[str, Any] = {
        "n": 1,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_tokens": req.max_tokens,
        "stop_token_ids": list(eos_ids),
        "logprobs": 0,  # the sampled token's own log-prob (and none other)
        "seed": seed,
        "detokenize": bool(params.stop),  # stop strings are matched on text
    }
    if params.stop:
        sampling["stop"] = list(params.stop)
    if ignore_eos:
        sampling.update(ignore_eos=True, stop_token_ids=[])
    return {
        "token_ids": list(req.prompt_ids) + list(req.prefix_ids),
        "sampling_params": sampling,
    }


def _served(
    answer: dict[str, Any], budget: int, url: str, stamped: bool = True
) -> ServedGeneration:
    """The server's answer → tokens, their log-probs and versions (`stamped`; else None: an
    evaluation needs none, and a fresh server labels its weights 'default'), and why it
    stopped (as rollout.vllm's `_generation`: end token or stop string; this round's budget;
    else the context window)."""
    choice = answer["choices"][0]
    tokens = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    logprobs = [float(c["logprob"]) for c in content]
    if len(logprobs) != len(tokens):
        raise HTTPStatus(502, f"{url} returned {len(tokens)} tokens but {len(logprobs)} log-probs")
    versions = _token_versions(choice.get("weight_versions"), len(tokens), url) if stamped else None
    if choice.get("finish_reason") == "stop":
        reason = FINISH_STOP
    elif len(tokens) >= budget:
        reason = FINISH_BUDGET  # the Collector turns this into `length` at rollout.max_tokens
    else:
        reason = FINISH_LENGTH
    return ServedGeneration(tokens, logprobs, reason, versions=versions, server=url)


def _token_versions(spans: Any, count: int, url: str) -> list[int]:
    """Per-token versions from vLLM's spans [{version, start, end}, ...]."""
    if count == 0:
        return []
    out: list[int | None] = [None] * count
    for span in spans or []:
        try:
            v = int(span["version"])
        except (TypeError, ValueError, KeyError):
            raise HTTPStatus(
                502, f"{url} sampled with weights labelled {span.get('version')!r}, not a version"
            ) from None
        for t in range(int(span["start"]), min(int(span["end"]), count)):
            out[t] = v
    if any(v is None for v in out):
        raise HTTPStatus(502, f"{url} did not say which weights sampled every token")
    return [int(v) for v in out if v is not None]
