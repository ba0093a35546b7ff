"""A real single-node SLURM cluster for the tests here (scripts/slurm_local.sh, issue 48).

CI starts it before the tests (.ci/run). Under the README's plain `pytest -n 2` the first test
that needs it starts it (once, under a file lock: each xdist worker has its own session) when
this machine can: root, apt-get and Debian. Else a test module skips whole, in one line saying
why (`skip_module_unless_possible`), or fails when $BAPO_REQUIRE_SLURM is set (CI: the SLURM tests
must run, not skip).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "slurm_local.sh"
LOCK = Path("/tmp/bapo-slurm-local.lock")
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


def unavailable() -> str | None:
    """Why a local cluster cannot be started here, else None."""
    if os.name != "posix" or not Path("/etc/debian_version").exists():
        return "not Debian (scripts/slurm_local.sh installs Debian's slurm packages)"
    if os.geteuid() != 0:
        return "not root (scripts/slurm_local.sh installs packages and runs the daemons as root)"
    if shutil.which("apt-get") is None:
        return "no apt-get (scripts/slurm_local.sh installs Debian's slurm packages with it)"
    return None


def skip_module_unless_possible() -> None:
    """At a test module's import: one skip line for the whole module saying why a cluster cannot
    be started here (an error instead when BAPO_REQUIRE_SLURM is set)."""
    why = unavailable()
    if why is None:
        return
    line = f"SLURM tests: {why}"
    if os.environ.get("BAPO_REQUIRE_SLURM"):
        raise RuntimeError(f"{line}, and BAPO_REQUIRE_SLURM is set")
    pytest.skip(line, allow_module_level=True)


@pytest.fixture(scope="session")
def slurm() -> None:
    """A running cluster of scripts/slurm_local.sh's, started if need be (once for all xdist
    workers); a failure to start is an error, not a skip."""
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one start for all xdist workers
        started = subprocess.run(
            ["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=600
        )
    assert started.returncode == 0, started.stdout + started.stderr


def sbatch(script: Path, cwd: Path) -> str:
    """Submit `script`; its job id. The job's console is 400 columns wide (sbatch passes the
    environment on): rich wraps at 80 without a terminal, paths too, and the tests read paths."""
    out = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        cwd=cwd,
        env={**os.environ, "COLUMNS": "400"},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().split(";")[0]


def job(job_id: str) -> dict[str, str]:
    """`scontrol show job` as {field: value} (JobState, Restarts, ExitCode, ...)."""
    out = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, check=True
    ).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def wait_until(condition, timeout_s: float, what: str, poll_s: float = 0.2):  # noqa: ANN001
    """Poll `condition` until it returns something true; that value. Fails on the timeout."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)
    return value


def wait_done(job_id: str, timeout_s: float, restarts: int = 0) -> dict[str, str]:
    """The job's record once it ended after `restarts` requeues."""

    def ended() -> dict[str, str] | None:
        info = job(job_id)
        done = info["JobState"] in DONE and int(info.get("Restarts", 0)) >= restarts
        return info if done else None

    return wait_until(ended, timeout_s, f"job {job_id} to end", poll_s=0.5)


@contextlib.contextmanager
def cancelled_at_exit(jobs: list[str]) -> Iterator[list[str]]:
    """Jobs a failed test submitted do not outlive it."""
    try:
        yield jobs
    finally:
        for job_id in jobs:
            subprocess.run(["scancel", job_id], capture_output=True)
