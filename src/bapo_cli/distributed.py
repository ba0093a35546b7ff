"""Data-parallel training with PyTorch's own stack: torchrun, `torch.distributed`, DDP.

    torchrun --nproc_per_node 2 -m bapo_cli train ...     (or: bapo train --nproc 2 ...)

Every rank runs the whole loop on its share of the prompts: each step draws the same global list
of `trainer.prompts_per_step` prompts (same seed on every rank) and rank r keeps prompts r, r+W,
r+2W, ... so **a prompt's whole group of samples lives on one rank** and group advantages need no
communication. Gradients are averaged by DDP; the loss of each micro-batch is divided by the
all-rank token count / W, so the averaged gradient is the gradient of the global mini-batch loss.
BAPO's bound search sums its two path vectors over all ranks (one all-reduce) before solving, so
every rank clips with identical bounds, equal to one process on the global batch. Step metrics
are averaged over ranks (maxima take the max); rank 0 alone logs, prints and writes checkpoints
(each rank's RNG, data position and regime buffers go into the same checkpoint).

Backends: gloo on CPU, NCCL on CUDA (one GPU per local rank). Not supported (yet): partial
rollouts under data parallelism (ranks would finish different numbers of groups per step) and
FSDP2 sharding.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

MAX_KEYS = ("staleness/max", "actor/ratio_max")


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def group(self) -> Any:
        return dist.group.WORLD if self.enabled else None

    def shard(self, items: list[Any]) -> list[Any]:
        """This rank's share of a global list: items rank, rank + W, rank + 2W, ..."""
        return items[self.rank :: self.world_size] if self.enabled else items

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        if not self.enabled:
            return module
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.local_rank] if torch.cuda.is_available() else None
        return DistributedDataParallel(module, device_ids=device_ids)

    def no_sync(self, module: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """Skip DDP's gradient all-reduce on every micro-batch but the last of an update."""
        if self.enabled and not last:
            return module.no_sync()
        return contextlib.nullcontext()

    def sum(self, values: list[float]) -> list[float]:
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def max(self, values: list[float]) -> list[float]:
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The step's metrics over all ranks: means, and the max for maxima."""
        if not self.enabled:
            return metrics
        keys = sorted(metrics)
        gathered: list[dict[str, float] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, {k: metrics[k] for k in keys})
        out = {}
        for key in keys:
            values = [g[key] for g in gathered if g is not None and key in g]
            out[key] = max(values) if key in MAX_KEYS else sum(values) / len(values)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's value of `obj` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (on every rank)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def from_env() -> DistContext:
    """Join the process group torchrun described in the environment (no-op without torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
        dist.init_process_group(backend=backend)
    return DistContext(rank=rank, world_size=world, local_rank=local)


def shutdown(ctx: DistContext, *, clean: bool = True) -> None:
    """Leave the process group. After a clean finish, wait for every rank first (tearing gloo down
    while a peer still talks can abort the process); after an error, leave at once so the other
    ranks fail on their next collective instead of hanging in a barrier."""
    if ctx.enabled and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
