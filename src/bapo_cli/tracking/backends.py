"""Which trackers a run logs to: `tracking.backends` (mlflow, wandb, tensorboard; several at once,
or none) turned into one `Tracker`, through a registry of backend names.

MLflow starts first when it is on, so that W&B can take the MLflow run's id: the two runs of one
`bapo train` then share an id, and a resume (which keeps one id, in the checkpoint) reopens both.
A backend that cannot start stops the run before any step, in one line naming that backend
(`start_failure`); the ones already started are ended as FAILED. W&B and TensorBoard are imported
only here, when a run asks for them: `bapo --help` and MLflow-only runs never load them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bapo_cli import redact
from bapo_cli.tracking.fanout import FanoutTracker
from bapo_cli.tracking.server import describe_failure
from bapo_cli.tracking.writer import MlflowTracker, NullTracker, Tracker

DISPLAY = {"mlflow": "MLflow", "wandb": "W&B", "tensorboard": "TensorBoard"}


class TrackerStartError(Exception):
    """A backend that did not start; `str()` is the one line `bapo train` prints."""

    def __init__(self, backend: str, message: str) -> None:
        super().__init__(message)
        self.backend = backend


def _mlflow(settings: Any, run_id: str | None, **common: Any) -> Tracker:
    return MlflowTracker(settings.uri, settings.experiment, run_id=run_id, **common)


def _wandb(settings: Any, run_id: str | None, **common: Any) -> Tracker:
    from bapo_cli.tracking.wandb_tracker import WandbTracker

    wb = settings.wandb
    return WandbTracker(
        project=wb.project or settings.experiment,
        entity=wb.entity,
        mode=wb.mode,
        run_id=run_id,
        **common,
    )


def _tensorboard(settings: Any, run_id: str | None, **common: Any) -> Tracker:
    from bapo_cli.tracking.tensorboard_tracker import TensorBoardTracker

    log_dir = settings.tensorboard.log_dir
    run_dir = common.get("run_dir")
    if log_dir is None and run_dir is None:
        raise ValueError("tracking.tensorboard.log_dir is needed when the run has no run dir")
    where = Path(log_dir) if log_dir is not None else Path(run_dir) / "tensorboard"
    return TensorBoardTracker(where, **common)


# name -> factory(settings, run_id, run_name=, tags=, run_dir=): the one list of backends
BACKENDS: dict[str, Callable[..., Tracker]] = {
    "mlflow": _mlflow,
    "wandb": _wandb,
    "tensorboard": _tensorboard,
}


def where(settings: Any, backend: str) -> str:
    """Where a backend logs, as shown to the user (credentials masked)."""
    if backend == "mlflow":
        return f"{redact.text(settings.uri)} experiment={settings.experiment}"
    if backend == "wandb":
        wb = settings.wandb
        project = f"{wb.entity}/" if wb.entity else ""
        return f"project={project}{wb.project or settings.experiment} mode={wb.mode or 'default'}"
    log_dir = settings.tensorboard.log_dir
    return f"log_dir={log_dir if log_dir is not None else '<run dir>/tensorboard'}"


def where_lines(settings: Any, run_id: str | None, run_dir: Path) -> list[str]:
    """What `bapo train` prints at the end about W&B and TensorBoard (MLflow's lines are the
    trainer's): where the run is and how to look at it."""
    lines = []
    if "wandb" in settings.backends:
        lines.append(f"W&B: {where(settings, 'wandb')}  run {run_id}")
        if (settings.wandb.mode or os.environ.get("WANDB_MODE")) == "offline":
            base = os.environ.get("WANDB_DIR") or run_dir
            lines.append(f"upload it: wandb sync {base}/wandb/offline-run-*-{run_id}")
    if "tensorboard" in settings.backends:
        log_dir = settings.tensorboard.log_dir or Path(run_dir) / "tensorboard"
        lines.append(f"TensorBoard: tensorboard --logdir {log_dir}")
    return lines


def make_tracker(
    settings: Any | None,
    *,
    run_name: str | None = None,
    run_id: str | None = None,
    tags: dict[str, str] | None = None,
    run_dir: Path | None = None,
) -> Tracker:
    """The tracker of a run's `tracking` config (`backends`, `uri`, `experiment`, `wandb`,
    `tensorboard`); `None` or no backends: a `NullTracker`. `run_id` reopens a run (a resume).
    Raises `TrackerStartError` when a backend other than MLflow cannot start, and MLflow's own
    error when MLflow cannot (`start_failure` words both)."""
    names = list(settings.backends) if settings is not None else []
    if not names:
        return NullTracker()
    order = sorted(names, key=lambda n: n != "mlflow")  # MLflow first: the others take its id
    started: list[Tracker] = []
    common = {"run_name": run_name, "tags": tags, "run_dir": run_dir}
    for name in order:
        try:
            started.append(BACKENDS[name](settings, run_id, **common))
        except Exception as exc:
            for tracker in started:
                tracker.close("FAILED")
            if name == "mlflow":
                raise
            raise TrackerStartError(
                name,
                f"cannot start the {DISPLAY[name]} run ({where(settings, name)}): "
                f"{describe_failure(exc)}",
            ) from exc
        run_id = run_id or started[-1].run_id
    return started[0] if len(started) == 1 else FanoutTracker(started)


def start_failure(settings: Any, err: BaseException, mlflow_hint: str) -> str:
    """The one line for a tracker that did not start: MLflow's names its URI and `mlflow_hint`
    (what to do), another backend's names the backend and where it logs."""
    if isinstance(err, TrackerStartError):
        others = [b for b in settings.backends if b != err.backend]
        return f"tracking: {err}; fix it, or leave it out: tracking.backends=[{','.join(others)}]"
    return (
        f"tracking: cannot start the MLflow run at {redact.text(settings.uri)} "
        f"({describe_failure(err)}); {mlflow_hint}"
    )
