"""A real `mlflow server` on 127.0.0.1 that a test can stop and start again (same port, store)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

START_TIMEOUT_S = 240.0  # a cold start on a busy 2-core machine took ~45 s (store migration)
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` in its own process group (it forks uvicorn), so stop() ends all of it."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = root
        self.port = port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start_s: list[float] = []  # seconds until each start answered

    def start(self) -> None:
        assert self.proc is None, "already running"
        mlflow = Path(sys.executable).with_name("mlflow")
        command = [
            str(mlflow), "server", "--host", "127.0.0.1", "--port", str(self.port),
            "--backend-store-uri", f"sqlite:///{self.root}/s.db",
            "--default-artifact-root", str(self.root / "art"), "--workers", "1",
        ]  # fmt: skip
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        log = (self.root / "server.log").open("ab")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        while time.monotonic() - t0 < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                tail = (self.root / "server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}:\n{tail}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer,
            ):
                if answer.status == 200:
                    self.start_s.append(time.monotonic() - t0)
                    return
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"mlflow server on {self.uri} did not answer in {START_TIMEOUT_S} s")

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL if it lingers; returns once the port refuses."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):  # uvicorn children of a dead parent
            os.killpg(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) != 0:
                    return
            time.sleep(0.1)


@pytest.fixture
def mlflow_server(tmp_path: Path):
    root = tmp_path / "server"
    root.mkdir()
    server = MlflowServer(root)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _restore_http_env(monkeypatch) -> None:
    """An http tracker fills in MLflow's retry variables for the process; undone after each test."""
    from bapo_cli.tracking import FAIL_FAST_HTTP

    for name in FAIL_FAST_HTTP:
        monkeypatch.setenv(name, os.environ.get(name, "x"))
        if os.environ[name] == "x":
            monkeypatch.delenv(name)
