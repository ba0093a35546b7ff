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

    rho(c_low, c_high) = P / (P + N),   P = sum_{A>0, r<c_high} w r |A|,  N = sum_{A<0, r>c_low} w r |A|

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
get P and N at every point from cumulative sums. That is one pass over the tokens for the whole
path, two K-length vectors, and one host read in `solve` -- instead of one pass and one `.item()`
per path step. Micro-batches (gradient accumulation) add their vectors; data-parallel ranks
all-reduce them, so every rank gets the same bounds, equal to one process on the whole batch.

Choices (the README section "How BAPO is implemented" states them for users)
-----------------------------------------------------------------------------
* rho counts gradient-carrying tokens only, with strict inequalities (r < c_high, r > c_low),
  compared in the ratio's dtype against the path values cast to that dtype. The losses in
  `losses.py` use the very same comparisons, so the searched active set is the trained one.
* Path values are ``a + k * step`` in float64 (never accumulated sums), rounded to 12 significant
  digits and clamped to b; the number of steps is ``floor((b - a) / step + 1e-9)`` so that
  1.2 + 36 * 0.05 counts as <= 3.0.
* The loop guard is literal: when the low range admits no step (a_low == b_low) there is no path
  beyond point 0, not even c_high steps. To adapt only c_high keep the low range one step wide.
* rho := 1 when no token carries mass (0/0: nothing to balance).
* If no mass-carrying token changes activity anywhere on the path (on-policy data, r == 1, is the
  common case), rho is constant and walking the path would not change the loss: steps = 0.
* Mass is w * r * |A| with r detached; w = 1 unless `weights` is given (the paper's Eq. 8 uses
  w = pi_rollout(y_t); `losses.bapo_loss(weighting="rollout_prob")`). Weights must be >= 0.
* Tokens whose ratio, advantage or weight is not finite are left out of the sums.

How it differs from the public reference recipe: the recipe measures each clipped token at its
clipped value (so raising c_low *adds* negative mass), searches c_low first, uses a pos/neg ratio
instead of a share, and searches per micro-batch. Here: gradient-carrying tokens only, c_high
first, a share, and per optimizer step over the whole mini-batch and all ranks (per micro-batch is
still available as the cheaper approximation: call `adaptive_bounds` on each micro-batch).

Run it: ``bapo train algo=bapo``; use it from another trainer: see docs/how-bapo-is-implemented.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "BapoBounds",
    "BoundAccumulator",
    "BoundPath",
    "adaptive_bounds",
    "rho_from_sums",
]

# A path longer than this is a configuration mistake (e.g. a step of 1e-9), not a search.
MAX_PATH_POINTS = 100_000
# Tolerance in units of one step when counting how many steps fit into a range.
STEP_TOLERANCE = 1e-9


@dataclass(frozen=True)
class BapoBounds:
    """Result of the search; plain Python numbers, ready to log or to pass to `bapo_loss`.

    c_low, c_high: the chosen bounds. rho_before: rho at the start point (a_low, a_high).
    rho: rho at the chosen point. steps: path steps taken (0 = start point).
    """

    c_low: float
    c_high: float
    rho_before: float
    rho: float
    steps: int


def _check_range(name: str, value: Any) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair (min, max) of numbers, got {value!r}") from None
    if not (0.0 < lo <= hi < math.inf):
        raise ValueError(f"{name} must satisfy 0 < min <= max < inf, got ({lo}, {hi})")
    return lo, hi


def _check_step(name: str, value: Any) -> float:
    step = float(value)
    if not (0.0 < step < math.inf):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return step


def check_rho0(rho0: Any) -> float:
    """Validate the target share; raise a ValueError naming `rho0`."""
    value = float(rho0)
    if not (0.0 <= value <= 1.0):
        raise ValueError(f"rho0 must lie in [0, 1], got {rho0!r}")
    return value


def _n_steps(name: str, lo: float, hi: float, step: float) -> int:
    n = math.floor((hi - lo) / step + STEP_TOLERANCE)
    if n >= MAX_PATH_POINTS:
        raise ValueError(f"{name} is too small: the path would have {n} points on this range")
    return n


def _path_value(start: float, k: int, step: float, stop: float) -> float:
    """start + k * step in float64 (never an accumulated sum), rounded to 12 significant digits
    (0.6 + 15 * 0.02 is 0.9, not 0.8999999999999999) and clamped to the range's max."""
    return min(float(f"{start + k * step:.12g}"), stop)


@dataclass(frozen=True)
class BoundPath:
    """The fixed path of Algorithm 1: point 0, then n_high c_high steps, then n_low c_low steps.

    `high_values[i]` is c_high after i c_high steps, `low_values[j]` is c_low after j c_low steps;
    path point k is (low_values[max(0, k - n_high)], high_values[min(k, n_high)]).
    """

    high_values: tuple[float, ...]
    low_values: tuple[float, ...]

    @classmethod
    def build(
        cls,
        low_range: Sequence[float] = (0.6, 0.9),
        high_range: Sequence[float] = (1.2, 3.0),
        low_step: float = 0.02,
        high_step: float = 0.05,
    ) -> BoundPath:
        a_low, b_low = _check_range("low_range", low_range)
        a_high, b_high = _check_range("high_range", high_range)
        low_step = _check_step("low_step", low_step)
        high_step = _check_step("high_step", high_step)
        n_low = _n_steps("low_step", a_low, b_low, low_step)
        # Literal loop guard: no c_low step possible -> the loop never runs, c_high stays too.
        n_high = _n_steps("high_step", a_high, b_high, high_step) if n_low > 0 else 0
        high = tuple(_path_value(a_high, i, high_step, b_high) for i in range(n_high + 1))
        low = tuple(_path_value(a_low, j, low_step, b_low) for j in range(n_low + 1))
        return cls(high_values=high, low_values=low)

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
        return self.low_values[max(0, k - self.n_high)], self.high_values[min(k, self.n_high)]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; float32 and narrower dtypes are compared in float32 (exact: every
    bfloat16/float16 value and every path value rounded to them is a float32 value)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rho_from_sums(pos: float, neg: float) -> float:
    """rho = P / (P + N), with the convention rho = 1 when no token carries mass (0/0)."""
    total = pos + neg
    return pos / total if total > 0 else 1.0


def _solve(path: BoundPath, sums: list[float], rho0: float) -> BapoBounds:
    """Walk Algorithm 1 on the per-bin sums (host side, K + 3 numbers; touches no token).

    Layout of `sums` (see `BoundAccumulator.add`): index n_low + 1 - x holds the negatives with
    exit index x in [0, n_low + 1]; index n_low + 2 + e holds the positives with entry index e in
    [0, n_high + 1]. x = #{j: low_j < r} (active while the c_low index j < x); e = #{i: high_i <=
    r} (active from the c_high index e on; e = n_high + 1: never).
    """
    n_h, n_l = path.n_high, path.n_low
    neg_bins = sums[n_l + 1 :: -1][: n_l + 2]  # neg_bins[x]
    pos_bins = sums[n_l + 2 :]  # pos_bins[e]
    # P after i c_high steps: positives that entered at or before i.
    pos_at, acc = [], 0.0
    for v in pos_bins[: n_h + 1]:
        acc += v
        pos_at.append(acc)
    # N after j c_low steps: negatives whose exit index is > j.
    neg_at, acc = [0.0] * (n_l + 1), 0.0
    for j in range(n_l, -1, -1):
        acc += neg_bins[j + 1]
        neg_at[j] = acc

    def rho_at(k: int) -> float:
        return rho_from_sums(pos_at[min(k, n_h)], neg_at[max(0, k - n_h)])

    rho_before = rho_at(0)
    # Does any mass-carrying token change activity strictly inside the path?
    changes = any(v != 0 for v in pos_bins[1 : n_h + 1]) or any(
        v != 0 for v in neg_bins[1 : n_l + 1]
    )
    k = 0
    if changes:  # otherwise rho (and the loss) is the same at every point: stay at the start
        last = len(path) - 1
        while k < last and rho_at(k) < rho0:
            k += 1
    c_low, c_high = path.point(k)
    return BapoBounds(c_low=c_low, c_high=c_high, rho_before=rho_before, rho=rho_at(k), steps=k)


def _check_same_shape(reference: str, tensors: dict[str, torch.Tensor | None]) -> None:
    shape = tensors[reference].shape
    for name, t in tensors.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


class BoundAccumulator:
    """Additive per-path-point sums, so micro-batches and ranks can be solved once together.

    >>> acc = BoundAccumulator()                       # paper ranges and steps
    >>> for ratio, adv, mask in micro_batches:         # doctest: +SKIP
    ...     acc.add(ratio, adv, mask)                  # no host sync
    >>> bounds = acc.solve(rho0=0.4, group=dist.group.WORLD)  # doctest: +SKIP

    `add` bins each token's mass by the path point where it changes activity (one bucketize and
    one bincount, no host sync) into a float64 vector of length K + 3. `solve`
    optionally all-reduces that vector over `group` and reads it to the host once. Every rank
    must call `solve` with the same group (and `add` at least once, even with an empty mask, so
    the vector lives on the rank's device).
    """

    def __init__(
        self,
        *,
        low_range: Sequence[float] = (0.6, 0.9),
        high_range: Sequence[float] = (1.2, 3.0),
        low_step: float = 0.02,
        high_step: float = 0.05,
    ) -> None:
        self.path = BoundPath.build(low_range, high_range, low_step, high_step)
        self._sums: torch.Tensor | None = None
        self._tables: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def _table(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """U = [-low_n, ..., -low_0, 0, high_0, ..., high_n]: the float64 path values rounded
        once to the ratio's dtype (as the loss rounds them), held in the compute dtype."""
        key = (dtype, device)
        if key not in self._tables:
            low = torch.tensor(self.path.low_values, dtype=torch.float64).to(dtype)
            high = torch.tensor(self.path.high_values, dtype=torch.float64).to(dtype)
            table = torch.cat([-low.flip(0), torch.zeros(1, dtype=dtype), high])
            self._tables[key] = table.to(compute_dtype(dtype)).to(device)
        return self._tables[key]

    def add(
        self,
        ratio: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> None:
        """Add one batch of tokens (any shape, all four tensors the same shape).

        ratio: r = pi_theta / pi_rollout (detached here); advantages: A; mask: nonzero = token
        counts; weights: optional w >= 0 per token. Tokens whose r, A or w is not finite (or
        whose product w * r * A overflows) are left out. No host sync.
        """
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
        m = r * adv  # signed w r A; |.| below
        if weights is not None:
            m = m * weights.detach().reshape(-1).to(cd)
        keep = keep & ((m - m) == 0)  # false for NaN/inf in r, A, w
        mass = torch.where(keep, m, 0.0).abs_()
        self.add_keyed(torch.copysign(r, adv), mass, ratio.dtype)

    def add_keyed(self, key: torch.Tensor, mass: torch.Tensor, dtype: torch.dtype) -> None:
        """Lower-level `add` for callers that already hold clean tensors (the BAPO loss).

        key = copysign(r, A) in `compute_dtype(dtype)` (+r for positive, -r for negative tokens),
        mass = w r |A| >= 0 and finite (0 for tokens that do not count), `dtype` = the ratio's
        dtype whose rounding of the path values is used.
        """
        table = self._table(dtype, key.device)
        # One binary search places every token on the path: for a negative token (key = -r)
        # count = #{j: -low_j <= -r} = #{j: low_j >= r}, i.e. n_low + 1 - (exit index); for a
        # positive token count = n_low + 2 + #{i: high_i <= r}, i.e. n_low + 2 + (entry index).
        # r == 0 lands on either side of the 0 separator, but then its mass is 0.
        count = torch.bucketize(key, table, right=True)
        bins = torch.bincount(count, weights=mass.double(), minlength=table.numel() + 1)
        if self._sums is None:
            self._sums = torch.zeros_like(bins, dtype=torch.float64)
        self._sums.add_(bins)

    def solve(self, rho0: float = 0.4, group: Any = None) -> BapoBounds:
        """Choose the bounds from everything added so far (one all-reduce, one host read).

        group: a torch.distributed process group (e.g. ``torch.distributed.group.WORLD``) over
        which to sum the vectors first; None = this process only.
        """
        rho0 = check_rho0(rho0)
        size = self.path.n_high + self.path.n_low + 4
        sums = self._sums if self._sums is not None else torch.zeros(size, dtype=torch.float64)
        if group is not None:
            import torch.distributed as dist

            sums = sums.clone()
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        return _solve(self.path, sums.tolist(), rho0)

    def reset(self) -> None:
        """Forget the added sums (start the next optimizer step)."""
        self._sums = None


def adaptive_bounds(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    rho0: float = 0.4,
    low_range: Sequence[float] = (0.6, 0.9),
    high_range: Sequence[float] = (1.2, 3.0),
    low_step: float = 0.02,
    high_step: float = 0.05,
    weights: torch.Tensor | None = None,
    group: Any = None,
) -> BapoBounds:
    """Algorithm 1 of the BAPO paper on one batch of tokens: one `add` and one `solve`.

    ratio, advantages, mask (and weights) have the same shape, e.g. [B, T]. Returns `BapoBounds`
    with Python numbers. See the module docstring for the exact semantics.
    """
    rho0 = check_rho0(rho0)
    acc = BoundAccumulator(
        low_range=low_range, high_range=high_range, low_step=low_step, high_step=high_step
    )
    acc.add(ratio, advantages, mask, weights)
    return acc.solve(rho0, group=group)
