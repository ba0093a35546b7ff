"""BAPO's Algorithm 1 as the paper writes it: the per-bin sums (`BoundAccumulator`, the
`PathAccumulator` of rule "paper") and the walk along the path (`walk`). The semantics, choices
and how the one pass works: `bounds`."""

from __future__ import annotations

from typing import Any

import torch

from bapo_cli.algos.bapo_locator import Locator, bin_sums, build_locator, keyed_inputs
from bapo_cli.algos.bapo_path import (
    PAPER,
    BapoBounds,
    BoundPath,
    PathAccumulator,
    check_rho0,
    rho_from_sums,
)


def rho_curve(path: BoundPath, sums: list[float]) -> tuple[list[float], list[float], bool]:
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


def walk(path: BoundPath, sums: list[float], rho0: float) -> BapoBounds:
    """Walk Algorithm 1 on the per-bin sums."""
    pos_at, neg_at, changes = rho_curve(path, sums)
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


class BoundAccumulator(PathAccumulator, rule="paper"):
    """Additive per-path-point sums, so micro-batches and ranks can be solved once together.

    >>> acc = BoundAccumulator()                       # paper ranges and steps
    >>> for ratio, adv, mask in micro_batches:         # doctest: +SKIP
    ...     acc.add(ratio, adv, mask)                  # no host sync
    >>> bounds = acc.solve(rho0=0.4, group=dist.group.WORLD)  # doctest: +SKIP

    `add` bins each token's mass by the path point where it changes activity (one table look-up
    and one `bin_sums`, no host sync) into a float64 vector of length K + 3. `solve`
    optionally all-reduces that vector over `group` and reads it to the host once. Every rank
    must call `solve` with the same group (and `add` at least once, even with an empty mask, so
    the vector lives on the rank's device).
    """

    def _locator(self, dtype: torch.dtype, device: torch.device) -> Locator:
        path = self.path
        return build_locator(path.low_values, path.high_values, self.dual_clip, dtype, device)

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
        key, m, _ = keyed_inputs(ratio, advantages, mask, weights)
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
        bins = bin_sums(count, mass, size)
        if self._sums is None:
            self._sums = torch.zeros_like(bins, dtype=torch.float64)
        self._sums.add_(bins)

    def solve(self, rho0: float = PAPER.rho0, group: Any = None) -> BapoBounds:
        """Choose the bounds from everything added so far (one all-reduce, one host read).

        group: a torch.distributed process group (e.g. ``torch.distributed.group.WORLD``) over
        which to sum the vectors first; None = this process only.
        """
        rho0 = check_rho0(rho0)
        return walk(self.path, self._host_sums(group), rho0)

    def _host_sums(self, group: Any) -> list[float]:
        """All-reduce (optional) and read the sums to the host: the one sync of the search."""
        return self._host_values(group)[self._lead :]

    def rho_along_path(self, group: Any = None) -> list[float]:
        """rho at every path point (K numbers, one host read): for logging the curve or checking
        it. Non-decreasing up to float rounding."""
        pos_at, neg_at, _ = rho_curve(self.path, self._host_sums(group))
        n_h = self.path.n_high
        return [
            rho_from_sums(pos_at[min(k, n_h)], neg_at[max(0, k - n_h)])
            for k in range(len(self.path))
        ]
