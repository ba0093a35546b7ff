"""scripts/paper45.py: the paper's comparison read-out (issue 45), fixed before its runs: the three
families and their Holm, the configuration names the sweeps produce, the design's sentences, on
hand-made runs; and the ablation's base (GRPO is clip-higher at [0.8, 1.2], bit for bit)."""

from __future__ import annotations

import pytest
import torch

from bapo_cli.algos.losses import policy_loss
from tests.conftest import REPO
from tests.sweep.conftest import load_script

paper45 = load_script("paper45")
Run = paper45.study_v3.Run


def test_the_families_are_16_6_and_6_over_13_configurations() -> None:
    assert [len(paper45.FAMILIES[f]) for f in ("Q1", "Q2", "Q3")] == [16, 6, 6]
    assert len(set(paper45.CONFIGURATIONS)) == 13
    used = {c for rows in paper45.FAMILIES.values() for _, a, b in rows for c in (a, b)}
    assert used == set(paper45.CONFIGURATIONS)
    # every preset the design names ships
    presets = {p.stem for p in (REPO / "conf" / "algo").glob("*.yaml")}
    assert {"grpo", "dapo", "topr", "dcpo", "bapo", "vespo", "luspo", "clip_higher"} <= presets


@pytest.mark.parametrize(
    ("facets", "name"),
    [
        ({"algo": "grpo"}, "grpo"),
        ({"algo": "bapo"}, "bapo0.4"),  # the preset's rho0
        ({"algo": "bapo", "algo.rho0": "0.5"}, "bapo0.5"),
        ({"algo": "clip_higher"}, "clip[0.80,1.28]"),
        ({"algo": "clip_higher", "algo.eps_high": "1.0"}, "clip[0.80,2.00]"),
        ({"algo": "clip_higher", "algo.eps_low": "0.4", "algo.eps_high": "0.2"}, "clip[0.60,1.20]"),
        ({"algo": "grpo", "trainer.old_logprob": "recompute"}, "grpo+recompute"),
        (
            {"algo": "grpo", "trainer.old_logprob": "recompute", "rollout.seq_mask": "kpop"},
            "grpo+recompute+kpop",
        ),
        ({"algo": "grpo", "rollout.seq_mask": "none"}, "grpo"),
    ],
)
def test_configuration_names(facets: dict[str, str], name: str) -> None:
    assert paper45.configuration(facets) == name


def _runs(values: dict[tuple[str, str], list[float]]) -> list:
    return [
        Run(arm, paper45.LR, config, seed, {paper45.KEY: v})
        for (arm, config), vs in values.items()
        for seed, v in enumerate(vs)
    ]


def _design(shift: dict[str, float], jitter: float = 0.0) -> list:
    """Every configuration on both arms, 4 seeds (few relabelings: fast): seed s has the value
    shift[c] + s * 0.001 (+ a per-configuration jitter)."""
    return _runs(
        {
            (arm, c): [shift.get(c, 0.0) + s * 0.001 + jitter * i for s in range(4)]
            for arm in paper45.ARMS
            for i, c in enumerate(paper45.CONFIGURATIONS)
        }
    )


def test_bapo_far_ahead_of_all_four_is_real_and_the_claim_holds() -> None:
    shift = {"bapo0.4": 1.0, "bapo0.5": 1.0}
    results = paper45.verdicts({"A": _design(shift), "B": _design(shift)}, samples=2000)
    for key, row in results["Q1"].items():
        diff, p, passed, answer = row["pooled"]
        assert diff == pytest.approx(1.0) and passed and answer == "real", key
    lines = paper45.claims(results)
    assert "Q1 reuse8: bapo0.4 ahead of GRPO, DAPO, TOPR and DCPO: holds" in lines
    assert "Q1 lag8: bapo0.5 ahead of GRPO, DAPO, TOPR and DCPO: holds" in lines
    # nothing moved in Q3: neither ablation sentence holds
    assert "Q3a reuse8: raising c_high helps: does not hold" in lines
    assert "Q3b lag8: loosening c_low hurts: does not hold" in lines


def test_one_rival_level_with_bapo_breaks_the_claim() -> None:
    shift = {"bapo0.4": 1.0, "bapo0.5": 1.0, "dcpo": 1.0}
    results = paper45.verdicts({"A": _design(shift), "B": _design(shift)}, samples=2000)
    assert results["Q1"][("reuse8", "bapo0.4", "dcpo")]["pooled"][3] == "no"
    assert results["Q1"][("reuse8", "bapo0.4", "topr")]["pooled"][3] == "real"
    assert "Q1 reuse8: bapo0.4 ahead of GRPO, DAPO, TOPR and DCPO: does not hold" in (
        paper45.claims(results)
    )


def test_signs_that_differ_between_settings_are_not_replicated() -> None:
    a = _design({"clip[0.60,1.20]": -1.0})
    b = _design({"clip[0.60,1.20]": 1.0})
    results = paper45.verdicts({"A": a, "B": b}, samples=2000)
    row = results["Q3"][("reuse8", "clip[0.60,1.20]", "grpo")]
    assert row["A"][0] == pytest.approx(-1.0) and row["B"][0] == pytest.approx(1.0)
    # the pooled mean is 0 here, so it cannot pass; a harm in both settings is what holds
    assert row["pooled"][3] == "no"
    results = paper45.verdicts({"A": a, "B": _design({"clip[0.60,1.20]": -0.5})}, samples=2000)
    assert results["Q3"][("reuse8", "clip[0.60,1.20]", "grpo")]["pooled"][3] == "real"
    assert "Q3b reuse8: loosening c_low hurts: holds" in paper45.claims(results)


def test_kpop_is_compared_with_its_matched_control_not_with_grpo() -> None:
    # GRPO far below everything: KPop's comparison must not see it
    shift = {"grpo": -5.0, "grpo+recompute+kpop": 0.0, "grpo+recompute": 0.0}
    results = paper45.verdicts({"A": _design(shift), "B": _design(shift)}, samples=2000)
    row = results["Q2"][("lag8", "grpo+recompute+kpop", "grpo+recompute")]
    assert row["pooled"][0] == pytest.approx(0.0) and row["pooled"][3] == "no"
    assert results["Q2"][("lag8", "vespo", "grpo")]["pooled"][3] == "real"


def test_missing_runs_count_in_the_family_and_read_not_determinable() -> None:
    shift = {"bapo0.4": 1.0, "bapo0.5": 1.0}
    a = [r for r in _design(shift) if r.algo != "topr"]
    results = paper45.verdicts({"A": a, "B": _design(shift)}, samples=2000)
    assert "pooled" not in results["Q1"][("reuse8", "bapo0.4", "topr")]
    assert results["Q1"][("reuse8", "bapo0.4", "topr")]["A"] is None
    assert "Q1 reuse8: bapo0.4 ahead of GRPO, DAPO, TOPR and DCPO: not determinable" in (
        paper45.claims(results)
    )
    text = paper45.markdown(results, ["A", "B"])
    assert "**not determinable**" in text and "Holm (α 0.05 over 16)" in text


def test_a_configuration_outside_the_design_is_refused() -> None:
    runs = _design({}) + [Run("reuse8", paper45.LR, "sapo", 0, {paper45.KEY: 0.0})]
    with pytest.raises(ValueError, match="sapo are not among the design's 13"):
        paper45.verdicts({"A": runs, "B": _design({})}, samples=100)


def test_the_ablation_base_grpo_is_clip_higher_at_0_8_1_2_bit_for_bit() -> None:
    """Q3 compares fixed clip bounds with GRPO's runs: GRPO's `ppo` loss at eps 0.2 and the
    clip-higher loss at (0.2, 0.2) give the same value and gradient, so GRPO is the [0.8, 1.2]
    cell of the ablation without a run of its own."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        log_prob = (torch.randn(6, 9, generator=g) * 0.5 - 2).requires_grad_()
        old = torch.randn(6, 9, generator=g) * 0.5 - 2
        adv = torch.randn(6, generator=g)
        mask = torch.rand(6, 9, generator=g) > 0.2
        ppo, _ = policy_loss("ppo", log_prob, old, adv, mask, eps=0.2, dual_clip=3.0)
        (g_ppo,) = torch.autograd.grad(ppo, log_prob)
        clip, _ = policy_loss(
            "clip_higher", log_prob, old, adv, mask, eps_low=0.2, eps_high=0.2, dual_clip=3.0
        )
        (g_clip,) = torch.autograd.grad(clip, log_prob)
        assert torch.equal(ppo, clip) and torch.equal(g_ppo, g_clip)


def test_the_reuse_gate_asks_every_printed_column_to_be_equal() -> None:
    committed = paper45.replicate.load_csv(paper45.STRESS2_ROW, paper45.CSV_KEYS)
    remade = [r for r in committed if r.arm == "reuse8" and r.algo in paper45.REUSABLE]
    assert len(remade) == 5 and all(paper45.gate(remade).values())
    # one column off in its last printed digit: that configuration is re-made, the rest reused
    dapo = next(r for r in remade if r.algo == "dapo")
    off = Run(dapo.arm, dapo.lr, dapo.algo, dapo.seed, dict(dapo.values))
    off.values["final entropy"] = off.values["final entropy"] * (1 + 1e-15)
    assert off.values["final entropy"] != dapo.values["final entropy"]
    result = paper45.gate([off if r is dapo else r for r in remade])
    assert result == {**{name: True for name in paper45.REUSABLE}, "dapo": False}
    # a configuration not re-made is not reused
    assert paper45.gate([r for r in remade if r.algo != "bapo"])["bapo"] is False
