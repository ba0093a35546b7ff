"""Run and sweep dirs that no two runs share, even when started in the same second.

Hydra's default `runs/<date>/<time>` is only as unique as the clock's second: two `bapo train`
started together (two terminals, a script, parallel sweeps) would write checkpoints, samples and
the MLflow spill journal into one directory. The CLI therefore claims the directory itself before
Hydra starts: `os.mkdir` either creates it or fails because it exists, atomically, so of several
processes racing for `<time>` exactly one gets it and the others move on to `<time>-1`, `<time>-2`,
... An explicit `hydra.run.dir=` / `hydra.sweep.dir=` is used as given (that is how
`trainer.resume=true` finds an earlier run's checkpoints), but a `bapo train` into a dir that
already holds a run is refused unless it resumes (`reuse_error`): a second run there would
overwrite the first one's checkpoints and `.hydra/` and append to its `samples.jsonl`.

Run and sweep dirs are created private (0700, `PRIVATE_DIR`): Hydra's copies of the config and
the overrides (`.hydra/*.yaml`, `multirun.yaml`) keep secrets as typed, and nobody else on the
machine may read them (the files inside are made 0600 as well: `bapo_cli.launch.jobs`).
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
# what a run (or a sweep) leaves in its dir: Hydra's record, checkpoints, samples
RUN_MARKERS = (".hydra", "checkpoints", "samples.jsonl", "multirun.yaml")


def claim(base: Path) -> Path:
    """Create `base`, or else the first free `base-1`, `base-2`, ...; the one created is returned
    and no other caller (thread or process) gets the same."""
    base.parent.mkdir(parents=True, exist_ok=True)
    path, taken = base, 0
    while True:
        try:
            path.mkdir(mode=PRIVATE_DIR)
            return path
        except FileExistsError:
            taken += 1
            path = base.with_name(f"{base.name}-{taken}")


def claim_timestamped(output_root: Path, kind: str, now: datetime | None = None) -> Path:
    """A fresh `<output_root>/<kind>/<date>/<time>[-N]` (kind: runs or sweeps), created."""
    now = now or datetime.now()
    return claim(Path(output_root) / kind / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S"))


def holds_a_run(path: Path) -> list[str]:
    """What in `path` shows a run was there (`RUN_MARKERS`, also in a sweep's job dirs)."""
    if not path.is_dir():
        return []
    found = [m for m in RUN_MARKERS if (path / m).exists()]
    jobs = sorted(p.parent.name for p in path.glob("*/.hydra"))  # a sweep's job dirs
    return found + [f"{job}/.hydra" for job in jobs[:3]]


def reuse_error(key: str, path: Path, resume: bool) -> str | None:
    """One line when `path` (named by `key=`) already holds a run and this one does not resume
    it, else None."""
    found = holds_a_run(path)
    if resume or not found:
        return None
    return (
        f"{key}={path} already holds a run ({', '.join(found)}); add trainer.resume=true to "
        f"continue it, or choose a new {key} (or drop it: each run gets a fresh dir)"
    )


def create_private(path: Path) -> None:
    """Create a named run dir (and its parents) owner-only, if it does not exist yet."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=PRIVATE_DIR, exist_ok=True)


def make_private(paths: list[Path]) -> None:
    """Files that may hold secrets as typed (Hydra's `.hydra/*.yaml`, `multirun.yaml`) and
    the dirs that hold them: owner only (0600, dirs 0700). Missing ones are skipped."""
    for path in paths:
        try:
            os.chmod(path, PRIVATE_DIR if path.is_dir() else PRIVATE_FILE)
        except OSError:
            continue
