"""Metrics added to a run that another process writes, or wrote: `bapo eval --watch` scores a
training run's checkpoints and logs the scores to that run, at each checkpoint's step. MLflow
only (the run id a checkpoint records is MLflow's); one `log_batch` per call, and the run's
status is never touched: the trainer owns it (reopening the run as a resume does would mark it
RUNNING, and closing it FINISHED, under the trainer's feet)."""

from __future__ import annotations

import time
from functools import lru_cache

from bapo_cli.tracking.server import describe_failure
from bapo_cli.tracking.store import client as new_client

TERMINAL = ("FINISHED", "FAILED", "KILLED")  # a run that no process writes any more
TRIES = 3  # a SQLite store the trainer writes at the same moment may be locked for a while


# one client per store for the process: opening a SQLite store checks its schema (~3 s on a
# loaded 2-core machine), once per checkpoint otherwise
client = lru_cache(maxsize=4)(new_client)


class AttachError(RuntimeError):
    """The store did not take the metrics; one line (they are kept on disk by the caller)."""


def log_to_run(uri: str, run_id: str, metrics: dict[str, float], step: int) -> None:
    """Add `metrics` at `step` to the run `run_id`; AttachError after TRIES failures."""
    from mlflow.entities import Metric

    stamp = int(time.time() * 1000)
    batch = [Metric(key, float(value), stamp, step) for key, value in metrics.items()]
    for attempt in range(TRIES):
        try:
            client(uri).log_batch(run_id, metrics=batch)
            return
        except Exception as exc:  # noqa: BLE001  (any store failure: retried, then one line)
            if attempt == TRIES - 1:
                raise AttachError(f"MLflow run {run_id}: {describe_failure(exc)}") from None
            time.sleep(1.0 + attempt)


def run_status(uri: str, run_id: str) -> str | None:
    """The run's status (RUNNING, FINISHED, ...), None when the store cannot say."""
    try:
        return str(client(uri).get_run(run_id).info.status)
    except Exception:  # noqa: BLE001  (unknown: the caller keeps waiting)
        return None
