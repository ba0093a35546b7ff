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
token's exit index: the first point with r <= c_low), add its mass into that bin (`bincount`) and
get P and N at every point from cumulative sums. One table look-up places a token (`_Locator`:
the positive and negative thresholds live in one sorted table, keyed by copysign(r, A)), so the
whole path costs one pass over the tokens, one vector of K + 3 sums (P's and N's bins), and one
host read in `solve` -- instead of one pass and one `.item()` per path step. Micro-batches
(gradient accumulation) add their vectors; data-parallel ranks all-reduce them, so every rank gets
the same bounds, equal to one process on the whole batch.

Choices (docs/bapo.md points users here)
----------------------------------------
* rho counts gradient-carrying tokens only, with strict inequalities (r < c_high, r > c_low),
  compared in the ratio's dtype against the path values cast to that dtype. The losses in
  `losses.py` use the very same comparisons, so the searched active set is the trained one.
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
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import torch

from bapo_cli.algos.params import ParamError, number, one_of, param

__all__ = [
    "PAPER",
    "RULES",
    "WEIGHTINGS",
    "RecipeAccumulator",
    "BapoBounds",
    "BoundAccumulator",
    "BoundPath",
    "BoundSearch",
    "adaptive_bounds",
    "rho_from_sums",
]

# Token weight w in rho: 1, or pi_rollout(y_t) (the paper's Eq. 8).
WEIGHTINGS = ("none", "rollout_prob")
# paper: Algorithm 1 as written above; recipe: the authors' public verl recipe (`RecipeAccumulator`)
RULES = ("paper", "recipe")
# The recipe's target test: P / (N + RECIPE_EPS) >= target (its `eps`).
RECIPE_EPS = 1e-8

# A path longer than this is a configuration mistake (e.g. a step of 1e-9), not a search.
MAX_PATH_POINTS = 100_000
# Tolerance in units of one step when counting how many steps fit into a range.
STEP_TOLERANCE = 1e-9


@dataclass(frozen=True)
class BapoBounds:
    """Result of the search; plain Python numbers, ready to log or to pass to `bapo_loss`.

    c_low, c_high: the chosen bounds. rho_before: rho at the start point (a_low, a_high).
    rho: rho at the chosen point. steps: path steps taken (0 = start point).
    pos_before, neg_before / pos, neg: the sums P and N that rho_before / rho are the shares of
    (w r |A| over the searched tokens, all ranks summed), so that a caller can weight rho by mass
    across several searches: sum(pos) / sum(pos + neg), where a search with no mass adds nothing
    (its rho is 1 only by the 0/0 convention).
    """

    c_low: float
    c_high: float
    rho_before: float
    rho: float
    steps: int
    pos_before: float = 0.0
    neg_before: float = 0.0
    pos: float = 0.0
    neg: float = 0.0


def range_pair(name: str, value: Any) -> tuple[float, float]:
    """(min, max) of a range such as `low_range`: two numbers with min <= max."""
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ParamError(name, value, "must be [min, max], two numbers") from None
    if lo > hi:
        raise ParamError(name, value, "min must be <= max")
    return lo, hi


def _check_range(name: str, value: Any) -> tuple[float, float]:
    lo, hi = range_pair(name, value)
    if not (lo > 0.0 and hi < math.inf):
        raise ParamError(name, value, "must satisfy 0 < min <= max < inf")
    return lo, hi


def _check_step(name: str, value: Any) -> float:
    step = number(name, value)
    if not (0.0 < step < math.inf):
        raise ParamError(name, value, "must be a finite number > 0")
    return step


def check_rho0(rho0: Any) -> float:
    """The target share as a float; a ParamError naming `rho0` unless it lies in [0, 1]."""
    value = number("rho0", rho0)
    if not (0.0 <= value <= 1.0):
        raise ParamError("rho0", rho0, "must be within [0, 1]")
    return value


def _n_steps(name: str, step: float, lo: float, hi: float) -> int:
    n = math.floor((hi - lo) / step + STEP_TOLERANCE)
    if n >= MAX_PATH_POINTS:
        raise ParamError(name, step, f"too small: the path would have {n} points on its range")
    return n


def _decimals(x: float) -> int:
    """Digits after the decimal point in the shortest repr of x (0.02 -> 2, 1e-05 -> 5)."""
    exponent = Decimal(repr(float(x))).as_tuple().exponent
    return max(0, -exponent) if isinstance(exponent, int) else 0


def path_value(start: float, k: int, step: float, stop: float) -> float:
    """Path value after k steps: start + k * step in float64 (never an accumulated sum), rounded
    to the decimals that start and step are written with (0.6 + 15 * 0.02 is 0.9, not
    0.8999999999999999) and clamped to the range's max. k = 0 gives start exactly."""
    if k == 0:
        return start
    return min(round(start + k * step, max(_decimals(start), _decimals(step))), stop)


@dataclass(frozen=True)
class BoundSearch:
    """The settings of Algorithm 1, with the paper's defaults; validated on construction.

    The one place these defaults and rules are written: `losses.bapo_loss`'s keyword arguments,
    `BoundAccumulator`, `adaptive_bounds`, the trainer and the `algo` schema of `bapo` (its
    fields, help texts and checks) all come from here. Ranges are stored as tuples of floats.
    """

    rho0: float = param(0.4, "target share of positive-advantage tokens in the active loss mass")
    low_range: tuple[float, float] = param((0.6, 0.9), "[a-, b-]: where c_low may move")
    high_range: tuple[float, float] = param((1.2, 3.0), "[a+, b+]: where c_high may move")
    low_step: float = param(0.02, "delta2: step of c_low along the search path")
    high_step: float = param(0.05, "delta1: step of c_high along the search path")
    weighting: str = param(
        "none", "token weight in rho: none (w=1) or rollout_prob (w=pi_rollout, paper Eq. 8)"
    )
    rule: str = param(
        "paper",
        "paper = Algorithm 1 (active tokens only, c_high first, share >= rho0); recipe = the "
        "authors' public verl recipe (clipped tokens counted at their clipped value, c_low "
        "first, stop when P/N >= rho0/(1-rho0)); docs/bapo.md",
    )

    def __post_init__(self) -> None:
        self.check()
        for name in ("low_range", "high_range"):
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))

    def check(self) -> None:
        """rho0 in [0, 1], ranges 0 < min <= max < inf, steps > 0 (and not so small that the path
        explodes), weighting one of WEIGHTINGS. Raises a ParamError naming the setting."""
        check_rho0(self.rho0)
        one_of("rule", self.rule, RULES)
        self.path()
        one_of("weighting", self.weighting, WEIGHTINGS)

    def path(self) -> BoundPath:
        """The fixed path these settings walk (memoised)."""
        return BoundPath.build(
            self.low_range, self.high_range, self.low_step, self.high_step, rule=self.rule
        )

    def accumulator(self, dual_clip: float | None = None) -> BoundAccumulator | RecipeAccumulator:
        """An empty accumulator over this path (`RecipeAccumulator` for rule=recipe);
        `solve(self.rho0)` it after adding."""
        cls = RecipeAccumulator if self.rule == "recipe" else BoundAccumulator
        return cls(
            low_range=self.low_range,
            high_range=self.high_range,
            low_step=self.low_step,
            high_step=self.high_step,
            dual_clip=dual_clip,
        )


@dataclass(frozen=True)
class BoundPath:
    """The fixed path of Algorithm 1: point 0, then n_high c_high steps, then n_low c_low steps.

    `high_values[i]` is c_high after i c_high steps, `low_values[j]` is c_low after j c_low steps;
    path point k is (low_values[max(0, k - n_high)], high_values[min(k, n_high)]).
    rule=recipe (`low_first`): c_low's steps come first, point k is
    (low_values[min(k, n_low)], high_values[max(0, k - n_low)]); each range is walked to its
    max, the last step clamped to it (the recipe's ``min(c + step, max)`` while ``c < max``), and
    c_high moves even when c_low cannot (no literal loop guard).
    """

    high_values: tuple[float, ...]
    low_values: tuple[float, ...]
    low_first: bool = False

    @classmethod
    def build(
        cls,
        low_range: Sequence[float] = BoundSearch.low_range,
        high_range: Sequence[float] = BoundSearch.high_range,
        low_step: float = BoundSearch.low_step,
        high_step: float = BoundSearch.high_step,
        rule: str = BoundSearch.rule,
    ) -> BoundPath:
        a_low, b_low = _check_range("low_range", low_range)
        a_high, b_high = _check_range("high_range", high_range)
        low_step = _check_step("low_step", low_step)
        high_step = _check_step("high_step", high_step)
        one_of("rule", rule, RULES)
        return _build_path(a_low, b_low, a_high, b_high, low_step, high_step, rule)

    @property
    def n_high(self) -> int:
        return len(self.high_values) - 1

    @property
    def n_low(self) -> int:
        return len(self.low_values) - 1

    def __len__(self) -> int:
        """Number of path points K (the start point included)."""
        return 1 + self.n_high + self.n_low

    def point(self, k: int) -> tuple[float, float]:
        """(c_low, c_high) at path point k."""
        if self.low_first:
            return self.low_values[min(k, self.n_low)], self.high_values[max(0, k - self.n_low)]
        return self.low_values[max(0, k - self.n_high)], self.high_values[min(k, self.n_high)]


def _n_steps_to_max(name: str, step: float, lo: float, hi: float) -> int:
    """Steps of ``c = min(c + step, hi)`` while ``c < hi`` (the recipe's loop): ceil, not floor."""
    n = math.ceil((hi - lo) / step - STEP_TOLERANCE)
    if n >= MAX_PATH_POINTS:
        raise ParamError(name, step, f"too small: the path would have {n} points on its range")
    return max(n, 0)


@functools.lru_cache(maxsize=64)
def _build_path(
    a_low: float,
    b_low: float,
    a_high: float,
    b_high: float,
    low_step: float,
    high_step: float,
    rule: str = "paper",
) -> BoundPath:
    """The path for validated numbers; memoised (a pure function of immutable inputs) so that a
    loss called every micro-batch does not rebuild it."""
    if rule == "recipe":
        n_low = _n_steps_to_max("low_step", low_step, a_low, b_low)
        n_high = _n_steps_to_max("high_step", high_step, a_high, b_high)
    else:
        n_low = _n_steps("low_step", low_step, a_low, b_low)
        # Literal loop guard: no c_low step possible -> the loop never runs, c_high stays too.
        n_high = _n_steps("high_step", high_step, a_high, b_high) if n_low > 0 else 0
    high = tuple(path_value(a_high, i, high_step, b_high) for i in range(n_high + 1))
    low = tuple(path_value(a_low, j, low_step, b_low) for j in range(n_low + 1))
    return BoundPath(high_values=high, low_values=low, low_first=rule == "recipe")


PAPER = BoundSearch()  # the paper's settings: the defaults of the functions below


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; float32 and narrower dtypes are compared in float32 (exact: every
    bfloat16/float16 value and every path value rounded to them is a float32 value)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rho_from_sums(pos: float, neg: float) -> float:
    """rho = P / (P + N), with the convention rho = 1 when no token carries mass (0/0)."""
    total = pos + neg
    return pos / total if total > 0 else 1.0


def _rho_curve(path: BoundPath, sums: list[float]) -> tuple[list[float], list[float], bool]:
    """From the per-bin sums (K + 3 numbers, host side; touches no token) return P after each
    number of c_high steps, N after each number of c_low steps, and whether any mass-carrying
    token changes activity strictly inside the path.

    Layout of `sums` (see `BoundAccumulator.add_keyed`): index n_low + 1 - x holds the negatives
    with exit index x in [0, n_low + 1]; index n_low + 2 + e holds the positives with entry index
    e in [0, n_high + 1]. x = #{j: low_j < r} (active while the c_low index j < x); e = #{i:
    high_i <= r} (active from the c_high index e on; e = n_high + 1: never).
    """
    n_h, n_l = path.n_high, path.n_low
    neg_bins = sums[n_l + 1 :: -1][: n_l + 2]  # neg_bins[x]
    pos_bins = sums[n_l + 2 :]  # pos_bins[e]
    pos_at, acc = [], 0.0  # P after i c_high steps: positives that entered at or before i
    for v in pos_bins[: n_h + 1]:
        acc += v
        pos_at.append(acc)
    neg_at, acc = [0.0] * (n_l + 1), 0.0  # N after j c_low steps: exit index > j
    for j in range(n_l, -1, -1):
        acc += neg_bins[j + 1]
        neg_at[j] = acc
    changes = any(v != 0 for v in pos_bins[1 : n_h + 1]) or any(
        v != 0 for v in neg_bins[1 : n_l + 1]
    )
    return pos_at, neg_at, changes


def _solve(path: BoundPath, sums: list[float], rho0: float) -> BapoBounds:
    """Walk Algorithm 1 on the per-bin sums."""
    pos_at, neg_at, changes = _rho_curve(path, sums)
    n_h = path.n_high

    def sums_at(k: int) -> tuple[float, float]:
        return pos_at[min(k, n_h)], neg_at[max(0, k - n_h)]

    def rho_at(k: int) -> float:
        return rho_from_sums(*sums_at(k))

    k = 0
    if changes:  # otherwise rho (and the loss) is the same at every point: stay at the start
        last = len(path) - 1
        while k < last and rho_at(k) < rho0:
            k += 1
    c_low, c_high = path.point(k)
    (pos_before, neg_before), (pos, neg) = sums_at(0), sums_at(k)
    return BapoBounds(
        c_low=c_low,
        c_high=c_high,
        rho_before=rho_at(0),
        rho=rho_at(k),
        steps=k,
        pos_before=pos_before,
        neg_before=neg_before,
        pos=pos,
        neg=neg,
    )


def _check_same_shape(reference: str, tensors: dict[str, torch.Tensor | None]) -> None:
    shape = tensors[reference].shape
    for name, t in tensors.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


class _Locator:
    """count(key) = #{u in table: u <= key}, exactly; what `torch.bucketize(key, table,
    right=True)` returns, but with a few elementwise ops and two table look-ups instead of a
    binary search (the search is the hot loop of the bound search).

    Keys are mapped to cells by a monotone function f: thresholds in a lower cell than the key are
    < key, in a higher cell > key, and the (at most one) threshold that shares the key's cell is
    compared exactly, so count = base[cell] + (thr[cell] <= key). f is applied to the thresholds
    with the same torch ops in the same dtype, so both sides agree on every cell. Two choices of
    f, tried in order, and the binary search when neither gives each threshold its own cell:

    * "bits": the top bits of the key as a float32, ``(key.view(int32) >> shift) & mask`` (2
      ops; float64 keys are rounded to float32 first, which is monotone too); cells are ordered
      by value through `_bit_ranks` (the sign bit reverses the negatives).
    * "scaled": ``trunc(clamp(key * scale, -h, h) + h)`` with >= 4 cells per threshold gap.

    Keys may be any float but NaN (NaN keys give arbitrary counts: callers give them no mass).
    The one inexact spot is key = -0.0, counted below a +0.0 threshold; its mass r |A| is 0.
    """

    MAX_CELLS = 1 << 18
    SHIFTS = (16, 15, 14)  # 128, 256, 512 cells per octave; tables of 64K, 128K, 256K cells

    def __init__(self, table: torch.Tensor, modes: Sequence[str] = ("bits", "scaled")) -> None:
        self.table = table  # sorted, compute dtype, CPU
        self.mode = "bucketize"
        if table.numel() == 0 or not bool((table[1:] > table[:-1]).all()):
            return
        if "bits" in modes:
            for shift in self.SHIFTS:
                self.mode, self.shift = "bits", shift
                ranks = _bit_ranks(1 << (32 - shift))
                if self._build(self._cells(table).long(), ranks):
                    return
        values = table.double()
        if "scaled" in modes and table.numel() > 1:
            scale = torch.tensor(4.0 / (values[1:] - values[:-1]).min().item(), dtype=table.dtype)
            half = math.ceil(values.abs().max().item() * scale.item()) + 2
            if 2 * half + 1 <= self.MAX_CELLS:
                self.mode, self.scale, self.half = "scaled", scale.item(), half
                if self._build(self._cells(table).long(), torch.arange(2 * half + 1)):
                    return
        self.mode = "bucketize"

    def _build(self, cells: torch.Tensor, ranks: torch.Tensor) -> bool:
        """Tables over all cells from the thresholds' cells; False if two share a cell."""
        table_ranks = ranks[cells]
        if not bool((table_ranks[1:] > table_ranks[:-1]).all()):
            return False
        # thresholds in lower cells; int32 so that base + (bool) stays a cheap int32 add
        self.base = torch.searchsorted(table_ranks, ranks, right=False).to(torch.int32)
        # empty cells hold NaN: (NaN <= key) is False for every key, +inf included
        self.thr = torch.full((ranks.numel(),), math.nan, dtype=self.table.dtype)
        self.thr[cells] = self.table
        return True

    def _cells(self, key: torch.Tensor) -> torch.Tensor:
        if self.mode == "bits":
            bits = key.float().view(torch.int32)
            return (bits >> self.shift) & ((1 << (32 - self.shift)) - 1)
        h = float(self.half)
        return (key * self.scale).clamp_(-h, h).add_(h).to(torch.int32)

    def to(self, device: torch.device) -> _Locator:
        out = _Locator.__new__(_Locator)
        out.__dict__.update(self.__dict__)
        out.table = self.table.to(device)
        if self.mode != "bucketize":
            out.base, out.thr = self.base.to(device), self.thr.to(device)
        return out

    def count(self, key: torch.Tensor) -> torch.Tensor:
        if self.mode == "bucketize":
            return torch.bucketize(key, self.table, right=True)
        cells = self._cells(key)
        return self.base.index_select(0, cells) + (self.thr.index_select(0, cells) <= key)


def _bit_ranks(n_cells: int) -> torch.Tensor:
    """Order of the bit cells by value: cell c < n/2 holds positive floats (rank c, growing with
    the value); cell n/2 + m holds negative floats of magnitude cell m (rank -1 - m)."""
    c = torch.arange(n_cells)
    half = n_cells // 2
    return torch.where(c < half, c, half - 1 - c)


@functools.lru_cache(maxsize=64)
def _locator(
    low_values: tuple[float, ...],
    high_values: tuple[float, ...],
    dual_clip: float | None,
    dtype: torch.dtype,
    device: torch.device,
) -> _Locator:
    """The thresholds U = [(-prev(dual),) -low_n, ..., -low_0, 0, high_0, ..., high_n]: the
    float64 path values rounded once to the ratio's dtype (as the loss rounds them), held in the
    compute dtype. prev(dual) is the largest compute-dtype number below the dual clip: r >= dual
    iff r > prev(dual), so dual-clipped negatives land in bin 0.

    A memo of a pure function (the tables are never modified), so that a loss called every
    micro-batch does not rebuild its look-up tables.
    """
    cd = compute_dtype(dtype)
    low = torch.tensor(low_values, dtype=torch.float64).to(dtype).to(cd)
    high = torch.tensor(high_values, dtype=torch.float64).to(dtype).to(cd)
    parts = [-low.flip(0), torch.zeros(1, dtype=cd), high]
    if dual_clip is not None:
        dual = torch.tensor([dual_clip], dtype=torch.float64).to(dtype).to(cd)
        parts.insert(0, -torch.nextafter(dual, torch.tensor(-math.inf, dtype=cd)))
    return _Locator(torch.cat(parts)).to(device)


def _keyed_inputs(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat (key = copysign(r, A), mass = w r |A|, weight = w |A|) in the compute dtype, 0 on
    tokens out of the mask or with a non-finite r, A, w or product."""
    _check_same_shape(
        "ratio", {"ratio": ratio, "advantages": advantages, "mask": mask, "weights": weights}
    )
    if not ratio.is_floating_point():
        raise ValueError(f"ratio must be a floating-point tensor, got {ratio.dtype}")
    cd = compute_dtype(ratio.dtype)
    r = ratio.detach().reshape(-1).to(cd)
    adv = advantages.detach().reshape(-1).to(cd)
    keep = mask.reshape(-1)
    keep = keep if keep.dtype == torch.bool else keep != 0
    key = torch.copysign(r, adv)  # +r for A > 0, -r for A < 0
    m = key * adv  # r |A| >= 0: key and A have the same sign
    a = adv.abs()
    if weights is not None:
        w = weights.detach().reshape(-1).to(cd)
        m, a = m * w, a * w
    keep = keep & ((m - m) == 0) & ((a - a) == 0)  # false for NaN/inf in r, A, w
    return torch.where(keep, key, 0.0), torch.where(keep, m, 0.0), torch.where(keep, a, 0.0)


def _checked_dual_clip(dual_clip: float | None, path: BoundPath) -> float | None:
    """The dual clip as a float, above every c_low the path can take (or None)."""
    dual = None if dual_clip is None else number("dual_clip", dual_clip)
    if dual is not None and not (path.low_values[-1] < dual < math.inf):
        raise ParamError(
            "dual_clip",
            dual_clip,
            f"must be finite and > the largest c_low ({path.low_values[-1]}), or None",
        )
    return dual


def _summed_to_host(sums: torch.Tensor | None, size: int, group: Any) -> list[float]:
    """A search's bin sums (zeros when nothing was added), all-reduced over `group` when given,
    read to the host: the one sync of a search. A rank with no tokens still joins the reduce, on
    the GPU when the backend is NCCL."""
    sums = sums if sums is not None else torch.zeros(size, dtype=torch.float64)
    if group is not None:
        import torch.distributed as dist

        sums = sums.clone()
        if dist.get_backend(group) == "nccl" and sums.device.type != "cuda":
            sums = sums.cuda()
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return sums.tolist()


class BoundAccumulator:
    """Additive per-path-point sums, so micro-batches and ranks can be solved once together.

    >>> acc = BoundAccumulator()                       # paper ranges and steps
    >>> for ratio, adv, mask in micro_batches:         # doctest: +SKIP
    ...     acc.add(ratio, adv, mask)                  # no host sync
    >>> bounds = acc.solve(rho0=0.4, group=dist.group.WORLD)  # doctest: +SKIP

    `add` bins each token's mass by the path point where it changes activity (one table look-up
    and one bincount, no host sync) into a float64 vector of length K + 3. `solve`
    optionally all-reduces that vector over `group` and reads it to the host once. Every rank
    must call `solve` with the same group (and `add` at least once, even with an empty mask, so
    the vector lives on the rank's device).
    """

    def __init__(
        self,
        *,
        low_range: Sequence[float] = PAPER.low_range,
        high_range: Sequence[float] = PAPER.high_range,
        low_step: float = PAPER.low_step,
        high_step: float = PAPER.high_step,
        dual_clip: float | None = None,
    ) -> None:
        self.path = BoundPath.build(low_range, high_range, low_step, high_step)
        self.dual_clip = _checked_dual_clip(dual_clip, self.path)
        self._lead = 0 if dual_clip is None else 1  # leading bin: dual-clipped negatives
        self._sums: torch.Tensor | None = None

    def _locator(self, dtype: torch.dtype, device: torch.device) -> _Locator:
        path = self.path
        return _locator(path.low_values, path.high_values, self.dual_clip, dtype, device)

    def add(
        self,
        ratio: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> None:
        """Add one batch of tokens (any shape, all four tensors the same shape).

        ratio: r = pi_theta / pi_rollout >= 0 (detached here); advantages: A; mask: nonzero =
        token counts; weights: optional w >= 0 per token. Tokens whose r, A or w is not finite (or
        whose product w * r * A overflows) are left out. No host sync.
        """
        key, m, _ = _keyed_inputs(ratio, advantages, mask, weights)
        self.add_keyed(key, m, ratio.dtype)

    def add_keyed(self, key: torch.Tensor, mass: torch.Tensor, dtype: torch.dtype) -> None:
        """Lower-level `add` for callers that already hold clean tensors (the BAPO loss).

        key = copysign(r, A) in `compute_dtype(dtype)` (+r for positive, -r for negative tokens),
        mass = w r |A| >= 0 and finite (0 for tokens that do not count), `dtype` = the ratio's
        dtype whose rounding of the path values is used.
        """
        locator = self._locator(dtype, key.device)
        # One look-up places every token on the path: for a negative token (key = -r)
        # count = #{j: -low_j <= -r} = #{j: low_j >= r}, i.e. n_low + 1 - (exit index); for a
        # positive token count = n_low + 2 + #{i: high_i <= r}, i.e. n_low + 2 + (entry index).
        # r == 0 lands on either side of the 0 separator, but then its mass is 0.
        # With a dual clip every count is one higher and bin 0 holds the dual-clipped negatives.
        count = locator.count(key.reshape(-1))
        size = locator.table.numel() + 1
        bins = torch.bincount(count, weights=mass.reshape(-1).double(), minlength=size)
        if self._sums is None:
            self._sums = torch.zeros_like(bins, dtype=torch.float64)
        self._sums.add_(bins)

    def solve(self, rho0: float = PAPER.rho0, group: Any = None) -> BapoBounds:
        """Choose the bounds from everything added so far (one all-reduce, one host read).

        group: a torch.distributed process group (e.g. ``torch.distributed.group.WORLD``) over
        which to sum the vectors first; None = this process only.
        """
        rho0 = check_rho0(rho0)
        return _solve(self.path, self._host_sums(group), rho0)

    def _host_sums(self, group: Any) -> list[float]:
        """All-reduce (optional) and read the sums to the host: the one sync of the search."""
        size = self.path.n_high + self.path.n_low + 4 + self._lead
        return _summed_to_host(self._sums, size, group)[self._lead :]

    def rho_along_path(self, group: Any = None) -> list[float]:
        """rho at every path point (K numbers, one host read): for logging the curve or checking
        it. Non-decreasing up to float rounding."""
        pos_at, neg_at, _ = _rho_curve(self.path, self._host_sums(group))
        n_h = self.path.n_high
        return [
            rho_from_sums(pos_at[min(k, n_h)], neg_at[max(0, k - n_h)])
            for k in range(len(self.path))
        ]

    def reset(self) -> None:
        """Forget the added sums (start the next optimizer step)."""
        self._sums = None


class RecipeAccumulator:
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

    def __init__(
        self,
        *,
        low_range: Sequence[float] = PAPER.low_range,
        high_range: Sequence[float] = PAPER.high_range,
        low_step: float = PAPER.low_step,
        high_step: float = PAPER.high_step,
        dual_clip: float | None = None,
    ) -> None:
        self.path = BoundPath.build(low_range, high_range, low_step, high_step, rule="recipe")
        self.dual_clip = _checked_dual_clip(dual_clip, self.path)
        self._lead = 0 if dual_clip is None else 1  # leading bin: dual-clipped negatives
        self._sums: torch.Tensor | None = None

    @property
    def _size(self) -> int:
        return self.path.n_high + self.path.n_low + 4 + self._lead

    def add(
        self,
        ratio: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> None:
        """Add one batch of tokens, as `BoundAccumulator.add` (dual-clipped negatives included:
        the recipe counts them). No host sync."""
        key, m, a = _keyed_inputs(ratio, advantages, mask, weights)
        path = self.path
        locator = _locator(
            path.low_values, path.high_values, self.dual_clip, ratio.dtype, key.device
        )
        count = locator.count(key)
        size = self._size
        bins = torch.cat(
            [
                torch.bincount(count, weights=m.double(), minlength=size),
                torch.bincount(count, weights=a.double(), minlength=size),
            ]
        )
        if self._sums is None:
            self._sums = torch.zeros_like(bins)
        self._sums.add_(bins)

    def solve(self, rho0: float = PAPER.rho0, group: Any = None) -> BapoBounds:
        """Walk the recipe's path; one all-reduce over `group` (optional), one host read."""
        rho0 = check_rho0(rho0)
        size = self._size
        values = _summed_to_host(self._sums, 2 * size, group)
        mass, weight = values[:size], values[size:]
        dual_mass = mass[0] if self._lead else 0.0  # dual-clipped negatives: r |A|, never active
        return _solve_recipe(self.path, mass[self._lead :], weight[self._lead :], dual_mass, rho0)

    def reset(self) -> None:
        """Forget the added sums (start the next optimizer step)."""
        self._sums = None


def _suffix_sums(values: list[float]) -> list[float]:
    """[sum(values[i:]) for i in range(len(values))], added from the end (exact zeros stay 0)."""
    return list(itertools.accumulate(reversed(values)))[::-1]


def _solve_recipe(
    path: BoundPath, mass: list[float], weight: list[float], dual_mass: float, rho0: float
) -> BapoBounds:
    """The recipe's walk on the per-bin sums (layout of `_rho_curve`): mass = w r |A|,
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


def adaptive_bounds(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    rho0: float = PAPER.rho0,
    low_range: Sequence[float] = PAPER.low_range,
    high_range: Sequence[float] = PAPER.high_range,
    low_step: float = PAPER.low_step,
    high_step: float = PAPER.high_step,
    weights: torch.Tensor | None = None,
    group: Any = None,
    dual_clip: float | None = None,
    rule: str = PAPER.rule,
) -> BapoBounds:
    """Algorithm 1 of the BAPO paper on one batch of tokens: one `add` and one `solve`.

    ratio, advantages, mask (and weights) have the same shape, e.g. [B, T]. dual_clip: leave out
    negative tokens with r >= dual_clip (they carry no gradient under a dual-clipped loss).
    Returns `BapoBounds` with Python numbers. See the module docstring for the exact semantics.
    """
    search = BoundSearch(
        rho0=rho0,
        low_range=low_range,
        high_range=high_range,
        low_step=low_step,
        high_step=high_step,
        rule=rule,
    )
    acc = search.accumulator(dual_clip)
    acc.add(ratio, advantages, mask, weights)
    return acc.solve(search.rho0, group=group)
