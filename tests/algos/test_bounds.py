"""BAPO bound search: property tests against a plain loop of Algorithm 1, edge cases, bad input.

The oracle below is written from the spec, not from the implementation: it walks the literal loop
(guard `c_low + low_step <= b_low` with the documented 1e-9-step tolerance) and evaluates rho from
its definition over the tokens at every visited point, comparing in the ratio's dtype (numpy).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from bapo_cli.algos.bounds import (
    BapoBounds,
    BoundAccumulator,
    BoundPath,
    Locator,
    adaptive_bounds,
)

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True)
TOL = 1e-6  # float32 masses are rounded once per token; rho agrees to ~1e-7


def path_value(a: float, k: int, step: float, b: float) -> float:
    """The documented path value: a + k*step in float64, rounded to the decimals a and step are
    written with, clamped to b."""
    if k == 0:
        return a
    digits = max(len(repr(x).split(".")[1]) if "e" not in repr(x) else 20 for x in (a, step))
    return min(round(a + k * step, digits), b)


def can_step(a: float, k: int, step: float, b: float) -> bool:
    """Literal loop guard `c + step <= b`, with c = a + k*step and the 1e-9-step tolerance."""
    return a + (k + 1) * step <= b + 1e-9 * step


def oracle(
    ratio, adv, mask, weights, rho0, low_range, high_range, low_step, high_step, dual_clip=None
):
    np_dtype = {torch.float32: np.float32, torch.float64: np.float64}[ratio.dtype]
    r_np, a_np = ratio.numpy(), adv.double().numpy()
    w_np = None if weights is None else weights.double().numpy()
    tokens = []
    for i in range(r_np.size):
        r, a = r_np.flat[i], a_np.flat[i]
        w = 1.0 if w_np is None else w_np.flat[i]
        finite = math.isfinite(r) and math.isfinite(a) and math.isfinite(w)
        dual_clipped = dual_clip is not None and a < 0 and r >= np_dtype(dual_clip)
        if bool(mask.reshape(-1)[i]) and finite and not dual_clipped:
            tokens.append((r, a, float(r) * abs(float(a)) * float(w)))

    def active(tok, c_low, c_high):
        r, a, _ = tok
        if a > 0:
            return r < np_dtype(c_high)
        if a < 0:
            return r > np_dtype(c_low)
        return False

    def rho(c_low, c_high):
        pos = sum(m for t in tokens if t[1] > 0 and active(t, c_low, c_high) for m in [t[2]])
        neg = sum(m for t in tokens if t[1] < 0 and active(t, c_low, c_high) for m in [t[2]])
        return pos / (pos + neg) if pos + neg > 0 else 1.0

    (a_l, b_l), (a_h, b_h) = low_range, high_range

    def walk(stop):
        k_l = k_h = 0
        c = (a_l, a_h)
        points = [c]
        while not stop(c) and can_step(a_l, k_l, low_step, b_l):
            if can_step(a_h, k_h, high_step, b_h):
                k_h += 1
            else:
                k_l += 1
            c = (path_value(a_l, k_l, low_step, b_l), path_value(a_h, k_h, high_step, b_h))
            points.append(c)
        return points

    full = walk(lambda c: False)
    rhos = [rho(*c) for c in full]
    changes = any(active(t, *c) != active(t, *full[0]) for c in full for t in tokens if t[2] > 0)
    visited = walk(lambda c: rho(*c) >= rho0) if changes else full[:1]
    c_low, c_high = visited[-1]
    result = BapoBounds(c_low, c_high, rhos[0], rho(c_low, c_high), len(visited) - 1)
    return result, rhos


def near_tie(rhos, rho0):
    """rho values within TOL of rho0 (other than exact 0 or 1, which both sides compute exactly)
    could be decided either way by float rounding of the sums."""
    return any(abs(x - rho0) < TOL and x not in (0.0, 1.0) for x in rhos)


def assert_matches(got: BapoBounds, want: BapoBounds):
    assert (got.c_low, got.c_high, got.steps) == (want.c_low, want.c_high, want.steps)
    assert got.rho_before == pytest.approx(want.rho_before, rel=TOL, abs=TOL)
    assert got.rho == pytest.approx(want.rho, rel=TOL, abs=TOL)


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    low_step = draw(st.floats(0.005, 0.2))
    high_step = draw(st.floats(0.01, 0.5))
    a_low = draw(st.floats(0.2, 1.0))
    a_high = draw(st.floats(0.8, 2.0))
    # whole numbers of steps (the tolerance matters), fractions, or degenerate (min == max)
    frac = st.sampled_from([0.0, 0.5]) | st.floats(0.0, 0.99)
    b_low = a_low + (draw(st.integers(0, 16)) + draw(frac)) * low_step
    b_high = a_high + (draw(st.integers(0, 16)) + draw(frac)) * high_step
    low_range, high_range = (a_low, b_low), (a_high, b_high)
    # ratios: anywhere, exactly on a path value, one ulp either side of it, or exactly 1
    path = BoundPath.build(low_range, high_range, low_step, high_step)
    dual_clip = draw(st.none() | st.floats(0.01, 2.0).map(lambda d: path.low_values[-1] + d))
    extra = () if dual_clip is None else (dual_clip,)
    marks = torch.tensor(path.low_values + path.high_values + extra, dtype=torch.float64)
    marks = marks.to(dtype)
    n = draw(st.integers(0, 40))
    ratios = []
    for _ in range(n):
        kind = draw(st.sampled_from(["any", "on", "below", "above", "one"]))
        if kind == "any":
            ratios.append(torch.tensor(draw(st.floats(0.0, 4.0)), dtype=dtype))
        elif kind == "one":
            ratios.append(torch.tensor(1.0, dtype=dtype))
        else:
            v = marks[draw(st.integers(0, len(marks) - 1))]
            if kind != "on":
                v = torch.nextafter(v, torch.tensor(-1.0 if kind == "below" else 9.0, dtype=dtype))
            ratios.append(v)
    ratio = torch.stack(ratios) if ratios else torch.zeros(0, dtype=dtype)
    p_pos = draw(st.floats(0.0, 1.0))
    magnitude = st.floats(0.01, 3.0)
    adv = torch.tensor(
        [
            0.0
            if draw(st.integers(0, 9)) == 0
            else (1 if draw(st.floats(0, 1)) < p_pos else -1) * draw(magnitude)
            for _ in range(n)
        ],
        dtype=dtype,
    )
    mask = torch.tensor([draw(st.integers(0, 5)) > 0 for _ in range(n)], dtype=torch.bool)
    weights = None
    if draw(st.booleans()):
        weights = torch.tensor(
            [draw(st.sampled_from([0.0, 1.0]) | st.floats(0.01, 2.0)) for _ in range(n)],
            dtype=dtype,
        )
    rho0 = draw(st.sampled_from([0.0, 1.0, 0.4]) | st.floats(0.0, 1.0))
    return dict(
        ratio=ratio,
        adv=adv,
        mask=mask,
        weights=weights,
        rho0=rho0,
        low_range=low_range,
        high_range=high_range,
        low_step=low_step,
        high_step=high_step,
        dual_clip=dual_clip,
    )


def run_both(c):
    got = adaptive_bounds(
        c["ratio"],
        c["adv"],
        c["mask"],
        rho0=c["rho0"],
        low_range=c["low_range"],
        high_range=c["high_range"],
        low_step=c["low_step"],
        high_step=c["high_step"],
        weights=c["weights"],
        dual_clip=c["dual_clip"],
    )
    want, rhos = oracle(
        c["ratio"],
        c["adv"],
        c["mask"],
        c["weights"],
        c["rho0"],
        c["low_range"],
        c["high_range"],
        c["low_step"],
        c["high_step"],
        c["dual_clip"],
    )
    return got, want, rhos


@SETTINGS
@given(cases())
def test_matches_plain_algorithm_1(c):
    got, want, rhos = run_both(c)
    assume(not near_tie(rhos, c["rho0"]))
    assert_matches(got, want)


@SETTINGS
@given(cases())
def test_rho_is_non_decreasing_along_the_path(c):
    acc = BoundAccumulator(
        low_range=c["low_range"],
        high_range=c["high_range"],
        low_step=c["low_step"],
        high_step=c["high_step"],
        dual_clip=c["dual_clip"],
    )
    acc.add(c["ratio"], c["adv"], c["mask"], c["weights"])
    rhos = acc.rho_along_path()
    assert len(rhos) == len(acc.path)
    assert all(b >= a - 1e-12 for a, b in zip(rhos, rhos[1:], strict=False))
    _, oracle_rhos = oracle(
        c["ratio"],
        c["adv"],
        c["mask"],
        c["weights"],
        0.0,
        *(c[k] for k in PATH_KEYS),
        c["dual_clip"],
    )
    assert rhos == pytest.approx(oracle_rhos, rel=TOL, abs=TOL)


PATH_KEYS = ("low_range", "high_range", "low_step", "high_step")

# ------------------------------------------------------------------------------------------
# Hand-computed cases and edges
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hand_example_strict_at_a_path_point(dtype):
    # A positive token at r = 1.3 is clipped at c_high = 1.30 (strict r < c_high) and enters at
    # 1.35; rho goes 0 -> 1.3 / (1.3 + 0.7).
    ratio = torch.tensor([1.3, 0.7], dtype=dtype)
    adv = torch.tensor([1.0, -1.0], dtype=dtype)
    b = adaptive_bounds(ratio, adv, torch.ones(2, dtype=torch.bool))
    assert (b.c_low, b.c_high, b.steps) == (0.6, 1.35, 3)
    assert b.rho_before == 0.0
    assert b.rho == pytest.approx(1.3 / 2.0, rel=1e-6)


def test_paper_path_has_52_points_and_exact_values():
    path = BoundPath.build()
    assert (path.n_high, path.n_low, len(path)) == (36, 15, 52)
    assert path.high_values[-1] == 3.0 and path.low_values[-1] == 0.9
    assert path.point(36) == (0.6, 3.0) and path.point(37) == (0.62, 3.0)
    assert path.high_values[5] == 1.45  # not 1.4500000000000002


def test_low_range_without_a_step_means_no_path_at_all():
    # Literal loop guard: c_low + low_step <= b_low fails at once, so c_high never moves either.
    path = BoundPath.build(low_range=(0.8, 0.8), high_range=(1.2, 3.0))
    assert len(path) == 1
    ratio = torch.tensor([2.0, 0.9])
    b = adaptive_bounds(ratio, torch.tensor([1.0, -1.0]), torch.ones(2), low_range=(0.8, 0.8))
    assert (b.c_low, b.c_high, b.steps, b.rho) == (0.8, 1.2, 0, 0.0)


def test_degenerate_high_range_moves_only_c_low():
    ratio = torch.tensor([1.0, 0.65, 0.75])
    adv = torch.tensor([1.0, -1.0, -1.0])
    b = adaptive_bounds(ratio, adv, torch.ones(3), rho0=0.9, high_range=(1.2, 1.2))
    # negatives leave at c_low >= 0.65, then >= 0.75: rho 1/2.4 -> 1/1.75 -> 1
    assert (b.c_high, b.c_low, b.steps, b.rho) == (1.2, 0.76, 8, 1.0)


def test_on_policy_data_stops_at_once():
    n = 1000
    adv = torch.where(torch.arange(n) % 5 == 0, 1.0, -1.0)
    b = adaptive_bounds(torch.ones(n), adv, torch.ones(n, dtype=torch.bool))
    assert b.steps == 0 and (b.c_low, b.c_high) == (0.6, 1.2)
    assert b.rho_before == b.rho == pytest.approx(0.2)


def test_no_token_changes_activity_means_no_steps():
    # rho = 0.25 < rho0, but every token sits outside the moving band: walking would not change
    # the loss, so the search stays at the start point.
    ratio = torch.tensor([0.5, 5.0, 1.0, 1.0])
    adv = torch.tensor([1.0, 1.0, -1.0, -2.0])
    b = adaptive_bounds(ratio, adv, torch.ones(4))
    assert b.steps == 0 and b.rho == b.rho_before == pytest.approx(0.5 / 3.5)


@pytest.mark.parametrize(
    "adv, expected_rho",
    [([1.0, 2.0, 0.5], 1.0), ([-1.0, -2.0, -0.5], 0.0), ([0.0, 0.0, 0.0], 1.0)],
    ids=["all-positive", "all-negative", "all-zero"],
)
def test_one_signed_batches(adv, expected_rho):
    ratio = torch.tensor([0.7, 1.0, 1.5])
    b = adaptive_bounds(ratio, torch.tensor(adv), torch.ones(3))
    assert b.rho == expected_rho
    if expected_rho == 0.0:  # nothing can reach rho0: Algorithm 1 walks the whole path
        assert (b.c_low, b.c_high, b.steps) == (0.9, 3.0, 51)


def test_empty_mask_and_empty_batch():
    b = adaptive_bounds(torch.ones(3), -torch.ones(3), torch.zeros(3))
    assert (b.steps, b.rho_before, b.rho) == (0, 1.0, 1.0)  # 0/0 convention
    e = torch.zeros(0)
    assert adaptive_bounds(e, e, e.bool()) == BapoBounds(0.6, 1.2, 1.0, 1.0, 0)


@pytest.mark.parametrize("rho0, steps", [(0.0, 0), (1.0, 51)])
def test_rho0_extremes(rho0, steps):
    ratio = torch.tensor([1.25, 0.7, 0.95])
    adv = torch.tensor([1.0, -1.0, -1.0])
    assert adaptive_bounds(ratio, adv, torch.ones(3), rho0=rho0).steps == steps


def test_non_finite_tokens_are_left_out():
    ratio = torch.tensor([1.3, 0.7, float("nan"), float("inf"), 1.0])
    adv = torch.tensor([1.0, -1.0, -1.0, -1.0, float("nan")])
    weights = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])
    clean = adaptive_bounds(ratio[:2], adv[:2], torch.ones(2))
    assert adaptive_bounds(ratio, adv, torch.ones(5), weights=weights) == clean
    weights[0] = float("inf")  # only the negative token is left: it exits at c_low = 0.7
    b = adaptive_bounds(ratio, adv, torch.ones(5), weights=weights)
    assert (b.rho_before, b.rho, b.c_low, b.steps) == (0.0, 1.0, 0.7, 41)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dual_clip_leaves_out_negatives_at_or_above_it(dtype):
    three = torch.tensor(3.0, dtype=dtype)
    up, down = torch.tensor(9.0, dtype=dtype), torch.tensor(0.0, dtype=dtype)
    below = torch.nextafter(three, down) if dtype != torch.bfloat16 else torch.tensor(2.984375)
    above = torch.nextafter(three, up) if dtype != torch.bfloat16 else torch.tensor(3.015625)
    ratio = torch.stack([three, below.to(dtype), above.to(dtype), torch.tensor(1.3, dtype=dtype)])
    adv = torch.tensor([-1.0, -1.0, -1.0, 1.0], dtype=dtype)
    got = adaptive_bounds(ratio, adv, torch.ones(4), dual_clip=3.0, rho0=0.5)
    keep = torch.tensor([False, True, False, True])
    assert got == adaptive_bounds(ratio, adv, keep, rho0=0.5)
    pos, neg = ratio[3].double().item(), ratio[1].double().item()
    assert got.rho == pytest.approx(pos / (pos + neg), rel=1e-6)
    with pytest.raises(ValueError, match="dual_clip"):
        adaptive_bounds(ratio, adv, torch.ones(4), dual_clip=0.9)


def test_micro_batches_add_up_to_the_whole_batch():
    g = torch.Generator().manual_seed(0)
    ratio = torch.exp(torch.randn(3000, generator=g) * 0.3)
    adv = torch.randn(3000, generator=g) - 0.5
    mask = torch.rand(3000, generator=g) < 0.9
    whole = adaptive_bounds(ratio, adv, mask)
    acc = BoundAccumulator()
    for idx in torch.arange(3000).chunk(7):
        acc.add(ratio[idx], adv[idx], mask[idx])
    split = acc.solve(0.4)
    assert (split.c_low, split.c_high, split.steps) == (whole.c_low, whole.c_high, whole.steps)
    assert split.rho == pytest.approx(whole.rho, rel=1e-12)
    assert acc.solve(0.4) == split  # solve does not consume the sums
    acc.reset()
    assert acc.solve(0.4).steps == 0


def naive_search(ratio, adv, mask, rho0=0.4):
    """The iterative version the one-pass search replaces (as in benchmarks/bench_loss.py)."""
    path = BoundPath.build()
    mass = (ratio.double() * adv.double().abs()) * mask
    pos, neg = adv > 0, adv < 0
    k = 0
    while True:
        c_low, c_high = path.point(k)
        p = (mass * (pos & (ratio < c_high))).sum()
        n = (mass * (neg & (ratio > c_low))).sum()
        rho = (p / (p + n)).item() if (p + n) > 0 else 1.0
        if rho >= rho0 or k == len(path) - 1:
            return c_low, c_high, k
        k += 1


def test_agrees_with_naive_search_on_a_large_batch():
    g = torch.Generator().manual_seed(1)
    ratio = torch.exp(torch.randn(30_000, generator=g) * 0.3)
    adv = torch.where(torch.rand(30_000, generator=g) < 0.35, 1.0, -1.0)
    mask = torch.rand(30_000, generator=g) < 0.95
    b = adaptive_bounds(ratio, adv, mask)
    assert (b.c_low, b.c_high, b.steps) == naive_search(ratio, adv, mask)
    assert 0 < b.steps < 51


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.lists(st.floats(-5, 5, width=32), min_size=1, max_size=30),
    st.lists(st.floats(-6, 6, width=32), min_size=0, max_size=50),
    st.sampled_from([torch.float32, torch.float64]),
    st.sampled_from([("bits", "scaled"), ("scaled",), ()]),
)
def test_locator_counts_like_bucketize(table, keys, dtype, modes):
    table = torch.tensor(sorted(table), dtype=dtype)
    loc = Locator(table, modes=modes)
    assert loc.mode in (*modes, "bucketize")
    probe = torch.cat([torch.tensor(keys, dtype=dtype), table, torch.nextafter(table, -table)])
    probe = torch.cat([probe, torch.tensor([0.0, 1e30, -1e30, math.inf, -math.inf], dtype=dtype)])
    probe = probe[~((probe == 0) & torch.signbit(probe))]  # -0.0: documented, mass 0
    assert torch.equal(loc.count(probe).long(), torch.bucketize(probe, table, right=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("modes", [("bits",), ("scaled",), ()])
def test_locator_modes_on_the_paper_table(dtype, modes):
    acc = BoundAccumulator(dual_clip=3.0)
    table = acc._locator(dtype, torch.device("cpu")).table
    loc = Locator(table, modes=modes)
    assert loc.mode == (modes[0] if modes else "bucketize")
    g = torch.Generator().manual_seed(0)
    probe = torch.cat(
        [
            torch.randn(100_000, generator=g, dtype=dtype) * 2,
            table,
            torch.nextafter(table, torch.tensor(-9.0, dtype=dtype)),
            torch.nextafter(table, torch.tensor(9.0, dtype=dtype)),
        ]
    )
    assert torch.equal(loc.count(probe).long(), torch.bucketize(probe, table, right=True))


def test_locator_falls_back_for_crowded_tables():
    assert Locator(torch.tensor([0.0, 1.0, 1.0, 2.0])).mode == "bucketize"  # equal values
    assert Locator(torch.tensor([0.0, 1e-7, 2.0]), modes=("scaled",)).mode == "bucketize"
    tiny = BoundAccumulator(low_range=(0.5, 0.9), low_step=1e-5)
    tiny.add(torch.tensor([0.7, 1.3]), torch.tensor([-1.0, 1.0]), torch.ones(2))
    assert tiny.solve(0.5).c_high == 1.35


# ------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(low_range=(0.9, 0.6)), "low_range"),
        (dict(low_range=(0.0, 0.6)), "low_range"),
        (dict(low_range=(-1.0, 0.6)), "low_range"),
        (dict(low_range=(0.6, math.inf)), "low_range"),
        (dict(low_range=(0.6,)), "low_range"),
        (dict(high_range=(3.0, 1.2)), "high_range"),
        (dict(high_range=(1.2, math.nan)), "high_range"),
        (dict(low_step=0.0), "low_step"),
        (dict(low_step=-0.02), "low_step"),
        (dict(high_step=0.0), "high_step"),
        (dict(high_step=math.inf), "high_step"),
        (dict(high_step=1e-12), "high_step"),
        (dict(rho0=-0.1), "rho0"),
        (dict(rho0=1.5), "rho0"),
        (dict(rho0=math.nan), "rho0"),
    ],
)
def test_bad_parameters_name_themselves(kwargs, name):
    ones = torch.ones(4)
    with pytest.raises(ValueError, match=name):
        adaptive_bounds(ones, ones, ones, **kwargs)


@pytest.mark.parametrize("which", ["advantages", "mask", "weights"])
def test_shape_mismatch_names_the_tensor(which):
    args = dict(ratio=torch.ones(4), advantages=torch.ones(4), mask=torch.ones(4))
    weights = None
    if which == "weights":
        weights = torch.ones(5)
    else:
        args[which] = torch.ones(2, 2)
    with pytest.raises(ValueError, match=which):
        adaptive_bounds(args["ratio"], args["advantages"], args["mask"], weights=weights)


def test_integer_ratio_is_rejected():
    with pytest.raises(ValueError, match="ratio"):
        adaptive_bounds(torch.ones(2, dtype=torch.long), torch.ones(2), torch.ones(2))


@example(rho0=0.4)
@given(st.floats(0, 1))
@settings(max_examples=10, deadline=None, derandomize=True)
def test_valid_rho0_accepted(rho0):
    assert adaptive_bounds(torch.ones(2), torch.ones(2), torch.ones(2), rho0=rho0).steps == 0


def test_bounds_carry_the_sums_rho_is_the_share_of():
    # start (0.6, 1.2): active are the positive at r = 0.5 and the negative at r = 1.0 (P = 0.5,
    # N = 1.0, rho 1/3); the positive at r = 2.0 enters at c_high = 2.05, 17 steps on (P = 2.5)
    ratio = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    got = adaptive_bounds(ratio, adv, torch.ones(3, dtype=torch.bool), rho0=0.6)
    assert (got.c_low, got.c_high, got.steps) == (0.6, 2.05, 17)
    assert (got.pos_before, got.neg_before, got.pos, got.neg) == (0.5, 1.0, 2.5, 1.0)
    assert got.rho_before == 0.5 / 1.5 and got.rho == 2.5 / 3.5
    # no mass at all: rho is 1 by convention only, and the sums say so
    none = adaptive_bounds(ratio, torch.zeros(3, dtype=torch.float64), torch.ones(3).bool())
    assert (none.rho, none.pos, none.neg, none.pos_before, none.neg_before) == (1.0, 0, 0, 0, 0)
