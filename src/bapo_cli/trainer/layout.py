"""How a step's samples become tensors: mini-batches (one per optimizer update, the regime's
pure `split`) of collated micro-batches, and the behaviour log-probs of fresh samples, scored
with the same split so an on-policy update sees identical tensors. Built before the collector,
which scores with it, and the regime, which draws from the collector."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.scoring import (
    MicroBatch,
    collate,
    record_scored,
    split_micro,
    split_to_count,
    token_logprobs,
)
from bapo_cli.staleness.regimes import Regime
from bapo_cli.trainer.distributed import DistContext
from bapo_cli.trainer.throughput import ScoreClock

__all__ = ["BatchLayout"]


@dataclass(frozen=True)
class BatchLayout:
    regime: type[Regime]  # its class: `split(samples, k)` and `defer_first`
    k: int
    trainer: Any  # TrainerConfig: micro_batch_size, micro_batch_tokens, old_logprob
    temperature: float  # rollout.temperature: the behaviour log-probs' softmax
    pad_id: int
    device: torch.device
    dtype: torch.dtype  # of the log-probs (`rollout.scoring.logprob_dtype`)
    ctx: DistContext
    scorer: torch.nn.Module  # what computes log-probs (DDP-wrapped or FSDP2-sharded)
    engine_logprobs: bool  # the engine that samples reports log-probs of its own
    clock: ScoreClock = field(default_factory=ScoreClock)  # the scoring forwards' time

    def layout(self, samples: list[Sample], *, updates: bool = False) -> list[list[MicroBatch]]:
        """Mini-batches of micro-batches. `updates` (the optimizer's layout, which every rank
        makes in step): under FSDP2 with several ranks and trainer.micro_batch_tokens, every
        mini-batch gets the largest count of micro-batches any rank packed (one all-reduce;
        `split_to_count`), since each forward is a collective. Scoring runs in `gathered()`,
        no collective, so it needs no such agreement."""
        size, tokens = self.trainer.micro_batch_size, self.trainer.micro_batch_tokens
        parts = [
            split_micro(part, size=size, tokens=tokens)
            for part in self.regime.split(samples, self.k)
        ]
        if updates and self.ctx.sharded and self.ctx.world_size > 1 and tokens:
            counts = self.ctx.max([float(len(micro)) for micro in parts])
            parts = [split_to_count(m, int(c)) for m, c in zip(parts, counts, strict=True)]
        return [
            [collate(micro, self.pad_id, self.device, self.dtype) for micro in part]
            for part in parts
        ]

    def score(self, samples: list[Sample]) -> None:
        """Behaviour log-probs of fresh samples. A regime whose first mini-batch is trained by
        the weights that sampled it (`defer_first`) leaves that one to the first update's own
        forward, unless the mode needs no proximal pass (recompute) or the engine's own
        log-probs are to be compared with the trainer's. The forwards' log-probs stay on the
        device until the last micro-batch is scored, then are read to the samples at once (on
        CUDA the clock times them by events, read once a stage)."""
        defer_first = (
            self.regime.defer_first
            and self.trainer.old_logprob != "recompute"
            and not self.engine_logprobs
        )
        scored = []
        for i, mini in enumerate(self.layout(samples)):
            if defer_first and i == 0:
                continue
            for mb in mini:
                with self.clock.timing(mb.num_tokens, self.device), torch.no_grad():
                    logp, _ = token_logprobs(self.scorer, mb, self.temperature)
                scored.append((mb, logp))
        record_scored(scored)
