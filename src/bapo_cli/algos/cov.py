"""Clip-Cov and KL-Cov (Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models", arXiv 2505.22617): entropy control through the covariance of a token's
log-probability and its advantage. Written after verl's `compute_policy_loss_clip_cov` /
`compute_policy_loss_kl_cov` (adapted there from PRIME-RL/Entropy-Mechanism-of-RL); formulas
and defaults in docs/algorithms.md.

Per loss call, over the valid tokens (means over the same tokens, everything detached):

    cov_t = (A_t - mean A) * (log pi_theta(y_t) - mean log pi_theta)

A token with a large positive cov_t is a confident token being pushed further (or an unlikely
one pushed down): the updates that collapse entropy. Clip-Cov (`clip_cov`) detaches a few of them
(loss and gradient 0): of the tokens the ratio clip left active with cov in (cov_lb, cov_ub),
max(1, floor(clip_ratio * n)) picked at random (torch's global generator, as verl). KL-Cov
(`kl_cov`) adds kl_cov_coef * |log r_t| to the loss of the max(1, floor(kl_cov_ratio * n)) tokens
with the largest cov_t, and clips no ratio at all (verl's kl_cov has no clip either).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.contract import Aggregation, RatioInputs
from bapo_cli.algos.core import (
    REGISTRY,
    Tensor,
    Tokens,
    surrogate_dropping,
    surrogate_metrics,
    token_activity,
    tokens,
)
from bapo_cli.algos.params import (
    LossParams,
    ParamError,
    check_dual_clip,
    dual_clip_param,
    number,
    param,
    positive,
)


def _check_share(name: str, value: Any) -> None:
    if not 0.0 < number(name, value) <= 1.0:
        raise ParamError(name, value, "must be within (0, 1]")


def covariance(tok: Tokens, log_prob: Tensor) -> Tensor:
    """cov_t = (A - mean A)(log pi - mean log pi) over the valid tokens, detached; 0 elsewhere."""
    with torch.no_grad():
        n = tok.n_valid.clamp(min=1)
        logp = torch.where(tok.valid, log_prob.detach(), 0.0)
        adv_c = tok.adv - tok.adv.sum() / n
        logp_c = logp - logp.sum() / n
        return torch.where(tok.valid, adv_c * logp_c, 0.0)


def _how_many(share: float, tok: Tokens) -> int:
    """max(1, floor(share * n_valid)): verl's count (one host read)."""
    return max(int(share * float(tok.n_valid)), 1)


@dataclass(frozen=True)
class ClipCovParams(LossParams):
    """Clip-Cov: detach a few random high-covariance tokens from the clipped surrogate."""

    clip_ratio: float = param(
        2e-4, "share of the valid tokens to detach (paper and verl: 2e-4; at least one token)"
    )
    cov_lb: float = param(1.0, "lower bound of the covariance of a token that may be detached")
    cov_ub: float = param(5.0, "upper bound of the covariance of a token that may be detached")
    eps_low: float = param(
        0.2,
        "ratio clip: c_low = 1 - eps_low, within (0, 1]; 1 = no lower bound, the recipe's "
        "clip [0, 2] with eps_high 1 (verl's clip_ratio 0.2)",
    )
    eps_high: float = param(0.2, "ratio clip: c_high = 1 + eps_high (verl's clip_ratio 0.2)")
    dual_clip: float | None = dual_clip_param(None)

    def check(self) -> None:
        _check_share("clip_ratio", self.clip_ratio)
        lb, ub = number("cov_lb", self.cov_lb), number("cov_ub", self.cov_ub)
        if not (math.isfinite(lb) and math.isfinite(ub) and lb < ub):
            raise ParamError("cov_ub", self.cov_ub, f"must be finite and > cov_lb ({self.cov_lb})")
        # eps_low = 1 (c_low = 0) is allowed here: the Entropy-Mechanism recipe's ratio clip is
        # [0, 2]; a ratio is never below 0, so no negative token is clipped low
        if not 0.0 < number("eps_low", self.eps_low) <= 1.0:
            raise ParamError("eps_low", self.eps_low, "must be within (0, 1]")
        positive("eps_high", self.eps_high)
        check_dual_clip(self.dual_clip)

    def describe(self) -> str:
        return (
            f"[{1 - self.eps_low:g}, {1 + self.eps_high:g}], {self.clip_ratio:g} of the tokens "
            f"with covariance in ({self.cov_lb:g}, {self.cov_ub:g}) detached"
        )


def clip_cov_drop(tok: Tokens, log_prob: Tensor, active: Tensor, params: ClipCovParams) -> Tensor:
    """Bool: the tokens Clip-Cov detaches, drawn with torch's global generator as verl does (a
    permutation of the candidates in row-major order, the first k kept)."""
    with torch.no_grad():
        cov = covariance(tok, log_prob)
        candidates = active & (cov > params.cov_lb) & (cov < params.cov_ub)
        where = candidates.reshape(-1).nonzero().squeeze(-1)
        drop = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
        if where.numel():
            k = min(_how_many(float(params.clip_ratio), tok), where.numel())
            drop[where[torch.randperm(where.numel())[:k].to(where.device)]] = True
        return drop.reshape(candidates.shape)


@REGISTRY.register("clip_cov", params=ClipCovParams)
def clip_cov_loss(
    log_prob: Tensor, inputs: RatioInputs, params: ClipCovParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """Clip-Cov (module docstring): the clipped surrogate, with the detached tokens' loss and
    gradient 0 (they stay in the normaliser, as verl multiplies their loss by 0). Candidates are
    the tokens the clip left active (verl: not clipped by the ratio). clipfrac_low /
    clipfrac_high count the detached tokens with the ratio-clipped ones. verl's clip_cov has no
    dual clip; the preset sets dual_clip: null, the option still applies if set."""
    bounds = 1.0 - float(params.eps_low), 1.0 + float(params.eps_high)
    tok = tokens(log_prob, inputs)
    active_pos, active_neg = token_activity(tok, *bounds, params.dual_clip)
    # verl's candidates: not clipped by the ratio (A = 0 tokens included, harmlessly: 0 loss)
    unclipped = tok.valid & ~((tok.pos & ~active_pos) | (tok.neg & ~active_neg))
    drop = clip_cov_drop(tok, log_prob, unclipped, params)
    return surrogate_dropping(tok, drop, bounds, params.dual_clip, aggregation, in_denominator=True)


@dataclass(frozen=True)
class KLCovParams(LossParams):
    """KL-Cov: a |log r| penalty on the highest-covariance tokens, no ratio clip."""

    kl_cov_ratio: float = param(
        2e-3,
        "share of the valid tokens penalised (paper, 7B models: 2e-3; verl's code default 2e-4, "
        "the paper's 32B value; at least one token)",
    )
    # Not `kl_coef`: that name is algo.kl_coef, the k3 KL to the initial policy of every preset
    kl_cov_coef: float = param(
        1.0,
        "coefficient of |log r| on the penalised tokens (the Entropy-Mechanism recipe scripts: "
        "1; verl's config policy_loss.ppo_kl_coef: 0.1)",
    )

    def check(self) -> None:
        _check_share("kl_cov_ratio", self.kl_cov_ratio)
        positive("kl_cov_coef", self.kl_cov_coef, zero=True)

    def describe(self) -> str:
        return (
            f"no ratio clip; {self.kl_cov_coef:g} |log r| on the {self.kl_cov_ratio:g} of the "
            "tokens with the largest covariance"
        )


def kl_cov_select(tok: Tokens, log_prob: Tensor, share: float) -> Tensor:
    """Bool: the k = max(1, floor(share * n)) valid tokens with the largest covariance."""
    with torch.no_grad():
        selected = torch.zeros(tok.valid.numel(), dtype=torch.bool, device=tok.valid.device)
        where = tok.valid.reshape(-1).nonzero().squeeze(-1)
        if where.numel():
            cov = covariance(tok, log_prob).reshape(-1)[where]
            top = torch.topk(cov, min(_how_many(share, tok), where.numel()), largest=True).indices
            selected[where[top]] = True
        return selected.reshape(tok.valid.shape)


@REGISTRY.register("kl_cov", params=KLCovParams)
def kl_cov_loss(
    log_prob: Tensor, inputs: RatioInputs, params: KLCovParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """KL-Cov (module docstring): loss_t = -A_t r_t + kl_cov_coef |log r_t| [t selected].

    Every token with A != 0 carries gradient (no clip). clipfrac_low / clipfrac_high count the
    penalised tokens (A < 0 / A > 0). KL-Cov has no bounds: c_low reports 0 (no lower bound, as
    CISPO) and c_high the largest ratio of the call (nothing above it was clipped). The algo
    group's dual_clip does not apply (verl's kl_cov has none)."""
    tok = tokens(log_prob, inputs)
    selected = kl_cov_select(tok, log_prob, float(params.kl_cov_ratio))
    abs_log_ratio = torch.where(selected, log_prob - inputs.old_log_prob, 0.0).abs()
    loss_tok = -tok.adv * tok.ratio + float(params.kl_cov_coef) * abs_log_ratio
    # on the device: read with the update's metrics
    ratio_max = torch.where(tok.valid, tok.r, 0.0).max() if tok.r.numel() else 1.0
    clipped = (tok.neg & selected, tok.pos & selected)
    metrics = surrogate_metrics(tok, (0.0, ratio_max), clipped, weight=tok.r)
    return aggregation(loss_tok, tok.valid), metrics
