"""Study v3's design (docs/study-v3.md) as committed: its sweep commands validate, make the
run count it states, and every arm keeps the matched controls (48 updates of 64 sequences)."""

from __future__ import annotations

import re
import shlex

from bapo_cli.config import hydra_runner
from bapo_cli.config.preflight import preflight
from tests.conftest import REPO
from tests.sweep.conftest import load_script

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


def _analysis():
    """scripts/study_v3.py, the design's rules as code (gates, Holm, frontier)."""
    return load_script("study_v3")


def test_holm_rejects_in_order_and_stops_at_the_first_miss() -> None:
    holm = _analysis().holm
    # thresholds 0.0125, 0.0167, 0.025, 0.05 for the sorted p-values
    p = {"a": 0.032, "b": 0.008, "c": 0.016, "d": 0.008}
    assert holm(p) == dict.fromkeys("abcd", True)
    p = {"a": 0.06, "b": 0.008, "c": 0.016, "d": 0.008}
    assert holm(p) == {"a": False, "b": True, "c": True, "d": True}
    # 0.02 > 0.0167 stops the rest, even d's 0.04, which would pass 0.05 on its own
    p = {"a": 0.02, "b": 0.02, "c": 0.008, "d": 0.04}
    assert holm(p) == {"a": False, "b": False, "c": True, "d": False}
    # the design's arithmetic: with five seeds the first rejection needs p = 2/252
    assert holm({"a": 4 / 252, "b": 1, "c": 1, "d": 1}) == dict.fromkeys("abcd", False)


def test_frontier_needs_every_smaller_lr_to_pass() -> None:
    m = _analysis()
    assert (
        m.frontier({1e-4: 0.1, 3e-4: 0.0, 6e-4: -0.1, 1e-3: 0.0}) == "0.0003"
    )  # 1e-3 passes alone
    assert m.frontier({1e-4: -0.031, 3e-4: 0.1, 6e-4: 0.1, 1e-3: 0.1}) == "< 0.0001"
    assert m.frontier({1e-4: 0.1, 3e-4: 0.1, 6e-4: 0.1, 1e-3: -0.029}) == "≥ 0.001"
    assert m.frontier({1e-4: 0.1, 3e-4: -0.03}) == "0.0001"  # -0.03 is not above the margin
    assert m.frontier_higher("0.0006", "0.0003") == "yes"
    assert m.frontier_higher("0.0003", "0.0003") == "no"
    assert m.frontier_higher("< 0.0001", "< 0.0001") == "not determinable"
    assert m.frontier_higher("≥ 0.001", "≥ 0.001") == "not determinable"
    assert m.frontier_higher("≥ 0.001", "0.0006") == "yes"


def test_gate_g1_wants_a_mean_drop_and_four_seeds_below_zero() -> None:
    g1 = _analysis().g1
    assert g1([-0.1, -0.1, -0.1, -0.1, 0.05])  # mean -0.07, 4 of 5 below 0
    assert not g1([-0.2, -0.2, -0.1, 0.05, 0.05])  # mean -0.08 but only 3 below 0
    assert not g1([-0.04, -0.04, -0.04, -0.04, -0.04])  # all below 0, mean above -0.05
    assert not g1([])
