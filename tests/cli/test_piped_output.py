"""Output piped at 80 columns (a real subprocess whose stdout is a pipe): run ids, paths and
commands a user copies come out whole, one line each; the end tells how to open the results."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from bapo_cli import tracking
from tests.conftest import run_bapo

pytestmark = pytest.mark.slow

NARROW = {"COLUMNS": "80", "OMP_NUM_THREADS": "1"}


def test_a_piped_sweep_prints_whole_paths_commands_and_ids(_output_root: Path) -> None:
    result = run_bapo(
        "train", "-m", "algo.rho0=0.3,0.5", "experiment=smoke", "tracking=mlflow", env=NARROW
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    (sweep_dir,) = (_output_root / "sweeps").glob("*/*")
    assert f"compare the jobs: bapo report --sweep {sweep_dir}" in lines
    assert "open the results: bapo ui" in lines
    for job in ("0", "1"):
        assert f"run dir: {sweep_dir / job}" in lines
    # each step line is one line, whatever its length
    assert [line for line in lines if line.startswith("step 2/2")] == [
        line for line in lines if "step 2/2" in line
    ]
    client = MlflowClient(tracking_uri=f"sqlite:///{_output_root}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("bapo").experiment_id])
    children = [r for r in runs if r.data.tags.get(tracking.ROLE_TAG) != "sweep"]
    # sweep children are named by what they sweep
    assert sorted(r.info.run_name for r in children) == [
        "bapo-reuse4-tiny-s0-rho0=0.3",
        "bapo-reuse4-tiny-s0-rho0=0.5",
    ]
    # each job's train.log holds its lines (Hydra's job log; 0 bytes before)
    log = (sweep_dir / "0" / "train.log").read_text()
    assert "step 2/2" in log and "bapo train: summary" in log and "run dir: " in log

    listed = run_bapo("runs", env=NARROW)
    assert listed.returncode == 0, listed.stderr
    for run in runs:
        assert run.info.run_id in listed.stdout  # whole 32-character ids (cut to 4 before)
    assert "bapo-reuse4-tiny-s0-rho0=0.3" in listed.stdout
