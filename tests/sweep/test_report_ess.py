"""`bapo report`'s ESS columns (issue 34): "ESS first quarter min" (the stress design's E_q, the
minimum of `actor/ess` over the logged steps 1 ... ceil(S/4)) and "final ESS", read from a real
MLflow store; runs that never logged `actor/ess` (older stores) keep reporting, with empty cells.
"""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from bapo_cli.cli import app
from bapo_cli.report.columns import first_quarter_min

runner = CliRunner()


def test_first_quarter_is_steps_one_to_ceil_s_over_four() -> None:
    # reuse 8: 6 steps, each the mean of its 8 updates: steps 1-2 count, step 3's dip does not
    reuse8 = [(1, 0.9), (2, 0.7), (3, 0.1), (4, 0.8), (5, 0.8), (6, 0.8)]
    assert first_quarter_min(reuse8) == 0.7
    # lag 8: 48 steps, one update each: steps 1-12 count
    lag8 = [(s, 1.0 - 0.01 * s) for s in range(1, 49)]
    assert first_quarter_min(lag8) == pytest.approx(0.88)
    assert first_quarter_min([(1, 0.4)]) == 0.4  # S = 1: the quarter is step 1
    assert first_quarter_min([(1, float("nan")), (2, 0.6), (3, 0.2), (8, 1.0)]) == 0.6
    assert first_quarter_min([]) is None and first_quarter_min(None) is None


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=60))
def test_first_quarter_min_is_the_min_of_a_prefix(values: list[float]) -> None:
    points = list(enumerate(values, start=1))
    quarter = math.ceil(len(values) / 4)
    got = first_quarter_min(points)
    assert got == min(values[:quarter])
    assert got >= min(values)  # a prefix's minimum is never below the whole run's


def _log_run(client: MlflowClient, exp: str, seed: int, ess: list[float] | None) -> str:
    """A run as `bapo train` logs it: params, held-out at step 0 and at the end, a training
    metric per step, and `actor/ess` per step unless `ess` is None (a store from before it)."""
    run = client.create_run(exp, run_name=f"seed{seed}")
    rid = run.info.run_id
    steps = len(ess) if ess is not None else 6
    now = int(time.time() * 1000)
    val = "val/pairs/avg_at_8"
    metrics = [Metric(val, 0.2, now, 0), Metric(val, 0.1, now, steps)]
    metrics += [Metric("reward/mean", 0.1 * s, now, s) for s in range(1, steps + 1)]
    if ess is not None:
        metrics += [Metric("actor/ess", v, now, s) for s, v in enumerate(ess, start=1)]
    params = [Param("algo.name", "grpo"), Param("trainer.seed", str(seed))]
    client.log_batch(rid, metrics=metrics, params=params, tags=[RunTag("x", "y")])
    client.set_terminated(rid)
    return rid


def test_report_shows_the_ess_columns_from_a_real_store(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("ess")
    # 8 steps: the quarter is steps 1-2 (min 0.45); final = last 10% of 8 points = step 8
    _log_run(client, exp, 0, [0.9, 0.45, 0.2, 0.5, 0.6, 0.7, 0.8, 0.95])
    _log_run(client, exp, 1, None)  # logged before actor/ess existed
    out = tmp_path / "report"
    result = runner.invoke(app, ["report", "--experiment", "ess", "--uri", uri, "--out", str(out)])
    assert result.exit_code == 0, result.output
    with (out / "runs.csv").open() as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    new, old = rows["trainer.seed=0"], rows["trainer.seed=1"]
    assert (new["ESS first quarter min"], new["final ESS"]) == ("0.450", "0.950")
    assert (old["ESS first quarter min"], old["final ESS"]) == ("", "")
    assert old["held-out change"] == "-0.100"  # the older run still reports
    md = (out / "runs.md").read_text()
    assert "ESS first quarter min | final ESS" in md


@pytest.mark.slow
def test_a_trained_run_reports_the_min_of_its_logged_ess(_output_root: Path) -> None:
    """A real `bapo train` (4 steps, 2 updates per batch, a large step so the second update is
    off-policy): the column is the minimum of the store's own `actor/ess` at step 1."""
    result = runner.invoke(
        app,
        [
            "train",
            "experiment=smoke",
            "tracking=mlflow",
            "tracking.experiment=ess_train",
            "rollout=hf",
            "trainer.max_steps=4",
            "trainer.prompts_per_step=4",
            "rollout.n=2",
            "staleness=2",
            "trainer.lr=1e-2",
        ],
    )
    assert result.exit_code == 0, result.output
    uri = f"sqlite:///{_output_root}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("ess_train").experiment_id])
    points = client.get_metric_history(run.info.run_id, "actor/ess")
    history = sorted((m.step, m.value) for m in points)
    assert [s for s, _ in history] == [1, 2, 3, 4]
    assert all(0 <= v <= 1 for _, v in history)
    out = _output_root / "report"
    result = runner.invoke(
        app, ["report", "--experiment", "ess_train", "--uri", uri, "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    with (out / "runs.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert row["ESS first quarter min"] == f"{history[0][1]:.3f}"  # ceil(4/4) = step 1 only
    assert row["final ESS"] == f"{history[-1][1]:.3f}"  # last 10% of 4 steps = step 4
