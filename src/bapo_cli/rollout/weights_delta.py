"""Delta pushes for the filesystem transport (`staleness.weights_delta=true`): a version holds
only what changed since the version before it, in the dtype the servers compute in.

An RL step at the learning rates LLM recipes use (about 1e-6) moves most bf16 weights by less
than their rounding step, so most elements of the serving copy do not change between versions
(issue 47, measured in docs/benchmarks.md). A delta version stores, per tensor, nothing when no
element changed, its changed elements as 2-byte gaps between their flat positions + their values
(`sparse`) when that is fewer bytes, else the whole tensor. Changed means another bit pattern, so
applying a delta to the version before it gives the new version bit for bit (-0.0, NaN
included). The 2-byte gaps were chosen by measurement over 4-byte indices: 4 bytes per changed
bf16 element instead of 6 (docs/benchmarks.md#delta-pushes).

    step_00000007/  model.safetensors  STABLE {"version": 7, ...}                  a full version
    step_00000008/  delta.safetensors  STABLE {"version": 8, "kind": "delta", "base": 7, ...}

A server holding version h is sent the chain h+1..v (`chain`); one that holds none of it (it
came back, or restarted) the newest full version and the deltas after it. The trainer writes a
full version every `full_every` versions, whenever a server came back since the last one, at
the start (a new run and a resumed one: nothing is known of what the servers hold) and whenever
a delta would move as many bytes as the full version (`VersionWriter.write`).

This module runs on both sides (the trainer writes, the vLLM worker applies) and so imports
neither the trainer nor vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from bapo_cli.rollout import weights_fs

GAP, VAL = "::gap", "::val"  # a sparse tensor's two entries in a delta file
STRIDE = 2**16 - 1  # the largest gap two bytes hold
LARGER = "a delta would not be fewer bytes"  # why a version is written full (`VersionWriter`)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, flat (equal bits: equal values, -0.0 and NaN told apart);
    shares `t`'s memory (a contiguous `t`)."""
    return t.reshape(-1).view(_BITS[t.element_size()])


def encode(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The delta from `old` to `new` (same names, shapes and dtypes): per tensor nothing, its
    changed elements as `NAME::gap` + `NAME::val` (`sparse`), or `NAME` whole, whichever is
    fewest bytes.

    In numpy over the bit patterns' views (no copy of a tensor): its `!=`, `count_nonzero` and
    `flatnonzero` are 3-10x faster than torch's bool `sum` and `nonzero` on one CPU thread
    (docs/benchmarks.md#delta-pushes)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in new.items():
        now = _bits(t).numpy()
        moved = _bits(old[name]).numpy() != now
        count = int(np.count_nonzero(moved))
        if count == 0:
            continue
        entries = count + -(-t.numel() // STRIDE)  # at most: the STRIDE-th positions join
        if entries * (2 + t.element_size()) >= t.numel() * t.element_size():
            out[name] = t  # whole: found by counting (most elements' positions would be large)
            continue
        gaps, positions = sparse(moved)
        out[name + GAP] = torch.from_numpy(gaps)
        out[name + VAL] = torch.from_numpy(now[positions]).view(t.dtype)
    return out


def sparse(moved: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The positions `moved` (flat bool) marks as 2-byte gaps between them (their uint16 bits
    as int16), and the positions. Every STRIDE-th position joins them (with its new value,
    changed or not), so no gap exceeds what two bytes hold, for one entry per STRIDE elements;
    marked in the mask, so the positions come out sorted without a sort. `moved` is changed."""
    moved[::STRIDE] = True
    positions = np.flatnonzero(moved)  # position 0 first: its gap is 0
    gaps = np.empty(positions.size, np.uint16)
    gaps[0] = 0
    np.subtract(positions[1:], positions[:-1], out=gaps[1:], casting="unsafe")  # each <= STRIDE
    return gaps.view(np.int16), positions


def positions_of(gaps: torch.Tensor) -> np.ndarray:
    return np.cumsum(gaps.numpy().view(np.uint16), dtype=np.int64)


def apply(held: dict[str, torch.Tensor], delta: Mapping[str, torch.Tensor]) -> list[str]:
    """Apply `delta` to `held` in place (its tensors are overwritten, or replaced by the delta's
    whole ones, taken and not copied: a delta read from its file is the caller's own); the
    names of the tensors it changed."""
    changed = []
    for key, t in delta.items():
        if key.endswith(VAL):
            continue
        if key.endswith(GAP):
            name = key[: -len(GAP)]
            into = held[name]
            if not into.is_contiguous():  # the write below must land in `held`, not in a copy
                into = held[name] = into.contiguous()
            _bits(into).numpy()[positions_of(t)] = _bits(delta[name + VAL]).numpy()
        else:
            name = key
            if held[name].shape != t.shape or held[name].dtype != t.dtype:
                raise weights_fs.WeightsDirError(f"a delta's {name} does not fit the held tensor")
            held[name] = t
        changed.append(name)
    return changed


def nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def read(directory: Path | str) -> dict[str, torch.Tensor]:
    """A delta version's tensors (whole: a delta is small)."""
    with safe_open(str(Path(directory) / weights_fs.DELTA), framework="pt", device="cpu") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (keys(), not iteration)


def serving_dtype(dtypes: Sequence[str | None]) -> torch.dtype | None:
    """The dtype every server computes in (their `bapo_model_info`), None unless they agree."""
    found = {getattr(torch, d, None) for d in dtypes}
    one = found.pop() if len(found) == 1 else None
    return one if isinstance(one, torch.dtype) else None


def chain(held: int | None, target: int, kinds: Mapping[int, tuple[str, int | None]]) -> list[int]:
    """The versions to load, in order, to take a server holding `held` (None: unknown) to
    `target`; `kinds` maps each version on disk to (kind, base). From `held` when every version
    after it is on disk and each delta's base is the one before it; else from the newest full
    version at or below `target`; [] when `held` is `target`. WeightsDirError when no full
    version starts a chain to `target`."""
    if held == target:
        return []
    start = None
    for v in range(target, -1, -1):
        kind, base = kinds.get(v, (None, None))
        if kind is None:
            break
        if kind != "delta":
            start = v
            break
        if base != v - 1:
            break
        if held is not None and v - 1 == held:
            return list(range(v, target + 1))
    if start is None:
        raise weights_fs.WeightsDirError(
            f"no full weights version starts a chain of deltas to version {target}"
        )
    return list(range(start, target + 1))


def kinds_on_disk(root: Path | str) -> dict[int, tuple[str, int | None]]:
    """(kind, base) of every complete version under `root` (a full version's base is None)."""
    out = {}
    for v in weights_fs.versions(root):
        try:
            marker = weights_fs.read_marker(weights_fs.version_dir(root, v))
        except weights_fs.WeightsDirError:
            continue
        kind = str(marker.get("kind", "full"))
        out[v] = (kind, int(marker["base"]) if kind == "delta" else None)
    return out


@dataclass(frozen=True)
class Written:
    """One version as written: its directory, whether it is a delta, the bytes of its tensor
    file, the bytes a full version would have taken, why it is full (None for a delta), and a
    line for the console when the choice by bytes turned (`VersionWriter.write`)."""

    directory: Path
    delta: bool
    bytes: int
    full_bytes: int
    why_full: str | None = None
    note: str | None = None


@dataclass
class VersionWriter:
    """The trainer's side: writes each version full or as a delta against the one before it
    (module docstring), keeping that version's tensors in the serving dtype to diff against.

    `dtype`: the servers' (None: the trainer's tensors as they are); `delta` False writes every
    version full, as `weights_fs.write_version` does. `pool`: the ServerPool pushed to; its
    servers keep what they load (to apply the next delta to), and a server that came back
    (`pool.revivals`) makes the next version full. `metrics`: the last version's bytes written
    and its kind (`servers/push_bytes`, `servers/push_delta`, `servers/push_full`; the trainer
    sums them over the versions of a step)."""

    delta: bool = False
    full_every: int = 10
    pool: Any = None
    dtype: torch.dtype | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    _held: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    _version: int | None = None
    _since_full: int = 0
    _force_full: str | None = None
    _revivals: int = 0
    _larger: bool = False  # the last delta encoded was not fewer bytes than the full version

    def __post_init__(self) -> None:
        if self.pool is not None:
            self.pool.keep_held = self.delta

    def force_full(self, why: str) -> None:
        """The next version is written full (a server came back: it loads that one)."""
        self._force_full = why

    def write(
        self, named: Iterable[tuple[str, torch.Tensor]], root: Path | str, version: int
    ) -> Written:
        revivals = getattr(self.pool, "revivals", 0)
        if revivals > self._revivals:
            self._revivals = revivals
            self.force_full("a server came back")
        tensors = weights_fs.gather(named)
        if self.dtype is not None or self.delta:  # a copy: the next version is diffed against it
            tensors = {n: t.to(self.dtype or t.dtype, copy=True) for n, t in tensors.items()}
        full_bytes = nbytes(tensors)
        why = self._why_full(tensors, version)
        delta: dict[str, torch.Tensor] = {}
        note = None
        if why is None:
            delta = encode(self._held or {}, tensors)
            share = nbytes(delta) / max(full_bytes, 1)
            if share >= 1:
                why = LARGER
            note = self._turned(version, share, why is None)
        fp = weights_fs.fingerprint(tensors.items())
        marker = {"tensors": len(tensors), "fingerprint": fp, "full_bytes": full_bytes}
        if why is None:
            marker.update(kind="delta", base=version - 1)
            directory = weights_fs.commit(root, version, weights_fs.DELTA, delta, marker)
            self._since_full += 1
        else:
            directory = weights_fs.commit(root, version, weights_fs.WEIGHTS, tensors, marker)
            self._since_full, self._force_full = 0, None
        if self.delta:
            self._held, self._version = tensors, version
        written = nbytes(tensors) if why is not None else nbytes(delta)
        self.metrics = {
            "push_bytes": float(written),
            "push_delta": float(why is None),
            "push_full": float(why is not None),
        }
        return Written(directory, why is None, written, full_bytes, why, note)

    def _turned(self, version: int, share: float, as_delta: bool) -> str | None:
        """A line when the choice by bytes turns (not every version: at lr 1e-4 in bf16 every
        delta is larger): the first version written full because its delta would not be fewer
        bytes, and the first delta after such ones."""
        turned, self._larger = as_delta == self._larger, not as_delta
        if not turned:
            return None
        if as_delta:
            return f"weights: version {version} written as a delta again ({share:.0%} of the bytes)"
        return (
            f"weights: version {version} written full: its delta would be {share:.0%} of the "
            "full version's bytes (versions are written full until a delta is fewer bytes)"
        )

    def _why_full(self, tensors: Mapping[str, torch.Tensor], version: int) -> str | None:
        if not self.delta:
            return "delta pushes are off"
        if self._held is None or self._version != version - 1:
            return "the start (what the servers hold is not known)"
        if self._force_full is not None:
            return self._force_full
        if self._since_full + 1 >= self.full_every:
            return f"a full version every {self.full_every}"
        held = self._held
        if held.keys() != tensors.keys() or any(
            held[n].shape != t.shape or held[n].dtype != t.dtype for n, t in tensors.items()
        ):
            return "the tensors' names, shapes or dtypes changed"
        return None
