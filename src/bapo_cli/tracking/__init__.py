"""Tracking: writing a run (trainer, `bapo eval`) to MLflow, W&B and/or TensorBoard, reading runs
back from MLflow (`bapo runs`, and `bapo report`, which is `bapo_cli.report`) and tying a sweep's
runs together. One module per job:

- backends.py: `make_tracker`, the registry of backends (`tracking.backends`), start failures
- writer.py: `Tracker`, `NullTracker`, `BufferedTracker` (survives outages), `MlflowTracker`,
  `flatten`
- wandb_tracker.py, tensorboard_tracker.py: the other two backends (imported only when used)
- fanout.py: several backends at once
- spill.py: the on-disk journal of metrics waiting out a long outage, and the undelivered file
- server.py: fail-fast HTTP settings, run links hidden, one masked line per store error
- store.py: the store behind a URI, created under a file lock; experiments and artifact location
- reader.py: `list_runs` for `bapo runs`; `unfinished_run`, the run a restart continues
- sweep.py: a multirun's parent run, its jobs' tags and child runs

The names below are the package's public face; callers import them from `bapo_cli.tracking`.
Tests that patch a module constant patch it in the module that reads it (e.g. `writer`).
"""

from bapo_cli.tracking.backends import BACKENDS, TrackerStartError, make_tracker, start_failure
from bapo_cli.tracking.reader import RunRow, list_runs, unfinished_run
from bapo_cli.tracking.server import (
    FAIL_FAST_HTTP,
    QUIET_LINKS,
    describe_failure,
    fail_fast_http,
    hide_run_links,
)
from bapo_cli.tracking.spill import SPILL_FILE, SPILL_OFFSET_FILE, UNDELIVERED_FILE
from bapo_cli.tracking.store import (
    artifact_location,
    ensure_experiment,
    open_experiment,
    sqlite_path,
    store_exists,
)
from bapo_cli.tracking.sweep import (
    JOB_NUM_TAG,
    OVERRIDES_TAG,
    PARENT_RUN_ENV,
    PARENT_TAG,
    ROLE_TAG,
    RUN_DIR_TAG,
    SWEEP_DIR_TAG,
    child_runs,
    finish_parent_run,
    job_tags,
    start_parent_run,
)
from bapo_cli.tracking.writer import (
    MAX_PENDING_METRICS,
    MlflowTracker,
    NullTracker,
    Tracker,
    flatten,
)

__all__ = [
    "BACKENDS",
    "FAIL_FAST_HTTP",
    "JOB_NUM_TAG",
    "MAX_PENDING_METRICS",
    "OVERRIDES_TAG",
    "PARENT_RUN_ENV",
    "PARENT_TAG",
    "QUIET_LINKS",
    "ROLE_TAG",
    "SPILL_FILE",
    "SPILL_OFFSET_FILE",
    "RUN_DIR_TAG",
    "SWEEP_DIR_TAG",
    "UNDELIVERED_FILE",
    "MlflowTracker",
    "NullTracker",
    "RunRow",
    "Tracker",
    "TrackerStartError",
    "artifact_location",
    "child_runs",
    "describe_failure",
    "ensure_experiment",
    "fail_fast_http",
    "finish_parent_run",
    "flatten",
    "hide_run_links",
    "job_tags",
    "list_runs",
    "make_tracker",
    "open_experiment",
    "sqlite_path",
    "start_failure",
    "start_parent_run",
    "store_exists",
    "unfinished_run",
]
