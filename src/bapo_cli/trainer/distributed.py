"""Data-parallel training with PyTorch's own stack: torchrun, `torch.distributed`, DDP.

    torchrun --nproc_per_node 2 -m bapo_cli train ...     (or: bapo train --nproc 2 ...)

Every rank runs the whole loop on its share of the prompts: rank r reads its own strided share of
the one seeded prompt stream (global positions r, r + W, r + 2W, ...), so ranks never share a
prompt, **a prompt's whole group of samples lives on one rank** and group advantages need no
communication, and a regime that draws different counts on different ranks (partial rollouts top
up their own pools) stays disjoint. Gradients are averaged over ranks; the loss of each
micro-batch is divided by the all-rank token count / W, so the averaged gradient is the gradient
of the global mini-batch loss. BAPO's bound search sums its two path vectors over all ranks (one
all-reduce) before solving, so every rank clips with identical bounds, equal to one process on
the global batch (`algo.bound_scope=microbatch` searches each rank's micro-batch alone). Step
metrics are averaged over ranks (maxima take the max); rank 0 alone logs, prints and writes
checkpoints (each rank's RNG, data position and regime buffers go into the same
checkpoint).

Strategies (`trainer.strategy`):
- ddp (default): every rank holds the whole model; DDP all-reduces gradients once per update
  (`no_sync` on the other micro-batches). Buffers are not broadcast per forward (a causal LM's
  buffers are constants), so forwards carry no collective and ranks may score different numbers
  of micro-batches (partial rollouts).
- fsdp2: `torch.distributed.fsdp.fully_shard` on every decoder layer and on the policy as root:
  parameters, gradients and AdamW state are sharded; with `trainer.precision=mixed` the weights
  stay float32 and forwards run in `model.dtype` (MixedPrecisionPolicy; gradients reduced in
  float32). Every forward gathers parameters, so ranks must run the same number of micro-batches
  (partial rollouts are refused). Rollout and validation run inside `gathered()`: the full
  weights are all-gathered once, kept for the whole generation phase (no collective per token;
  ranks may generate different amounts) and freed after. Checkpoints gather a full state dict
  (HF weights, optimizer by parameter name) on rank 0.

Backends: gloo on CPU, NCCL on CUDA (one GPU per local rank). Under torchrun even a single
process (`--nproc 1`) joins a process group, so the NCCL/FSDP2 code path runs on one GPU too.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bapo_cli.parent_death import signal_on_parent_death

MAX_KEYS = ("staleness/max", "staleness/trajectory_max", "actor/ratio_max")
STRATEGIES = ("ddp", "fsdp2")


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str = "ddp"
    launched: bool = False  # started by torchrun: in a process group even with one rank

    @property
    def enabled(self) -> bool:
        return self.world_size > 1 or self.launched

    @property
    def sharded(self) -> bool:
        return self.enabled and self.strategy == "fsdp2"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def group(self) -> Any:
        return dist.group.WORLD if self.enabled else None

    def wrap(
        self, module: torch.nn.Module, compute_dtype: torch.dtype | None = None
    ) -> torch.nn.Module:
        """The policy's `ResponseLogits` made data-parallel: DDP-wrapped, or sharded in place
        (fsdp2; `compute_dtype` is the forward's parameter dtype, the stored one stays)."""
        if not self.enabled:
            return module
        if self.strategy == "fsdp2":
            return _fully_shard(module, compute_dtype)
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.local_rank] if torch.cuda.is_available() else None
        return DistributedDataParallel(module, device_ids=device_ids, broadcast_buffers=False)

    def no_sync(self, module: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """Skip DDP's gradient all-reduce on every micro-batch but the last of an update. (FSDP2
        reduce-scatters every micro-batch: its sharded gradients accumulate; skipping would hold
        full-size gradients.)"""
        if self.enabled and self.strategy == "ddp" and not last:
            return module.no_sync()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def gathered(self, module: torch.nn.Module):
        """fsdp2: the full weights on every rank for the block (generation, validation, weight
        sync to an engine) — one all-gather on entry, none per forward inside, freed on exit.
        Every rank must enter; inside, ranks may run different numbers of forwards. A no-op
        otherwise."""
        if not self.sharded:
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        parts = [m for m in module.modules() if isinstance(m, FSDPModule)]
        for m in parts:
            m.unshard()
            m.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for m in parts:  # FSDP2's defaults: the root keeps its weights until backward
                m.reshard()
                m.set_reshard_after_forward(m is not module, recurse=False)

    def full_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """(model weights, optimizer state) to checkpoint. fsdp2: full, gathered from the shards
        by every rank (a collective) and present on rank 0 only; weights None = the model's own
        (not sharded). `model` is the HF model inside the policy."""
        if not self.sharded:
            return None, optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=options)
        return weights, get_optimizer_state_dict(model, optimizer, options=options)

    def load_optimizer(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Restore what `full_state` saved (fsdp2: each rank keeps its shard of the full state)."""
        if not self.sharded:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=options)

    def sum(self, values: list[float]) -> list[float]:
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t)
        return t.tolist()

    def max(self, values: list[float]) -> list[float]:
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def _comm_device(self) -> torch.device:
        """NCCL reduces CUDA tensors only; gloo takes host tensors."""
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

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


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "MASTER_ADDR" in os.environ


def stop_with_agent() -> None:
    """A SIGTERM to this rank when torchrun's agent, its parent, dies (Linux; elsewhere nothing).
    An agent killed outright (srun forcing a step's end, the OOM killer, kill -9) leaves its
    ranks orphaned: outside the process tree SLURM signals, they would train on unseen (and,
    likely, close the MLflow run FAILED at a broken pipe). With the signal the rank stops as a
    SIGTERM stops it: the step ends, a checkpoint is written, the run is closed KILLED."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    if not signal_on_parent_death(signal.SIGTERM, os.getppid()):  # the agent died already
        os.kill(os.getpid(), signal.SIGTERM)


def from_env(strategy: str = "ddp", timeout_min: float = 60.0) -> DistContext:
    """Join the process group torchrun described in the environment (no-op without torchrun).

    `timeout_min`: how long a collective waits for the other ranks before failing. Rank 0 works
    alone while the others wait at their next collective (validation, writing a checkpoint), which
    on a large model can outlast NCCL's default of 10 minutes."""
    if strategy not in STRATEGIES:
        raise ValueError(f"trainer.strategy={strategy}: unknown; valid: {', '.join(STRATEGIES)}")
    if not launched_by_torchrun():
        return DistContext(strategy=strategy)
    stop_with_agent()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_min))
    return DistContext(
        rank=rank, world_size=world, local_rank=local, strategy=strategy, launched=True
    )


def _fully_shard(policy: torch.nn.Module, compute_dtype: torch.dtype | None) -> torch.nn.Module:
    """FSDP2 on each decoder layer, then on the policy (`ResponseLogits`) as the root: the root
    group holds what is left (embeddings, final norm, output layer; tied weights stay tied)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    stored = next(policy.parameters()).dtype
    mp = MixedPrecisionPolicy()
    if compute_dtype is not None and compute_dtype != stored:
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=stored)
    layers = decoder_layers(policy)
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(policy, mp_policy=mp)
    # FSDP2 names its root at the first forward; generation calls the layers without the root,
    # so run one tiny forward through the root now (every rank, as the all-gather needs).
    device = next(policy.parameters()).device
    one = torch.ones((1, 1), dtype=torch.long, device=device)
    zero = torch.zeros(1, dtype=torch.long, device=device)
    with torch.no_grad():  # one response token: (ids, mask, gather_pos, targets, rows, cols)
        policy(one, one, torch.zeros_like(one), torch.zeros_like(one), zero, zero)
    policy.reshard()  # the root keeps gathered weights after a forward; the optimizer needs shards
    return policy


def decoder_layers(policy: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a HF causal LM (`model.model.layers` for Qwen/Llama/Mistral)."""
    decoder = policy.model.get_decoder()
    layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None)
    if layers is None:
        raise ValueError(
            f"trainer.strategy=fsdp2: cannot find the decoder layers of {type(decoder).__name__} "
            "(expected .layers or .h); use trainer.strategy=ddp"
        )
    return list(layers)


def shutdown(ctx: DistContext, *, clean: bool = True) -> None:
    """Leave the process group. After a clean finish, wait for every rank first (tearing gloo down
    while a peer still talks can abort the process); after an error, leave at once so the other
    ranks fail on their next collective instead of hanging in a barrier."""
    if ctx.enabled and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
