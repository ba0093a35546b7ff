"""A `bapo train -m` sweep grouped in MLflow: one parent run, one child run per job.

The launching process creates the store, the experiment and the parent run before any job starts
(jobs that start together on a fresh SQLite store otherwise race in MLflow's schema migration),
hands the parent's id to every job through `hydra.job.env_set` (so in-process, joblib and SLURM
jobs all see it), and closes the parent when the sweep ends: FINISHED, FAILED, or KILLED on
Ctrl-C. Each job's run carries `mlflow.parentRunId`, its overrides, the sweep dir and its job
number (`bapo_cli.launch.jobs`), which is what `bapo report --sweep DIR` reads back.

    bapo train -m algo.rho0=0.3,0.4,0.5
    bapo train -m experiment=staleness_study hydra/launcher=joblib hydra.launcher.n_jobs=2
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console

from bapo_cli import tracking
from bapo_cli.config import hydra_runner
from bapo_cli.tracking import redact


def run_grouped(checked: Any, typed: list[str], config_name: str, task: Callable) -> None:
    """Run the multirun `checked` (a validated Preflight) under a parent MLflow run."""
    cfg = checked.config.tracking
    console = Console()
    parent = tracking.start_parent_run(
        cfg.uri,
        cfg.experiment,
        run_name=f"sweep-{time.strftime('%Y-%m-%d-%H%M%S')}",
        tags={
            tracking.OVERRIDES_TAG: " ".join(typed),
            "bapo.command": f"bapo {config_name} -m " + " ".join(typed),
        },
    )
    shown = redact.text(cfg.uri)
    console.print(f"MLflow parent run {parent} in experiment {cfg.experiment!r} ({shown})")
    argv = [
        "--multirun",
        *checked.overrides,
        f"++hydra.job.env_set.{tracking.PARENT_RUN_ENV}={parent}",
    ]
    status = "FAILED"
    try:
        hydra_runner.run(argv, config_name=config_name, task_function=task)
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        sweep_dir = tracking.finish_parent_run(cfg.uri, parent, status)
        where = sweep_dir or "(no job recorded a sweep dir)"
        console.print(f"sweep {status.lower()}: {where}; MLflow parent run {parent}")
        if sweep_dir and status == "FINISHED":
            console.print(f"compare the jobs: bapo report --sweep {sweep_dir}")
