"""Generation on N vLLM servers (`rollout.servers=[URL, ...]`): requests spread over them, each
token's engine log-prob and weight version kept, dead servers' requests re-sent to the others,
weights pushed to every server. The whole story, with each fault and bound:
docs/engines.md#async-rl-on-generation-servers.

    pool = ServerPool(["http://127.0.0.1:8001", "http://127.0.0.1:8002"],
                      expect=identity.model_identity(model_dir), weights_dir="/shared/weights")
    pool.start(version=0)                # each answers, serves the run's model; labelled 0
    gens = pool.generate(requests, params, seeds, eos_ids)   # Generation + per-token versions
    pool.publish(model.named_parameters(), version=7, interrupt=False)

- Requests go to vLLM's token-in/token-out route (`POST /inference/v1/generate`): each token's
  version is the server's own stamp, so a response a push interrupted carries both versions.
  Each goes to the live server with the fewest in flight; one request per sample, own seed.
- A server that fails (refused, reset, 5xx, no answer within `request_timeout_s`) or stalls (no
  `GET /health` within `stall_s`) is marked down and its requests are re-sent whole: each
  request has exactly one result. A down server is revived in a thread of its own: checked
  again, given the newest version, then used. An aborted response is re-sent (`MAX_ABORTS`).
- An answer no healthy server sends (`server_answers`: ids outside the vocabulary, more tokens
  than asked, log-probs that are no probabilities, versions never pushed) is a `ServerFault`
  that ends the call in one line: it would repeat, so it is not re-sent; unless the server's
  health then fails (`_gone`: a vLLM server killed mid-answer may send `{}`): down, re-sent.
- Servers `join` and `leave` a running pool (`rollout.membership`); `events` says each change.
- A push pauses every live server, reloads the version in place (`bapo_reload`, checked by the
  fingerprint it read), resets the prefix cache with its running requests, stamps the version
  and resumes. The probe (staleness.probe), not the calls returning, says it arrived.
- Start-up (`check`): each server answers, serves the run's model (`rollout.identity`) in a
  window that holds the run's, has the generate route, is not left paused (eval), and, with an
  `owner`, is claimed for the run (`rollout.claims`) until `close`. Each refusal is one line.
  Given a `rollout.quorum.Quorum`, a server that does not answer is no refusal while enough do:
  it starts down and is revived like one that went down.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bapo_cli.rollout import identity, server_push, weights_fs
from bapo_cli.rollout.base import Request, SamplingParams
from bapo_cli.rollout.claims import Claims, Owner
from bapo_cli.rollout.identity import ModelIdentity, model_identity
from bapo_cli.rollout.quorum import Quorum
from bapo_cli.rollout.server_answers import (
    Aborted,
    ServedGeneration,
    first_choice,
    generate_body,
    served,
    short,
    token_versions,
)
from bapo_cli.rollout.server_check import (
    GENERATE,
    ServerDown,
    ServerTaken,
    check_server,
    refuse_paused,
)
from bapo_cli.rollout.server_http import (
    CHECK_TIMEOUT_S,
    HEALTH_EVERY_S,
    STALL_S,
    AnyOf,
    Cancelled,
    HTTPStatus,
    ServerError,
    ServerFault,
    Unreachable,
    Watch,
    call,
    generate_limit,
    validate_url,
)
from bapo_cli.rollout.server_push import CLOSE_TIMEOUT_S, PUSH_TIMEOUT_S, PushMissed

__all__ = [  # rollout.servers is where the rest of the project finds these
    "CHECK_TIMEOUT_S",
    "HTTPStatus",
    "ModelIdentity",
    "PUSH_TIMEOUT_S",
    "PushMissed",
    "ServedGeneration",
    "ServerError",
    "ServerFault",
    "ServerTaken",
    "Unreachable",
    "call",
    "model_identity",
    "validate_url",
]

REQUEST_TIMEOUT_S = 600.0  # one response, all told (a healthy server's longest)
REVIVE_S = 2.0  # how often a down server is asked whether it is back
POLL_S = 0.2
MAX_ABORTS = 3  # a request vLLM aborted this many times: the server is refused, not asked again
GONE_WAIT_S = 0.25  # after a malformed answer, health is asked again this much later (`_gone`)


class NoServerLeft(ServerError):
    """Every server of the pool is down."""


class TooFewServers(ServerError):
    """Fewer servers answer at start than the run's quorum (`rollout.min_servers`)."""


class PoolClosed(ServerError):
    """`close()` was called while requests were waiting: their answers are not wanted."""


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
    vocab_size: int | None = None  # what it said at its check (token ids are below it)
    info: dict[str, Any] | None = None  # its worker extension's bapo_model_info, at the check
    joining: bool = False  # added mid-run (`join`), not yet taken in


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
        check_timeout_s: float = CHECK_TIMEOUT_S,
        stall_s: float = STALL_S,
        health_every_s: float = HEALTH_EVERY_S,
        wait_paused_s: float | None = None,
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
        self.check_timeout_s = check_timeout_s
        # slow or stalled: a busy server's health, asked while its requests and pushes wait
        # (server_http.Watch); stall_s 0: never asked, a request waits its whole timeout
        self.watch = Watch(health_every_s, stall_s) if stall_s > 0 else None
        # None: a paused server is fine (this pool's pushes resume it); seconds: a server still
        # paused after that long is refused at its check (bapo eval, which never pushes)
        self.wait_paused_s = wait_paused_s
        self._reviving: set[str] = set()  # down servers asked in a thread of their own now
        self.version = 0  # the newest version published (what a server that comes back gets)
        self.pushed = False  # whether this pool pushed weights (then it knows the newest version)
        self.published: Path | None = None  # its directory
        # pushes and revivals change which weights a server holds: one at a time (a revival
        # must not load an older version while a push from another thread loads the newest)
        self.lock = threading.RLock()
        # a revived server's running requests: aborted (its own, already re-sent), or let finish
        # when other processes send it requests too (data-parallel ranks share the servers)
        self.revive_mode = "abort"
        self.closed = threading.Event()  # close(): generate() stops waiting for answers
        # one line per server going down, coming back, joining, leaving, or answering but
        # refused when it came back; the first word says which (down, back, join, leave, refused)
        self.events: list[str] = []
        # who holds the servers (None: claims nothing, and a server a run holds refuses its
        # pushes); `base`: the fingerprint of the model pushed weights derive from, recorded
        # by the server for `bapo eval` (weights_fs.model_fingerprint)
        self.claims = Claims(owner, self.rpc) if owner is not None else None
        self.base = base
        self.stamped = stamped  # False: the tokens' weight versions are not read (bapo eval)
        # pushes: in one call where a server can (`rollout.server_push`); `keep_held`: servers
        # keep the tensors they load, to apply the next delta to (rollout.weights_delta)
        self.fuse, self.keep_held = True, False
        self.pushes: Counter[str] = Counter()  # how each server push was made
        self.revivals = 0  # servers that came back (the next version is written full)

    # ------------------------------------------------------------------------------ start-up

    def start(
        self, version: int, directory: Path | None = None, quorum: Quorum | None = None
    ) -> list[Server]:
        """Check every server (`check`), then label the weights the live ones hold `version`:
        the run's start weights (directory None: what the servers loaded at their start) or the
        version written in `directory` (a resumed run), loaded first. The servers left down."""
        down = self.check(quorum)
        self.push(directory, version, interrupt=False)
        return down

    def check(self, quorum: Quorum | None = None) -> list[Server]:
        """Every server answers and serves the run's model (and, with an owner, is claimed; the
        claims are renewed from then on); ServerError (one line) otherwise. With a `quorum`, a
        server that does not answer (`ServerDown`) starts down while at least `quorum.need`
        answer (TooFewServers otherwise); the servers left down are returned."""
        down: list[tuple[Server, str]] = []
        for server in self.servers:
            try:
                self._check_one(server)
                if self.wait_paused_s is not None:
                    refuse_paused(server.url, self.wait_paused_s, self.check_timeout_s)
            except ServerDown as exc:
                if quorum is None:
                    raise
                down.append((server, exc.why))
                continue
            server.alive = True
        if quorum is not None:
            line = quorum.short([(s.url, why) for s, why in down])
            if line is not None:
                raise TooFewServers(line)
        for server, why in down:  # asked again as a server that went down is (`revive`)
            server.last_error = why
            server.next_probe = time.monotonic() + self.revive_s
            self.events.append(f"down {server.url} at start: {why}")
        if self.claims is not None:
            self.claims.start(lambda: [s.url for s in self.servers if s.alive])
        return [s for s, _ in down]

    def _check_one(self, server: Server) -> None:
        """One server's start-up check (`server_check.check_server`); its model info kept."""
        info = check_server(
            server.url,
            expect=self.expect,
            max_model_len=self.max_model_len,
            claims=self.claims,
            timeout_s=self.check_timeout_s,
        )
        server.info = info
        server.vocab_size = int(info["vocab_size"])

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
        aborts: Counter[int] = Counter()
        workers = max(1, self.max_in_flight * len(self.servers))
        ex = ThreadPoolExecutor(max_workers=min(workers, 256), thread_name_prefix="bapo-gen")
        given_up = threading.Event()  # set on the way out: requests still waiting end at once
        cancel = AnyOf(self.closed, given_up)
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
                    body = generate_body(requests[i], params, seeds[i], eos_ids, ignore_eos)
                    server.in_flight += 1
                    future = ex.submit(
                        call,
                        server.url,
                        "POST",
                        GENERATE,
                        body,
                        self.request_timeout_s,
                        limit=generate_limit(len(body["token_ids"]), requests[i].max_tokens),
                        cancel=cancel,
                        watch=self.watch,
                    )
                    running[future] = (i, server)
                if not running:
                    if not any(s.alive for s in self.servers) and not self._reviving:
                        self._all_down()
                    time.sleep(POLL_S)  # every live server is full, or one is being revived
                    continue
                done, _ = wait(list(running), timeout=self.revive_s, return_when=FIRST_COMPLETED)
                for future in done:
                    i, server = running.pop(future)
                    server.in_flight -= 1
                    try:
                        gen = served(
                            future.result(),
                            requests[i].max_tokens,
                            server.url,
                            server.vocab_size,
                            self.newest_version,
                            self.stamped,
                        )
                    except Cancelled:
                        raise PoolClosed("the server pool was closed") from None
                    except Aborted as exc:
                        aborts[i] += 1
                        if aborts[i] >= MAX_ABORTS:
                            raise ServerFault(f"{exc}, {MAX_ABORTS} times") from None
                        todo.appendleft(i)  # whole, to whichever server is least loaded
                        server.resent += 1
                        continue
                    except (Unreachable, HTTPStatus) as exc:
                        if isinstance(exc, HTTPStatus) and exc.status < 500:
                            raise ServerError(
                                f"the server {server.url} refused a request: {exc}"
                            ) from None
                        self._down(server, exc)
                        server.resent += 1
                        todo.appendleft(i)  # whole, to another server
                        continue
                    except ServerFault as exc:
                        if not self._gone(server):  # a live server's own fault: not re-sent
                            raise
                        self._down(server, Unreachable(f"died answering ({exc})"))
                        server.resent += 1
                        todo.appendleft(i)  # whole, to another server
                        continue
                    if out[i] is not None:  # a request has one result: never reached
                        raise RuntimeError(f"request {i} answered twice")
                    out[i] = gen
                    server.completed += 1
        finally:  # a fault, an error or close(): answers nobody will read end within a slice
            given_up.set()
            ex.shutdown(wait=True, cancel_futures=True)
        return [g for g in out if g is not None]

    @property
    def newest_version(self) -> int | None:
        """The newest weights version a server may stamp on a token: the newest this pool
        pushed; None for a pool that never pushed (bapo eval: the server holds whatever its run
        left, any version)."""
        return self.version if self.pushed else None

    def _least_loaded(self) -> Server | None:
        live = [s for s in self.servers if s.alive and s.in_flight < self.max_in_flight]
        return min(live, key=lambda s: s.in_flight) if live else None

    def _down(self, server: Server, exc: Exception) -> None:
        if server.alive:
            server.alive = False
            server.last_error = str(exc)
            server.next_probe = time.monotonic() + self.revive_s
            self.events.append(f"down {server.url}: {exc}")

    def _gone(self, server: Server) -> bool:
        """After a malformed answer: whether the server is dying (its health refused, failed
        or unanswered, now or a moment later), as a vLLM server killed mid-answer is: it may
        send `{}` for the requests it held before its socket closes. Its answer is then no
        fault of a live server but the end of a dead one."""
        for wait_s in (0.0, GONE_WAIT_S):
            if self.closed.wait(wait_s):
                return False
            try:
                call(server.url, "GET", "/health", None, self.check_timeout_s)
            except ServerError:
                return True
        return False

    def _all_down(self) -> None:
        detail = "; ".join(f"{s.url}: {s.last_error or 'down'}" for s in self.servers)
        raise NoServerLeft(f"every generation server is down ({detail})")

    def _revive_due(self) -> None:
        """Ask each down server whose time has come whether it is back, each in a thread of its
        own: a server that does not answer must not hold up the others' answers."""
        now = time.monotonic()
        for server in self.servers:
            if not server.alive and now >= server.next_probe and server.url not in self._reviving:
                server.next_probe = now + self.revive_s
                self._reviving.add(server.url)
                threading.Thread(
                    target=self._revive_in_thread, args=(server,), daemon=True, name="bapo-revive"
                ).start()

    def _revive_in_thread(self, server: Server) -> None:
        try:
            if not self.closed.is_set():
                self.revive(server)
        finally:
            server.next_probe = time.monotonic() + self.revive_s
            self._reviving.discard(server.url)

    def revive(self, server: Server) -> bool:
        """A down server that answers again: checked (same model), given the newest weights,
        then used. False while it is still down. Its health is asked outside the lock, so a
        server that does not answer holds up no push."""
        try:
            call(server.url, "GET", "/health", None, self.check_timeout_s)
        except ServerError:
            return False  # still down: `last_error` keeps why it went down
        with self.lock:
            if not any(s is server for s in self.servers):  # it left while health was asked
                return False
            try:
                self._check_one(server)
                self._load_revived(server)
            except (ServerDown, Unreachable):
                return False
            except ServerError as exc:  # back, but refused: another run holds it, another model
                if server.last_error != str(exc):  # said once, not every REVIVE_S
                    self.events.append(f"refused {server.url}: {exc}")
                server.last_error = str(exc)
                return False
            server.alive = True
            self.revivals += 1  # a join too: it holds none of the deltas' chain
            kind, server.joining = ("join" if server.joining else "back"), False
        self.events.append(f"{kind} {server.url} at version {self.version}")
        return True

    # ---------------------------------------------------------------------------- membership

    def join(self, url: str) -> None:
        """Take a server in mid-run (`rollout.membership`): it starts down and is revived as a
        server that came back is (checked as at start, claimed, given the newest version, then
        sent requests), at once."""
        url = validate_url(url)
        with self.lock:
            if any(s.url == url for s in self.servers):
                return
            server = Server(url, joining=True, last_error="joining")
            self.servers = [*self.servers, server]  # a new list: other threads read the old

    def leave(self, url: str) -> None:
        """Let a server go mid-run: it takes no more requests, its claim is released, and the
        pool forgets it. Called between units (`staleness.servers`), when none of this run's
        requests is on it: what it answered was kept, nothing is cut off."""
        with self.lock:
            gone = [s for s in self.servers if s.url == url]
            if not gone:
                return
            if gone[0].in_flight:
                raise RuntimeError(f"{url} left holding {gone[0].in_flight} requests")
            self.servers = [s for s in self.servers if s.url != url]
        if self.claims is not None:
            self.claims.drop(url)
        self.events.append(f"leave {url}")

    def _load_revived(self, server: Server) -> None:
        """Bring a server that came back to the newest version (a pool that does not push,
        `staleness.server_setup.FollowerPool`, waits for the one that does)."""
        self._push_one(server, self.published, self.version, mode=self.revive_mode)

    def held_version(self, server: Server) -> int:
        """The weights version a server stamps on what it samples now (one token)."""
        sampling = {"max_tokens": 1, "ignore_eos": True, "detokenize": False}
        body = {"token_ids": [0], "sampling_params": sampling}
        answer = call(server.url, "POST", GENERATE, body, self.check_timeout_s)
        choice = first_choice(answer, server.url)
        return token_versions(choice.get("weight_versions"), 1, server.url)[0]

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
            self.published, self.version, self.pushed = directory, version, True
            live = [s for s in self.servers if s.alive]
            mode = "keep" if interrupt else "wait"
            ex = ThreadPoolExecutor(max_workers=max(1, len(live)))
            try:
                futures = {ex.submit(self._push_one, s, directory, version, mode): s for s in live}
                for future, server in futures.items():
                    try:
                        future.result()
                    except (Unreachable, HTTPStatus) as exc:
                        self._down(server, exc)
            finally:  # a stop (a signal) while pushes wait waits for none (close() ends them)
                ex.shutdown(wait=False)
            if not any(s.alive for s in self.servers):
                self._all_down()

    def close(self) -> None:
        """Stop waiting: a `generate` in another thread raises PoolClosed within `revive_s`, and
        every call this pool has waiting returns within `server_http.SLICE_S`. Requests still
        running are aborted on their servers (`pause?mode=abort`, `resume`: no server keeps
        generating answers nobody will read), all servers at once, each call within
        CLOSE_TIMEOUT_S: a run's stop never waits long on a server that hangs."""
        self.closed.set()
        busy = [s.url for s in self.servers if s.alive and s.in_flight > 0]
        threads = [threading.Thread(target=_abort, args=(u,), daemon=True) for u in busy]
        if self.claims is not None:  # the servers are free for the next run at once
            urls = [s.url for s in self.servers]
            threads.append(threading.Thread(target=self.claims.release, args=(urls,), daemon=True))
        for thread in threads:
            thread.start()
        for thread in threads:  # a server that does not answer lets its lease lapse
            thread.join(2 * CLOSE_TIMEOUT_S + 1)

    def _push_one(self, server: Server, directory: Path | None, version: int, mode: str) -> None:
        """One server's push: one call where it can, else five (`rollout.server_push`)."""
        server_push.push_one(self, server, directory, version, mode)

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
        limit = generate_limit(len(token_ids), 1)
        for server in (s for s in self.servers if s.alive):
            url = server.url
            answer = call(url, "POST", GENERATE, body, self.check_timeout_s, limit=limit)
            try:
                rows = answer["prompt_logprobs"][1:]
                logprobs = [
                    float(row[str(t)]["logprob"])
                    for row, t in zip(rows, token_ids[1:], strict=True)
                ]
            except (KeyError, IndexError, TypeError, ValueError):
                raise ServerFault(
                    f"{url} answered the probe without the prompt's log-probs: {short(answer)}"
                ) from None
            choice = first_choice(answer, url)
            out[url] = (token_versions(choice.get("weight_versions"), 1, url)[0], logprobs)
        return out

    # ------------------------------------------------------------------------------- metrics

    def spread(self) -> dict[str, int]:
        """Requests completed per server since the pool started."""
        return {s.url: s.completed for s in self.servers}


# ---------------------------------------------------------------------------------- answers


def _abort(url: str) -> None:
    """close(): abort what the server runs for us and let it take requests again. The resume is
    sent even when the pause went unanswered in time: a loaded server may still pause after the
    client gave up (its calls run in order, so the resume comes after), and a server left paused
    holds every request of the next run."""
    try:
        with contextlib.suppress(ServerError):
            call(url, "POST", "/pause?mode=abort", None, CLOSE_TIMEOUT_S)
    finally:
        with contextlib.suppress(ServerError):
            call(url, "POST", "/resume", None, CLOSE_TIMEOUT_S)
