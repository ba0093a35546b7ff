"""Adding a staleness regime is its class (and a test): the schema, the run plan and the trainer
read everything else from it.

A toy regime registered here, in a test module, validates by its own rules, describes itself in
the run plan, and trains: the trainer asks it how many updates a batch makes and whether the first
may score itself, so each step makes the toy's two updates, the second one version stale.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from bapo_cli.config.errors import ConfigError
from bapo_cli.config.preflight import PreflightError, preflight
from bapo_cli.launch import plan
from bapo_cli.rollout.base import Sample
from bapo_cli.staleness.regimes import REGIMES, Regime, regime, split_groups
from tests.train.conftest import FAST, run_train


@dataclass
class Halves(Regime):
    """Toy: each fresh batch trains as two halves, both scored by a separate pass."""

    @classmethod
    def updates_per_batch(cls, k: int) -> int:
        return 2

    @classmethod
    def describe(cls, k: int, epochs: int) -> str:
        return f"halves: 2 updates per rollout batch × {epochs} epochs"

    @classmethod
    def check_run(cls, cfg) -> None:
        if cfg.trainer.prompts_per_step % 2:
            prompts = cfg.trainer.prompts_per_step
            raise ConfigError("trainer.prompts_per_step", prompts, "must be even (halves)")

    def next_batch(self) -> list[Sample]:
        return self.collector.complete(self.draw(self.prompts_per_step))

    @classmethod
    def split(cls, samples: list[Sample], k: int) -> list[list[Sample]]:
        return split_groups(samples, 2)


@pytest.fixture
def halves():
    regime("halves")(Halves)
    yield
    REGIMES.remove("halves")
    assert "halves" not in REGIMES


def _error(*overrides: str) -> str:
    with pytest.raises(PreflightError) as info:
        preflight("train", list(overrides))
    return str(info.value)


def test_a_registered_regime_validates_by_its_own_rules_and_describes_itself(halves) -> None:
    cfg = preflight("train", ["staleness=1", "staleness.regime=halves"]).config
    assert (cfg.staleness.regime, cfg.staleness.k) == ("halves", 1)
    described = plan.describe_staleness(1, "halves", 3)
    assert described == "halves: 2 updates per rollout batch × 3 epochs"
    assert _error("staleness.regime=halves", "trainer.prompts_per_step=7") == (
        "trainer.prompts_per_step=7: must be even (halves)"
    )
    # the shared rule of every regime but reuse, named for this one
    assert _error("staleness=0", "staleness.regime=halves") == (
        "staleness.regime=halves: needs staleness.k >= 1 (k=0 is on-policy: use reuse)"
    )
    # the valid names are the registry's, in registration order
    assert _error("staleness.regime=bogus").endswith("reuse, replay, partial, lag, async, halves")


def test_a_registered_regime_trains_with_its_own_update_count(tmp_path, halves) -> None:
    assert "rollout=hf" in FAST  # the toy does not defer: every token is scored by a pass
    result = run_train(tmp_path, "staleness=1", "staleness.regime=halves", "trainer.max_steps=2")
    assert [m["actor/updates"] for m in result.history] == [2.0, 2.0]
    assert [u["staleness_max"] for u in result.updates] == [0.0, 1.0, 0.0, 1.0]
    first = result.updates[0]
    assert first["ratio_max"] == pytest.approx(1.0)  # on-policy, scored by a separate pass
