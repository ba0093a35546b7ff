"""Generation with transformers' `generate()` on the trainer's own model (`rollout=hf`).

Works everywhere (CPU, one GPU); on the tiny CPU model it outruns vLLM, on real models it is the
slower one. The engine holds a reference to the
trainer's model, so its weights are always the trainer's current weights and `sync_weights` only
records the new policy version.

Behaviour log-probs: this engine returns none. The trainer scores the sampled tokens with its own
forward pass right after sampling, before any update, with the same weights and the same tensor
layout as its first update (rollout/scoring.py). The recorded log-probs are therefore exactly the
behaviour policy's, and an on-policy update sees a ratio of exactly 1. (The vLLM engine reports
its own log-probs too; the trainer scores its tokens the same way and logs the gap as
`rollout/logprob_abs_diff_*`.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from bapo_cli.models.loading import autocast_to
from bapo_cli.rollout.base import (
    FINISH_BUDGET,
    FINISH_STOP,
    Generation,
    Request,
    SamplingParams,
    eos_ids,
)


class HFEngine:
    """Batched sampling through `model.generate`, left-padded, one row per request."""

    name = "hf"

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        batch_size: int = 256,
        autocast: torch.dtype | None = None,  # mixed precision: sample in this dtype
        **_: object,
    ):
        self.model = model
        self.autocast = autocast
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.version = 0
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = eos_ids(model, tokenizer)
        if not self.eos_ids:
            raise ValueError("the tokenizer has no end-of-sequence token: generation cannot stop")

    def sync_weights(self, model: torch.nn.Module, version: int) -> float:
        if model is not self.model:  # a different module: copy its weights in, from memory
            self.model.load_state_dict(model.state_dict())
        self.version = version
        return 0.0

    def close(self) -> None:
        self.model = None

    @torch.no_grad()
    def generate(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        interrupt: Callable[[], bool] | None = None,
    ) -> list[Generation]:
        """One Generation per request. `interrupt` (asked after every new token): when it says
        yes, every unfinished response stops where it is, finish reason `budget`, to be
        continued later (with new weights: `staleness.interrupt`)."""
        out: list[Generation] = []
        for start in range(0, len(requests), self.batch_size):
            batch = requests[start : start + self.batch_size]
            out += self._generate_batch(batch, params, interrupt)
        return out

    def _generate_batch(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        interrupt: Callable[[], bool] | None = None,
    ) -> list[Generation]:
        device = next(self.model.parameters()).device
        rows = [list(r.prompt_ids) + list(r.prefix_ids) for r in requests]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):  # left padding, as generation needs
            input_ids[i, width - len(row) :] = torch.tensor(row)
            attention[i, width - len(row) :] = 1
        budget = max(r.max_tokens for r in requests)
        sample = params.temperature > 0
        kwargs = dict(
            max_new_tokens=budget,
            do_sample=sample,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_ids,
        )
        if sample:
            kwargs.update(
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else None,
            )
        if params.stop:
            kwargs.update(stop_strings=list(params.stop), tokenizer=self.tokenizer)
        if interrupt is not None:
            kwargs.update(stopping_criteria=StoppingCriteriaList([_Interrupt(interrupt)]))
        was_training = self.model.training
        self.model.eval()
        try:
            with autocast_to(self.autocast, device):
                generated = self.model.generate(
                    input_ids=input_ids.to(device), attention_mask=attention.to(device), **kwargs
                )
        finally:
            self.model.train(was_training)
        new = generated[:, width:].tolist()
        return [
            self._finish(tokens, req, params) for tokens, req in zip(new, requests, strict=True)
        ]

    def _finish(self, tokens: list[int], request: Request, params: SamplingParams) -> Generation:
        """Cut at the first end token (kept), a stop string, or this request's budget."""
        kept = tokens[: request.max_tokens]
        for i, tok in enumerate(kept):
            if tok in self.eos_ids:
                return Generation(kept[: i + 1], None, FINISH_STOP)
        if params.stop and self.pad_id in kept:  # generate() pads rows ended by a stop string
            return Generation(kept[: kept.index(self.pad_id)], None, FINISH_STOP)
        return Generation(kept, None, FINISH_BUDGET)


class _Interrupt(StoppingCriteria):
    """Stops every row of a `generate()` call once `asked()` says yes (checked after each token).

    Rows that already ended keep their end token; the others come back as they are and
    `_finish` marks them `budget`, so the collector continues them in its next round."""

    def __init__(self, asked: Callable[[], bool]) -> None:
        self.asked = asked

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **_) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), bool(self.asked()), dtype=torch.bool)
