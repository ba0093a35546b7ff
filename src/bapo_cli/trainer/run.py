"""What one training run is made of, handed from stage to stage of `train()`: the `Run` (every
piece `_build` made: config, model and scorer, optimizer, prompts, engine, collector, regime, loss
spec, and what the stages keep between steps), its counters (`TrainState`, saved in checkpoints)
and `TrainingError`, which every stage raises when training cannot go on."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from bapo_cli.config.schema import TrainConfig
from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.collect import Collector
from bapo_cli.rollout.scoring import (
    MicroBatch,
    collate,
    logprob_dtype,
    record_behaviour,
    split_micro,
    split_to_count,
)
from bapo_cli.staleness.regimes import Regime
from bapo_cli.trainer import checkpoint, distributed
from bapo_cli.trainer.prompts import PromptStream
from bapo_cli.trainer.update import LossSpec

__all__ = ["Run", "TrainState", "TrainingError"]


class TrainingError(RuntimeError):
    """Training cannot go on; the message says why and what was kept."""


@dataclass
class TrainState:
    step: int = 0  # rollout steps done
    version: int = 0  # optimizer updates applied = policy version
    skipped_in_a_row: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass
class Run:
    """Everything one training run built, handed to each stage (resume, step, save, close)."""

    cfg: TrainConfig
    ctx: distributed.DistContext
    console: Console
    run_dir: Path  # rank 0's run dir, on every rank
    model: torch.nn.Module  # the policy itself: checkpoints and the engine read it
    scorer: torch.nn.Module  # what computes log-probs (DDP-wrapped or FSDP2-sharded)
    ref_model: torch.nn.Module | None  # the frozen KL reference (algo.kl_coef > 0)
    tokenizer: Any
    device: torch.device
    prompts: PromptStream
    engine_name: str
    engine: Any
    spec: LossSpec
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    # set by _build once the run exists: the collector scores with `score`, which splits by the
    # regime, which draws from the collector
    collector: Collector = field(init=False)
    regime: Regime = field(init=False)
    state: TrainState = field(default_factory=TrainState)
    run_id: str | None = None  # the MLflow run to continue (resume)
    val_sets: list[Any] = field(default_factory=list)
    last_ckpt: Path | None = None
    saved_step: int | None = None  # the step of `last_ckpt` (a stop saves no step twice)
    rest_s: float | None = None  # the previous step's time from its first update to its end
    updates: list[dict[str, float]] = field(default_factory=list)  # per optimizer update
    batch: list[Sample] = field(default_factory=list)  # the samples of the last step
    # a cumulative advantage estimator's statistics per prompt id (algo.advantage=dcpo: steps
    # seen, mean, std of its rewards), the same on every rank; in rank_state, so a step
    # abandoned before its updates saves the table as it was before that step
    prompt_stats: dict[str, list[float]] = field(default_factory=dict)

    def layout(self, samples: list[Sample], *, updates: bool = False) -> list[list[MicroBatch]]:
        """Mini-batches (one per optimizer update) of micro-batches; the same split scores the
        behaviour log-probs and trains, so an on-policy update sees identical tensors.

        `updates` (the optimizer's layout, which every rank makes in step): under FSDP2 with
        several ranks and trainer.micro_batch_tokens, every mini-batch gets the largest count of
        micro-batches any rank packed (one all-reduce; `split_to_count`), since each forward is a
        collective. Scoring needs no such agreement: it runs in `gathered()`, no collective."""
        trainer, pad = self.cfg.trainer, self.tokenizer.pad_token_id
        dtype = logprob_dtype(self.model)  # float64 under model.dtype=float64, else float32
        parts = [
            split_micro(part, size=trainer.micro_batch_size, tokens=trainer.micro_batch_tokens)
            for part in self.regime.split(samples)
        ]
        if updates and self.ctx.sharded and self.ctx.world_size > 1 and trainer.micro_batch_tokens:
            counts = self.ctx.max([float(len(micro)) for micro in parts])
            parts = [split_to_count(m, int(c)) for m, c in zip(parts, counts, strict=True)]
        return [[collate(micro, pad, self.device, dtype) for micro in part] for part in parts]

    def score(self, samples: list[Sample]) -> None:
        """Behaviour log-probs of fresh samples. A regime whose first mini-batch is trained by
        the weights that sampled it (`defer_first`) leaves that one to the first update's own
        forward (not with an engine that reports its own log-probs: those are compared with the
        trainer's)."""
        defer_first = (
            self.regime.defer_first
            and self.cfg.trainer.old_logprob != "recompute"  # loglinear needs no proximal pass
            and self.engine_name == "hf"
        )
        for i, mini in enumerate(self.layout(samples)):
            if defer_first and i == 0:
                continue
            for mb in mini:
                record_behaviour(self.scorer, mb, self.cfg.rollout.temperature)

    def rank_state(self) -> dict[str, Any]:
        """What differs between ranks: sampling RNG, data position, the regime's buffers (and the
        prompt statistics of a cumulative advantage, the same on every rank: kept with the data
        position they belong to)."""
        return {
            "regime": self.regime.state_dict(),
            "prompts": self.prompts.state_dict(),
            "next_group": self.collector.next_group,
            "rng": checkpoint.rng_state(),
            "prompt_stats": self.prompt_stats,
        }
