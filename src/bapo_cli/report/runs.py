"""What a report compares, read from the MLflow store: each run's config, tags and the histories
of the metrics the report uses (`METRICS`, the held-out `VAL_KEY` and the Entropy-Clip quadrant
shares), as `RunData`. A sweep dir is found in the store by its `bapo.sweep_dir` tag, an
experiment by name, single runs by id; a store, sweep or experiment that is not there is a
`ReportError` of one line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from bapo_cli import tracking
from bapo_cli.tracking import store


class ReportError(Exception):
    """Nothing to report (missing dir, no runs, no metrics); the message says why."""


# plot family -> the metric keys it draws (plots.py); these and the keys the columns read are
# what is fetched from the store (METRICS). A run that never logged a key shows an empty cell.
PLOTS: dict[str, tuple[str, ...]] = {
    "reward": ("reward/mean",),
    "entropy": ("actor/entropy",),
    "clip_bounds": ("actor/c_low", "actor/c_high"),
    "rho": ("bapo/rho_before", "bapo/rho"),
    "clip_fractions": ("actor/clipfrac_low", "actor/clipfrac_high"),
    "grad_norm": ("actor/grad_norm",),
    "staleness": ("staleness/mean",),
}
METRICS = tuple(dict.fromkeys(k for keys in PLOTS.values() for k in keys)) + (
    "perf/step_s",
    "actor/rho",
    "actor/ess",
    "response/length_mean",
    "response/clip_frac",
)
QUADRANT_KEY = re.compile(r"^tokens/quadrant_(high|low)_(pos|neg)_(active|clipped)_mass$")

VAL_KEY = re.compile(r"^val/.+/avg_at_\d+$")  # the held-out outcome `trainer.val_every` logs


@dataclass
class RunData:
    run_id: str
    name: str
    status: str
    overrides: list[str] | None  # a sweep job's typed overrides; None: started on its own
    histories: dict[str, list[tuple[int, float]]]  # metric -> [(step, value)] by step
    params: dict[str, str] = field(default_factory=dict)  # the config it recorded (flattened)
    parent_id: str | None = None
    facets: dict[str, str] = field(default_factory=dict)  # key -> canonical value (`facets`)
    label: str = ""  # facets whose values differ between the runs in the report
    group: str = ""  # label without the seed
    values: dict[str, float | None] = field(default_factory=dict)
    run_dir: str | None = None  # where its checkpoints are (`bapo.run_dir` tag, or sweep dir/job)


def sweep_store(sweep_dir: Path) -> str:
    """The tracking URI the jobs of a sweep dir logged to (from a job's saved config)."""
    if not sweep_dir.is_dir():
        raise ReportError(f"sweep dir {sweep_dir} does not exist")
    configs = sorted(sweep_dir.glob("*/.hydra/config.yaml"))
    if not configs:
        raise ReportError(f"{sweep_dir} holds no job dirs (<job#>/.hydra/config.yaml): not a sweep")
    cfg = OmegaConf.load(configs[0])
    backends = saved_backends(cfg.tracking)
    if not backends:
        raise ReportError(f"the jobs in {sweep_dir} ran with tracking=none: nothing was logged")
    if "mlflow" not in backends:
        raise ReportError(
            f"the jobs in {sweep_dir} logged to {', '.join(backends)} only "
            f"(tracking.backends=[{','.join(backends)}]); bapo report reads MLflow: compare them "
            "there, or log with tracking.backends=[mlflow,...] next time"
        )
    return str(cfg.tracking.uri)


def saved_backends(tracking_cfg: Any) -> list[str]:
    """The backends a saved job config logged to: `backends`, or the single `backend` (mlflow
    or none) of configs written before W&B and TensorBoard were added."""
    if "backends" in tracking_cfg:
        return list(tracking_cfg.backends)
    return [] if tracking_cfg.get("backend", "mlflow") == "none" else ["mlflow"]


def load_runs(
    uri: str,
    *,
    sweep_dir: Path | None = None,
    experiment: str | None = None,
    run_ids: list[str] | None = None,
) -> list[RunData]:
    """Runs of a sweep dir, an experiment or a list of ids, with their metric histories."""
    if not tracking.store_exists(uri):
        raise ReportError(
            f"no MLflow store at {uri}; bapo report reads MLflow, so runs logged only to W&B or "
            "TensorBoard are not there"
        )
    client = store.client(uri)  # fail-fast HTTP: a server that is down fails in seconds
    if sweep_dir is not None:
        where = str(sweep_dir.resolve())
        runs = _search(client, f"tags.`{tracking.SWEEP_DIR_TAG}` = '{where}'")
        runs = [r for r in runs if r.data.tags.get(tracking.ROLE_TAG) != "sweep"]
        if not runs:
            raise ReportError(f"no tracked runs of sweep {where} in {uri}")
    elif experiment is not None:
        found = client.get_experiment_by_name(store.experiment_name(experiment))
        if found is None:
            names = ", ".join(sorted(e.name for e in client.search_experiments()))
            raise ReportError(f"no experiment {experiment!r} in {uri}; there are: {names}")
        runs = client.search_runs([found.experiment_id], max_results=10_000)
        runs = [r for r in runs if r.data.tags.get(tracking.ROLE_TAG) != "sweep"]
        if not runs:
            raise ReportError(f"experiment {experiment!r} has no runs")
    else:
        runs = []
        for run_id in run_ids or []:
            try:
                runs.append(client.get_run(run_id))
            except Exception as exc:
                raise ReportError(f"no run {run_id} in {uri}") from exc
    runs.sort(key=lambda r: (int(r.data.tags.get(tracking.JOB_NUM_TAG, -1)), r.info.start_time))
    out = [_run_data(client, r) for r in runs]
    empty = [r.run_id[:12] for r in out if not r.histories]
    if len(empty) == len(out):
        raise ReportError(f"no metrics in run(s) {', '.join(empty)}: nothing to compare yet")
    return [r for r in out if r.histories]


def _search(client: Any, filter_string: str) -> list[Any]:
    ids = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(ids, filter_string=filter_string, max_results=10_000) if ids else []


def _run_data(client: Any, run: Any) -> RunData:
    tags = run.data.tags
    histories = {}
    for key in run.data.metrics:
        if key in METRICS or VAL_KEY.match(key) or QUADRANT_KEY.match(key):
            points = sorted(
                (m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)
            )
            histories[key] = points
    overrides = tags.get(tracking.OVERRIDES_TAG)
    run_dir = tags.get(tracking.RUN_DIR_TAG)
    if run_dir is None and tracking.SWEEP_DIR_TAG in tags and tracking.JOB_NUM_TAG in tags:
        run_dir = str(Path(tags[tracking.SWEEP_DIR_TAG]) / tags[tracking.JOB_NUM_TAG])
    return RunData(
        run_id=run.info.run_id,
        name=run.info.run_name or run.info.run_id[:12],
        status=run.info.status,
        overrides=overrides.split() if overrides is not None else None,
        histories=histories,
        params=dict(run.data.params),
        parent_id=tags.get(tracking.PARENT_TAG),
        run_dir=run_dir,
    )
