"""scripts/stress2.py and scripts/ess_readout.py: the stress design's read-out (issue 34), fixed
before its runs: the 40 pooled verdicts (Holm over the family, the two-setting answer rules) and
the ESS question (Fisher, AUROC, the two-setting "yes"), on hand-made runs and a real store."""

from __future__ import annotations

import csv
import itertools
import math
import sys
import time
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from bapo_cli import report
from tests.conftest import REPO
from tests.sweep.conftest import load_script

stress2 = load_script("stress2")
ess = sys.modules["ess_readout"]
Run = stress2.study_v3.Run

# ------------------------------------------------------------------------ the design's family


def test_the_family_is_21_configurations_and_40_comparisons() -> None:
    assert len(stress2.CONFIGURATIONS) == 21 and len(set(stress2.CONFIGURATIONS)) == 21
    assert len(stress2.COMPARISONS) == 40
    assert {c for _, c in stress2.COMPARISONS} == set(stress2.CONFIGURATIONS) - {"grpo"}
    # `algo=glob(*)` when the design was committed: the presets that shipped then, i.e. today's
    # less issue 45's four (a re-run of the design's command would sweep those too)
    shipped = {p.stem for p in (REPO / "conf" / "algo").glob("*.yaml")}
    assert set(stress2.PRESETS) == shipped - {"topr", "dcpo", "vespo", "luspo"}
    # E_q and the outcome are `bapo report`'s own columns, not a re-derivation
    headers = [h for h, _ in report.COLUMNS]
    assert {ess.EQ_KEY, ess.FINAL_KEY, stress2.KEY, "final ESS"} <= set(headers)


def test_configuration_adds_old_logprob_only_off_its_default() -> None:
    assert stress2.configuration({"algo": "grpo"}) == "grpo"
    assert stress2.configuration({"algo": "grpo", "trainer.old_logprob": "behaviour"}) == "grpo"
    assert (
        stress2.configuration({"algo": "grpo", "trainer.old_logprob": "loglinear"})
        == "grpo+loglinear"
    )
    assert stress2.configuration({"algo": "vcpo", "trainer.old_logprob": "behaviour"}) == "vcpo"


def test_holm_over_the_40_by_hand() -> None:
    # thresholds 0.05/40 = 0.00125, 0.05/39 = 0.001282, 0.05/38 = 0.001316, 0.05/37 = 0.001351
    p = {
        ("reuse8", "bapo"): 0.0001,  # rank 1: <= 0.00125
        ("lag8", "cispo"): 0.0012,  # rank 2: <= 0.001282
        ("reuse8", "sapo"): 0.0013,  # rank 3: <= 0.001316
        ("lag8", "m2po"): 0.00136,  # rank 4: > 0.001351: Holm stops here
        ("reuse8", "dapo"): 0.0014,  # rank 5: never reached
    }
    rejected = stress2.holm_over_family(p)
    assert len(rejected) == 40
    assert {k for k, v in rejected.items() if v} == {
        ("reuse8", "bapo"),
        ("lag8", "cispo"),
        ("reuse8", "sapo"),
    }
    # the comparisons not run still count: over the 5 alone (0.05/2 = 0.025 at rank 4) all pass
    assert all(stress2.study_v3.holm({str(k): v for k, v in p.items()}).values())


def test_answer_rules() -> None:
    assert stress2.answer([0.1, 0.05], 1e-5, True) == "real"
    assert stress2.answer([-0.1, -0.05], 1e-5, True) == "real"  # a real harm is real too
    assert stress2.answer([0.2, -0.01], 1e-5, True) == "not replicated"
    assert stress2.answer([0.2, 0.0], 1e-5, True) == "not replicated"  # a zero is no sign
    assert stress2.answer([0.1, 0.1], 0.01, False) == "indicated"
    assert stress2.answer([0.1, -0.1], 0.01, False) == "indicated"  # unadjusted, pooled p
    assert stress2.answer([0.1, 0.1], 0.05, False) == "no"


# ------------------------------------------------------------------------ hand-made settings


def _runs(shift: dict[tuple[str, str], float], configs=("grpo", "bapo", "cispo", "dapo", "sapo")):
    """8 seeds per cell; each cell's seeds are 0.00 ... 0.07 in some order, so a cell's mean
    difference from GRPO's is exactly its shift."""
    runs = []
    for arm in stress2.ARMS:
        for c in configs:
            for s in range(8):
                v = shift.get((arm, c), 0.0) + 0.01 * ((3 * s + len(c)) % 8)
                runs.append(Run(arm, 6e-4, c, s, {"held-out change": v}))
    return runs


def test_hand_made_runs_get_each_answer() -> None:
    both = {("reuse8", "bapo"): 0.1, ("reuse8", "dapo"): 0.03, ("lag8", "bapo"): -0.1}
    a = _runs({**both, ("reuse8", "cispo"): 0.2})
    b = _runs({**both, ("reuse8", "cispo"): -0.005})  # setting B: barely the other way
    out = stress2.verdicts({"A": a, "B": b}, samples=20_000)
    answers = {k: v["pooled"][3] for k, v in out.items() if "pooled" in v}
    assert answers == {
        ("reuse8", "bapo"): "real",
        ("reuse8", "cispo"): "not replicated",
        ("reuse8", "dapo"): "indicated",
        ("reuse8", "sapo"): "no",
        ("lag8", "bapo"): "real",  # a harm, same sign in A and B
        ("lag8", "cispo"): "no",
        ("lag8", "dapo"): "no",
        ("lag8", "sapo"): "no",
    }
    # per setting: the exact permutation p; 8 v 8 fully separated is 2 / C(16, 8) = 2 / 12870
    diff, p, na, nb = out[("reuse8", "bapo")]["A"]
    assert diff == pytest.approx(0.1) and p == pytest.approx(2 / 12870) and (na, nb) == (8, 8)
    assert out[("reuse8", "cispo")]["B"][0] == pytest.approx(-0.005)
    # pooled: the mean of the within-setting differences
    assert out[("reuse8", "cispo")]["pooled"][0] == pytest.approx((0.2 - 0.005) / 2)
    dapo = out[("reuse8", "dapo")]["pooled"]
    assert 0.05 / 37 < dapo[1] < 0.05 and dapo[2] is False  # passes unadjusted, not Holm
    # comparisons nobody ran are missing, not "no"
    assert "pooled" not in out[("reuse8", "vcpo")] and out[("reuse8", "vcpo")]["A"] is None
    md = stress2.table(out, ["A", "B"])
    assert "| reuse8 | cispo | +0.200, p = 0.0002 (8 v 8) |" in md
    assert "**not replicated**" in md and "| reuse8 | vcpo | missing |" in md


def test_a_configuration_outside_the_design_is_refused() -> None:
    runs = _runs({}, configs=("grpo", "bapo0.5"))
    with pytest.raises(ValueError, match="bapo0.5 are not among the design's 21"):
        stress2.verdicts({"A": runs, "B": runs}, samples=100)
    # runs of other lrs or arms are not the design's and are left alone
    other = [Run("reuse1", 6e-4, "bapo0.5", 0, {}), Run("reuse8", 1e-4, "x", 0, {})]
    assert stress2.pick(other, 6e-4, None) == []


# ------------------------------------------------------------------------ Fisher and AUROC


def test_fisher_by_hand() -> None:
    # [[3, 1], [1, 3]]: margins 4 / 4 of 8; P(X >= 3) = (C(4,3) C(4,1) + C(4,4) C(4,0)) / C(8,4)
    assert ess.fisher_greater(3, 1, 1, 3) == pytest.approx(17 / 70)
    assert ess.fisher_greater(4, 0, 0, 4) == pytest.approx(1 / 70)
    assert ess.fisher_greater(0, 4, 4, 0) == 1.0  # the fewest possible: every table counts
    assert ess.fisher_greater(0, 0, 0, 0) == 1.0
    # one falling run, and it collapsed; 1 of 10 collapsed: P = 1/10
    assert ess.fisher_greater(1, 0, 0, 9) == pytest.approx(0.1)


def test_fisher_matches_scipy() -> None:
    scipy_stats = pytest.importorskip("scipy.stats")
    for a, b, c, d in itertools.product(range(0, 7, 2), range(0, 5), range(0, 6, 3), range(4)):
        want = scipy_stats.fisher_exact([[a, b], [c, d]], alternative="greater").pvalue
        assert ess.fisher_greater(a, b, c, d) == pytest.approx(want, rel=1e-9, abs=1e-12)


counts = st.integers(0, 12)


@settings(max_examples=150, deadline=None)
@given(counts, counts, counts, counts)
def test_fisher_p_is_a_probability_and_falls_as_collapses_move_into_the_falling_row(
    a, b, c, d
) -> None:
    p = ess.fisher_greater(a, b, c, d)
    assert 0.0 <= p <= 1.0 + 1e-12
    if c > 0:  # a collapsed run moves from the steady row to the falling row
        assert ess.fisher_greater(a + 1, b, c - 1, d) <= p + 1e-12
    if c > 0 and b > 0:  # ... and a kept run the other way: the margins stay, p drops strictly
        assert ess.fisher_greater(a + 1, b - 1, c - 1, d + 1) < p


def _brute_auroc(scores: list[float], positive: list[bool]) -> float:
    pos = [s for s, p in zip(scores, positive, strict=True) if p]
    neg = [s for s, p in zip(scores, positive, strict=True) if not p]
    wins = sum(1.0 if x > y else 0.5 if x == y else 0.0 for x in pos for y in neg)
    return wins / (len(pos) * len(neg))


def test_auroc_by_hand() -> None:
    assert ess.auroc([0.9, 0.8, 0.1, 0.2], [True, True, False, False]) == 1.0
    assert ess.auroc([0.1, 0.2, 0.9, 0.8], [True, True, False, False]) == 0.0
    assert ess.auroc([0.5, 0.5], [True, False]) == 0.5  # a tie counts 1/2
    # pairs (pos, neg): (3,1) win, (3,3) tie, (2,1) win, (2,3) loss: (1 + 0.5 + 1 + 0) / 4
    assert ess.auroc([3, 2, 1, 3], [True, True, False, False]) == pytest.approx(2.5 / 4)
    assert ess.auroc([0.1, 0.2], [True, True]) is None


labelled = st.lists(st.tuples(st.integers(0, 6), st.booleans()), min_size=2, max_size=30)


@settings(max_examples=150, deadline=None)
@given(labelled)
def test_auroc_equals_the_pair_count_with_ties(pairs) -> None:
    scores, positive = [float(s) for s, _ in pairs], [p for _, p in pairs]
    assume(any(positive) and not all(positive))
    got = ess.auroc(scores, positive)
    assert 0.0 <= got <= 1.0
    assert got == pytest.approx(_brute_auroc(scores, positive))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=20, unique=True), st.data())
def test_auroc_of_the_negated_score_is_one_minus_it_without_ties(scores, data) -> None:
    positive = data.draw(st.lists(st.booleans(), min_size=len(scores), max_size=len(scores)))
    assume(any(positive) and not all(positive))
    assert ess.auroc([-s for s in scores], positive) == pytest.approx(
        1 - ess.auroc(scores, positive)
    )


def test_ess_table_cells_and_read_outs() -> None:
    # (E_q, held-out final): falling & collapse x2, falling & kept, steady & collapse,
    # steady & kept x3, and two runs left out (no ESS logged; no held-out)
    pairs = [(0.2, 0.01), (0.3, 0.0), (0.4, 0.2), (0.9, 0.04), (0.5, 0.2), (0.8, 0.3)]
    pairs += [(0.7, 0.05), (None, 0.0), (0.1, None)]
    t = ess.ess_table(pairs)
    cells = (t.falling_collapse, t.falling_kept, t.steady_collapse, t.steady_kept)
    assert cells == (2, 1, 1, 3) and t.left_out == 2 and t.runs == 7
    assert t.p == pytest.approx(ess.fisher_greater(2, 1, 1, 3))
    assert t.sensitivity == pytest.approx(2 / 3) and t.specificity == pytest.approx(3 / 4)
    # -E_q: collapsed {-0.2, -0.3, -0.9} vs kept {-0.4, -0.5, -0.8, -0.7}: 2 x 4 + 0 wins of 12
    assert t.auroc == pytest.approx(8 / 12)


# ------------------------------------------------------------------------ the ESS answer


def _ess_runs(associated: bool) -> list:
    """Every configuration of both arms; E_q 0.3 or 0.9, held-out final 0.01 or 0.2. Seeds 0-5
    of every fifth (arm, configuration) cell fall (9 configurations in all); with `associated`
    exactly the falling runs collapse, else seeds 6 and 7 of every cell, none of them falling."""
    runs = []
    for i, (arm, c) in enumerate(itertools.product(stress2.ARMS, stress2.CONFIGURATIONS)):
        for s in range(8):
            falling = i % 5 == 0 and s < 6
            collapse = falling if associated else s >= 6
            values = {
                "held-out change": 0.0,
                ess.EQ_KEY: 0.3 if falling else 0.9,
                ess.FINAL_KEY: 0.01 if collapse else 0.2,
            }
            runs.append(Run(arm, 6e-4, c, s, values))
    return runs


def test_ess_answer_is_yes_only_under_both_settings() -> None:
    yes, no = _ess_runs(True), _ess_runs(False)
    whole, within = stress2.ess_tables({"A": yes, "B": yes})
    assert whole["A"].runs == 336 and whole["A"].p < 1e-10
    assert ess.answer(whole, ["A", "B"]) == "yes"
    cells = (whole["A"].falling_collapse, whole["A"].steady_kept)
    assert cells == (54, 282) and whole["A"].falling_kept == whole["A"].steady_collapse == 0
    # the 9 configurations with falling runs collapse in 6 of their 16 runs: a table each
    assert len(within) == 18 and all(t.falling_collapse == 6 and t.runs == 16 for *_, t in within)
    whole, within = stress2.ess_tables({"A": yes, "B": no})
    assert whole["B"].falling_collapse == 0 and whole["B"].p == 1.0
    assert ess.answer(whole, ["A", "B"]) == "no"
    # in B every configuration has 4 collapses of 16: each gets its own table
    assert len([n for n, _, _ in within if n == "B"]) == 21
    assert ess.answer({"A": whole["A"]}, ["A", "B"]) == "not determinable"
    md = stress2.ess_markdown(whole, within, ["A", "B"])
    assert "**Answer: no**" in md and "| B | grpo | 16 |" in md
    (row_a,) = [line for line in md.splitlines() if line.startswith("| A | 336 |")]
    assert row_a.startswith("| A | 336 | 54 | 0 | 0 | 282 | ") and "e-" in row_a  # not 0.0000
    assert ess.fmt_p(0.04) == "0.0400" and ess.fmt_p(3e-7) == "3.0e-07"


# ------------------------------------------------------------------------ a real store


def _store_run(client, exp, overrides: str, params: dict, change: float, eq: float) -> str:
    """A run as a sweep job logs it: its overrides tag, its config as params, held-out at step 0
    and at the end (6 steps), `actor/ess` per step (E_q = `eq` at step 2)."""
    rid = client.create_run(exp).info.run_id
    now = int(time.time() * 1000)
    ess_values = [1.0, eq, 0.05, 0.8, 0.8, 0.8]
    metrics = [Metric("val/pairs/avg_at_8", 0.2, now, 0)]
    metrics += [Metric("val/pairs/avg_at_8", 0.2 + change, now, 6)]
    metrics += [Metric("actor/ess", v, now, s) for s, v in enumerate(ess_values, start=1)]
    metrics += [Metric("reward/mean", 0.1, now, s) for s in range(1, 7)]
    tags = [RunTag("bapo.overrides", overrides)]
    client.log_batch(rid, metrics, [Param(k, v) for k, v in params.items()], tags)
    client.set_terminated(rid)
    return rid


def _store(path: Path, cap: str = "5.0", drift: bool = False) -> str:
    uri = f"sqlite:///{path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("algos_stress2")
    for seed in range(2):
        for algo, old, change in (
            ("grpo", "behaviour", -0.1),
            ("bapo", "behaviour", -0.05),
            ("grpo", "loglinear", -0.15),
        ):
            typed = f"algo={algo} experiment=study_v3_reuse8 trainer.lr=6e-4 trainer.seed={seed}"
            if old != "behaviour":
                typed += f" trainer.old_logprob={old} algo.behav_weight_cap=5"
            params = {
                "algo.name": algo,
                "trainer.lr": "0.0006",
                "trainer.seed": str(seed),
                "trainer.old_logprob": old,
                "algo.behav_weight_cap": cap if old != "behaviour" else "None",
                "trainer.max_steps": "7" if drift and seed == 1 and algo == "bapo" else "6",
            }
            _store_run(client, exp, typed, params, change + 0.01 * seed, 0.3 + 0.1 * seed)
    return uri


def test_a_real_store_is_read_by_configuration_arm_and_seed(tmp_path: Path) -> None:
    uri = _store(tmp_path)
    runs = stress2.load(uri)
    got = sorted((r.arm, r.algo, r.seed) for r in runs)
    assert got == sorted(
        ("reuse8", c, s) for c in ("grpo", "bapo", "grpo+loglinear") for s in range(2)
    )
    bapo1 = next(r for r in runs if r.algo == "bapo" and r.seed == 1)
    assert bapo1.lr == 6e-4
    assert bapo1.values["held-out change"] == pytest.approx(-0.04)  # report's column, final - 0
    assert bapo1.values[ess.EQ_KEY] == pytest.approx(0.4)  # min of steps 1-2 of 6
    out = stress2.verdicts({"A": runs, "B": runs}, samples=1_000)
    diff, p, na, nb = out[("reuse8", "grpo+loglinear")]["A"]
    assert diff == pytest.approx(-0.05) and (na, nb) == (2, 2)


def test_a_store_that_breaks_the_design_is_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(report.ReportError, match=r"algo.behav_weight_cap=None; the design's"):
        stress2.load(_store(tmp_path / "a", cap="None"))
    drifted = _store(tmp_path / "b", drift=True)
    with pytest.raises(report.ReportError, match=r"\(reuse8, bapo\) differ in trainer.max_steps"):
        stress2.load(drifted)
    assert stress2.main([drifted, drifted]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "mlflow" not in line]
    assert len(err) == 1 and err[0].startswith("error: runs ")  # MLflow's own INFO lines aside


def test_export_and_read_out_from_csv_equal_the_store(tmp_path: Path, capsys) -> None:
    uri = _store(tmp_path)
    a_csv = tmp_path / "A.csv"
    assert stress2.main(["--export", uri, str(a_csv)]) == 0
    with a_csv.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and rows[0].keys() >= {ess.EQ_KEY, "held-out final", "final ESS"}
    from_csv = stress2.load_setting(str(a_csv))
    from_store = stress2.load(uri)
    key = lambda r: (r.arm, r.algo, r.seed)  # noqa: E731
    by_key = {key(r): r.values for r in from_store}
    for r in from_csv:
        for k in stress2.CSV_KEYS:
            want = by_key[key(r)][k]
            assert r.values[k] == want  # exact: the CSV holds repr()
    # the whole read-out from CSVs, written to --out
    out = tmp_path / "out"
    args = [str(a_csv), str(a_csv), "--out", str(out), "--samples", "1000"]
    assert stress2.main(args) == 0
    md = (out / "stress2.md").read_text()
    assert "| reuse8 | bapo | +0.050, p = 0.3333 (2 v 2) |" in md
    assert "**Answer: " in md
    with (out / "ess_runs.csv").open() as f:
        ess_rows = list(csv.DictReader(f))
    assert len(ess_rows) == 12
    first = next(r for r in ess_rows if r["configuration"] == "grpo" and r["seed"] == "0")
    assert (first["falling"], first["collapse"]) == ("True", "False")  # E_q 0.3; final 0.1
    with (out / "comparisons.csv").open() as f:
        comp = list(csv.DictReader(f))
    assert len(comp) == 40
    assert math.isclose(
        float(next(r for r in comp if r["configuration"] == "bapo")["A diff"]), 0.05
    )


@pytest.mark.slow  # 40 permutation tests of 200,000 draws
def test_the_committed_stress_table_reads_back() -> None:
    """docs/algorithms.md's stress-table results, re-drawn from the committed per-run CSVs (672
    runs, 8 seeds per setting): the 40 answers' real ones, and the ESS answer with its tables."""
    root = REPO / "docs/algos-pairs/stress2"
    settings = {
        name: stress2.load_setting(
            ",".join(str(root / f"setting-{name}-seed{s}.csv") for s in range(8))
        )
        for name in ("A", "B")
    }
    assert [len(runs) for runs in settings.values()] == [336, 336]
    out = stress2.verdicts(settings)
    real = {k: round(v["pooled"][0], 3) for k, v in out.items() if v["pooled"][3] == "real"}
    assert real == {
        ("reuse8", "gspo"): 0.107,
        ("reuse8", "vcpo"): 0.075,
        ("reuse8", "prime_default"): -0.044,
        ("reuse8", "kl_cov"): -0.076,
        ("reuse8", "sapo"): -0.08,
        ("reuse8", "grpo+loglinear"): -0.077,
        ("reuse8", "m2po"): -0.098,
        ("reuse8", "cispo"): -0.099,
        ("reuse8", "ce_gppo"): -0.098,
        ("reuse8", "grpo+recompute"): -0.099,
        ("lag8", "gspo"): 0.115,
        ("lag8", "vcpo"): 0.072,
        ("lag8", "bapo"): -0.044,
        ("lag8", "dapo"): -0.033,
        ("lag8", "kl_cov"): -0.103,
        ("lag8", "sapo"): -0.103,
        ("lag8", "grpo+loglinear"): -0.108,
        ("lag8", "m2po"): -0.108,
        ("lag8", "cispo"): -0.109,
        ("lag8", "ce_gppo"): -0.109,
        ("lag8", "grpo+recompute"): -0.109,
    }
    assert not [k for k, v in out.items() if v["pooled"][3] == "not replicated"]
    whole, _ = stress2.ess_tables(settings)
    assert [
        (t.falling_collapse, t.falling_kept, t.steady_collapse, t.steady_kept)
        for t in whole.values()
    ] == [(132, 204, 0, 0), (126, 210, 0, 0)]
    assert ess.answer(whole, ["A", "B"]) == "no"
