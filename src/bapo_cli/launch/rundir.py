"""Run and sweep dirs that no two runs share, even when started in the same second.

Hydra's default `runs/<date>/<time>` is only as unique as the clock's second: two `bapo train`
started together (two terminals, a script, parallel sweeps) would write checkpoints, samples and
the MLflow spill journal into one directory. The CLI therefore claims the directory itself before
Hydra starts: `os.mkdir` either creates it or fails because it exists, atomically, so of several
processes racing for `<time>` exactly one gets it and the others move on to `<time>-1`, `<time>-2`,
...

An explicit `hydra.run.dir=` / `hydra.sweep.dir=` is used (that is how `trainer.resume=true`
finds an earlier run's checkpoints), but as the real path it names (`settle`): pre-flight resolves
it the way Hydra will (`${paths.output_root}/../x`, `${oc.env:PWD}/x`, `${now:...}`), then
`os.path.realpath` undoes `..`, `.` and symlinks, the check below runs on that path and Hydra is
handed that very path, so no spelling reaches a dir the check did not see. A sweep's job dirs
(`<sweep dir>/<hydra.sweep.subdir>`) are checked the same way; pre-flight has already refused
two jobs sharing one (bapo_cli.config.preflight.distinct_job_dirs).

- `bapo train` into a dir that already holds a run (`RUN_MARKERS`) is refused unless it resumes:
  a second run there would overwrite the first one's checkpoints and `.hydra/` and append to its
  `samples.jsonl`.
- `bapo eval` has no resume; it refuses a dir that holds a run, an earlier evaluation or a
  checkpoint (`EVAL_MARKERS`) unless `--allow-existing-dir`. Even then it never replaces a
  training run's `samples.jsonl` and never writes into another run's `.hydra/`: Hydra's record of
  the evaluation goes to a fresh `.hydra-eval` (`-1`, `-2`, ...) beside it.

Run and sweep dirs are created private (0700, `PRIVATE_DIR`): Hydra's copies of the config and
the overrides (`.hydra/*.yaml`, `multirun.yaml`) keep secrets as typed, and nobody else on the
machine may read them (the files inside are made 0600 as well: `bapo_cli.launch.jobs`).
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import Any

from bapo_cli.config.hydra_runner import quote

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
# what a run (or a sweep) leaves in its dir: Hydra's record, checkpoints, samples
RUN_MARKERS = (".hydra", "checkpoints", "samples.jsonl", "multirun.yaml")
# what bapo eval may not write among either: an earlier evaluation's or a training run's files,
# and a model or checkpoint (bapo_cli.trainer.checkpoint, bapo_cli.models.lora)
EVAL_MARKERS = RUN_MARKERS + (
    "results.json",
    "eval.log",
    "train.log",
    "COMPLETE",
    "trainer_state.pt",
    "config.json",
    "model.safetensors",
    "adapter_config.json",
    "adapter_model.safetensors",
)
ALLOW_EXISTING = "--allow-existing-dir"


class RunDirError(Exception):
    """A run dir that may not be used; `str()` is the one line shown to the user."""


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


def holds_a_run(path: Path, markers: tuple[str, ...] = RUN_MARKERS) -> list[str]:
    """What in `path` shows a run was there (`markers`, also in a sweep's job dirs)."""
    if not path.is_dir():
        return []
    found = [m for m in markers if (path / m).exists()]
    jobs = sorted(p.parent.name for p in path.glob("*/.hydra"))  # a sweep's job dirs
    return found + [f"{job}/.hydra" for job in jobs[:3]]


def reuse_error(key: str, path: Path, resume: bool, named: str | None = None) -> str | None:
    """One line when `path` (named by `key=`, spelled `named` on the command line) already holds
    a run and this one does not resume it, else None."""
    found = holds_a_run(path)
    if resume or not found:
        return None
    return (
        f"{_shown(key, path, named)} already holds a run ({', '.join(found)}); add "
        f"trainer.resume=true to continue it, or choose a new {key} (or drop it: each run gets "
        "a fresh dir)"
    )


def eval_reuse_error(
    key: str, path: Path, allow: bool, named: str | None = None, sweep: bool = False
) -> str | None:
    """One line when bapo eval may not write into `path`, else None: it holds a run, an
    evaluation or a checkpoint (`EVAL_MARKERS`) and `--allow-existing-dir` is not given; or,
    switch or not, it holds what the evaluation would replace and is not an earlier
    evaluation's: a training run's samples.jsonl, another sweep's multirun.yaml (`sweep`)."""
    found = holds_a_run(path, EVAL_MARKERS)
    shown = _shown(key, path, named)
    fresh = f"choose a new {key} (or drop it: each run gets a fresh dir)"
    if found and not allow:
        return (
            f"{shown} already holds a run or a checkpoint ({', '.join(found)}); bapo eval "
            f"writes there only with {ALLOW_EXISTING} (results.json, samples.jsonl and eval.log "
            f"beside what is there), or {fresh}"
        )
    if (path / "samples.jsonl").exists() and not (path / "results.json").exists():
        return (
            f"{shown} holds a training run's samples.jsonl, which bapo eval would replace (even "
            f"with {ALLOW_EXISTING}); {fresh}"
        )
    if sweep and (path / "multirun.yaml").exists():
        return (
            f"{shown} holds another sweep's multirun.yaml, which this sweep would replace (even "
            f"with {ALLOW_EXISTING}); {fresh}"
        )
    return None


def _shown(key: str, path: Path, named: str | None) -> str:
    """`hydra.run.dir=<as typed>`, and the real path when the spelling differs from it."""
    named = str(path) if named is None else named
    return f"{key}={named}" + ("" if named == str(path) else f" (that is {path})")


def settle(checked: Any, multirun: bool, allow_existing: bool = False) -> Path:
    """Decide, check and pin where Hydra writes this run (sweep); `checked` is the CLI's
    pre-flight (bapo_cli.config.preflight.Preflight), its overrides completed in place.

    No `hydra.run.dir=` / `hydra.sweep.dir=` on the command line: a fresh `<time>[-N]` dir is
    claimed. Else the one named, as a real path: checked (`reuse_error`; bapo eval:
    `eval_reuse_error`), created private and handed to Hydra as that path. A sweep's job dirs
    are checked the same way. Returns the run (sweep) dir; raises RunDirError."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    named = _named(checked.overrides, key)
    if named is None:
        kind = "sweeps" if multirun else "runs"
        out = claim_timestamped(Path(checked.config.paths.output_root), kind)
        checked.overrides.append(f"{key}={quote(str(out))}")
    else:
        out = Path(os.path.realpath(checked.dirs.output))
        if out.exists() and not out.is_dir():
            shown = _shown(key, out, named[1])
            raise RunDirError(f"{shown} is not a directory; choose a new {key}")
        _check(checked, allow_existing, key, out, named[1], sweep=multirun)
        checked.overrides[named[0]] = f"{key}={quote(str(out))}"  # Hydra writes where checked
    jobs = [out] if not multirun else []
    for num, sub in enumerate(checked.dirs.subdirs or []):  # None: a run, or sampled jobs
        job = Path(os.path.realpath(os.path.join(out, sub)))
        if job != out:
            _check(checked, allow_existing, "hydra.sweep.subdir", job, sub, job=num)
        jobs.append(job)
    if named is not None:
        create_private(out)
    if getattr(checked.config, "trainer", None) is None and allow_existing:
        _own_record(checked, jobs)
    return out


def _check(
    checked: Any,
    allow_existing: bool,
    key: str,
    path: Path,
    named: str,
    sweep: bool = False,
    job: int | None = None,
) -> None:
    trainer = getattr(checked.config, "trainer", None)  # bapo eval has none
    if trainer is not None:
        line = reuse_error(key, path, trainer.resume, named)
    else:
        line = eval_reuse_error(key, path, allow_existing, named, sweep)
    if line is not None:
        raise RunDirError(line if job is None else f"job {job}: {line}")


def _named(overrides: list[str], key: str) -> tuple[int, str] | None:
    """(index, value as typed) of the last override that names `key`, else None."""
    for i in range(len(overrides) - 1, -1, -1):
        name, sep, value = overrides[i].partition("=")
        if sep and name.lstrip("+") == key:
            return i, value
    return None


def _own_record(checked: Any, job_dirs: list[Path]) -> None:
    """bapo eval --allow-existing-dir: where a dir already holds Hydra's record (`.hydra/`) of
    another run, this evaluation's goes to the first `.hydra-eval[-N]` free in every job dir."""
    record = checked.dirs.record
    if record is None or not any((d / record).exists() for d in job_dirs):
        return
    base, taken = f"{record}-eval", 0
    name = base
    while any((d / name).exists() for d in job_dirs):
        taken += 1
        name = f"{base}-{taken}"
    line = f"hydra.output_subdir={quote(name)}"
    typed = _named(checked.overrides, "hydra.output_subdir")
    if typed is None:
        checked.overrides.append(line)
    else:
        checked.overrides[typed[0]] = line


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
