"""Tracking settings refused before the model loads (issue 33 items 8 and 10): an MLflow URI with
no store behind it, a store or log dir that cannot be created, a TensorBoard dir that holds
another run's event files (the second run logged 0 scalars without a word). Real files, real
event files, real `bapo train` runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bapo_cli.tracking import checks
from bapo_cli.tracking.tensorboard_tracker import TensorBoardTracker
from tests.conftest import run_bapo
from tests.tracking.readback import tb_scalars


@pytest.mark.parametrize(
    ("uri", "says"),
    [
        ("ftp://x/y", "MLflow has no store for ftp:// URIs"),
        ("s3://bucket/mlruns", "MLflow has no store for s3:// URIs"),
        ("http://", "no host in the server URL"),
        ("sqlite://", "a SQLite store is a file"),
        ("sqlite:////proc/bapo-nope/mlflow.db", "cannot create the file /proc/bapo-nope/mlflow.db"),
        ("sqlite:////proc/self/status", "cannot write to the file /proc/self/status"),
        ("/etc/passwd/mlruns", "/etc/passwd is a file, not a directory"),
    ],
)
def test_a_uri_mlflow_cannot_use_is_one_line(uri: str, says: str) -> None:
    line = checks.uri_error(uri)
    assert line is not None and line.startswith(f"tracking.uri={uri}: ") and says in line, line
    assert "\n" not in line


@pytest.mark.parametrize(
    "uri",
    [
        "sqlite:///{tmp}/new/dir/mlflow.db",  # created at start, with its parents
        "sqlite:////{tmp}/mlflow.db",
        "http://127.0.0.1:5000",
        "https://user:pass@mlflow.example.org",
        "databricks",
        "databricks://profile",
        "postgresql+psycopg2://u@db.example.org/mlflow",
    ],
)
def test_uris_mlflow_can_use_pass_and_create_nothing(uri: str, tmp_path: Path) -> None:
    uri = uri.format(tmp=str(tmp_path).lstrip("/"))
    assert checks.uri_error(uri) is None
    assert list(tmp_path.iterdir()) == []  # checked, not created


def test_a_directory_store_follows_this_mlflows_file_store_switch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow 3 raises at start for a file store unless MLFLOW_ALLOW_FILE_STORE=true."""
    from mlflow.store.tracking.file_store import FileStore

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    try:
        FileStore(str(tmp_path / "probe"))
        refused = False
    except Exception:
        refused = True
    line = checks.uri_error(f"file:{tmp_path}/mlruns")
    assert (line is not None) == refused
    if refused:
        assert "MLFLOW_ALLOW_FILE_STORE=true" in line
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert checks.uri_error(f"file:{tmp_path}/mlruns") is None
    assert checks.uri_error(str(tmp_path / "mlruns")) is None


def _events(log_dir: Path, run_dir: Path, steps=(1, 2)) -> None:
    tracker = TensorBoardTracker(log_dir, run_dir=run_dir)
    for step in steps:
        tracker.log_metrics({"reward/mean": step / 10}, step)
    tracker.close()


def test_a_log_dir_names_its_run_and_refuses_another(tmp_path: Path) -> None:
    tb, first, second = tmp_path / "tb", tmp_path / "run1", tmp_path / "run2"
    _events(tb, first)
    assert checks.run_of(tb) == str(first.resolve())
    with pytest.raises(FileExistsError, match=f"the run in {first}"):
        TensorBoardTracker(tb, run_dir=second)  # a second job of a sweep, say
    _events(tb, first, steps=(2, 3))  # its own resume: steps 1-2 are not logged twice
    assert [s for s, _ in tb_scalars(tb)["reward/mean"]] == [1, 2, 3]


def test_foreign_event_files_are_told_from_a_resume(tmp_path: Path) -> None:
    tb, first, second = tmp_path / "tb", tmp_path / "run1", tmp_path / "run2"
    assert checks.foreign_events_error(tb, second, resume=False) is None  # nothing there
    _events(tb, first)
    line = checks.foreign_events_error(tb, second, resume=False)
    assert line is not None and f"the run in {first}" in line and "would log nothing" in line
    assert f"tracking.tensorboard.log_dir={tb}/NAME" in line  # how to share it deliberately
    assert f"hydra.run.dir={first}" in line  # or how to resume that run
    assert checks.foreign_events_error(tb, second, resume=True) is not None
    assert checks.foreign_events_error(tb, first, resume=True) is None
    assert checks.foreign_events_error(tb, None, resume=True) is None  # run dir yet unknown
    (tb / checks.RUN_MARKER).unlink()  # event files of unknown origin
    assert checks.foreign_events_error(tb, second, resume=False) is not None
    assert checks.foreign_events_error(tb, second, resume=True) is None


def _one_error_line(result) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "bapo train" not in result.stdout  # refused before the plan, the model, the run dir
    return lines[0]


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["tracking=mlflow", "tracking.uri=ftp://x/y"], "tracking.uri=ftp://x/y: MLflow has no"),
        (
            ["tracking=mlflow", "tracking.uri=sqlite:////proc/bapo-nope/mlflow.db"],
            "cannot create the file /proc/bapo-nope/mlflow.db",
        ),
        (
            ["tracking=tensorboard", "tracking.tensorboard.log_dir=/proc/bapo-nope/tb"],
            "tracking.tensorboard.log_dir=/proc/bapo-nope/tb: cannot create the directory",
        ),
    ],
)
def test_bad_tracking_settings_fail_before_the_model_loads(
    overrides: list[str], says: str, _output_root: Path
) -> None:
    line = _one_error_line(run_bapo("train", "experiment=smoke", *overrides))
    assert says in line, line
    assert not (_output_root / "runs").exists()


@pytest.mark.slow
def test_a_second_run_into_a_shared_tensorboard_dir_is_refused_and_a_resume_is_not(
    tmp_path: Path, _output_root: Path
) -> None:
    tb = tmp_path / "shared-tb"
    args = ["experiment=smoke", "tracking=tensorboard", f"tracking.tensorboard.log_dir={tb}"]
    first = run_bapo("train", *args)
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = (_output_root / "runs").glob("*/*")
    logged = tb_scalars(tb)["reward/mean"]
    assert [s for s, _ in logged] == [1, 2]
    events = sorted(tb.glob("events.out.tfevents.*"))

    line = _one_error_line(run_bapo("train", *args))
    assert f"already holds the event files of the run in {os.path.realpath(run_dir)}" in line
    assert sorted(tb.glob("events.out.tfevents.*")) == events  # nothing written there
    assert tb_scalars(tb)["reward/mean"] == logged
    assert len(list((_output_root / "runs").glob("*/*"))) == 1  # no second run dir either

    more = [*args, "trainer.max_steps=3", "trainer.resume=true", f"hydra.run.dir={run_dir}"]
    resumed = run_bapo("train", *more)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [s for s, _ in tb_scalars(tb)["reward/mean"]] == [1, 2, 3]
