"""LUSPO (Length-Unbiased Sequence Policy Optimization, arXiv 2602.05261): GSPO with each
sequence's loss scaled by its length (`luspo`).

GSPO averages the sequence losses, l_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
with s_i = exp(mean_t log r_{i,t}), over the sequences: a sequence's gradient is
A_i grad s_i = A_i s_i mean_t grad log pi(y_t), so a long response moves each of its tokens
less than a short one with the same advantage. LUSPO multiplies l_i by |y_i|:

    L = (1/B) sum_i |y_i| l_i            (gradient A_i s_i sum_t grad log pi(y_t) per sequence)

Written as GSPO here (`core.sequence_clipped_surrogate`: every token carries s_i, gradient
s_i grad log pi(y_t)) with the aggregation `seq-mean-token-sum`: summing the tokens of a
sequence is |y_i| l_i, the mean over sequences TRL's `.mean()`.

Source: TRL's `loss_type="luspo"` (huggingface/trl@f2cd577, `trl/trainer/grpo_trainer.py`,
`GRPOTrainer._compute_loss`: `importance_sampling_level="sequence"`, per sequence
`-min(coef_1 A, coef_2 A)`, then `(per_token_loss * mask.sum(1, keepdim=True)).mean()`);
clip range 2e-3 / 2.5e-3 from TRL's paper index (`docs/source/paper_index.md`, "section 5.1 of
the paper"). No dual clip (TRL's luspo has none; `algo.dual_clip` adds verl's on s_i). The paper
itself was not readable here: the formula is TRL's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bapo_cli.algos.contract import Aggregation, RatioInputs
from bapo_cli.algos.core import REGISTRY, Tensor, sequence_clipped_surrogate, tokens
from bapo_cli.algos.params import ClipRangeParams, dual_clip_param, param


@dataclass(frozen=True)
class LUSPOParams(ClipRangeParams):
    """LUSPO: GSPO's sequence-ratio clip, each sequence's loss times its length."""

    eps_low: float = param(
        2e-3, "lower clip range of the sequence ratio (LUSPO paper, Sec. 5.1, via TRL: 2e-3)"
    )
    eps_high: float = param(
        2.5e-3, "upper clip range of the sequence ratio (LUSPO paper, Sec. 5.1, via TRL: 2.5e-3)"
    )
    dual_clip: float | None = dual_clip_param(None)

    def describe(self) -> str:
        return (
            f"sequence ratio in [{1 - self.eps_low:g}, {1 + self.eps_high:g}], each sequence's "
            "loss times its length"
        )


@REGISTRY.register("luspo", params=LUSPOParams, agg="seq-mean-token-sum")
def luspo_loss(
    log_prob: Tensor, inputs: RatioInputs, params: LUSPOParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """LUSPO (module docstring): GSPO's clipped sequence ratio on every token; with
    agg="seq-mean-token-sum" (the preset's, LUSPO's) each sequence counts |y_i| times. The metrics
    are GSPO's: clipped tokens are those of clipped sequences. Needs [B, T] tensors."""
    if log_prob.dim() != 2:
        raise ValueError(
            f"luspo needs [B, T] tensors (its ratio is per sequence), got shape "
            f"{tuple(log_prob.shape)}"
        )
    tok = tokens(log_prob, inputs)
    return sequence_clipped_surrogate(tok, params.bounds(), params.dual_clip, aggregation)
