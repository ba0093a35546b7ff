"""Commands that talk to a tracking store fail fast when it is down, and `bapo ui` leaves
nothing behind (issue 22): `bapo runs` against an absent server used to print nothing for over
120 s (MLflow's 7 retries with backoff), and `bapo ui` killed with SIGTERM left its MLflow
server orphaned and listening."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from bapo_cli.tracking import FAIL_FAST_HTTP
from tests.faults.conftest import free_port

PW = "Pw0rd-s3cr3t"


def _env() -> dict[str, str]:
    """The caller's environment without MLflow's retry settings (as a user's shell has it)."""
    env = {k: v for k, v in os.environ.items() if k not in FAIL_FAST_HTTP}
    return {**env, "COLUMNS": "200"}


@pytest.mark.parametrize("command", ["runs", "report"])
def test_a_store_command_on_an_absent_server_fails_fast_in_one_masked_line(
    command: str, tmp_path: Path
) -> None:
    uri = f"http://alice:{PW}@127.0.0.1:{free_port()}"  # nothing listens there
    args = ["--uri", uri] if command == "runs" else ["--uri", uri, "--experiment", "bapo"]
    args += [] if command == "runs" else ["--out", str(tmp_path / "report")]
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "bapo_cli", command, *args],
        capture_output=True,
        text=True,
        timeout=90,  # MLflow's own retries took over 120 s
        env=_env(),
    )
    took = time.monotonic() - t0
    assert done.returncode == 1, done.stdout + done.stderr
    error = " ".join(done.stderr.split())
    host = uri.removeprefix(f"http://alice:{PW}@")
    assert error == (
        f"error: tracking: cannot read runs from http://alice:***@{host} (connection refused)"
    )
    assert PW not in done.stdout + done.stderr and "Traceback" not in done.stderr
    assert took < 60, took


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_bapo_ui_stops_all_of_its_server_on_sigterm(tmp_path: Path) -> None:
    """SIGTERM once the server has started its web workers (before that it would be orphaned
    all the same; waiting for it to answer took 45-130 s on a busy 2-core machine)."""
    port = free_port()
    ui = subprocess.Popen(
        [sys.executable, "-m", "bapo_cli", "ui", "--uri", f"sqlite:///{tmp_path}/m.db"]
        + ["--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=_env(),
        start_new_session=True,  # so that cleanup can reach everything it started
    )
    try:
        deadline = time.monotonic() + 240
        started: list[psutil.Process] = []
        while len(started) < 2 and not _answers(port):  # `mlflow ui` and its uvicorn
            assert ui.poll() is None, f"bapo ui exited with {ui.returncode}"
            assert time.monotonic() < deadline, "the UI did not start its server"
            time.sleep(0.5)
            started = psutil.Process(ui.pid).children(recursive=True)
        started = psutil.Process(ui.pid).children(recursive=True)
        ui.send_signal(signal.SIGTERM)
        code = ui.wait(timeout=60)
        _, alive = psutil.wait_procs(started, timeout=30)
        assert alive == [], alive  # without forwarding: the MLflow server, orphaned
        assert not _listening(port)
        assert code == 128 + signal.SIGTERM
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # whatever a failed run left
            try:
                os.killpg(ui.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(1)


def test_bapo_ui_relays_mlflows_errors_masked(tmp_path: Path) -> None:
    """MLflow's own error line names the backend URI it was given, credentials included."""
    done = subprocess.run(
        [sys.executable, "-m", "bapo_cli", "ui", "--uri", f"http://alice:{PW}@127.0.0.1:1"]
        + ["--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert done.returncode != 0
    assert "http://alice:***@127.0.0.1:1" in done.stderr, done.stderr[-2000:]
    assert PW not in done.stdout + done.stderr
