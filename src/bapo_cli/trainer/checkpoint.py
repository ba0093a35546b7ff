"""Checkpoints that survive a kill: HF-format weights + tokenizer + the trainer's state, atomically.

Layout: `<run_dir>/checkpoints/step_000010/` holds `model.safetensors`, `config.json`, the
tokenizer files (loadable by transformers and vLLM as they are) and `trainer_state.pt` (optimizer,
scheduler, RNG states, step, policy version, the staleness regime's buffers, the data position,
the MLflow run id). A checkpoint is written into `step_000010.tmp/` and renamed when complete, and
`COMPLETE` is written last, so a kill mid-write never leaves a half checkpoint under a final name;
`latest()` ignores anything without the marker.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

MARKER = "COMPLETE"
STATE_FILE = "trainer_state.pt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names it and why."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def save(
    root: Path,
    step: int,
    model: Any,
    tokenizer: Any,
    state: dict[str, Any],
    weights: dict[str, Any] | None = None,  # a full state dict gathered from shards (FSDP2)
) -> Path:
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    torch.save(state, tmp / STATE_FILE)
    (tmp / MARKER).write_text(str(step))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    if not root.is_dir():
        return None
    done = [p for p in root.glob("step_*") if p.is_dir() and (p / MARKER).is_file()]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def latest_usable(root: Path, warn: Any = print) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete checkpoint whose files load, with its trainer state.

    A checkpoint that is complete but unreadable (a disk fault, a foreign file) is reported via
    `warn` and skipped: resume falls back to the one before it."""
    if not root.is_dir():
        return None
    done = sorted(
        (p for p in root.glob("step_*") if p.is_dir() and (p / MARKER).is_file()),
        key=lambda p: int(p.name.split("_")[1]),
        reverse=True,
    )
    for path in done:
        try:
            if not (path / "config.json").is_file():
                raise CheckpointError(f"checkpoint {path} has no config.json")
            return path, load_state(path)
        except CheckpointError as err:
            warn(f"skipping unusable checkpoint: {err}")
    return None


def load_state(directory: Path) -> dict[str, Any]:
    path = directory / STATE_FILE
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # truncated or foreign file
        raise CheckpointError(
            f"checkpoint {directory} is unreadable ({exc.__class__.__name__})"
        ) from None


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
