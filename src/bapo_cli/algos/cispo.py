"""CISPO (MiniMax-M1, arXiv 2506.13585): the clipped, detached IS weight times log pi (`cispo`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.contract import Aggregation, RatioInputs
from bapo_cli.algos.core import REGISTRY, Tensor, rounded, surrogate_metrics, tokens
from bapo_cli.algos.params import LossParams, param, positive


@dataclass(frozen=True)
class CISPOParams(LossParams):
    """CISPO: the detached IS weight clipped to [max(0, 1 - eps_low), 1 + eps_high]."""

    eps_low: float = param(
        1.0, "lower clip range of the IS weight; >= 1 = no lower bound (MiniMax-M1's setting)"
    )
    eps_high: float = param(
        0.28,
        "upper clip range of the IS weight: w <= 1 + eps_high (MiniMax-M1 tunes only this one "
        "and does not publish it; 0.28 as verl's and Trinity-RFT's CISPO)",
    )

    def check(self) -> None:
        positive("eps_low", self.eps_low)
        positive("eps_high", self.eps_high)

    def bounds(self) -> tuple[float, float]:
        return max(0.0, 1.0 - float(self.eps_low)), 1.0 + float(self.eps_high)

    def describe(self) -> str:
        return f"IS weight clipped to [{max(0.0, 1 - self.eps_low):g}, {1 + self.eps_high:g}]"


@REGISTRY.register("cispo", params=CISPOParams)
def cispo_loss(
    log_prob: Tensor, inputs: RatioInputs, params: CISPOParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, Eq. 4): loss_t = -sg(clip(r_t, c_low, c_high)) A_t
    log pi_theta(y_t), c_low = max(0, 1 - eps_low), c_high = 1 + eps_high.

    The weight, not the token, is clipped: every valid token with A != 0 carries gradient
    -w_t A_t grad log pi (a low-probability token with a large ratio keeps the gradient w = c_high
    instead of none). clipfrac_low / clipfrac_high count the tokens whose weight was clipped
    (either sign). The algo group's dual_clip does not apply: the weight is at most c_high.
    """
    c_low, c_high = params.bounds()
    tok = tokens(log_prob, inputs)
    lo, hi = rounded(c_low, tok.r), rounded(c_high, tok.r)
    weight = tok.r.clamp(min=lo, max=hi)  # detached IS weight
    logp = torch.where(tok.valid, log_prob, 0.0)  # no 0 * inf on masked or non-finite tokens
    loss_tok = -tok.adv * weight * logp
    signed = tok.pos | tok.neg
    low = signed & (tok.r <= lo) if c_low > 0 else torch.zeros_like(signed)
    clipped = (low, signed & (tok.r >= hi))
    metrics = surrogate_metrics(tok, (c_low, c_high), clipped, weight=weight)
    return aggregation(loss_tok, tok.valid), metrics
