"""A multirun in MLflow: one parent run (created by the launching process) with one child run
per job. The parent's id reaches every job through `PARENT_RUN_ENV`, which the CLI sets with
`hydra.job.env_set`, so it works for every launcher (in-process, joblib workers, SLURM); the
tags below place each job's run in its sweep."""

from __future__ import annotations

from typing import Any

from bapo_cli import redact
from bapo_cli.tracking.server import hide_run_links
from bapo_cli.tracking.store import client as store_client
from bapo_cli.tracking.store import open_experiment

PARENT_RUN_ENV = "BAPO_PARENT_RUN_ID"
PARENT_TAG = "mlflow.parentRunId"  # what the MLflow UI nests runs by
OVERRIDES_TAG = "bapo.overrides"  # the job's Hydra overrides, space-separated
SWEEP_DIR_TAG = "bapo.sweep_dir"  # absolute sweep directory (parent and children)
JOB_NUM_TAG = "bapo.job_num"
RUN_DIR_TAG = "bapo.run_dir"  # the run's directory (checkpoints, samples, train.log)
ROLE_TAG = "bapo.role"  # "sweep" on a parent run


def job_tags(
    overrides: list[str], sweep_dir: str | None, job_num: int | None, parent_run_id: str | None
) -> dict[str, str]:
    """Tags that place one job's run in its sweep (the job's overrides label it in reports,
    secrets masked)."""
    tags = {OVERRIDES_TAG: " ".join(redact.overrides(overrides))}
    if sweep_dir is not None:
        tags[SWEEP_DIR_TAG] = sweep_dir
    if job_num is not None:
        tags[JOB_NUM_TAG] = str(job_num)
    if parent_run_id:
        tags[PARENT_TAG] = parent_run_id
    return tags


def start_parent_run(uri: str, experiment: str, run_name: str, tags: dict[str, str]) -> str:
    """Create the store, the experiment and the sweep's parent run, before any job starts.

    Jobs that start at once on a fresh SQLite store race in MLflow's schema migration and fail;
    once this process has created the store and the experiment they only add rows. Tag values
    are masked (`redact.params`): `bapo.command` holds the command line as typed.
    """
    hide_run_links(uri)
    client, exp_id = open_experiment(uri, experiment)
    run = client.create_run(
        exp_id, run_name=run_name, tags=redact.params({ROLE_TAG: "sweep", **tags})
    )
    return run.info.run_id


def finish_parent_run(uri: str, run_id: str, status: str = "FINISHED") -> str | None:
    """Close the parent run; tag it with the sweep dir its children recorded (returned)."""
    hide_run_links(uri)
    client = store_client(uri)
    sweep_dirs = {r.data.tags.get(SWEEP_DIR_TAG) for r in child_runs(client, run_id)} - {None}
    sweep_dir = sorted(sweep_dirs)[0] if sweep_dirs else None
    if sweep_dir is not None:
        client.set_tag(run_id, SWEEP_DIR_TAG, sweep_dir)
    client.set_terminated(run_id, status=status)
    return sweep_dir


def child_runs(client: Any, parent_run_id: str) -> list[Any]:
    """The runs whose `mlflow.parentRunId` is this run, by job number."""
    parent = client.get_run(parent_run_id)
    runs = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'",
        max_results=10_000,
    )
    return sorted(runs, key=lambda r: int(r.data.tags.get(JOB_NUM_TAG, "0") or 0))
