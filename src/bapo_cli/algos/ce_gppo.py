"""CE-GPPO (Su et al., arXiv 2509.20712): the clipped surrogate, except that the tokens PPO clips
keep a bounded, scaled gradient instead of none. Written after the authors' published loss
(`compute_gppo_loss_general_beta`, github.com/Kwai-Klear/CE-GPPO); formulas and defaults in
docs/algorithms.md.

With c_low = 1 - eps_low, c_high = 1 + eps_high and sg(.) stop-gradient:

    A < 0, r < c_low :   loss_t = -beta1 * c_low  * A * r / sg(r)   (value -beta1 c_low A,
    A > 0, r > c_high:   loss_t = -beta2 * c_high * A * r / sg(r)    gradient -beta c A grad log pi)
    otherwise        :   loss_t = -A r
    A < 0            :   loss_t = min(loss_t, -A * dual_clip)       (the dual clip, as PPO's)

so a clipped token's gradient is the one it had at the bound, times beta: beta = 0 is PPO,
beta = 1 keeps the bound's gradient. The comparisons are the reference code's, strict (a
token exactly at a bound takes the unclipped branch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.contract import Aggregation, RatioInputs
from bapo_cli.algos.core import REGISTRY, Tensor, rounded, surrogate_metrics, tokens
from bapo_cli.algos.params import ClipRangeParams, param, positive


@dataclass(frozen=True)
class CEGPPOParams(ClipRangeParams):
    """CE-GPPO: PPO's clip, with the clipped tokens' gradient scaled by beta1 / beta2."""

    eps_low: float = param(0.2, "clip range: c_low = 1 - eps_low (CE-GPPO's scripts: 0.2)")
    eps_high: float = param(0.2, "clip range: c_high = 1 + eps_high (CE-GPPO's scripts: 0.2)")
    beta1: float = param(
        0.75,
        "gradient scale of clipped A < 0 tokens (r < c_low) (README snippet and 7B script: "
        "0.75; the reference code's default and yaml: 0.25; the 1.5B script: 0.5)",
    )
    beta2: float = param(
        1.0, "gradient scale of clipped A > 0 tokens (r > c_high) (reference code, scripts: 1)"
    )

    def check(self) -> None:
        super().check()
        positive("beta1", self.beta1, zero=True)
        positive("beta2", self.beta2, zero=True)

    def describe(self) -> str:
        return (
            f"[{1 - self.eps_low:g}, {1 + self.eps_high:g}], clipped tokens keep "
            f"{self.beta1:g} (A < 0) / {self.beta2:g} (A > 0) of the bound's gradient"
        )


@REGISTRY.register("ce_gppo", params=CEGPPOParams)
def ce_gppo_loss(
    log_prob: Tensor, inputs: RatioInputs, params: CEGPPOParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """CE-GPPO (module docstring). clipfrac_low / clipfrac_high count the tokens beyond the
    bounds (they still carry the scaled gradient); the metrics' gradient weight of such a token
    is beta * c (r for the others), so rho is the positive share of the gradient it trains on."""
    c_low, c_high = params.bounds()
    tok = tokens(log_prob, inputs)
    r, adv = tok.r, tok.adv
    lo, hi = rounded(c_low, r), rounded(c_high, r)
    low = tok.neg & (r < lo)  # PPO drops these; CE-GPPO keeps beta1 of the bound's gradient
    high = tok.pos & (r > hi)
    zero = torch.zeros_like(r)
    scale = torch.where(
        low,
        zero + float(params.beta1) * c_low,
        torch.where(high, zero + float(params.beta2) * c_high, zero),
    )
    grad_only = tok.ratio / r  # value 1, gradient grad log pi
    r_eff = torch.where(low | high, scale * grad_only, tok.ratio)
    dual = torch.zeros_like(tok.neg)
    if params.dual_clip is not None:  # min(loss_t, -A dual) for A < 0: the constant wins above
        upper = rounded(params.dual_clip, r)
        dual = tok.neg & (torch.where(low, scale, r) > upper)
        r_eff = torch.where(dual, torch.full_like(r, upper), r_eff)
    loss_tok = -adv * r_eff
    # a clipped token whose beta is 0 carries no gradient, nor does a dual-clipped one
    active = ~(high & (scale == 0)) & ~dual & ~(low & (scale == 0))
    metrics = surrogate_metrics(
        tok, (c_low, c_high), (low, high), weight=torch.where(low | high, scale, r), active=active
    )
    return aggregation(loss_tok, tok.valid), metrics
