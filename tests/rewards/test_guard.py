"""TimeLimitedWorker: the hard limit, crash recovery, threads and fork, on a tiny test worker."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from bapo_cli.rewards.guard import BACKSTOP_EXTRA_S, TimeLimitedWorker, WorkerStartError

WORKER = textwrap.dedent(
    """
    import os, sys, time
    from bapo_cli.rewards.guard import serve

    def handler(cmd, x):
        if cmd == "sleep":
            time.sleep(x)
        elif cmd == "crash":
            os._exit(3)
        elif cmd == "raise":
            raise KeyError(x)
        elif cmd == "print":
            print("noise on stdout", flush=True)
            sys.stdout.write('{"id": 999999, "ok": "forged"}\\n')
            sys.stdout.flush()
        elif cmd == "pid":
            return os.getpid()
        return x

    serve(handler)
    """
)


@pytest.fixture
def worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "echo_worker.py").write_text(WORKER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with TimeLimitedWorker("echo_worker", startup_timeout_s=60) as w:
        yield w


def test_round_trip_and_lazy_start(worker: TimeLimitedWorker) -> None:
    assert worker.pid is None and worker.starts == 0  # nothing runs before the first call
    out = worker.call(("echo", "\x00\udcff\u2603 \\boxed{"), 10)
    assert (out.status, out.value) == ("ok", "\x00\udcff\u2603 \\boxed{")
    assert worker.starts == 1


def test_timeout_kills_and_restarts(worker: TimeLimitedWorker) -> None:
    worker.call(("echo", 1), 10)  # start-up is not charged to the timed call below
    first = worker.pid
    out = worker.call(("sleep", 30), 0.5)
    assert out.status == "timeout"
    assert 0.5 <= out.seconds < 2.5
    assert worker.pid is None  # killed
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)
    assert worker.call(("echo", 2), 10).value == 2  # a fresh child answers
    assert worker.starts == 2


def test_crash_and_error_are_reported(worker: TimeLimitedWorker) -> None:
    assert worker.call(("crash", 0), 10).status == "crashed"
    out = worker.call(("raise", "k"), 10)
    assert (out.status, out.value) == ("error", "KeyError")
    assert worker.call(("echo", 3), 10).value == 3  # an exception does not kill the child


def test_worker_killed_while_idle_is_replaced(worker: TimeLimitedWorker) -> None:
    worker.call(("echo", 1), 10)
    os.kill(worker.pid, signal.SIGKILL)
    time.sleep(0.2)
    assert worker.call(("echo", 4), 10).value == 4


def test_library_prints_cannot_forge_replies(worker: TimeLimitedWorker) -> None:
    out = worker.call(("print", 7), 10)
    assert (out.status, out.value) == ("ok", 7)


def test_threads_share_one_worker(worker: TimeLimitedWorker) -> None:
    results: list[int] = []

    def run(i: int) -> None:
        results.append(worker.call(("echo", i), 30).value)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(8))
    assert worker.starts == 1


def _child(worker: TimeLimitedWorker, q) -> None:
    q.put(worker.call(("pid", 0), 30).value)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_starts_its_own_worker(worker: TimeLimitedWorker) -> None:
    parent_worker = worker.call(("pid", 0), 30).value
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(worker, q))
    p.start()
    child_worker = q.get(timeout=60)
    p.join(timeout=60)
    assert child_worker != parent_worker
    assert worker.call(("pid", 0), 30).value == parent_worker  # the parent's child survived


def test_start_failure_is_an_error() -> None:
    w = TimeLimitedWorker("no_such_module_for_bapo_tests", startup_timeout_s=30)
    with pytest.raises(WorkerStartError, match="did not start"):
        w.call(("echo", 1), 5)
    with pytest.raises(ValueError, match="timeout_s"):
        w.call(("echo", 1), 0)


def _is_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_child_ends_itself_when_the_parent_dies_mid_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "echo_worker.py").write_text(WORKER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import threading, time\n"
            "from bapo_cli.rewards.guard import TimeLimitedWorker\n"
            "w = TimeLimitedWorker('echo_worker')\n"
            "w.call(('echo', 0), 60)\n"
            "print(w.pid, flush=True)\n"
            "w.call(('sleep', 600), 1.0)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(parent.stdout.readline())
    time.sleep(0.2)  # the sleep request is running
    parent.kill()  # SIGKILL: no finalizer runs, nothing closes the request down
    parent.wait()
    parent.stdout.close()
    deadline = time.monotonic() + 1.0 + BACKSTOP_EXTRA_S + 5
    while time.monotonic() < deadline and not _is_gone(child):
        time.sleep(0.1)
    assert _is_gone(child)
