"""The runs of `bapo train`: MLflow queried back from a real SQLite store, W&B (offline) and
TensorBoard read back from their files (tests/tracking/readback.py)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from bapo_cli.tracking.wandb_tracker import typed
from bapo_cli.trainer import checkpoint
from tests.tracking.readback import (
    isolate_wandb,
    tb_scalars,
    tb_table,
    tb_texts,
    wandb_config,
    wandb_history,
    wandb_records,
    wandb_run,
    wandb_run_dir,
)
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


def _mlflow_histories(client: MlflowClient, run_id: str) -> dict[int, dict[str, float]]:
    """{step: {key: value}} of every metric of an MLflow run."""
    rows: dict[int, dict[str, float]] = {}
    for key in client.get_run(run_id).data.metrics:
        for m in client.get_metric_history(run_id, key):
            rows.setdefault(m.step, {})[key] = m.value
    return rows


@pytest.mark.slow  # the W&B SDK starts its own process
def test_wandb_and_tensorboard_get_what_mlflow_gets(tmp_path, monkeypatch) -> None:
    """One run logging to all three: the same params (masked), the same metrics at the same
    steps, the same config.yaml and samples; W&B's run takes the MLflow run's id."""
    isolate_wandb(tmp_path, monkeypatch)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    result = run_train(
        tmp_path,
        "trainer.max_steps=3",
        "tracking=mlflow",
        f"tracking.uri={uri}",
        "tracking.experiment=test",
        "tracking.backends=[mlflow,wandb,tensorboard]",
        "tracking.wandb.mode=offline",
    )
    client = MlflowClient(tracking_uri=uri)
    params = client.get_run(result.run_id).data.params
    steps = _mlflow_histories(client, result.run_id)
    assert sorted(steps) == [1, 2, 3] and "bapo/c_high" in steps[3]

    records = wandb_records(result.run_dir)
    run = wandb_run(records)
    assert (run["run_id"], run["project"]) == (result.run_id, "test")
    assert {"algo=bapo", "model=tiny", "regime=reuse"} <= set(run["tags"])
    config = wandb_config(records)
    assert config == {k: typed(v) for k, v in params.items()}
    assert config["algo.rho0"] == 0.4 and config["algo.high_range"] == "[1.2, 3.0]"
    assert wandb_history(records) == steps  # float64 both: exactly equal
    files = wandb_run_dir(result.run_dir) / "files"
    config_yaml = client.download_artifacts(result.run_id, "config.yaml", str(tmp_path))
    assert (files / "config.yaml").read_text() == Path(config_yaml).read_text()
    samples = (result.run_dir / "samples.jsonl").read_text()
    assert (files / "samples.jsonl").read_text() == samples

    log_dir = result.run_dir / "tensorboard"
    scalars = tb_scalars(log_dir)
    assert set(scalars) == {k for row in steps.values() for k in row}
    for key, points in scalars.items():
        expected = [(s, row[key]) for s, row in sorted(steps.items()) if key in row]
        assert [s for s, _ in points] == [s for s, _ in expected], key
        assert [v for _, v in points] == pytest.approx([v for _, v in expected], rel=1e-6), key
    texts = tb_texts(log_dir)
    assert tb_table(texts["params"]) == params
    assert tb_table(texts["tags"])["algo"] == "bapo"
    assert texts["config.yaml"].replace("\n    ", "\n").removeprefix("    ") == (
        Path(config_yaml).read_text().rstrip("\n")
    )
    assert (log_dir / "samples.jsonl").read_text() == samples


@pytest.mark.slow  # the W&B SDK starts its own process
def test_a_secret_on_the_command_line_reaches_neither_wandb_nor_tensorboard(
    tmp_path, monkeypatch
) -> None:
    """W&B records the command line in the run's metadata and the config as params: both are
    masked, so the password is in no file of the W&B run or the event files (MLflow off)."""
    isolate_wandb(tmp_path, monkeypatch)
    secret_uri = "http://alice:s3cret-pw@127.0.0.1:1"
    overrides = ["tracking=wandb", f"tracking.uri={secret_uri}", "tracking.wandb.mode=offline"]
    monkeypatch.setattr(sys, "argv", ["bapo", "train", *overrides])
    result = run_train(
        tmp_path, *overrides, "tracking.backends=[wandb,tensorboard]", "trainer.max_steps=1"
    )
    written = [p for d in ("wandb", "tensorboard") for p in (result.run_dir / d).rglob("*")]
    assert len([p for p in written if p.is_file()]) > 5
    for path in written:
        if path.is_file() and not path.is_symlink():
            assert b"s3cret-pw" not in path.read_bytes(), path
    records = wandb_records(result.run_dir)
    assert wandb_config(records)["tracking.uri"] == "http://alice:***@127.0.0.1:1"
    args = [
        a for r in records if r["type"] == "environment" for a in r["environment"].get("args", [])
    ]
    assert "tracking.uri=http://alice:***@127.0.0.1:1" in args  # W&B did record the argv
    params = tb_table(tb_texts(result.run_dir / "tensorboard")["params"])
    assert params["tracking.uri"] == "http://alice:***@127.0.0.1:1"
    assert not (tmp_path / "outputs" / "mlflow.db").exists()  # MLflow was off
