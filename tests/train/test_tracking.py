"""The MLflow run of `bapo train`, queried back from a real SQLite store."""

from __future__ import annotations

import shutil

from mlflow.tracking import MlflowClient

from bapo_cli.trainer import checkpoint
from tests.train.conftest import run_train
from tests.train.test_loop import DESIGN_KEYS


def test_mlflow_run_holds_params_metrics_artifacts_and_tags(tmp_path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    result = run_train(
        tmp_path,
        "algo=bapo",
        "staleness=2",
        "trainer.max_steps=3",
        "tracking=mlflow",
        f"tracking.uri={uri}",
        "tracking.experiment=test",
    )
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["algo.rho0"] == "0.4" and params["staleness.k"] == "2"
    assert params["algo.high_range"] == "[1.2, 3.0]"
    for key in [
        *DESIGN_KEYS,
        "bapo/c_low",
        "bapo/c_high",
        "bapo/rho",
        "bapo/rho_before",
        "bapo/search_steps",
        "tokens/quadrant_high_pos_active",
    ]:
        assert key in run.data.metrics, key
    history = client.get_metric_history(result.run_id, "reward/mean")
    assert sorted(m.step for m in history) == [1, 2, 3]
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == [
        h["reward/mean"] for h in result.history
    ]
    artifacts = {a.path for a in client.list_artifacts(result.run_id)}
    assert {"config.yaml", "samples.jsonl"} <= artifacts
    tags = run.data.tags
    assert (tags["algo"], tags["staleness"], tags["regime"], tags["model"]) == (
        "bapo",
        "2",
        "reuse",
        "tiny",
    )


def test_resumed_run_continues_the_same_mlflow_run_without_duplicate_steps(tmp_path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = ("trainer.save_every=2", "tracking=mlflow", f"tracking.uri={uri}")
    # a run that logged steps 1-3 and was killed before step 4: only the step-2 checkpoint is left
    first = run_train(tmp_path, *args, "trainer.max_steps=3", name="run")
    shutil.rmtree(checkpoint.step_dir(first.run_dir / "checkpoints", 3))
    resumed = run_train(tmp_path, *args, "trainer.max_steps=4", "trainer.resume=true", name="run")
    assert resumed.run_id == first.run_id
    client = MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(resumed.run_id, "reward/mean")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]  # step 3 replayed, not logged twice
    by_step = {m.step: m.value for m in history}
    assert by_step[3] == resumed.history[2]["reward/mean"]  # the replay computed the same value
