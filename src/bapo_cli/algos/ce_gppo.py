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

import math
from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.core import (
    REGISTRY,
    Aggregation,
    Tensor,
    _check_dual_clip,
    _rounded,
    check_eps,
    prepare_tokens,
    surrogate_metrics,
)
from bapo_cli.algos.params import ParamError, number, param


@dataclass(frozen=True)
class CEGPPOParams:
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

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        check_eps(self.eps_low, self.eps_high)
        for name in ("beta1", "beta2"):
            if not 0.0 <= number(name, getattr(self, name)) < math.inf:
                raise ParamError(name, getattr(self, name), "must be a finite number >= 0")

    def describe(self) -> str:
        return (
            f"[{1 - self.eps_low:g}, {1 + self.eps_high:g}], clipped tokens keep "
            f"{self.beta1:g} (A < 0) / {self.beta2:g} (A > 0) of the bound's gradient"
        )


@REGISTRY.register("ce_gppo", params=CEGPPOParams)
def ce_gppo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = CEGPPOParams.eps_low,
    eps_high: float = CEGPPOParams.eps_high,
    beta1: float = CEGPPOParams.beta1,
    beta2: float = CEGPPOParams.beta2,
    dual_clip: float | None = 3.0,
    agg: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """CE-GPPO (module docstring). clipfrac_low / clipfrac_high count the tokens beyond the
    bounds (they still carry the scaled gradient); the metrics' gradient weight of such a token
    is beta * c (r for the others), so rho is the positive share of the gradient it trains on."""
    CEGPPOParams(eps_low=eps_low, eps_high=eps_high, beta1=beta1, beta2=beta2)
    c_low, c_high = 1.0 - float(eps_low), 1.0 + float(eps_high)
    dual_clip = _check_dual_clip(dual_clip, c_low)
    aggregation = Aggregation.checked(log_prob.dim(), agg, global_tokens, global_seqs, norm_len)
    tok = prepare_tokens(log_prob, old_log_prob, advantages, mask)
    r, adv = tok.r, tok.adv
    lo, hi = _rounded(c_low, r), _rounded(c_high, r)
    low = tok.neg & (r < lo)  # PPO drops these; CE-GPPO keeps beta1 of the bound's gradient
    high = tok.pos & (r > hi)
    zero = torch.zeros_like(r)
    scale = torch.where(
        low, zero + float(beta1) * c_low, torch.where(high, zero + float(beta2) * c_high, zero)
    )
    grad_only = tok.ratio / r  # value 1, gradient grad log pi
    r_eff = torch.where(low | high, scale * grad_only, tok.ratio)
    dual = torch.zeros_like(tok.neg)
    if dual_clip is not None:  # min(loss_t, -A dual) for A < 0: the constant wins above it
        upper = _rounded(dual_clip, r)
        dual = tok.neg & (torch.where(low, scale, r) > upper)
        r_eff = torch.where(dual, torch.full_like(r, upper), r_eff)
    loss_tok = -adv * r_eff
    loss = aggregation(loss_tok, tok.valid)
    weight = torch.where(low | high, scale, r)
    metrics = surrogate_metrics(
        tok,
        ratio=r,
        weight=weight,
        active_pos=tok.pos & ~(high & (scale == 0)),
        active_neg=tok.neg & ~dual & ~(low & (scale == 0)),
        clipped_low=low,
        clipped_high=high,
        c_low=c_low,
        c_high=c_high,
    )
    return loss, metrics
