"""The README's first command, `bapo train experiment=demo`, shows what BAPO is for: on the
pair-search task its clip bounds leave PPO's [0.6, 1.2] from the first steps, where on the default
`data=arith` they never do (there the positive share is already above rho0). Two real steps of
each, as configured (only the step count and tracking changed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bapo_cli.config.preflight import preflight
from bapo_cli.trainer.train import train

SHORT = ["trainer.max_steps=2", "tracking=none"]


def _bounds(tmp_path: Path, name: str, *overrides: str) -> list[tuple[float, float]]:
    cfg = preflight("train", [*overrides, *SHORT]).config
    history = train(cfg, tmp_path / name).history
    return [(h["bapo/c_low"], h["bapo/c_high"]) for h in history]


@pytest.mark.slow  # two full-size pairs steps
def test_the_demo_moves_bapos_bounds_and_arith_does_not(tmp_path: Path) -> None:
    demo = preflight("train", ["experiment=demo"]).config
    assert (demo.data.kind, demo.model.name, demo.algo.name) == ("pairs", "tiny_pairs", "bapo")
    assert demo.trainer.max_steps == 150
    moved = _bounds(tmp_path, "demo", "experiment=demo")
    assert any(low > 0.6 or high > 1.2 for low, high in moved), moved
    kept = _bounds(tmp_path, "arith", "trainer.prompts_per_step=8", "rollout.n=4")
    assert kept == [(0.6, 1.2)] * 2
