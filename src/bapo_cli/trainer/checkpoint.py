"""Checkpoints that survive a kill, a full disk and a hostile file: HF-format weights + tokenizer +
the trainer's state.

Layout: `<run_dir>/checkpoints/step_000010/` holds `model.safetensors`, `config.json`, the
tokenizer files (loadable by transformers and vLLM as they are) and `trainer_state.pt` (optimizer,
scheduler, RNG states, step, policy version, the staleness regime's buffers, the data position,
the MLflow run id). Under LoRA (`model.lora.rank > 0`) the weights are the adapter's alone
(`adapter_config.json`, `adapter_model.safetensors`; the base stays where `model.path` points):
resume loads the base from there and the adapter from here; `bapo merge-lora` writes a plain model.

Atomic: a checkpoint is written into `step_000010.tmp-<pid>-<random>/` (no two writers share a
temporary), `COMPLETE` is written last and the directory is then renamed to its final name. Only
names matching `step_\\d{6}` that hold the marker count, so a kill mid-write never leaves a half
checkpoint under a final name, and leftovers (`*.tmp-*`, `step_foo`) are ignored. Re-saving a step
moves the old one aside (`step_000010.old-<pid>-<random>`), renames the new one in and only then
deletes the old one; a kill between the two renames is repaired by `recover` on the next resume
or save. `keep_last` prunes to the newest N (marker removed first, so a kill mid-delete leaves no
half checkpoint that looks complete). A full disk is one line (`DiskFullError`) and the
temporary is removed.

Safe to load: `trainer_state.pt` is read with `torch.load(weights_only=True)`, which builds only
tensors and plain containers and refuses every other global, so a crafted file cannot run code:
it is reported and skipped like a corrupt one. The trainer therefore stores plain data only: RNG
states as lists and tensors (`rng_state`), rollout samples as dicts
(`staleness.regimes.sample_state`). Plain dicts rather than
`torch.serialization.add_safe_globals` with our dataclasses: the file does not depend on class
paths, and what may be loaded stays torch's own allow-list.
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

# re-exported: train.py seeds through `checkpoint.seed_everything` (the generators' states are
# saved and restored here); the function lives in the ground-floor `bapo_cli.seeding`
from bapo_cli.seeding import seed_everything  # noqa: F401

MARKER = "COMPLETE"
# what says how to load the weights: a whole model's config, or a LoRA adapter's (model.lora)
WEIGHT_CONFIGS = ("config.json", "adapter_config.json")
STATE_FILE = "trainer_state.pt"
STEP_RE = re.compile(r"^step_(\d{6})$")
# a temporary being written (tmp) or a replaced checkpoint set aside (old), by process <pid>
_SIDE_RE = re.compile(r"^(step_\d{6})\.(tmp|old)-(\d+)-[0-9a-f]+$")
_NEARLY_FULL = 1 << 20  # bytes: a write that failed with less free than this ran out of space


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names it and why."""


class DiskFullError(RuntimeError):
    """A checkpoint could not be written for lack of space; the previous one is intact."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def complete(root: Path) -> list[Path]:
    """The complete checkpoints under `root` (`step_NNNNNN` with the marker), oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = STEP_RE.match(path.name)
        if match and path.is_dir() and (path / MARKER).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def save(
    root: Path,
    step: int,
    model: Any,
    tokenizer: Any,
    state: dict[str, Any],
    weights: dict[str, Any] | None = None,  # a full state dict gathered from shards (FSDP2)
    keep_last: int | None = None,  # then keep only the newest N complete checkpoints
) -> Path:
    final = step_dir(root, step)
    root.mkdir(parents=True, exist_ok=True)
    recover(root)
    _remove_leftovers(root)
    tmp = _side_name(final, "tmp")
    tmp.mkdir()
    try:
        model.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        with (tmp / STATE_FILE).open("wb") as f:  # closed on failure: a full disk's space back
            torch.save(state, f)
        (tmp / MARKER).write_text(str(step))
    except BaseException as exc:
        full = _out_of_space(exc, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if not full:
            raise
        previous = complete(root)
        kept = f"{previous[-1]} is intact" if previous else "none was written before"
        raise DiskFullError(
            f"disk full writing checkpoint step {step} in {root} "
            f"({_size(shutil.disk_usage(root).free)} free); the partial write was removed and "
            f"the previous checkpoint {kept}"
        ) from None
    try:
        _swap_in(tmp, final)
    except BaseException:  # interrupted between the renames: whichever is complete goes back
        recover(root)
        _remove_leftovers(root, mine=True)
        raise
    if keep_last is not None:
        prune(root, keep_last)
    return final


def _swap_in(tmp: Path, final: Path) -> None:
    """Rename the written temporary to its final name; a checkpoint already there (re-saved step)
    stays complete, set aside, until the new one is in place."""
    if not final.exists():
        tmp.rename(final)
        return
    aside = _side_name(final, "old")
    final.rename(aside)
    tmp.rename(final)
    shutil.rmtree(aside, ignore_errors=True)


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints; returns the deleted ones."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: must be >= 1")
    doomed = complete(root)[:-keep_last]
    for path in doomed:
        (path / MARKER).unlink(missing_ok=True)  # first: never a half-deleted "complete" one
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def recover(root: Path) -> None:
    """Put back a checkpoint a kill left under a side name: between the two renames of a re-save
    the step has no final dir, but the new one (complete temporary) or the old one (set aside)
    is whole. Tolerates other processes doing the same at once (ranks at start-up)."""
    if not root.is_dir():
        return
    sides: dict[str, dict[str, Path]] = {}
    for path in root.iterdir():
        match = _SIDE_RE.match(path.name)
        if match and (path / MARKER).is_file():
            sides.setdefault(match.group(1), {}).setdefault(match.group(2), path)
    for name, kinds in sides.items():
        if (root / name).exists():
            continue
        for kind in ("tmp", "old"):  # the newer write first
            if kind in kinds:
                try:
                    kinds[kind].rename(root / name)
                    break
                except OSError:  # renamed by another process meanwhile
                    continue


def _remove_leftovers(root: Path, mine: bool = False) -> None:
    """Temporaries and set-aside copies of processes that are gone (killed mid-save), or of this
    one (`mine`: an interrupted save); run after `recover`, and never the only whole copy."""
    for path in root.iterdir():
        match = _SIDE_RE.match(path.name)
        if not match:
            continue
        pid = int(match.group(3))
        gone = (mine and pid == os.getpid()) or not _alive(pid)
        if gone and ((root / match.group(1)).exists() or not (path / MARKER).is_file()):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _side_name(final: Path, kind: str) -> Path:
    return final.with_name(f"{final.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def _out_of_space(exc: BaseException, where: Path) -> bool:
    """Whether a failed write ran out of disk. torch and safetensors wrap the OSError in their
    own errors (or lose it: torch's zip writer reports 'unexpected pos'), so the message and the
    space left count too."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen) or "os error 28" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    if not isinstance(exc, Exception):  # KeyboardInterrupt and the like
        return False
    try:
        return shutil.disk_usage(where).free < _NEARLY_FULL
    except OSError:
        return False


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    done = complete(root)
    return done[-1] if done else None


def latest_usable(root: Path, warn: Any = print) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete checkpoint whose files load, with its trainer state; None if there is
    no complete checkpoint at all.

    A checkpoint that is complete but unreadable (a disk fault, a foreign or crafted file) is
    reported via `warn`, by name, and skipped: resume falls back to the one before it. When every
    one is unusable, CheckpointError: starting fresh over them is the user's call."""
    recover(root)
    done = complete(root)
    for path in reversed(done):
        try:
            if not any((path / name).is_file() for name in WEIGHT_CONFIGS):
                raise CheckpointError(
                    f"checkpoint {path} has no config.json (nor adapter_config.json)"
                )
            return path, load_state(path)
        except CheckpointError as err:
            warn(f"skipping unusable checkpoint: {err}")
    if done:
        names = ", ".join(p.name for p in done)
        raise CheckpointError(
            f"no usable checkpoint in {root} ({names}: unusable, see above); move them aside or "
            "resume in a new run dir to start fresh"
        )
    return None


def load_state(directory: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint: tensors and plain data only (weights_only=True), so
    loading never runs code from the file."""
    path = directory / STATE_FILE
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" not in str(exc):
            raise CheckpointError(
                f"checkpoint {directory} is unreadable ({exc.__class__.__name__})"
            ) from None
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f"a reference to {found.group(1)}" if found else "objects"
        raise CheckpointError(
            f"checkpoint {directory}: {STATE_FILE} holds {what}, not only tensors and plain "
            "data; refused without loading it (it could run code)"
        ) from None
    except Exception as exc:  # truncated or foreign file
        raise CheckpointError(
            f"checkpoint {directory} is unreadable ({exc.__class__.__name__})"
        ) from None


def rng_state() -> dict[str, Any]:
    """Every RNG's state as plain data and tensors (loadable with weights_only=True)."""
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    np.random.set_state(
        (
            npy["kind"],
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
