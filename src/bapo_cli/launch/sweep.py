"""A `bapo train -m` sweep grouped in MLflow: one parent run, one child run per job.

The launching process creates the store, the experiment and the parent run before any job starts
(jobs that start together on a fresh SQLite store otherwise race in MLflow's schema migration),
hands the parent's id to every job through `hydra.job.env_set` (so in-process, joblib and SLURM
jobs all see it), and closes the parent when the sweep ends: FINISHED, FAILED, or KILLED on
Ctrl-C. Each job's run is named by the values it sweeps (`bapo-reuse4-tiny-s0-rho0=0.3`; the
keys whose values differ between the jobs reach it through `hydra.job.env_set` too) and carries
`mlflow.parentRunId`, its overrides, the sweep dir and its job number (`bapo_cli.launch.jobs`),
which is what `bapo report --sweep DIR` reads back.

    bapo train -m algo.rho0=0.3,0.4,0.5
    bapo train -m experiment=staleness_study hydra/launcher=joblib hydra.launcher.n_jobs=2
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console

from bapo_cli import redact, tracking
from bapo_cli.config import hydra_runner
from bapo_cli.launch.jobs import SWEPT_ENV
from bapo_cli.trainer.progress import ui_command


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
    shown, name = redact.text(cfg.uri), redact.text(cfg.experiment)
    _say(console, f"MLflow parent run {parent} in experiment {name!r} ({shown})")
    argv = [
        "--multirun",
        *checked.overrides,
        f"++hydra.job.env_set.{tracking.PARENT_RUN_ENV}={parent}",
    ]
    keys = swept_keys(checked.jobs)
    if keys:
        argv.append(f"++hydra.job.env_set.{SWEPT_ENV}='{' '.join(keys)}'")
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
        _say(console, f"sweep {status.lower()}: {where}; MLflow parent run {parent}")
        if sweep_dir and status == "FINISHED":
            _say(console, f"compare the jobs: bapo report --sweep {sweep_dir}")
            _say(console, f"open the results: {ui_command(cfg.uri)}")


def _say(console: Console, line: str) -> None:
    """Unwrapped (a path or command stays one copyable line at any width, piped too)."""
    console.print(line, highlight=False, markup=False, emoji=False, soft_wrap=True)


def swept_keys(jobs: list[list[str]] | None) -> list[str]:
    """The override keys whose values differ between `jobs` (each job's override list), in the
    order they first appear; none when the jobs are not known up front (a sampling sweeper)."""
    if not jobs or len(jobs) < 2:
        return []
    values: dict[str, list[str | None]] = {}
    for job in jobs:
        given = {}
        for override in job:
            key, _, value = override.partition("=")
            given[key.lstrip("+~")] = value
        for key in given:
            values.setdefault(key, [])
        for key in values:
            values[key].append(given.get(key))
    return [key for key, seen in values.items() if len(set(seen)) > 1 or len(seen) < len(jobs)]
