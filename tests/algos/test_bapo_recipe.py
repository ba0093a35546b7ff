"""`rule=recipe` (algo=bapo_recipe): the bound search of the authors' public verl recipe, checked
against a literal re-statement of its loop (one pass over the data per path step)."""

from __future__ import annotations

import math

import pytest
import torch

from bapo_cli.algos.bounds import BoundPath, BoundSearch, RecipeAccumulator, adaptive_bounds
from bapo_cli.algos.losses import search_inputs
from bapo_cli.algos.params import ParamError
from tests.algos.test_losses import loss_and_grad, make_batch


def recipe_loop(r, adv, mask, *, low_range, high_range, low_step, high_step, target):
    """The recipe's search as its code reads: every token at its clipped value, c_low up to its
    max first, then c_high, each step min(c + step, max), stop once P / (N + 1e-8) >= target.
    Path values are a + k * step rounded as bapo-cli does (the recipe adds floats up)."""

    def ratio(lo, hi):
        eff = torch.where(adv >= 0, r.clamp(max=hi), r.clamp(min=lo))
        v = torch.where(mask, eff * adv, 0.0)
        p, n = v.clamp(min=0).sum().item(), (-v.clamp(max=0)).sum().item()
        return math.inf if n <= 0 else p / (n + 1e-8)

    def value(a, k, step, b):
        return min(round(a + k * step, 10), b)

    (a_lo, b_lo), (a_hi, b_hi) = low_range, high_range
    j = i = steps = 0
    lo, hi = a_lo, a_hi
    cur = ratio(lo, hi)
    while cur < target and lo < b_lo:
        j += 1
        lo, steps = value(a_lo, j, low_step, b_lo), steps + 1
        cur = ratio(lo, hi)
    while cur < target and hi < b_hi:
        i += 1
        hi, steps = value(a_hi, i, high_step, b_hi), steps + 1
        cur = ratio(lo, hi)
    return lo, hi, steps


SETTINGS = [
    dict(low_range=(0.6, 0.8), high_range=(1.2, 2.0), low_step=0.05, high_step=0.05),  # YAML
    dict(low_range=(0.8, 0.95), high_range=(1.2, 2.0), low_step=0.05, high_step=0.1),  # script
    dict(low_range=(0.6, 0.75), high_range=(1.2, 1.5), low_step=0.1, high_step=0.2),  # clamped
]


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("rho0", [0.2, 1 / 3, 0.5, 0.6])
@pytest.mark.parametrize("seed", range(4))
def test_recipe_search_is_the_recipes_loop(setting, rho0, seed):
    log_prob, old, adv, mask = make_batch(seed, b=30, t=12, stale=0.6, p_pos=0.4)
    r = torch.exp(log_prob - old)
    a = adv[:, None].expand_as(r)
    want = recipe_loop(r, a, mask, **setting, target=rho0 / (1 - rho0))
    b = adaptive_bounds(r, a, mask, rho0=rho0, rule="recipe", **setting)
    assert (b.c_low, b.c_high, b.steps) == pytest.approx(want)
    # reported: the gradient-carrying sums at the chosen bounds, as every loss reports them
    pos = (r * a.abs())[mask & (a > 0) & (r < b.c_high)].sum().item()
    neg = (r * a.abs())[mask & (a < 0) & (r > b.c_low)].sum().item()
    assert (b.pos, b.neg) == (pytest.approx(pos, rel=1e-12), pytest.approx(neg, rel=1e-12))


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("seed", range(3))
def test_recipe_search_stops_within_the_c_high_phase(setting, seed):
    log_prob, old, adv, mask = make_batch(seed, b=30, t=12, stale=0.8, p_pos=0.4)
    r = torch.exp(log_prob - old)
    a = adv[:, None].expand_as(r)
    b_lo = setting["low_range"][1]
    path = BoundSearch(rule="recipe", **setting).path()
    mid = path.high_values[len(path.high_values) // 2]
    eff = torch.where(a >= 0, r.clamp(max=mid), r.clamp(min=b_lo))
    v = torch.where(mask, eff * a, 0.0)
    t = v.clamp(min=0).sum().item() / ((-v.clamp(max=0)).sum().item() + 1e-8)  # P/N at (b_lo, mid)
    rho0 = t / (1 + t) * (1 - 1e-9)
    want = recipe_loop(r, a, mask, **setting, target=rho0 / (1 - rho0))
    assert want[:2] == (b_lo, mid)  # stops at the middle c_high
    b = adaptive_bounds(r, a, mask, rho0=rho0, rule="recipe", **setting)
    assert (b.c_low, b.c_high, b.steps) == pytest.approx(want)


def test_recipe_moves_c_low_first_and_the_paper_c_high():
    log_prob, old, adv, mask = make_batch(3, b=40, t=12, stale=0.6, p_pos=0.3)
    r, a = torch.exp(log_prob - old), adv[:, None].expand_as(log_prob)
    paper = adaptive_bounds(r, a, mask, rho0=0.45)
    recipe = adaptive_bounds(r, a, mask, rho0=0.45, rule="recipe")
    assert paper.steps > 0 and paper.c_high > 1.2
    # the recipe walks c_low to its max before c_high moves (raising c_low adds negative mass)
    assert recipe.c_low == 0.9 and recipe.steps > 15
    search = BoundSearch(rule="recipe")
    assert search.path().point(15) == (0.9, 1.2) and search.path().point(16) == (0.9, 1.25)


def test_recipe_walks_the_whole_path_on_policy():
    log_prob, _, adv, mask = make_batch(4, b=20, t=6, p_pos=0.2)
    r = torch.ones_like(log_prob)
    b = adaptive_bounds(r, adv[:, None].expand_as(r), mask, rho0=0.5, rule="recipe")
    assert (b.c_low, b.c_high, b.steps) == (0.9, 3.0, len(BoundSearch(rule="recipe").path()) - 1)
    # the paper's search stays at the start point: nothing changes activity on-policy
    paper = adaptive_bounds(r, adv[:, None].expand_as(r), mask, rho0=0.5)
    assert paper.steps == 0


def test_recipe_path_includes_each_max():
    path = BoundPath.build((0.6, 0.75), (1.2, 1.5), 0.1, 0.2, rule="recipe")
    assert path.low_values == (0.6, 0.7, 0.75) and path.high_values == (1.2, 1.4, 1.5)
    # the paper's literal loop guard: only whole steps, c_high first
    paper = BoundPath.build((0.6, 0.75), (1.2, 1.5), 0.1, 0.2)
    assert paper.low_values == (0.6, 0.7) and paper.high_values == (1.2, 1.4)
    assert path.point(0) == paper.point(0) == (0.6, 1.2)
    assert (path.point(1), paper.point(1)) == ((0.7, 1.2), (0.6, 1.4))


def test_dual_clipped_negatives_count_in_the_recipe_but_not_in_rho():
    log_prob, old, adv, mask = make_batch(8, b=40, t=20, stale=1.0, p_pos=0.3)
    r, a = torch.exp(log_prob - old), adv[:, None].expand_as(log_prob)
    assert bool((mask & (a < 0) & (r >= 3.0)).any())
    want = recipe_loop(
        r,
        a,
        mask,
        low_range=(0.6, 0.9),
        high_range=(1.2, 3.0),
        low_step=0.02,
        high_step=0.05,
        target=1.0,
    )
    _, grad, m = loss_and_grad("bapo", log_prob, old, adv, mask, rho0=0.5, rule="recipe")
    assert (m["c_low"], m["c_high"], m["search_steps"]) == pytest.approx(want)
    trained = grad != 0
    pos = (r * a.abs())[trained & (a > 0)].sum().item()
    neg = (r * a.abs())[trained & (a < 0)].sum().item()
    assert m["rho"] == pytest.approx(pos / (pos + neg), rel=1e-12)


def test_recipe_over_micro_batches_equals_the_whole_batch():
    log_prob, old, adv, mask = make_batch(10, b=24, t=12, stale=0.5, p_pos=0.35)
    _, _, full = loss_and_grad("bapo", log_prob, old, adv, mask, rho0=0.5, rule="recipe")
    acc = BoundSearch(rule="recipe").accumulator(dual_clip=3.0)
    assert isinstance(acc, RecipeAccumulator)
    for rows in (slice(0, 7), slice(7, 15), slice(15, 24)):
        acc.add(**search_inputs(log_prob[rows], old[rows], adv[rows], mask[rows], rule="recipe"))
    b = acc.solve(0.5)
    assert (b.c_low, b.c_high, b.steps) == (full["c_low"], full["c_high"], full["search_steps"])
    assert b.rho == pytest.approx(full["rho"], rel=1e-12)


def test_a_bad_rule_is_one_line():
    with pytest.raises(ParamError) as info:
        BoundSearch(rule="verl")
    assert str(info.value) == "rule='verl': must be one of paper, recipe"
