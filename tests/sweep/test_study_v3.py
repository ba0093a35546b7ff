"""Study v3's design (docs/study-v3.md) as committed: its sweep commands validate, make the
run count it states, and every arm keeps the matched controls (48 updates of 64 sequences)."""

from __future__ import annotations

import re
import shlex

from bapo_cli.config import hydra_runner
from bapo_cli.config.preflight import preflight
from tests.conftest import REPO

DESIGN = REPO / "docs" / "study-v3.md"


def _sweeps() -> list[list[str]]:
    """The `bapo train -m ...` lines of the design's Commands section, as override lists (the
    results, added later, may quote them again)."""
    text = DESIGN.read_text()
    start = text.index("## Commands, in this order")
    section = text[start : text.index("\n## ", start + 1)]
    lines = re.findall(r"^bapo train -m (.+)$", section, flags=re.MULTILINE)
    return [shlex.split(line) for line in lines]


def test_the_design_commands_make_the_stated_grid() -> None:
    """Jobs counted as Hydra expands them; one job of each arm x algorithm composed and
    validated (composing all 180 takes minutes; the lr and seed values are plain numbers)."""
    jobs = [hydra_runner.expand_sweep(hydra_runner.normalize_overrides(s)) for s in _sweeps()]
    assert [len(j) for j in jobs] == [60, 40, 80]  # GRPO on 3 arms; clip-higher, BAPO x2 on 2
    assert "**Run count: 180**" in DESIGN.read_text()
    cells = {}
    for job in (j for sweep in jobs for j in sweep):
        cells.setdefault(tuple(o for o in job if not o.startswith(("trainer.", "paths."))), job)
    assert len(cells) == 3 + 2 * 3  # GRPO x 3 arms; clip-higher, BAPO 0.4, BAPO 0.5 x 2 arms
    for job in cells.values():
        cfg = preflight("train", job).config
        assert cfg.trainer.lr in (1e-4, 3e-4, 6e-4, 1e-3)
        assert cfg.trainer.seed in range(5)


def test_every_arm_makes_48_updates_of_64_sequences_from_the_shipped_model() -> None:
    for arm, rollout_steps, updates_per_batch in (("reuse1", 48, 1), ("reuse8", 6, 8)) + (
        ("lag8", 48, 1),
    ):
        cfg = preflight("train", [f"experiment=study_v3_{arm}", "algo=grpo"]).config
        assert cfg.trainer.max_steps == rollout_steps
        assert cfg.trainer.max_steps * updates_per_batch == 48
        per_update = cfg.trainer.prompts_per_step // updates_per_batch * cfg.rollout.n
        assert per_update == 64
        assert cfg.trainer.val_every == cfg.trainer.max_steps  # held-out at start and end
        assert (cfg.trainer.val_benchmarks, cfg.trainer.val_n) == (["pairs"], 8)
        assert (cfg.model.name, cfg.rollout.name) == ("tiny_pairs", "hf")
        assert cfg.tracking.experiment == "study_v3"
    lag = preflight("train", ["experiment=study_v3_lag8"]).config.staleness
    assert (lag.regime, lag.k) == ("lag", 8)
