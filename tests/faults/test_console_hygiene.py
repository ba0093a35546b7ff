"""One real `bapo train --nproc 2` on a fresh MLflow store (issue 33 items 6 and 12): the console
holds the tool's own lines only (MLflow's table creation, alembic's migrations, torch's DDP
FutureWarning and torchrun's OMP banner are not there, and the run's train.log keeps the first
three), and nothing the launch starts listens beyond the loopback while it runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.faults.sockets import Listening

NOISE = ("mlflow.store", "alembic", "FutureWarning", "broadcast_buffers", "OMP_NUM_THREADS env")


@pytest.fixture(scope="module")
def nproc_2_run(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("hygiene") / "outputs"
    env = {**os.environ, "BAPO_OUTPUT_ROOT": str(root), "COLUMNS": "200"}
    for name in ("OMP_NUM_THREADS", "MLFLOW_CONFIGURE_LOGGING", "HYDRA_FULL_ERROR"):
        env.pop(name, None)
    command = [sys.executable, "-m", "bapo_cli", "train", "--nproc", "2", "experiment=smoke"]
    command.append("tracking=mlflow")  # the default store, not there yet: created by this run
    launch = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    listening = Listening()
    try:
        deadline = time.monotonic() + 600
        while launch.poll() is None and time.monotonic() < deadline:
            listening.sample(launch.pid)
            time.sleep(0.2)
        out, err = launch.communicate(timeout=60)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode == 0, err[-3000:]
    return root, out, err, listening


@pytest.mark.slow
def test_the_console_shows_the_tools_lines_and_train_log_keeps_the_libraries(nproc_2_run):
    root, out, err, _ = nproc_2_run
    console = out + err
    assert "bapo train: summary" in out and (root / "mlflow.db").is_file()  # a real, fresh run
    for noise in NOISE:
        assert noise not in console, [line for line in console.splitlines() if noise in line]
    (run_dir,) = (root / "runs").glob("*/*")
    log = (run_dir / "train.log").read_text()
    assert "[mlflow.store.db.utils][INFO] - Creating initial MLflow database tables..." in log
    assert "[alembic.runtime.migration][INFO] - Running upgrade" in log
    assert "FutureWarning: `broadcast_buffers` is deprecated" in log  # rank 0's DDP


@pytest.mark.slow
def test_bapo_train_nproc_2_listens_on_the_loopback_only(nproc_2_run):
    _, _, _, listening = nproc_2_run
    assert any(name == "pt_elastic" for _, _, name in listening.seen)  # the store was seen
    assert listening.exposed() == set(), listening.seen
