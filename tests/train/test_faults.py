"""Faults during training: kill -9 and resume, a corrupt checkpoint, updates that blow up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from bapo_cli.trainer import checkpoint
from bapo_cli.trainer.train import TrainingError
from tests.train.conftest import FAST, run_train


def _train_cmd(run_dir: Path, uri: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bapo_cli",
        "train",
        *FAST,
        "tracking=mlflow",
        f"tracking.uri={uri}",
        "trainer.max_steps=12",
        "trainer.save_every=3",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


def _history(uri: str) -> tuple[list[str], dict[int, list[float]]]:
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("bapo")
    runs = client.search_runs([exp.experiment_id])
    by_step: dict[int, list[float]] = {}
    for m in client.get_metric_history(runs[0].info.run_id, "reward/mean"):
        by_step.setdefault(m.step, []).append(m.value)
    return [r.info.run_id for r in runs], by_step


@pytest.mark.slow
def test_kill_9_then_resume_loses_and_duplicates_no_step(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/killed.db"
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        _train_cmd(run_dir, uri), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    marker = checkpoint.step_dir(run_dir / "checkpoints", 6) / checkpoint.MARKER
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), proc.stderr.read() if proc.poll() is not None else "timed out"
    os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    resumed = subprocess.run(
        _train_cmd(run_dir, uri, "trainer.resume=true"), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    run_ids, killed_history = _history(uri)
    assert len(run_ids) == 1  # the resumed run continued the same MLflow run
    assert sorted(killed_history) == list(range(1, 13))
    assert all(len(v) == 1 for v in killed_history.values())  # no duplicated step
    # and the numbers are those of a run that was never killed
    clean_uri = f"sqlite:///{tmp_path}/clean.db"
    clean = subprocess.run(
        _train_cmd(tmp_path / "clean", clean_uri), capture_output=True, text=True, timeout=600
    )
    assert clean.returncode == 0, clean.stderr[-2000:]
    _, clean_history = _history(clean_uri)
    assert killed_history == clean_history


def test_corrupt_checkpoint_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    args = ("trainer.max_steps=4", "trainer.save_every=2")
    first = run_train(tmp_path, *args, name="run")
    state_file = checkpoint.step_dir(first.run_dir / "checkpoints", 4) / checkpoint.STATE_FILE
    state_file.write_bytes(state_file.read_bytes()[:100])  # a truncated write
    with pytest.raises(checkpoint.CheckpointError, match="is unreadable"):
        checkpoint.load_state(state_file.parent)
    resumed = run_train(
        tmp_path, "trainer.max_steps=6", "trainer.save_every=2", "trainer.resume=true", name="run"
    )
    assert len(resumed.history) == 6
    assert resumed.history[:2] == first.history[:2]  # state came from the step-2 checkpoint
    assert resumed.checkpoint == checkpoint.step_dir(first.run_dir / "checkpoints", 6)


def test_non_finite_updates_are_skipped_counted_then_stop_the_run(tmp_path: Path) -> None:
    # a learning rate that sends the weights to ~1e30: the next forward overflows to NaN
    with pytest.raises(TrainingError, match="consecutive updates had a non-finite loss"):
        run_train(
            tmp_path,
            "trainer.lr=1e30",
            "trainer.max_steps=5",
            "trainer.max_skipped_steps=3",
            "trainer.grad_clip=null",
            "staleness=4",
        )
    assert not (tmp_path / "run" / "checkpoints").exists()  # no checkpoint of broken weights
