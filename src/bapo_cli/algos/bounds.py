"""BAPO's adaptive clipping bounds (Algorithm 1 of arXiv 2510.18927), in one pass over the tokens.

The method
----------
PPO (and GRPO, which is PPO's clipped surrogate with group-normalised advantages) trains on

    J = E_t[ min(r_t A_t, clip(r_t, c_low, c_high) A_t) ],   r_t = pi_theta(y_t) / pi_rollout(y_t)

with fixed bounds (c_low, c_high) = (1 - eps, 1 + eps); clip-higher (DAPO) only makes them
asymmetric. A token carries gradient only while it is inside the trust region on its side:

    A_t > 0 : active iff r_t < c_high          A_t < 0 : active iff r_t > c_low

On stale (off-policy) data the negative-advantage tokens dominate the gradient and a fixed bound
drops many low-probability positive tokens, so entropy collapses. BAPO re-chooses the bounds at
every policy update so that the positive tokens' share of the gradient-carrying loss mass,

    rho = P / (P + N),  P = sum_{A>0, r<c_high} w r |A|,  N = sum_{A<0, r>c_low} w r |A|

reaches a target rho0. Algorithm 1 walks a fixed path of bound pairs and stops at the first pair
with rho >= rho0:

    c_low <- a_low, c_high <- a_high
    while rho < rho0 and c_low + low_step <= b_low:
        if c_high + high_step <= b_high: c_high <- c_high + high_step
        else:                            c_low  <- c_low  + low_step

Both moves raise rho (a higher c_high admits positives, a higher c_low drops negatives), so rho is
non-decreasing along the path and the first point with rho >= rho0 is the closest to PPO's bounds.

How this module computes it
---------------------------
The path does not depend on the data: point 0 is (a_low, a_high), then n_high steps of c_high,
then n_low steps of c_low. Each token changes activity at most once along it, so for every token
we compute *where* (a positive token's entry index: the first point with r < c_high; a negative
token's exit index: the first point with r <= c_low), add its mass into that bin (`bin_sums`) and
get P and N at every point from cumulative sums. One table look-up places a token (`Locator`:
the positive and negative thresholds live in one sorted table, keyed by copysign(r, A)), so the
whole path costs one pass over the tokens, one vector of K + 3 sums (P's and N's bins), and one
host read in `solve` -- instead of one pass and one `.item()` per path step. Micro-batches
(gradient accumulation) add their vectors; data-parallel ranks all-reduce them, so every rank gets
the same bounds, equal to one process on the whole batch.

Choices (docs/bapo.md points users here)
----------------------------------------
* rho counts gradient-carrying tokens only, with strict inequalities (r < c_high, r > c_low),
  compared in the ratio's dtype against the path values cast to that dtype. The losses
  (`core.token_activity`) use the very same comparisons, so the searched active set is the
  trained one.
* Path values are ``a + k * step`` in float64 (never accumulated sums), rounded to the decimals
  that a and step are written with (0.9, not 0.8999999999999999) and clamped to b; the number of
  steps is ``floor((b - a) / step + 1e-9)`` so that 1.2 + 36 * 0.05 counts as <= 3.0.
* The loop guard is literal: when the low range admits no step (a_low == b_low) there is no path
  beyond point 0, not even c_high steps. To adapt only c_high keep the low range one step wide.
* rho := 1 when no token carries mass (0/0: nothing to balance). `BapoBounds` carries P and N too,
  so a trainer averages rho by mass over its updates and a massless one does not count as 1.
* If no mass-carrying token changes activity anywhere on the path (on-policy data, r == 1, is the
  common case), rho is constant and walking the path would not change the loss: steps = 0.
* Mass is w * r * |A| with r detached; w = 1 unless `weights` is given (the paper's Eq. 8 uses
  w = pi_rollout(y_t); `losses.bapo_loss(weighting="rollout_prob")`). Weights must be >= 0.
* Tokens whose ratio, advantage or weight is not finite are left out of the sums, and so are
  negative tokens at or above the loss's dual clip (`dual_clip`): they carry no gradient.

How it differs from the public reference recipe: the recipe measures each clipped token at its
clipped value (so raising c_low *adds* negative mass), searches c_low first, uses a pos/neg ratio
instead of a share, and searches per micro-batch. Here: gradient-carrying tokens only, c_high
first, a share, and per optimizer step over the whole mini-batch and all ranks (per micro-batch is
still available as the cheaper approximation: call `adaptive_bounds` on each micro-batch).
`BoundSearch(rule="recipe")` runs the recipe's search instead (`RecipeAccumulator`; `algo=
bapo_recipe`), so the two can be compared on the same trainer.

Settings: `BoundSearch` holds the search's six settings with the paper's defaults (rho0 0.4,
c_low in [0.6, 0.9] by 0.02, c_high in [1.2, 3.0] by 0.05, weighting none), written and validated
here once; `losses.bapo_loss`, `BoundAccumulator`, `adaptive_bounds`, the trainer and the CLI's
`algo` schema all take them from it.

Run it: ``bapo train algo=bapo``; use it from another trainer: docs/bapo.md.

Where the code is (one module per piece, this one the family's entry point, whose names every
caller imports), imported one way: `bapo_path` owns what both searches share (`BoundSearch`,
`BoundPath`, `BapoBounds`, `PAPER`, the accumulator base `PathAccumulator`) and imports neither;
`bapo_locator` (the one-pass table look-up) imports it; `bapo_algorithm1` (`BoundAccumulator`,
the paper's walk) and `bapo_recipe` (`RecipeAccumulator`, the recipe's walk) import those two,
not each other, and register under their rule; `adaptive_bounds` here imports them all.
"""

from __future__ import annotations

from typing import Any

import torch

from bapo_cli.algos.bapo_algorithm1 import BoundAccumulator
from bapo_cli.algos.bapo_locator import Locator
from bapo_cli.algos.bapo_path import (
    MAX_PATH_POINTS,
    PAPER,
    RECIPE_EPS,
    RULES,
    STEP_TOLERANCE,
    WEIGHTINGS,
    BapoBounds,
    BoundPath,
    BoundSearch,
    PathAccumulator,
    check_rho0,
    compute_dtype,
    path_value,
    range_pair,
    rho_from_sums,
)
from bapo_cli.algos.bapo_recipe import RecipeAccumulator

__all__ = [
    "PAPER",
    "RULES",
    "WEIGHTINGS",
    "RecipeAccumulator",
    "BapoBounds",
    "BoundAccumulator",
    "BoundPath",
    "BoundSearch",
    "PathAccumulator",
    "adaptive_bounds",
    "rho_from_sums",
    "MAX_PATH_POINTS",
    "RECIPE_EPS",
    "STEP_TOLERANCE",
    "check_rho0",
    "compute_dtype",
    "path_value",
    "range_pair",
    "Locator",
]


def adaptive_bounds(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    group: Any = None,
    dual_clip: float | None = None,
    **settings: Any,
) -> BapoBounds:
    """Algorithm 1 of the BAPO paper on one batch of tokens: one `add` and one `solve`.

    ratio, advantages, mask (and weights) have the same shape, e.g. [B, T]. dual_clip: leave out
    negative tokens with r >= dual_clip (they carry no gradient under a dual-clipped loss).
    `settings`: the search's (`BoundSearch`: rho0, low_range, high_range, low_step, high_step,
    rule; the paper's defaults for the rest). Returns `BapoBounds` with Python numbers. See the
    module docstring for the exact semantics.
    """
    search = BoundSearch(**settings)
    acc = search.accumulator(dual_clip)
    acc.add(ratio, advantages, mask, weights)
    return acc.solve(search.rho0, group=group)
