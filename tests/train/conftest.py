"""Training tests run the real loop on the real tiny model (the shipped weights, as a user's)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bapo_cli.config.preflight import preflight
from bapo_cli.trainer.train import TrainResult, train

# small batches: every test trains in seconds on 2 cores
FAST = [
    "rollout=hf",  # the engine whose log-probs are the trainer's own (vLLM has tests/rollout)
    "tracking=none",
    "trainer.prompts_per_step=8",
    "rollout.n=4",
    "trainer.micro_batch_size=16",
    "rollout.max_tokens=8",
]


def run_train(tmp_path: Path, *overrides: str, name: str = "run") -> TrainResult:
    cfg = preflight("train", [*FAST, *overrides]).config
    return train(cfg, tmp_path / name)


@pytest.fixture(scope="session", autouse=True)
def _tiny_model_built() -> None:
    """Find the tiny model (shipped: no build) before any test times itself."""
    from bapo_cli.models import tiny

    tiny.ensure_tiny(preflight("train", []).config.model.tiny, progress=False)


def train_in_background(
    run_dir: Path, *overrides: str, base: tuple[str, ...] = tuple(FAST), env: dict | None = None
) -> subprocess.Popen:
    """`bapo train` in a subprocess, its stderr piped (the async, server and DDP-server tests)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **(env or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "bapo_cli", "train", *base, *overrides, f"hydra.run.dir={run_dir}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def wait_for(condition, timeout_s: float, what: str, proc: subprocess.Popen | None = None):
    """Poll `condition`; fail on the timeout, or at once if `proc` (the trainer) has exited."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the trainer exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
