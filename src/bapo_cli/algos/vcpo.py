"""VCPO (arXiv 2602.17616, "variance-controlled" off-policy RL; reference code
github.com/mit-han-lab/vcpo): the sequence-level truncated-IS policy gradient, with two
variance controls the trainer applies around the loss when its `hooks()` ask (`contract.LossHooks`):

1. **ESS-scaled step.** The update's effective sample size ratio (`algos.ess`, over the
   sequences' weights w_i = prod_t pi_theta / pi_behav, unclipped) scales the learning rate of
   that optimizer step by sqrt(min(1, ESS/N / ess_base)) (`ess_rule=sqrt`; `linear` drops the
   square root). VCPO's `_optimizer_step_with_buffer` (`verl/workers/actor/megatron_actor.py`)
   and its scripts (`ess_scaling.scaling_rule=sqrt`, `base_ess_ratio=1.0`).
2. **Off-policy minimum-variance baseline** (`baseline=opob`). Per prompt group, the baseline
   b = sum_i v_i R_i / sum_i v_i with v_i = ||g_i||^2 w_i^2, g_i = grad_theta sum_t log pi(y_it)
   the sequence's score, w_i its (unclipped) weight: the baseline that minimises the variance of
   sum_i w_i (R_i - b) g_i. With GRPO's advantages A_i = (R_i - mean) / std this is the group's
   advantages re-centred on their v-weighted mean, A_i - sum_j v_j A_j / sum_j v_j
   (`opob_recentre`), which needs no rewards and keeps the project's std normalisation.

The loss, per token, with C = is_cap and w_i from the loss's own log-ratios:

    loss_it = -sg(min(w_i, C)) * A_i * r_it / sg(r_it)    (value -min(w_i, C) A_i,
                                                           gradient -min(w_i, C) A_i grad log pi)

VCPO's scripts: sequence-level IS truncated at 8 (`rollout_is=sequence`,
`rollout_is_threshold=8.0`), no ratio clip (`clip_ratio_low=1.0`, `clip_ratio_high=1e9`), agg
`seq-mean-token-mean`. Where this follows the reference code and where it departs (the
baseline's weight, the ESS guard) is in docs/algorithms.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.contract import Aggregation, LossHooks, RatioInputs
from bapo_cli.algos.core import REGISTRY, Tensor, surrogate_metrics, tokens
from bapo_cli.algos.params import LossParams, ParamError, number, one_of, param

ESS_RULES = ("sqrt", "linear", "none")
BASELINES = ("opob", "none")


@dataclass(frozen=True)
class VCPOParams(LossParams):
    """VCPO: sequence-level truncated IS, ESS-scaled step, off-policy min-variance baseline."""

    is_cap: float = param(
        8.0,
        "cap C of the sequence's IS weight min(w_i, C), detached (VCPO's scripts: "
        "rollout_is_threshold 8.0)",
    )
    ess_base: float = param(
        1.0,
        "the step's lr is scaled by f(min(1, ESS/N / ess_base)) (VCPO's base_ess_ratio: 1.0)",
    )
    ess_rule: str = param(
        "sqrt",
        "f of the ESS step scale: sqrt (VCPO's scripts), linear, or none (no step scaling)",
    )
    baseline: str = param(
        "opob",
        "opob: re-centre each group's advantages on their ||g_i||^2 w_i^2-weighted mean (one "
        "extra forward and a backward per sequence per update); none: GRPO's advantages",
    )

    def check(self) -> None:
        if not 1.0 <= number("is_cap", self.is_cap) < math.inf:
            raise ParamError("is_cap", self.is_cap, "must be a finite number >= 1")
        if not 0.0 < number("ess_base", self.ess_base) <= 1.0:
            raise ParamError("ess_base", self.ess_base, "must be within (0, 1]")
        one_of("ess_rule", self.ess_rule, ESS_RULES)
        one_of("baseline", self.baseline, BASELINES)

    def describe(self) -> str:
        step = "lr unscaled" if self.ess_rule == "none" else f"lr x {self.ess_rule}(ESS)"
        base = "min-variance baseline" if self.baseline == "opob" else "GRPO baseline"
        return f"sequence IS weight <= {self.is_cap:g}, {step}, {base}"

    def lr_scale(self, ess: float) -> float:
        """The step's learning-rate factor for an ESS ratio `ess` in [0, 1]."""
        return step_scale(ess, float(self.ess_base), self.ess_rule)

    def hooks(self) -> LossHooks:
        recentre = opob_baseline if self.baseline == "opob" else None
        return LossHooks(lr_scale=self.lr_scale, recentre=recentre)


def step_scale(ess: float, base: float, rule: str) -> float:
    """f(min(1, ess / base)), f = sqrt or identity (`none`: 1). A non-finite ess (never made by
    `algos.ess`) gives the smallest step, 0, not the full one."""
    if rule == "none":
        return 1.0
    if not math.isfinite(ess):
        return 0.0
    share = min(1.0, max(0.0, ess) / base)
    return math.sqrt(share) if rule == "sqrt" else share


def baseline_weights(grad_sq_norm: Tensor, log_w: Tensor, groups: Tensor) -> Tensor:
    """v_i = ||g_i||^2 w_i^2 per sequence [B] (float64), scaled per group by a common factor
    (so no weight overflows: w_i^2 = exp(2 log w_i) is taken relative to the group's largest
    finite log w). Within a group with an infinite weight only those sequences count (the limit);
    a sequence without a log weight (NaN: no valid token) gets 0."""
    with torch.no_grad():
        log_w = log_w.double()
        g2 = grad_sq_norm.double()
        v = torch.zeros_like(log_w)
        for gid in torch.unique(groups):
            rows = groups == gid
            lw = log_w[rows]
            infinite = lw == math.inf
            if bool(infinite.any()):
                v[rows] = torch.where(infinite, g2[rows], 0.0)
                continue
            finite = torch.isfinite(lw)
            if not bool(finite.any()):
                continue
            top = lw[finite].max()
            v[rows] = torch.where(finite, g2[rows] * torch.exp(2.0 * (lw - top)), 0.0)
        return v


def opob_recentre(advantages: Tensor, groups: Tensor, v: Tensor) -> Tensor:
    """A_i - sum_{j in g} v_j A_j / sum_{j in g} v_j per group g; a group whose weights sum to 0
    keeps its advantages. In `advantages`' dtype."""
    adv = advantages.double()
    out = adv.clone()
    for gid in torch.unique(groups):
        rows = groups == gid
        total = v[rows].sum()
        if float(total) > 0:
            out[rows] = adv[rows] - (v[rows] * adv[rows]).sum() / total
    return out.to(advantages.dtype)


def opob_baseline(
    grad_sq_norm: Tensor, log_w: Tensor, groups: Tensor, advantages: Tensor
) -> Tensor:
    """The `recentre` hook of baseline=opob: each group's advantages re-centred on their
    ||g_i||^2 w_i^2-weighted mean (the trainer measures ||g_i||^2 and log w_i per update)."""
    return opob_recentre(advantages, groups, baseline_weights(grad_sq_norm, log_w, groups))


@REGISTRY.register("vcpo", params=VCPOParams, agg="seq-mean-token-mean")
def vcpo_loss(
    log_prob: Tensor, inputs: RatioInputs, params: VCPOParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """VCPO's loss (module docstring): every valid token with A != 0 carries the gradient
    -min(w_i, C) A_i grad log pi. clipfrac_high counts the tokens of sequences whose weight was
    truncated (w_i > C); c_low reports 0 (no lower bound) and c_high the cap C (a bound on the
    sequence's weight, not on a token's ratio). The algo group's dual_clip does not apply."""
    if log_prob.dim() != 2:
        raise ValueError(
            f"vcpo needs [B, T] tensors (its weight is a sequence's), got {tuple(log_prob.shape)}"
        )
    tok = tokens(log_prob, inputs)
    with torch.no_grad():
        log_w = tok.log_ratio.double().sum(dim=-1, keepdim=True)  # 0 on invalid tokens
        cap = math.log(float(params.is_cap))
        weight = torch.exp(log_w.clamp(max=cap)).to(tok.r.dtype).expand_as(tok.r)
        truncated = (log_w > cap).expand_as(tok.valid) & tok.valid
    grad_only = tok.ratio / tok.r  # value 1, gradient grad log pi
    loss_tok = -tok.adv * weight * grad_only
    clipped = (torch.zeros_like(tok.valid), truncated & (tok.pos | tok.neg))
    metrics = surrogate_metrics(tok, (0.0, float(params.is_cap)), clipped, weight=weight)
    return aggregation(loss_tok, tok.valid), metrics
