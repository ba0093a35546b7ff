"""Where each token changes activity along the bound path, in one table look-up (`Locator`),
and the clean (key, mass, weight) inputs both searches bin (`keyed_inputs`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from bapo_cli.algos.bapo_path import compute_dtype


def _check_same_shape(reference: str, tensors: dict[str, torch.Tensor | None]) -> None:
    shape = tensors[reference].shape
    for name, t in tensors.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


class Locator:
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

    def to(self, device: torch.device) -> Locator:
        out = Locator.__new__(Locator)
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
def build_locator(
    low_values: tuple[float, ...],
    high_values: tuple[float, ...],
    dual_clip: float | None,
    dtype: torch.dtype,
    device: torch.device,
) -> Locator:
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
    return Locator(torch.cat(parts)).to(device)


def bin_sums(count: torch.Tensor, values: torch.Tensor, size: int) -> torch.Tensor:
    """float64 sums of `values` per bin `count` (each in [0, size)), flat: what
    ``torch.bincount(count, weights=values.double(), minlength=size)`` gives (the same additions
    in the same order on the CPU), at a size fixed in advance: bincount reads its input's min
    and max to the host on CUDA, which would stall the device once per micro-batch."""
    out = torch.zeros(size, dtype=torch.float64, device=count.device)
    return out.index_add_(0, count.reshape(-1), values.reshape(-1).double())


def keyed_inputs(
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
