"""`bapo ui` stops all of its MLflow server on SIGHUP and SIGINT too (issue 33, item 9), prints
the address of the experiment's runs and keeps MLflow's INFO lines and Starlette's deprecation
warning off the console (issue 44).

A closed terminal or ssh session sends SIGHUP: passed on as it came, uvicorn read it as "restart
the workers", so `bapo ui` hung and the server kept listening. SIGINT reached the server's
processes as a KeyboardInterrupt: a traceback on the console. (SIGTERM:
tests/faults/test_store_commands.py.) Both UIs start at once, on one store: SIGINT reaches one
while its uvicorn still imports, SIGHUP the other once it answers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from bapo_cli.tracking import store
from tests.faults.conftest import free_port

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 300  # two MLflow servers starting together on a busy 2-core machine


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class Ui:
    def __init__(self, tmp_path: Path, name: str, uri: str, experiment: str) -> None:
        self.port = free_port()
        self.uri, self.experiment = uri, experiment
        self.err, self.out = tmp_path / f"{name}.err", tmp_path / f"{name}.out"
        self.started: list[psutil.Process] = []
        env = {**os.environ, "COLUMNS": "200"}
        with self.err.open("w") as err, self.out.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bapo_cli", "ui", "--uri", self.uri, "--experiment", "study"]
                + ["--port", str(self.port)],
                stdout=out,
                stderr=err,
                env=env,
                start_new_session=True,  # so that cleanup can reach everything it started
            )

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def cleanup(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # whatever a failed run left
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(1)
        if self.started:  # the server's own process group (`mlflow ui` leads it)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.started[0].pid, signal.SIGKILL)


def _left(procs: list[psutil.Process]) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=30)
    out = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:  # a zombie listens to nothing
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_bapo_ui_stops_its_whole_server_on_sighup_and_sigint_without_a_traceback(
    tmp_path: Path,
) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    _, experiment = store.open_experiment(uri, "study")  # a store with one, both UIs on it
    uis = {sig: Ui(tmp_path, sig.name, uri, experiment) for sig in (signal.SIGHUP, signal.SIGINT)}
    hup, intr = uis[signal.SIGHUP], uis[signal.SIGINT]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        # SIGINT as soon as `mlflow ui` has started its uvicorn, which is still importing: a
        # Ctrl-C passed on as it came interrupts that import with a KeyboardInterrupt traceback
        # (once the server answers, uvicorn printed one only now and then)
        while len(intr.children()) < 2:
            assert intr.proc.poll() is None, intr.err.read_text()[-3000:]
            assert time.monotonic() < deadline, "bapo ui did not start its server"
            time.sleep(0.1)
        intr.started = intr.children()
        intr.proc.send_signal(signal.SIGINT)
        # SIGHUP once the server answers (a closed terminal or ssh session)
        while not _answers(hup.port):
            assert hup.proc.poll() is None, hup.err.read_text()[-3000:]
            assert time.monotonic() < deadline, "bapo ui did not start its server"
            time.sleep(0.5)
        hup.started = hup.children()
        assert len(hup.started) >= 2  # `mlflow ui` and its uvicorn
        err = hup.err.read_text()
        assert " INFO" not in err and "DeprecationWarning" not in err, err[-3000:]
        hup.proc.send_signal(signal.SIGHUP)
        for ui in uis.values():  # printed before the server starts
            runs = f"http://127.0.0.1:{ui.port}/#/experiments/{ui.experiment}/runs"
            assert f"{ui.uri}: {runs}  (Ctrl-C stops it)" in ui.out.read_text()
        for sig, ui in uis.items():
            code = ui.proc.wait(timeout=60)  # SIGHUP before: uvicorn restarted, bapo ui waited
            assert code == 128 + sig, (sig, code)
            assert _left(ui.started) == [], sig
            assert not _listening(ui.port), sig
            pgid = ui.started[0].pid  # the server's own process group: nothing left in it
            alive = [p for p in psutil.process_iter(["pid"]) if _pgid(p.pid) == pgid]
            assert _left(alive) == [], sig
        err = uis[signal.SIGINT].err.read_text()
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
        assert "Traceback" not in uis[signal.SIGHUP].err.read_text()
    finally:
        for ui in uis.values():
            ui.cleanup()


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None
