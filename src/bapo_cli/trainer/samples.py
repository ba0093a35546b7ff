"""samples.jsonl in the run dir: the first `trainer.log_samples` samples of each step, one JSON
row each (rank 0 writes; data-parallel: of the ranks' batches in rank order), and on resume the
rows of steps after the checkpoint's dropped."""

from __future__ import annotations

import json
from pathlib import Path

from bapo_cli.rollout.base import Sample

__all__ = ["append_rows", "sample_rows", "trim_samples"]


def trim_samples(path: Path, step: int) -> None:
    """On resume: drop the rows of steps after the checkpoint's (written by steps a stop or a
    crash left unsaved), so that the resumed run writes each step's samples once."""
    if not path.exists():
        return
    with path.open(encoding="utf-8") as f:
        lines = f.readlines()
    kept = [line for line in lines if _sample_step(line) <= step]
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    tmp.replace(path)


def _sample_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 0  # not a row of ours: kept


def sample_rows(step: int, batch: list[Sample], count: int) -> list[dict]:
    """The rows of a step's first `count` samples (of this rank's batch)."""
    return [
        {
            "step": step,
            "id": getattr(s.problem, "id", None),
            "group": s.group,  # the prompt group: unique per prompt drawn in this run (all ranks)
            "prompt": getattr(s.problem, "question", None),
            "response": s.text,
            "reward": s.reward,
            "versions": [min(s.versions, default=0), max(s.versions, default=0)],
        }
        for s in batch[: max(count, 0)]
    ]


def append_rows(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with path.open("a", encoding="utf-8") as f:
        for record in rows:
            f.write(json.dumps(record) + "\n")
