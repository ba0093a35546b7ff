"""The bound search of the authors' public verl recipe (`BoundSearch(rule="recipe")`,
`algo=bapo_recipe`): the `PathAccumulator` of rule "recipe", with `BoundAccumulator`'s interface
and one-pass computation (it shares the path and the token look-up, not Algorithm 1's code)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch

from bapo_cli.algos.bapo_locator import bin_sums, build_locator, keyed_inputs
from bapo_cli.algos.bapo_path import (
    PAPER,
    RECIPE_EPS,
    BapoBounds,
    BoundPath,
    PathAccumulator,
    check_rho0,
    rho_from_sums,
)


class RecipeAccumulator(PathAccumulator, rule="recipe"):
    """The bound search of the authors' public verl recipe (`BoundSearch(rule="recipe")`), with
    `BoundAccumulator`'s interface (`add`, `solve`, `reset`) and its one-pass computation.

    What the recipe does (recipe/bapo/policy_loss.py of github.com/WooooDyy/BAPO), per loss call:
    every token counts, a clipped one at its clipped value,

        P(c_high) = sum_{A>0} min(r, c_high) |A|,   N(c_low) = sum_{A<0} max(r, c_low) |A|,

    c_low moves first (to its max), then c_high, and the search stops at the first point with
    P / (N + 1e-8) >= target (inf when N = 0). Here target = rho0 / (1 - rho0), so rho0 stays a
    share in every rule (the recipe's ``adv_ratio_target: 1`` is rho0 = 0.5; docs/bapo.md).
    Raising c_low adds negative mass, so c_low only helps when the start point already meets the
    target: off-policy batches walk it to its max. On-policy data walks the whole path too (the
    recipe has no early stop; the bounds do not matter there).

    Each token is binned by where it changes activity, as in `BoundAccumulator`, with two sums
    per bin: w r |A| and w |A|, so P and N at every path point come from cumulative sums.
    Negatives at or above the dual clip count at r |A| (max(r, c_low) = r), as in the recipe.
    The result reports the sums of the gradient-carrying tokens (pos, neg, rho), the same
    quantity every loss reports, so `actor/rho` compares across algorithms.
    """

    def add(
        self,
        ratio: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> None:
        """Add one batch of tokens, as `BoundAccumulator.add` (dual-clipped negatives included:
        the recipe counts them). No host sync."""
        key, m, a = keyed_inputs(ratio, advantages, mask, weights)
        path = self.path
        locator = build_locator(
            path.low_values, path.high_values, self.dual_clip, ratio.dtype, key.device
        )
        count = locator.count(key)
        size = self._size
        bins = torch.cat([bin_sums(count, m, size), bin_sums(count, a, size)])
        if self._sums is None:
            self._sums = torch.zeros_like(bins)
        self._sums.add_(bins)

    def solve(self, rho0: float = PAPER.rho0, group: Any = None) -> BapoBounds:
        """Walk the recipe's path; one all-reduce over `group` (optional), one host read."""
        rho0 = check_rho0(rho0)
        size = self._size
        values = self._host_values(group, per_bin=2)
        mass, weight = values[:size], values[size:]
        dual_mass = mass[0] if self._lead else 0.0  # dual-clipped negatives: r |A|, never active
        return _solve_recipe(self.path, mass[self._lead :], weight[self._lead :], dual_mass, rho0)


def _suffix_sums(values: list[float]) -> list[float]:
    """[sum(values[i:]) for i in range(len(values))], added from the end (exact zeros stay 0)."""
    return list(itertools.accumulate(reversed(values)))[::-1]


def _solve_recipe(
    path: BoundPath, mass: list[float], weight: list[float], dual_mass: float, rho0: float
) -> BapoBounds:
    """The recipe's walk on the per-bin sums (layout of `rho_curve`): mass = w r |A|,
    weight = w |A| per bin."""
    n_h, n_l = path.n_high, path.n_low
    neg_m, neg_w = mass[n_l + 1 :: -1][: n_l + 2], weight[n_l + 1 :: -1][: n_l + 2]  # [exit x]
    pos_m, pos_w = mass[n_l + 2 :], weight[n_l + 2 :]  # [entry e]
    # positives active at c_high index i: entry e <= i; the others count at high_i |A|
    active_pos = list(itertools.accumulate(pos_m[: n_h + 1]))
    clipped_pos = _suffix_sums(pos_w)[1:]  # [i] = sum of pos_w[i + 1 :]
    # negatives active at c_low index j: exit x > j; the others (r <= low_j) count at low_j |A|
    clipped_neg = list(itertools.accumulate(neg_w[: n_l + 1]))
    active_neg = _suffix_sums(neg_m)[1:]  # [j] = sum of neg_m[j + 1 :]
    target = math.inf if rho0 >= 1.0 else rho0 / (1.0 - rho0)

    def indices(k: int) -> tuple[int, int]:  # (c_low index, c_high index) at point k
        return min(k, n_l), max(0, k - n_l)

    def met(k: int) -> bool:
        j, i = indices(k)
        p = active_pos[i] + path.high_values[i] * clipped_pos[i]
        n = active_neg[j] + path.low_values[j] * clipped_neg[j] + dual_mass
        return (math.inf if n <= 0 else p / (n + RECIPE_EPS)) >= target

    k, last = 0, len(path) - 1
    while k < last and not met(k):
        k += 1
    (j0, i0), (j, i) = indices(0), indices(k)
    c_low, c_high = path.point(k)
    return BapoBounds(
        c_low=c_low,
        c_high=c_high,
        rho_before=rho_from_sums(active_pos[i0], active_neg[j0]),
        rho=rho_from_sums(active_pos[i], active_neg[j]),
        steps=k,
        pos_before=active_pos[i0],
        neg_before=active_neg[j0],
        pos=active_pos[i],
        neg=active_neg[j],
    )
