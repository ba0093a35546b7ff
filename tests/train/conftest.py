"""Training tests run the real loop on the real tiny model (the shipped weights, as a user's)."""

from __future__ import annotations

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
