"""SAPO (arXiv 2511.20347): a sigmoid gate instead of a hard clip (`sapo`)."""

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

# |tau (r - 1)| = 2 arcosh(sqrt 2) = 2 ln(1 + sqrt 2).
SAPO_HALF_WIDTH = 2.0 * math.log(1.0 + math.sqrt(2.0))


@dataclass(frozen=True)
class SAPOParams:
    """SAPO: a sigmoid gate instead of a hard clip, sharper for negative advantages."""

    tau_pos: float = param(1.0, "gate temperature for A > 0 (SAPO paper: 1.0)")
    tau_neg: float = param(1.05, "gate temperature for A < 0 (SAPO paper: 1.05)")

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        for name in ("tau_pos", "tau_neg"):
            if not 0.0 < number(name, getattr(self, name)) < math.inf:
                raise ParamError(name, getattr(self, name), "must be a finite number > 0")

    def describe(self) -> str:
        return f"soft gate, tau {self.tau_pos:g} (A > 0) / {self.tau_neg:g} (A < 0)"

    def half_bounds(self) -> tuple[float, float]:
        """(c_low, c_high): where a negative / positive token's gate weight has halved."""
        return (
            max(0.0, 1.0 - SAPO_HALF_WIDTH / float(self.tau_neg)),
            1.0 + SAPO_HALF_WIDTH / float(self.tau_pos),
        )


@REGISTRY.register("sapo", params=SAPOParams)
def sapo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    tau_pos: float = SAPOParams.tau_pos,
    tau_neg: float = SAPOParams.tau_neg,
    dual_clip: float | None = 3.0,
    agg: str = "seq-mean-token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347): loss_t = -A_t f(r_t),
    f(r) = (4 / tau) sigmoid(tau (r - 1)), tau = tau_pos if A > 0 else tau_neg.

    Its gradient is -A_t g(r_t) r_t grad log pi with the gate g(r) = 4 s (1 - s) =
    sech^2(tau (r - 1) / 2), s = sigmoid(tau (r - 1)): 1 on-policy, decaying smoothly off-policy
    instead of dropping to 0 at a bound. Every valid token with A != 0 carries gradient. SAPO has
    no bounds; c_low / c_high report where the gate has halved (1 -/+ 2 ln(1 + sqrt 2) / tau,
    c_low at least 0), and clipfrac_low / clipfrac_high count the tokens beyond them.
    dual_clip is not used: f is bounded by 4 / tau.
    """
    params = SAPOParams(tau_pos=tau_pos, tau_neg=tau_neg)
    aggregation = Aggregation.checked(log_prob.dim(), agg, global_tokens, global_seqs, norm_len)
    tok = prepare_tokens(log_prob, old_log_prob, advantages, mask)
    tau = torch.where(tok.pos, float(tau_pos), float(tau_neg)).to(tok.r.dtype)
    loss_tok = -tok.adv * (4.0 / tau) * torch.sigmoid(tau * (tok.ratio - 1.0))
    loss = aggregation(loss_tok, tok.valid)
    c_low, c_high = params.half_bounds()
    with torch.no_grad():
        gate = torch.sigmoid(tau * (tok.r - 1.0))
        weight = 4.0 * gate * (1.0 - gate) * tok.r
    lo, hi = _rounded(c_low, tok.r), _rounded(c_high, tok.r)
    metrics = surrogate_metrics(
        tok,
        ratio=tok.r,
        weight=weight,
        active_pos=tok.pos,
        active_neg=tok.neg,
        clipped_low=tok.neg & (tok.r <= lo) if c_low > 0 else torch.zeros_like(tok.neg),
        clipped_high=tok.pos & (tok.r >= hi),
        c_low=c_low,
        c_high=c_high,
    )
    return loss, metrics
