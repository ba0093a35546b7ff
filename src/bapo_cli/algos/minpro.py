"""MinPRO, the Minimum Prefix Ratio (Lei, Cheng, Tao, "A Step Back: Prefix Importance Ratio
Stabilizes Policy Optimization", arXiv 2601.22718): a token's off-policy correction should be
the prefix ratio prod_{s <= t} rho_s (the probability of reaching y_t and taking it, target over
behaviour), which a token-level objective replaces by rho_t alone and a sequence-level one by an
exploding product. MinPRO keeps a prefix correction but "replaces the unstable cumulative prefix
ratio with a non-cumulative surrogate based on the minimum token-level ratio observed in the
preceding prefix" (the paper's abstract).

The paper's equations could not be read for this implementation (it has no public code); what
is implemented is that sentence, written out (docs/algorithms.md says so and lists what is
assumed):

    m_t  = sg(min_{s < t} rho_s)        over the sequence's valid tokens before t; m = 1 for the
                                        first token (an empty prefix)
    loss_t = -m_t * min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t)

i.e. GRPO's clipped surrogate for the current token (with the dual clip for A < 0, as every
clipped loss here), its advantage weighted by the smallest ratio of the prefix: a prefix whose
tokens the current policy has moved away from (some rho_s small) counts less, without the
product's exponential range. m_t is not capped at 1 (the sentence does not say it is); its log
is capped at 20 so no weight is infinite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.contract import Aggregation, RatioInputs
from bapo_cli.algos.core import REGISTRY, Tensor, check_shapes, clipped_surrogate, prepare_tokens
from bapo_cli.algos.params import ClipRangeParams, param

# The log of the prefix weight is capped here: e^20 ~ 5e8, finite in every dtype a loss runs in.
MAX_LOG_PREFIX = 20.0


@dataclass(frozen=True)
class MinPROParams(ClipRangeParams):
    """MinPRO: GRPO's clipped surrogate weighted by the prefix's minimum token ratio."""

    eps_low: float = param(0.2, "clip range of the current token's ratio: c_low = 1 - eps_low")
    eps_high: float = param(0.2, "clip range of the current token's ratio: c_high = 1 + eps_high")

    def describe(self) -> str:
        return (
            f"[{1 - self.eps_low:g}, {1 + self.eps_high:g}] per token, its advantage weighted by "
            "the minimum token ratio of the preceding prefix"
        )


def prefix_min_weight(log_prob: Tensor, old_log_prob: Tensor, mask: Tensor) -> Tensor:
    """m_t = min over the valid tokens s < t of rho_s, [B, T] float64, detached; 1 where the
    prefix has no valid token. A token whose log-ratio is not finite is no part of any prefix
    (the loss leaves it out, as every loss leaves out non-finite tokens)."""
    if log_prob.dim() != 2:
        raise ValueError(
            f"minpro needs [B, T] tensors (a prefix is within a sequence), got shape "
            f"{tuple(log_prob.shape)}"
        )
    with torch.no_grad():
        log_ratio = log_prob.detach().double() - old_log_prob.detach().double()
        in_mask = mask if mask.dtype == torch.bool else mask != 0
        usable = torch.where(in_mask & torch.isfinite(log_ratio), log_ratio, math.inf)
        running = torch.cummin(usable, dim=-1).values  # min over s <= t
        before = torch.cat([torch.full_like(running[:, :1], math.inf), running[:, :-1]], dim=-1)
        log_m = torch.where(torch.isfinite(before), before, 0.0).clamp(max=MAX_LOG_PREFIX)
        return torch.exp(log_m)


@REGISTRY.register("minpro", params=MinPROParams)
def minpro_loss(
    log_prob: Tensor, inputs: RatioInputs, params: MinPROParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """MinPRO (module docstring). The prefix weight m_t > 0 multiplies the advantage, which
    leaves the side a ratio clips on unchanged: the clipped surrogate of the weighted advantage
    is m_t times the token's clipped surrogate. The metrics are the clipped surrogate's, with
    the mass r |m A| (rho is the positive share of the gradient weight the loss trains on)."""
    old, mask = inputs.old_log_prob, inputs.mask
    adv = check_shapes(log_prob, old, inputs.advantages, mask)
    weight = prefix_min_weight(log_prob, old, mask)
    tok = prepare_tokens(log_prob, old, adv * weight.to(adv.dtype), mask)
    return clipped_surrogate(tok, params.bounds(), params.dual_clip, aggregation)
