"""What one training run is made of, handed from stage to stage of `train()`: the `Run` (every
piece `setup` built: config, model and scorer, optimizer, prompts, engine, batch layout,
collector, regime, loss spec, and what the stages keep between steps), its counters
(`TrainState`, saved in checkpoints) and `TrainingError`, which every stage raises when training
cannot go on."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from bapo_cli.config.schema import TrainConfig
from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.collect import Collector
from bapo_cli.rollout.scoring import MicroBatch
from bapo_cli.staleness.regimes import Regime
from bapo_cli.staleness.source import SampleSource
from bapo_cli.trainer import checkpoint, distributed
from bapo_cli.trainer.layout import BatchLayout
from bapo_cli.trainer.prompts import PromptStream
from bapo_cli.trainer.update import LossSpec

__all__ = ["Run", "TrainResult", "TrainState", "TrainingError"]


class TrainingError(RuntimeError):
    """Training cannot go on; the message says why and what was kept."""


@dataclass
class TrainState:
    step: int = 0  # rollout steps done
    version: int = 0  # optimizer updates applied = policy version
    skipped_in_a_row: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass
class TrainResult:
    run_dir: Path
    run_id: str | None
    history: list[dict[str, float]]  # one dict of logged metrics per step
    checkpoint: Path | None  # the last checkpoint written
    updates: list[dict[str, float]] = field(default_factory=list)  # per update (this process)
    last_batch: list[Sample] = field(default_factory=list)  # the samples of the last step
    interrupted: bool = False  # stopped by Ctrl-C or a signal (run KILLED, resume printed)
    exit_code: int = 0  # 128 + the signal that stopped it (130 Ctrl-C, 143 SIGTERM)


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
    source: SampleSource  # who samples: decided once, shown in the run plan
    engine: Any  # the engine in this process (validation only when samples come from elsewhere)
    spec: LossSpec
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    batches: BatchLayout
    collector: Collector
    regime: Regime
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
        """Mini-batches (one per optimizer update) of collated micro-batches (`BatchLayout`)."""
        return self.batches.layout(samples, updates=updates)

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
