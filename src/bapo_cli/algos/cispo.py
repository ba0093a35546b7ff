"""CISPO (MiniMax-M1, arXiv 2506.13585): the clipped, detached IS weight times log pi (`cispo`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.core import (
    REGISTRY,
    Aggregation,
    Tensor,
    _rounded,
    prepare_tokens,
    surrogate_metrics,
)
from bapo_cli.algos.params import ParamError, number, param


@dataclass(frozen=True)
class CISPOParams:
    """CISPO: the detached IS weight clipped to [max(0, 1 - eps_low), 1 + eps_high]."""

    eps_low: float = param(
        1.0, "lower clip range of the IS weight; >= 1 = no lower bound (MiniMax-M1's setting)"
    )
    eps_high: float = param(
        0.28,
        "upper clip range of the IS weight: w <= 1 + eps_high (MiniMax-M1 tunes only this one "
        "and does not publish it; 0.28 as verl's and Trinity-RFT's CISPO)",
    )

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        if not 0.0 < number("eps_low", self.eps_low) < math.inf:
            raise ParamError("eps_low", self.eps_low, "must be a finite number > 0")
        if not 0.0 < number("eps_high", self.eps_high) < math.inf:
            raise ParamError("eps_high", self.eps_high, "must be a finite number > 0")

    def describe(self) -> str:
        return f"IS weight clipped to [{max(0.0, 1 - self.eps_low):g}, {1 + self.eps_high:g}]"


@REGISTRY.register("cispo", params=CISPOParams)
def cispo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = CISPOParams.eps_low,
    eps_high: float = CISPOParams.eps_high,
    dual_clip: float | None = 3.0,
    agg: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, Eq. 4): loss_t = -sg(clip(r_t, c_low, c_high)) A_t
    log pi_theta(y_t), c_low = max(0, 1 - eps_low), c_high = 1 + eps_high.

    The weight, not the token, is clipped: every valid token with A != 0 carries gradient
    -w_t A_t grad log pi (a low-probability token with a large ratio keeps the gradient w = c_high
    instead of none). clipfrac_low / clipfrac_high count the tokens whose weight was clipped
    (either sign). dual_clip is not used: the weight is already at most c_high.
    """
    CISPOParams(eps_low=eps_low, eps_high=eps_high)
    c_low, c_high = max(0.0, 1.0 - float(eps_low)), 1.0 + float(eps_high)
    aggregation = Aggregation.checked(log_prob.dim(), agg, global_tokens, global_seqs, norm_len)
    tok = prepare_tokens(log_prob, old_log_prob, advantages, mask)
    lo, hi = _rounded(c_low, tok.r), _rounded(c_high, tok.r)
    weight = tok.r.clamp(min=lo, max=hi)  # detached IS weight
    logp = torch.where(tok.valid, log_prob, 0.0)  # no 0 * inf on masked or non-finite tokens
    loss_tok = -tok.adv * weight * logp
    loss = aggregation(loss_tok, tok.valid)
    signed = tok.pos | tok.neg
    metrics = surrogate_metrics(
        tok,
        ratio=tok.r,
        weight=weight,
        active_pos=tok.pos,
        active_neg=tok.neg,
        clipped_low=signed & (tok.r <= lo) if c_low > 0 else torch.zeros_like(signed),
        clipped_high=signed & (tok.r >= hi),
        c_low=c_low,
        c_high=c_high,
    )
    return loss, metrics


# Where the soft gate's gradient weight sech^2(tau (r - 1) / 2) has fallen to one half:
