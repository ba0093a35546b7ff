"""DCPO (Dynamic Clipping Policy Optimization, arXiv 2509.02333): PPO's clip with bounds that
depend on each token's old probability (`dcpo`).

PPO bounds |r - 1| <= eps for every token. DCPO bounds the change weighted by the new
probability, |(r - 1) p| <= eps with p = r q and q = pi_old(y_t), which solves to

    c_low(q)  = (1 + sqrt(max(1 - 4 eps_low / q, 0))) / 2
    c_high(q) = min((1 + sqrt(1 + 4 eps_high / q)) / 2, bound_cap)
    loss_t    = -min(r_t A_t, clip(r_t, c_low(q_t), c_high(q_t)) A_t),  dual-clipped at c for A < 0

A likely token (q -> 1) gets about PPO's range; a rare one a much wider one (q = 0.01,
eps_high 0.28: c_high = 5.8): rare tokens that the update makes likelier are not clipped, the
paper's point (its clipped-token share is ~10x below GRPO's / DAPO's).

Source: the authors' code, lime-RL/DCPO@01787b0, `verl/trainer/ppo/core_algos.py`:
`get_clip_low_high` (the bounds from the old log-prob; q = 0 gives c_low 1 and c_high the cap)
and `compute_policy_loss_dcpo` with `clip_type="dynamic"` (clamp to the per-token bounds, then
verl's dual clip -A c for A < 0), run by `recipe/dcpo/run_dcpo.sh`. Choices:

- eps_low 0.2, eps_high 0.28, dual clip c = 10 and the cap max(c, 10) = 10: `run_dcpo.sh`
  (CLIP_RATIO_HIGH=0.28, CLIP_RATIO_C=10; CLIP_RATIO_LOW from `run_base.sh`'s default 0.2),
  the script that ran the README's Qwen2.5-Math-7B results. The README's bounds table uses
  0.16 / 0.2 to illustrate the bounds (at q = 0.9 and 0.01); no script sets them:
  `algo.eps_low=0.16 algo.eps_high=0.2` gives that table.
- The reference ties the cap to the dual clip (max(clip_ratio_c, 10)); here it is its own
  option, `bound_cap` (10), so `algo.dual_clip` stays the algo group's option.
- The advantage, DCPO's smooth standardisation across steps, is `advantages.dcpo`
  (`algo.advantage=dcpo`, any preset); the aggregation is docs/algorithms.md's "OTM" reading.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.contract import Aggregation, RatioInputs
from bapo_cli.algos.core import REGISTRY, Tensor, surrogate_metrics, tokens
from bapo_cli.algos.params import (
    LossParams,
    ParamError,
    check_dual_clip,
    dual_clip_param,
    number,
    param,
    positive,
)


@dataclass(frozen=True)
class DCPOParams(LossParams):
    """DCPO: per-token clip bounds from the token's old probability."""

    eps_low: float = param(
        0.2, "eps_low of |(r - 1) p| <= eps below 1 (run_dcpo.sh: 0.2; the README's table: 0.16)"
    )
    eps_high: float = param(
        0.28, "eps_high of |(r - 1) p| <= eps above 1 (run_dcpo.sh: 0.28; the README's table: 0.2)"
    )
    bound_cap: float = param(
        10.0, "cap of the per-token upper bound c_high(q) (the reference: max(clip_ratio_c, 10))"
    )
    dual_clip: float | None = dual_clip_param(10.0)

    def check(self) -> None:
        positive("eps_low", self.eps_low)
        positive("eps_high", self.eps_high)
        if not 1.0 < number("bound_cap", self.bound_cap) < math.inf:
            raise ParamError("bound_cap", self.bound_cap, "must be a finite number > 1")
        check_dual_clip(self.dual_clip)

    def describe(self) -> str:
        return (
            f"per-token bounds |(r - 1) p| <= {self.eps_low:g} / {self.eps_high:g} from the old "
            f"probability, c_high <= {self.bound_cap:g}"
        )


def dynamic_bounds(
    old_log_prob: Tensor, eps_low: float, eps_high: float, cap: float
) -> tuple[Tensor, Tensor]:
    """(c_low, c_high) per token from q = exp(old_log_prob), as `get_clip_low_high`: q = 0 gives
    c_low = 1 and c_high = cap; c_high is at most `cap`. In old_log_prob's dtype, detached."""
    with torch.no_grad():
        q = torch.exp(old_log_prob.detach())
        safe = torch.where(q != 0, q, 1.0)
        low_inside = torch.where(q != 0, 1.0 - 4.0 * eps_low / safe, 1.0).clamp(min=0.0)
        high_inside = 1.0 + 4.0 * eps_high / safe
        c_low = (1.0 + torch.sqrt(low_inside)) / 2.0
        c_high = torch.where(q != 0, (1.0 + torch.sqrt(high_inside)) / 2.0, math.inf)
        return c_low, c_high.clamp(max=cap)


@REGISTRY.register("dcpo", params=DCPOParams, agg="seq-mean-token-mean")
def dcpo_loss(
    log_prob: Tensor, inputs: RatioInputs, params: DCPOParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """DCPO (module docstring): PPO's clipped surrogate with c_low, c_high per token. As every
    clip here, activity is decided by strict comparisons: a positive token carries gradient iff
    r < c_high(q), a negative one iff c_low(q) < r (< dual_clip). c_low / c_high report the mean
    bound over the call's valid tokens (the bounds differ per token)."""
    tok = tokens(log_prob, inputs)
    old = torch.where(tok.valid, inputs.old_log_prob, 0.0)  # q = 1 off the mask
    lo, hi = dynamic_bounds(old, float(params.eps_low), float(params.eps_high), params.bound_cap)
    r = tok.r
    dual = params.dual_clip
    active_pos = tok.pos & (r < hi)
    active_neg = tok.neg & (r > lo)
    upper_neg = hi.new_full((), math.inf) if dual is None else hi.new_full((), float(dual))
    active_neg = active_neg & (r < upper_neg)
    active = active_pos | active_neg
    # the value of a clipped token: min(r, c_high) for A > 0; min(max(r, c_low), dual) for A < 0
    r_clipped = torch.where(
        tok.pos, torch.minimum(r, hi), torch.minimum(torch.maximum(r, lo), upper_neg)
    )
    loss_tok = -tok.adv * torch.where(active, tok.ratio, r_clipped)
    clipped = (tok.neg & (r <= lo), tok.pos & (r >= hi))
    with torch.no_grad():
        n = tok.n_valid.clamp(min=1)
        means = torch.stack([torch.where(tok.valid, b, 0.0).sum() / n for b in (lo, hi)])
        # 1 without a valid token; 0-dim tensors on the device, read with the update's metrics
        c_low, c_high = torch.where(tok.valid.any(), means, 1.0).unbind()
    metrics = surrogate_metrics(tok, (c_low, c_high), clipped, weight=r, ratio=r, active=active)
    return aggregation(loss_tok, tok.valid), metrics
