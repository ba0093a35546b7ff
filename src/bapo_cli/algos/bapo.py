"""BAPO's loss: the clipped surrogate with the bounds its search picks per update (`bapo`), and
what the trainer feeds the per-step search (`search_inputs`). The search itself: `bounds`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.bapo_algorithm1 import BoundAccumulator
from bapo_cli.algos.bapo_path import (
    PAPER,
    RULES,
    WEIGHTINGS,
    BapoBounds,
    BoundSearch,
    compute_dtype,
    range_pair,
)
from bapo_cli.algos.contract import Aggregation, RatioInputs
from bapo_cli.algos.core import (
    REGISTRY,
    Tensor,
    Tokens,
    clipped_surrogate,
    prepare_tokens,
    rounded,
    tokens,
)
from bapo_cli.algos.params import ParamError, check_dual_clip, dual_clip_param, one_of, param


def _search_key_mass(tok: Tokens, old_log_prob: Tensor, weighting: str) -> tuple[Tensor, Tensor]:
    """key = copysign(r, A) and mass = w r |A| for the bound search, from prepared tokens (the
    accumulator, built with the loss's dual clip, leaves out dual-clipped negatives itself)."""
    cd = compute_dtype(tok.r.dtype)
    adv = tok.adv.to(cd)
    key = torch.copysign(tok.r.to(cd), adv)  # +r for A > 0, -r for A < 0
    mass = key * adv  # r |A| (same signs); 0 on invalid tokens (A = 0 there)
    if weighting == "rollout_prob":  # paper Eq. 8: w = pi_rollout(y_t)
        w = torch.where(tok.valid, old_log_prob.detach().exp(), 0.0)  # as `search_inputs`
        mass = mass * w.to(cd)
    return key, mass


def search_inputs(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    dual_clip: float | None = 3.0,
    weighting: str = PAPER.weighting,
    rule: str = PAPER.rule,
) -> dict[str, Tensor]:
    """The (ratio, advantages, mask, weights) that `bapo_loss` feeds its bound search, for a
    trainer that accumulates over micro-batches: ``acc.add(**search_inputs(...))``. Applies the
    same non-finite masking, dual-clip exclusion and weighting as the loss (rule=recipe keeps the
    dual-clipped negatives: the recipe counts them, and its accumulator, built with the dual
    clip, sets them apart)."""
    one_of("weighting", weighting, WEIGHTINGS)
    one_of("rule", rule, RULES)
    with torch.no_grad():
        tok = prepare_tokens(log_prob, old_log_prob, advantages, mask)
        keep = tok.valid
        if dual_clip is not None and rule == "paper":
            keep = keep & ~(tok.neg & (tok.r >= rounded(dual_clip, tok.r)))
        weights = None
        if weighting == "rollout_prob":
            weights = torch.where(tok.valid, old_log_prob.detach().exp(), 0.0)
    return {"ratio": tok.r, "advantages": tok.adv, "mask": keep, "weights": weights}


def inputs_search(log_prob: Tensor, inputs: RatioInputs, params: BapoParams) -> dict[str, Tensor]:
    """`search_inputs` of a loss call's inputs with the loss's settings: what the trainer's
    per-update search adds per micro-batch, and the recipe's search on one call."""
    return search_inputs(
        log_prob,
        inputs.old_log_prob,
        inputs.advantages,
        inputs.mask,
        dual_clip=params.dual_clip,
        weighting=params.weighting,
        rule=params.rule,
    )


BOUND_SCOPES = ("minibatch", "microbatch")


@dataclass(frozen=True)
class BapoParams(BoundSearch):
    """BAPO: per-update adaptive (c_low, c_high) so positive tokens carry a share rho0 of loss.

    The search's settings are `BoundSearch`'s (paper defaults); training also keeps the bounds a
    trust region around r = 1 (c_low within (0, 1], c_high >= 1) and chooses where to search.
    `bounds` (not a config key): the bounds the trainer solved over the whole update, or None to
    search the call's own tokens, summed over the ranks of `group` when given.
    """

    bound_scope: str = param(
        "minibatch",
        "minibatch = paper (one search per optimizer step over all micro-batches and ranks); "
        "microbatch = cheaper approximation, one search per micro-batch of each rank",
    )
    dual_clip: float | None = dual_clip_param()
    bounds: BapoBounds | None = param(None, "bounds solved by the caller", runtime=True)
    group: Any = param(None, "ranks the call's own search sums over", runtime=True)

    def check(self) -> None:
        low, high = (
            range_pair("low_range", self.low_range),
            range_pair("high_range", self.high_range),
        )
        if not (low[0] > 0.0 and low[1] <= 1.0):
            raise ParamError("low_range", self.low_range, "c_low must stay within (0, 1]")
        if high[0] < 1.0:
            raise ParamError("high_range", self.high_range, "c_high must stay >= 1")
        super().check()
        one_of("bound_scope", self.bound_scope, BOUND_SCOPES)
        check_dual_clip(self.dual_clip)
        if self.bounds is not None and not isinstance(self.bounds, BapoBounds):
            raise ParamError("bounds", self.bounds, "must be a BapoBounds or None")

    def describe(self) -> str:
        lo, hi = self.low_range, self.high_range
        if self.rule == "recipe":
            return (
                f"adaptive (public recipe): c_low {lo[0]}→{lo[1]} by {self.low_step}, then "
                f"c_high {hi[0]}→{hi[1]} by {self.high_step}, clipped tokens at their clipped "
                f"value, until P/N ≥ {self.rho0}/(1-{self.rho0}) (per {self.bound_scope})"
            )
        return (
            f"adaptive: c_high {hi[0]}→{hi[1]} by {self.high_step}, then c_low {lo[0]}→{lo[1]} "
            f"by {self.low_step}, until rho ≥ {self.rho0} (per {self.bound_scope})"
        )


def _search(log_prob: Tensor, inputs: RatioInputs, tok: Tokens, params: BapoParams) -> BapoBounds:
    """Algorithm 1 on this call's tokens (all-reduced over `params.group` if given)."""
    acc = params.accumulator(params.dual_clip)
    if isinstance(acc, BoundAccumulator):
        key, mass = _search_key_mass(tok, inputs.old_log_prob, params.weighting)
        acc.add_keyed(key, mass, tok.r.dtype)
    else:  # the recipe's search also sums |A| per bin: the plain interface
        acc.add(**inputs_search(log_prob, inputs, params))
    return acc.solve(params.rho0, group=params.group)


@REGISTRY.register("bapo", params=BapoParams, searches_bounds=True)
def bapo_loss(
    log_prob: Tensor, inputs: RatioInputs, params: BapoParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """BAPO: the clipped surrogate with bounds chosen by Algorithm 1 (see `bounds`).

    params.bounds=None searches on this call's tokens: called once per optimizer step that is
    the paper's method; called per micro-batch it is the cheaper per-micro-batch approximation.
    For the exact per-step search with gradient accumulation, sum a `BoundAccumulator` over the
    micro-batches (`search_inputs`), `solve` once and pass the result as params.bounds (then
    the search settings and group are not used).
    """
    tok = tokens(log_prob, inputs)
    bounds = params.bounds if params.bounds is not None else _search(log_prob, inputs, tok, params)
    loss, metrics = clipped_surrogate(
        tok, (bounds.c_low, bounds.c_high), params.dual_clip, aggregation
    )
    metrics.update(
        c_low=bounds.c_low,
        c_high=bounds.c_high,
        rho_before=bounds.rho_before,
        rho=bounds.rho,
        rho_pos=bounds.pos,
        rho_neg=bounds.neg,
        rho_pos_before=bounds.pos_before,
        rho_neg_before=bounds.neg_before,
        search_steps=float(bounds.steps),
    )
    return loss, metrics
