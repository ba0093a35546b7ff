"""`bapo runs` reads a real MLflow store."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_bapo


def test_runs_on_an_empty_store_says_so(_output_root: Path) -> None:
    result = run_bapo("runs")
    assert result.returncode == 0, result.stderr
    assert f"no runs yet in sqlite:///{_output_root}/mlflow.db" in result.stdout
    assert not (_output_root / "mlflow.db").exists()  # listing must not create a store


@pytest.mark.slow
def test_runs_lists_tracked_runs(tmp_path: Path) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/store.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("bapo-test")
    run = client.create_run(exp, run_name="grpo-k4")
    client.log_metric(run.info.run_id, "reward/mean", 0.625, step=3)
    client.set_terminated(run.info.run_id)
    mlflow.set_tracking_uri(None)

    result = run_bapo("runs", "--uri", uri, "--experiment", "bapo-test")
    assert result.returncode == 0, result.stderr
    assert run.info.run_id[:12] in result.stdout
    assert "grpo-k4" in result.stdout and "0.625" in result.stdout and "FINISHED" in result.stdout
    assert "actor/entropy" in result.stdout
    other = run_bapo("runs", "--uri", uri, "--experiment", "nope")
    assert "no runs yet" in other.stdout
