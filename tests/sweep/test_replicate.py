"""scripts/replicate.py: issue 32's two-setting verdicts (the stratified permutation test, the
pooled answer rules) on hand-made runs; the study's loader is tested in test_study_v3."""

from __future__ import annotations

import itertools
import random
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import REPO
from tests.sweep.conftest import load_script

rep = load_script("replicate")
study_v3 = sys.modules["study_v3"]

values = st.lists(st.integers(-50, 50).map(lambda v: v / 100), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(values, values)
def test_one_stratum_is_the_study_permutation_test(a, b) -> None:
    stat, p = rep.stratified_permutation_p([(a, b)])
    assert stat == pytest.approx(sum(a) / len(a) - sum(b) / len(b))
    assert p == pytest.approx(study_v3.permutation_p(a, b))


def test_two_strata_by_hand() -> None:
    # each stratum relabels to +1 or -1; the mean over strata is 1, 0, 0, -1: two of four reach |1|
    assert rep.stratified_permutation_p([([1.0], [0.0]), ([1.0], [0.0])]) == (1.0, 0.5)
    # a shift between strata is not evidence: labels never cross strata
    shifted = [([1.0, 1.1], [0.0, 0.1]), ([11.0, 11.1], [10.0, 10.1])]
    stat, p = rep.stratified_permutation_p(shifted)
    assert stat == pytest.approx(1.0)
    # 6 x 6 relabelings; |mean| >= 1 only for the observed split and its mirror in both strata
    assert p == pytest.approx(2 / 36)


def test_monte_carlo_agrees_with_exact() -> None:
    strata = [([0.1, 0.3, 0.2, 0.4], [0.0, 0.1, -0.1, 0.2]), ([0.2, 0.1, 0.3], [0.1, 0.0, 0.05])]
    _, exact = rep.stratified_permutation_p(strata)
    _, approx = rep.stratified_permutation_p(strata, samples=1_000)  # 70 x 20 > 1000: sampled
    assert abs(exact - approx) < 0.03


@pytest.mark.parametrize("n", [1, 2, 7, 12870, 2**31 + 5])
def test_bulk_draws_are_the_draws_of_choice(n) -> None:
    """`choice_draws` reads the Mersenne Twister's words in bulk: the same indices, in the same
    order, as `random.Random(...).choice` one by one (which the committed verdicts were drawn
    with), and the generator is left as it was."""
    rng = random.Random(5)
    before = rng.getstate()
    bulk = rep.choice_draws(rng, n, 3_000)
    assert rng.getstate() == before
    one_by_one = random.Random(5)
    assert bulk.tolist() == [one_by_one.choice(range(n)) for _ in range(3_000)]


def test_monte_carlo_of_equal_strata_is_the_draw_by_draw_count() -> None:
    """Strata of one size take the bulk draws: p is the one the draw-by-draw loop gives."""
    strata = [
        ([0.1, 0.3, 0.2, 0.4], [0.0, 0.1, -0.1, 0.2]),
        ([0.2, 0.1, 0.3, 0.5], [0.1, 0.0, 0.05, 0.3]),
    ]
    observed, p = rep.stratified_permutation_p(strata, samples=1_000)  # 70 x 70 > 1000: sampled

    def stat(a: list[float], b: list[float], idx: tuple[int, ...]) -> float:  # the script's
        pooled = [*a, *b]
        sa = sum(pooled[i] for i in idx)
        return sa / len(a) - (sum(pooled) - sa) / len(b)

    choices = [
        [stat(a, b, idx) for idx in itertools.combinations(range(len(a) + len(b)), len(a))]
        for a, b in strata
    ]
    rng, tol = random.Random(0), 1e-12 * max(1.0, abs(observed))
    hits = sum(
        abs(sum(rng.choice(c) for c in choices) / len(strata)) >= abs(observed) - tol
        for _ in range(1_000)
    )
    assert p == (hits + 1) / 1_001


def test_empty_stratum_is_refused() -> None:
    with pytest.raises(ValueError, match="each side"):
        rep.stratified_permutation_p([([1.0], [])])


def _runs(shift: dict[tuple[str, str], float], seeds=range(5)) -> list:
    """GRPO at 0 (+ seed noise) and each BAPO cell at `shift`, in the two stale arms at 6e-4."""
    runs = []
    for arm in study_v3.STALE:
        for algo in ("grpo", "bapo0.4", "bapo0.5"):
            for seed in seeds:
                change = shift.get((arm, algo), 0.0) + 0.01 * ((seed * 7) % 5 - 2)
                runs.append(study_v3.Run(arm, 6e-4, algo, seed, {"held-out change": change}))
    return runs


def test_verdicts_follow_the_design_rules() -> None:
    both = {("reuse8", "bapo0.5"): 0.08, ("lag8", "bapo0.4"): -0.08}
    flip = {("reuse8", "bapo0.5"): 0.20, ("lag8", "bapo0.4"): -0.08}
    a = _runs(both)
    b = _runs({**both, ("reuse8", "bapo0.5"): -0.02})  # the yes flips sign in setting B
    out = rep.verdicts({"A": a, "B": _runs(both)}, 6e-4)
    assert out[("reuse8", "bapo0.5")]["pooled"][3] == "yes"
    assert out[("lag8", "bapo0.4")]["pooled"][3] == "replicated harm"
    assert out[("reuse8", "bapo0.4")]["pooled"][3] == "no"
    assert out[("reuse8", "bapo0.5")]["A"][2] is True  # 5 v 5 separated: p = 2/252, Holm rejects
    flipped = rep.verdicts({"A": _runs(flip), "B": b}, 6e-4)
    diff, p, sig, answer = flipped[("reuse8", "bapo0.5")]["pooled"]
    assert diff == pytest.approx((0.20 - 0.02) / 2) and sig and answer == "not replicated"
    # --seeds keeps the chosen seeds only
    few = rep.verdicts({"A": a, "B": a}, 6e-4, seeds={0, 1})
    assert few[("reuse8", "bapo0.5")]["A"][1] == pytest.approx(
        study_v3.permutation_p(
            study_v3.cell([r for r in a if r.seed < 2], "reuse8", 6e-4, "bapo0.5", rep.KEY),
            study_v3.cell([r for r in a if r.seed < 2], "reuse8", 6e-4, "grpo", rep.KEY),
        )
    )
    table = rep.table(out, ["A", "B"])
    assert "| reuse8 | ρ0 0.5 |" in table and "**yes**" in table and "**replicated harm**" in table


def test_csv_round_trip_and_stages_join(tmp_path) -> None:
    runs = _runs({("reuse8", "bapo0.5"): 0.08})
    for r in runs:
        r.values = {**r.values, "held-out start": 0.2, "held-out final": None, "final entropy": 0.5}
    out = tmp_path / "all.csv"
    rep.export_csv(runs, out)
    back = rep.load_csv(out)
    key = lambda r: (r.arm, r.lr, r.algo, r.seed)  # noqa: E731
    assert sorted(map(key, back)) == sorted(map(key, runs))
    by_key = {key(r): r.values for r in back}
    for r in runs:
        assert by_key[key(r)]["held-out change"] == r.values["held-out change"]  # exact: repr
        assert by_key[key(r)]["held-out final"] is None
    # two stages of one setting join; the verdicts equal those drawn from the runs themselves
    first = tmp_path / "s1.csv"
    later = tmp_path / "s2.csv"
    rep.export_csv([r for r in runs if r.seed < 3], first)
    rep.export_csv([r for r in runs if r.seed >= 3], later)
    joined = rep.load_setting(f"{first},{later}")
    assert rep.verdicts({"A": joined, "B": joined}, 6e-4) == rep.verdicts(
        {"A": runs, "B": runs}, 6e-4
    )
    # overlapping stages are refused: a run counted twice would inflate the seeds
    with pytest.raises(ValueError, match="appears twice"):
        rep.load_setting(f"{first},{first}")


def test_a_bad_csv_is_one_line(tmp_path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("arm,lr,algo,seed\nreuse8,0.0006,grpo,0\n")
    assert rep.main([str(bad), str(bad)]) == 2
    bad.write_text("arm,lr,algo,seed,held-out change\nreuse8,0.0006,grpo,0,abc\n")
    with pytest.raises(ValueError, match="held-out change 'abc' is not a number"):
        rep.load_csv(bad)


def test_the_committed_stage_one_csv_reads_back() -> None:
    runs = rep.load_setting(str(REPO / "docs/study-v3/replication/stage1-setting-B.csv"))
    assert len(runs) == 30 and {r.seed for r in runs} == set(range(5))
    out = rep.verdicts({"B": runs}, 6e-4)
    diff, p, _ = out[("reuse8", "bapo0.5")]["B"]
    assert round(diff, 3) == 0.043 and round(p, 3) == 0.230  # docs/study-v3.md, stage 1


def test_the_committed_pooled_verdict_reads_back() -> None:
    """docs/study-v3.md's pooled Q1 answers, re-drawn from the committed per-run CSVs (96 runs)."""
    r = REPO / "docs/study-v3/replication"
    a = rep.load_setting(f"{r}/stage2-setting-A.csv,{r}/stage3-setting-A.csv")
    b = rep.load_setting(f"{r}/stage1-setting-B.csv,{r}/stage3-setting-B.csv")
    assert len(a) == len(b) == 48 and {x.seed for x in a} == {x.seed for x in b} == set(range(8))
    out = rep.verdicts({"A": a, "B": b}, 6e-4)
    answers = {c: (round(v["pooled"][0], 3), v["pooled"][3]) for c, v in out.items()}
    assert answers == {
        ("reuse8", "bapo0.4"): (-0.010, "no"),
        ("reuse8", "bapo0.5"): (0.045, "yes"),
        ("lag8", "bapo0.4"): (-0.044, "replicated harm"),
        ("lag8", "bapo0.5"): (0.045, "yes"),
    }
