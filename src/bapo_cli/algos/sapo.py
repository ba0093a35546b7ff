"""SAPO (arXiv 2511.20347): a sigmoid gate instead of a hard clip (`sapo`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.contract import Aggregation, RatioInputs
from bapo_cli.algos.core import REGISTRY, Tensor, rounded, surrogate_metrics, tokens
from bapo_cli.algos.params import LossParams, param, positive

# Where the soft gate's gradient weight sech^2(tau (r - 1) / 2) has fallen to one half:
# |tau (r - 1)| = 2 arcosh(sqrt 2) = 2 ln(1 + sqrt 2).
SAPO_HALF_WIDTH = 2.0 * math.log(1.0 + math.sqrt(2.0))


@dataclass(frozen=True)
class SAPOParams(LossParams):
    """SAPO: a sigmoid gate instead of a hard clip, sharper for negative advantages."""

    tau_pos: float = param(1.0, "gate temperature for A > 0 (SAPO paper: 1.0)")
    tau_neg: float = param(1.05, "gate temperature for A < 0 (SAPO paper: 1.05)")

    def check(self) -> None:
        positive("tau_pos", self.tau_pos)
        positive("tau_neg", self.tau_neg)

    def describe(self) -> str:
        return f"soft gate, tau {self.tau_pos:g} (A > 0) / {self.tau_neg:g} (A < 0)"

    def half_bounds(self) -> tuple[float, float]:
        """(c_low, c_high): where a negative / positive token's gate weight has halved."""
        return (
            max(0.0, 1.0 - SAPO_HALF_WIDTH / float(self.tau_neg)),
            1.0 + SAPO_HALF_WIDTH / float(self.tau_pos),
        )


@REGISTRY.register("sapo", params=SAPOParams, agg="seq-mean-token-mean")
def sapo_loss(
    log_prob: Tensor, inputs: RatioInputs, params: SAPOParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347): loss_t = -A_t f(r_t),
    f(r) = (4 / tau) sigmoid(tau (r - 1)), tau = tau_pos if A > 0 else tau_neg.

    Its gradient is -A_t g(r_t) r_t grad log pi with the gate g(r) = 4 s (1 - s) =
    sech^2(tau (r - 1) / 2), s = sigmoid(tau (r - 1)): 1 on-policy, decaying smoothly off-policy
    instead of dropping to 0 at a bound. Every valid token with A != 0 carries gradient. SAPO has
    no bounds; c_low / c_high report where the gate has halved (1 -/+ 2 ln(1 + sqrt 2) / tau,
    c_low at least 0), and clipfrac_low / clipfrac_high count the tokens beyond them.
    The algo group's dual_clip does not apply: f is bounded by 4 / tau.
    """
    tok = tokens(log_prob, inputs)
    tau = torch.where(tok.pos, float(params.tau_pos), float(params.tau_neg)).to(tok.r.dtype)
    loss_tok = -tok.adv * (4.0 / tau) * torch.sigmoid(tau * (tok.ratio - 1.0))
    c_low, c_high = params.half_bounds()
    with torch.no_grad():
        gate = torch.sigmoid(tau * (tok.r - 1.0))
        weight = 4.0 * gate * (1.0 - gate) * tok.r
    lo, hi = rounded(c_low, tok.r), rounded(c_high, tok.r)
    low = tok.neg & (tok.r <= lo) if c_low > 0 else torch.zeros_like(tok.neg)
    metrics = surrogate_metrics(tok, (c_low, c_high), (low, tok.pos & (tok.r >= hi)), weight=weight)
    return aggregation(loss_tok, tok.valid), metrics
