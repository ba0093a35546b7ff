"""DPPO (Qi et al., arXiv 2602.04879): a trust region on the probability *difference* of the
sampled token instead of its ratio, in two variants, `dppo_tv` (binary total variation) and
`dppo_kl` (binary KL). Written after verl's `compute_policy_loss_dppo_tv` / `_dppo_kl`
(`verl/trainer/ppo/core_algos.py`); formulas and defaults in docs/algorithms.md.

With p = pi_theta(y_t) and q = pi_old(y_t) (the behaviour policy that sampled the token), a token
is masked (no loss, no gradient) when the update moves it out of the trust region in the
direction its advantage pushes:

    dppo_tv:  A > 0 and p - q > delta_high,      A < 0 and p - q < -delta_low
    dppo_kl:  A > 0 and p > q and D > delta_high, A < 0 and p < q and D > delta_low,
              D = q log(q / p) + (1 - q) log((1 - q) / (1 - p))   (the KL of two Bernoullis)

and every other token keeps the truncated-IS policy gradient,

    loss_t = -A_t * sg(min(r_t, ratio_cap)) * log pi_theta(y_t) * keep_t,

so its gradient is -A_t min(r_t, ratio_cap) grad log pi: the ratio only weights, it never
decides. A low-probability token whose ratio grew large (q = 0.01, p = 0.05: r = 5) stays
inside a 0.15 TV region; a high-probability one that moved by 0.2 in probability does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.contract import Aggregation, RatioInputs
from bapo_cli.algos.core import REGISTRY, Tensor, rounded, surrogate_metrics, tokens
from bapo_cli.algos.params import LossParams, ParamError, number, param, positive

# verl's 1e-8 inside the Bernoulli KL's second log: keeps log((1 - q) / (1 - p)) finite at p = 1.
BINARY_KL_EPS = 1e-8


@dataclass(frozen=True)
class DPPOTVParams(LossParams):
    """DPPO-Binary-TV: mask a token once its probability moved by more than delta."""

    delta_low: float = param(
        0.15,
        "TV threshold for A < 0: masked once pi_old - pi_theta > delta_low (verl's DPPO "
        "example: 0.15)",
    )
    delta_high: float = param(
        0.15,
        "TV threshold for A > 0: masked once pi_theta - pi_old > delta_high (verl's DPPO "
        "example: 0.15)",
    )
    ratio_cap: float = param(
        20.0,
        "truncated IS: the weight is min(r, ratio_cap), detached (20: this project's choice; "
        "verl runs 3.0, ActorConfig.clip_ratio_c, its code's fallback 20 never applies; its "
        "DPPO example sets 10000)",
    )

    divergence = "tv"  # which trust region (a class constant, not a parameter)

    def check(self) -> None:
        positive("delta_low", self.delta_low)
        positive("delta_high", self.delta_high)
        if not 1.0 <= number("ratio_cap", self.ratio_cap) < math.inf:
            raise ParamError("ratio_cap", self.ratio_cap, "must be a finite number >= 1")

    def describe(self) -> str:
        return (
            f"probability moved by at most {self.delta_low:g} (A < 0) / {self.delta_high:g} "
            f"(A > 0), IS weight <= {self.ratio_cap:g}"
        )


@dataclass(frozen=True)
class DPPOKLParams(DPPOTVParams):
    """DPPO-Binary-KL: mask a token once the Bernoulli KL of its probability exceeds delta."""

    delta_low: float = param(
        0.05, "binary-KL threshold for A < 0 (pi_theta < pi_old) (verl's DPPO example: 0.05)"
    )
    delta_high: float = param(
        0.05, "binary-KL threshold for A > 0 (pi_theta > pi_old) (verl's DPPO example: 0.05)"
    )

    divergence = "kl"

    def describe(self) -> str:
        return (
            f"binary KL at most {self.delta_low:g} (A < 0) / {self.delta_high:g} (A > 0), "
            f"IS weight <= {self.ratio_cap:g}"
        )


def dppo_keep(log_prob: Tensor, old_log_prob: Tensor, adv: Tensor, params: DPPOTVParams) -> Tensor:
    """Bool [B, T]: the tokens DPPO keeps (inside the trust region, or moving back into it)."""
    delta_low, delta_high = float(params.delta_low), float(params.delta_high)
    with torch.no_grad():
        p, q = log_prob.detach().exp(), old_log_prob.detach().exp()
        if params.divergence == "tv":
            keep_pos = p - q <= delta_high
            keep_neg = p - q >= -delta_low
        else:
            kl = q * (old_log_prob.detach() - log_prob.detach()) + (1 - q) * torch.log(
                (1 - q + BINARY_KL_EPS) / (1 - p + BINARY_KL_EPS)
            )
            keep_pos = (kl <= delta_high) | (p <= q)
            keep_neg = (kl <= delta_low) | (p >= q)
        return torch.where(adv > 0, keep_pos, keep_neg)


def _dppo(
    log_prob: Tensor, inputs: RatioInputs, params: DPPOTVParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """Both variants: the kept tokens' truncated-IS policy gradient (module docstring)."""
    tok = tokens(log_prob, inputs)
    keep = tok.valid & dppo_keep(
        torch.where(tok.valid, log_prob, 0.0),
        torch.where(tok.valid, inputs.old_log_prob, 0.0),
        tok.adv,
        params,
    )
    weight = tok.r.clamp(max=rounded(params.ratio_cap, tok.r))  # sg(min(r, C))
    logp = torch.where(keep, log_prob, 0.0)  # no 0 * inf on masked or non-finite tokens
    loss_tok = -tok.adv * weight * logp
    bounds = 1.0 - float(params.delta_low), 1.0 + float(params.delta_high)
    clipped = (tok.neg & ~keep, tok.pos & ~keep)
    metrics = surrogate_metrics(tok, bounds, clipped, weight=weight, active=keep)
    return aggregation(loss_tok, tok.valid), metrics


@REGISTRY.register("dppo_tv", params=DPPOTVParams)
def dppo_tv_loss(
    log_prob: Tensor, inputs: RatioInputs, params: DPPOTVParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """DPPO-Binary-TV (module docstring). clipfrac_low / clipfrac_high count the masked tokens
    (A < 0 / A > 0); DPPO has no ratio bounds, so c_low / c_high report 1 - delta_low and
    1 + delta_high (a token with pi_old = 1 is masked there). The algo group's dual_clip does
    not apply: the weight is capped by ratio_cap instead (verl replaces the dual clip so)."""
    return _dppo(log_prob, inputs, params, aggregation)


@REGISTRY.register("dppo_kl", params=DPPOKLParams)
def dppo_kl_loss(
    log_prob: Tensor, inputs: RatioInputs, params: DPPOKLParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """DPPO-Binary-KL (module docstring); metrics as `dppo_tv_loss` (c_low / c_high report
    1 -/+ delta, the thresholds on the ratio scale, not ratio bounds)."""
    return _dppo(log_prob, inputs, params, aggregation)
