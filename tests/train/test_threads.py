"""Thread counts from the cores actually free, and sleeping OpenMP waits (issue 21 item 5).

A step slowed 15-60x on a busy machine where a fair share predicts ~4x: torch ran a thread per
core whatever else ran, and its threads spun at barriers. `benchmarks/bench_load.py` measures
the effect; these tests pin the rules.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bapo_cli import threads


@pytest.mark.parametrize(
    ("cores", "load", "free"),
    [(2, 0.0, 2), (2, 0.4, 2), (2, 1.3, 1), (2, 12.0, 1), (8, 3.0, 5), (1, 0.0, 1)],
)
def test_free_cores_is_what_the_load_leaves_at_least_one(cores: int, load: float, free: int):
    assert threads.free_cores(cores, load) == free


@pytest.mark.slow  # starts processes
def test_busy_loops_that_just_started_leave_one_thread() -> None:
    """Real CPU-bound processes, one per usable core: the choice sees them at once (runnable
    now), a minute before the load average would."""
    cores = threads.usable_cores()
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        time.sleep(0.5)
        assert threads.other_load() >= cores - 0.5
        choice = threads.choose(current=cores)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    assert choice.threads == 1, choice


def test_explicit_settings_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BAPO_THREADS", "3")
    assert threads.choose(current=2).threads == 3
    monkeypatch.delenv("BAPO_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun's default, or the user's
    assert threads.choose(current=5) == threads.ThreadChoice(5, "OMP_NUM_THREADS=1")


def _env_after_import(**env: str) -> str:
    """OMP_WAIT_POLICY and KMP_BLOCKTIME as a fresh process sees them once bapo_cli is imported."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "KMP_BLOCKTIME")}
    clean.pop("BAPO_THREADS", None)
    code = (
        "import os, bapo_cli; "
        "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('KMP_BLOCKTIME'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.slow  # starts processes
def test_importing_the_package_makes_openmp_waits_sleep_unless_told_otherwise() -> None:
    assert _env_after_import() == "PASSIVE 0"
    assert _env_after_import(OMP_WAIT_POLICY="ACTIVE") == "ACTIVE 0"
    assert _env_after_import(BAPO_THREADS="legacy") == "None None"
