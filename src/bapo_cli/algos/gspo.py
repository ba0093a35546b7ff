"""GSPO (arXiv 2507.18071): the clip on the length-normalised sequence ratio (`gspo`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bapo_cli.algos.contract import Aggregation, RatioInputs
from bapo_cli.algos.core import REGISTRY, Tensor, sequence_clipped_surrogate, tokens
from bapo_cli.algos.params import ClipRangeParams, param


@dataclass(frozen=True)
class GSPOParams(ClipRangeParams):
    """GSPO: clip the length-normalised sequence ratio s_i to [1 - eps_low, 1 + eps_high]."""

    eps_low: float = param(3e-4, "lower clip range of the sequence ratio (GSPO paper: 3e-4)")
    eps_high: float = param(4e-4, "upper clip range of the sequence ratio (GSPO paper: 4e-4)")

    def describe(self) -> str:
        return f"sequence ratio in [{1 - self.eps_low:g}, {1 + self.eps_high:g}]"


@REGISTRY.register("gspo", params=GSPOParams, agg="seq-mean-token-mean")
def gspo_loss(
    log_prob: Tensor, inputs: RatioInputs, params: GSPOParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """GSPO (arXiv 2507.18071): the clipped surrogate on the sequence ratio
    s_i = exp(mean_t log r_{i,t}) over the sequence's valid tokens.

    Written in the paper's GSPO-token form (`core.sequence_clipped_surrogate`): every token has
    the value s_i and the gradient s_i grad log pi(y_t), so with agg="seq-mean-token-mean" (the
    paper's 1/G sum_i) the gradient is exactly GSPO's, sum_i A_i grad s_i / G, and per-token
    advantages (rollout.tis_cap) still apply. A whole sequence is clipped or not. Needs [B, T]
    tensors.
    """
    if log_prob.dim() != 2:
        raise ValueError(
            f"gspo needs [B, T] tensors (its ratio is per sequence), got shape "
            f"{tuple(log_prob.shape)}"
        )
    tok = tokens(log_prob, inputs)
    return sequence_clipped_surrogate(tok, params.bounds(), params.dual_clip, aggregation)
