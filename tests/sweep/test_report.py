"""`bapo report`: tables from hand-made histories, and one-line errors for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from bapo_cli import report
from bapo_cli.cli import app

runner = CliRunner()


def _run(overrides: str, rewards: list[float], entropy: float = 0.5) -> report.RunData:
    steps = range(1, len(rewards) + 1)
    return report.RunData(
        run_id=overrides.replace(" ", "_"),
        name=overrides,
        status="FINISHED",
        overrides=overrides.split(),
        histories={
            "reward/mean": list(zip(steps, rewards, strict=True)),
            "actor/entropy": [(s, entropy) for s in steps],
            "actor/c_low": [(s, 0.8) for s in steps],
        },
    )


def test_labels_drop_shared_overrides_and_groups_average_seeds() -> None:
    runs = [
        _run("x=1 algo=grpo trainer.seed=0", [0.0] * 9 + [0.2], entropy=0.4),
        _run("x=1 algo=grpo trainer.seed=1", [0.0] * 9 + [0.4], entropy=0.6),
        _run("x=1 algo=bapo trainer.seed=0", [0.5] * 10),
    ]
    report.label_runs(runs)
    assert [r.label for r in runs] == [
        "algo=grpo trainer.seed=0",
        "algo=grpo trainer.seed=1",
        "algo=bapo trainer.seed=0",
    ]
    assert [r.group for r in runs] == ["algo=grpo", "algo=grpo", "algo=bapo"]
    # final = mean of the last 10% of steps (here the last one); best = highest step
    assert runs[0].values["final reward"] == pytest.approx(0.2)
    assert runs[1].values["best reward"] == pytest.approx(0.4)
    assert runs[0].values["mean rho"] is None  # never logged: an empty cell, not 0
    (name, n, stats), (_, n2, _) = report.group_rows(runs)
    assert (name, n, n2) == ("algo=grpo", 2, 1)
    assert stats["final reward"] == pytest.approx((0.3, 0.1414213), rel=1e-5)
    assert stats["final entropy"] == pytest.approx((0.5, 0.1414213), rel=1e-5)
    header, rows = report.groups_table(runs)
    assert rows[0][header.index("final reward")] == "0.300 ± 0.141"
    assert rows[0][header.index("mean rho")] == ""


def test_write_report_without_a_store_writes_tables_and_plots(tmp_path: Path) -> None:
    runs = [
        _run("algo=grpo trainer.seed=0", [0.1, 0.2]),
        _run("algo=bapo trainer.seed=0", [0.3, 0.4]),
    ]
    out = report.write_report(runs, tmp_path / "r")
    names = sorted(p.name for p in out.files)
    assert names == ["clip_bounds.png", "entropy.png", "reward.png", "runs.csv", "runs.md"]
    assert out.parent_id is None


def test_report_on_missing_sweep_dir_is_one_line(tmp_path: Path) -> None:
    result = runner.invoke(app, ["report", "--sweep", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert f"sweep dir {tmp_path / 'nope'} does not exist" in " ".join(result.output.split())


def test_report_on_runs_without_metrics_says_so(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("empty")
    ids = [client.create_run(exp).info.run_id for _ in range(2)]
    result = runner.invoke(app, ["report", *ids, "--uri", uri])
    assert result.exit_code == 2, result.output
    assert "no metrics in run(s)" in result.output and "nothing to compare" in result.output
    by_name = runner.invoke(app, ["report", "--experiment", "nope", "--uri", uri])
    assert by_name.exit_code == 2 and "no experiment 'nope'" in by_name.output


def test_report_wants_exactly_one_source(tmp_path: Path) -> None:
    result = runner.invoke(app, ["report"])
    assert result.exit_code == 2 and "exactly one of" in result.output
    both = runner.invoke(app, ["report", "abc", "--experiment", "x"])
    assert both.exit_code == 2 and "exactly one of" in both.output


def test_report_on_a_dir_that_is_not_a_sweep(tmp_path: Path) -> None:
    result = runner.invoke(app, ["report", "--sweep", str(tmp_path)])
    assert result.exit_code == 2 and "not a sweep" in result.output


def test_facet_makes_one_panel_column_per_value(tmp_path: Path) -> None:
    runs = [
        _run(f"algo={a} staleness='{k}' trainer.seed={s}", [0.1 * s, 0.2])
        for a in ("grpo", "bapo")
        for k in (0, 8)
        for s in (0, 1)
    ]
    out = report.write_report(runs, tmp_path / "r", facet="staleness")
    assert (tmp_path / "r" / "groups.md").read_text().count("\n") == 2 + 4
    assert "| algo=grpo staleness=0 | 2 |" in (tmp_path / "r" / "groups.md").read_text()
    from PIL import Image

    with Image.open(tmp_path / "r" / "reward.png") as image:  # two panels side by side
        assert image.width > 1.8 * image.height
    assert len([p for p in out.files if p.suffix == ".png"]) == 3


# ------------------------------------------------------------- held-out outcome and significance


def _study_run(overrides: str, held_out: tuple[float, float], rho: list[float]) -> report.RunData:
    run = _run(overrides, [0.1] * len(rho))
    steps = range(1, len(rho) + 1)
    run.histories["actor/rho"] = list(zip(steps, rho, strict=True))
    run.histories["val/pairs/avg_at_8"] = [(0, held_out[0]), (len(rho), held_out[1])]
    return run


def test_held_out_columns_read_the_validation_metric_and_start_rho_the_first_tenth() -> None:
    run = _study_run("algo=grpo", (0.2, 0.35), [0.3] * 2 + [0.9] * 18)
    report.label_runs([run])
    assert run.values["held-out start"] == pytest.approx(0.2)
    assert run.values["held-out final"] == pytest.approx(0.35)
    assert run.values["start rho"] == pytest.approx(0.3)  # first 10% of 20 steps = 2 steps


def test_permutation_p_is_exact_on_small_samples() -> None:
    # 20 ways to split 6 values 3/3; only the observed split and its mirror are as extreme
    assert report.permutation_p([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]) == pytest.approx(2 / 20)
    # identical groups: every split is at least as extreme as a zero difference
    assert report.permutation_p([1.0, 1.0], [1.0, 1.0]) == 1.0
    # 5 vs 5 perfectly separated: the smallest p a 5-seed study can reach
    assert report.permutation_p([0.0] * 5, [1.0, 1.1, 1.2, 1.3, 1.4]) == pytest.approx(2 / 252)
    # Monte-Carlo branch (C(40,20) splits): clearly separated samples give a tiny p
    p = report.permutation_p([float(i) for i in range(20)], [100.0 + i for i in range(20)])
    assert p == pytest.approx(1 / 20_001)
    with pytest.raises(ValueError, match="at least one value"):
        report.permutation_p([], [1.0])


def test_comparisons_match_the_baseline_within_each_facet_value(tmp_path: Path) -> None:
    runs = []
    for arm, shift in (("reuse8", 0.1), ("lag8", 0.0)):
        for seed in range(3):
            runs.append(
                _study_run(f"experiment={arm} algo=grpo trainer.seed={seed}", (0.2, 0.3), [0.3])
            )
            final = 0.3 + shift + 0.01 * seed
            runs.append(
                _study_run(f"experiment={arm} algo=bapo trainer.seed={seed}", (0.2, final), [0.3])
            )
    out = report.write_report(runs, tmp_path / "r", facet="experiment", baseline="algo=grpo")
    assert "comparisons.md" in [p.name for p in out.files]
    header, rows = report.comparisons_table(runs, "algo=grpo", "experiment")
    assert header[:4] == ["experiment", "group", "vs", "seeds"]
    assert [r[:4] for r in rows] == [
        ["reuse8", "algo=bapo", "algo=grpo", "3 vs 3"],
        ["lag8", "algo=bapo", "algo=grpo", "3 vs 3"],
    ]
    diff, p = header.index("held-out final diff"), header.index("held-out final p")
    assert rows[0][diff] == "+0.110" and rows[0][p] == "0.100"  # separated: 2 of 20 splits
    assert rows[1][diff] == "+0.010"
    with pytest.raises(report.ReportError, match="--baseline algo=ppo: no group has it"):
        report.comparisons_table(runs, "algo=ppo", "experiment")
    # the baseline is itself a facet value: nothing shares a column with it, said in one line
    with pytest.raises(report.ReportError, match="must set another key"):
        report.comparisons_table(runs, "experiment=reuse8", "experiment")


# ----------------------------------------------------- facets: runs from anywhere, by config


def _cfg_run(
    algo: str, lr: str, seed: int, final: float, *, k: str = "8", typed: str | None = None
) -> report.RunData:
    """A run as the store holds it: recorded config (params), and typed overrides only when it
    was a sweep job (`typed`)."""
    params = {
        "algo.name": algo,
        "algo.loss": {"grpo": "ppo"}.get(algo.split("@")[0], "bapo"),
        "algo.advantage": "grpo",
        "staleness.k": k,
        "staleness.regime": "reuse",
        "trainer.prompts_per_step": "64" if k == "8" else "8",
        "trainer.lr": lr,
        "trainer.seed": str(seed),
        "tracking.uri": f"sqlite:////tmp/store{seed}/mlflow.db",  # where it logged: no facet
    }
    if "@" in algo:  # bapo@0.4: BAPO with that rho0
        params["algo.name"], params["algo.rho0"] = algo.split("@")
    run = _study_run(typed or params["algo.name"], (0.3, final), [0.3])
    run.overrides = typed.split() if typed else None
    run.params = params
    return run


def test_facets_label_runs_from_sweeps_and_from_single_runs_alike() -> None:
    runs = [
        _cfg_run("grpo", "0.0003", 0, 0.30),  # started on its own
        _cfg_run("grpo", "0.0003", 1, 0.31, typed="algo=grpo trainer.lr=3e-4 trainer.seed=1"),
        _cfg_run("bapo@0.4", "0.0003", 0, 0.35),
        _cfg_run("bapo@0.5", "0.0003", 0, 0.36),
        _cfg_run("grpo", "0.0003", 2, 0.32, k="1"),
    ]
    keys = report.label_runs(runs)
    # staleness.k determines prompts_per_step (dropped); the store's path is not a facet
    assert keys == ["algo", "algo.rho0", "staleness.k"]
    assert [r.label for r in runs] == [
        "algo=grpo staleness.k=8 trainer.seed=0",
        "algo=grpo staleness.k=8 trainer.seed=1",  # typed 3e-4, recorded 0.0003: one group
        "algo=bapo algo.rho0=0.4 staleness.k=8 trainer.seed=0",
        "algo=bapo algo.rho0=0.5 staleness.k=8 trainer.seed=0",
        "algo=grpo staleness.k=1 trainer.seed=2",
    ]
    # presets label, configs decide: the same config typed as staleness=8 in one sweep and as
    # an experiment preset in another is one group; a preset name the configs determine labels
    mixed = [
        _cfg_run("grpo", "0.0003", 0, 0.3, typed="staleness=8 trainer.seed=0"),
        _cfg_run("grpo", "0.0003", 1, 0.3, typed="experiment=study_v3_reuse8 trainer.seed=1"),
        _cfg_run("grpo", "0.0003", 2, 0.3, k="1", typed="experiment=study_v3_reuse1"),
    ]
    report.label_runs(mixed)
    assert [r.group for r in mixed] == ["staleness.k=8", "staleness.k=8", "staleness.k=1"]
    named = [mixed[1], mixed[2]]
    report.label_runs(named)
    assert [r.group for r in named] == ["experiment=study_v3_reuse8", "experiment=study_v3_reuse1"]
    assert report.canonical("1e-4") == report.canonical("0.0001") == "0.0001"
    assert report.canonical("'8'") == report.canonical("8.0") == "8"
    assert report.canonical("True") == "true"


def test_baseline_is_found_in_each_cell_of_the_other_facets(tmp_path: Path) -> None:
    runs = []
    for lr in ("0.0003", "0.0006"):
        for seed in range(3):
            grpo = 0.30 - (0.2 if lr == "0.0006" else 0.0) + 0.01 * seed
            runs.append(_cfg_run("grpo", lr, seed, grpo))
            runs.append(_cfg_run("bapo@0.4", lr, seed, grpo + 0.1))
            runs.append(_cfg_run("bapo@0.5", lr, seed, grpo - 0.001 * seed))
    header, rows = report.comparisons_table(runs, "algo=grpo")
    assert [r[:3] for r in rows] == [
        ["algo=bapo algo.rho0=0.4 trainer.lr=0.0003", "algo=grpo trainer.lr=0.0003", "3 vs 3"],
        ["algo=bapo algo.rho0=0.5 trainer.lr=0.0003", "algo=grpo trainer.lr=0.0003", "3 vs 3"],
        ["algo=bapo algo.rho0=0.4 trainer.lr=0.0006", "algo=grpo trainer.lr=0.0006", "3 vs 3"],
        ["algo=bapo algo.rho0=0.5 trainer.lr=0.0006", "algo=grpo trainer.lr=0.0006", "3 vs 3"],
    ]
    change, p = header.index("held-out change diff"), header.index("held-out change p")
    assert [r[change] for r in rows] == ["+0.100", "-0.001", "+0.100", "-0.001"]
    assert [r[p] for r in rows][::2] == ["0.100", "0.100"]  # separated: 2 of 20 splits
    # the facet column splits the table; the cells are the same
    header, faceted = report.comparisons_table(runs, "algo=grpo", facet="trainer.lr")
    assert [r[:3] for r in faceted][:2] == [
        ["0.0003", "algo=bapo algo.rho0=0.4", "algo=grpo"],
        ["0.0003", "algo=bapo algo.rho0=0.5", "algo=grpo"],
    ]
    # algo.loss is part of the algo choice: both BAPO groups share the lr cell
    with pytest.raises(report.ReportError, match="two groups have it in one cell"):
        report.comparisons_table(runs, "algo.loss=bapo")
    with pytest.raises(report.ReportError, match="every group has it"):
        report.comparisons_table(runs, "staleness.k=8")
    with pytest.raises(report.ReportError, match="must be KEY=VALUE, e.g. algo=grpo"):
        report.comparisons_table(runs, "grpo")
    with pytest.raises(
        report.ReportError,
        match="--facet algo.rho: no run has it; keys that differ: algo, algo.rho0, trainer.lr",
    ):
        report.write_report(runs, tmp_path / "r", facet="trainer.lr,algo.rho")
    out = report.write_report(runs, tmp_path / "r", facet="trainer.lr,staleness.k")
    assert "comparisons.md" not in [p.name for p in out.files]


def test_quadrant_table_and_mechanism_columns(tmp_path: Path) -> None:
    runs = []
    for seed, low_pos in ((0, 0.2), (1, 0.4)):
        run = _run(f"algo=bapo trainer.seed={seed}", [0.1, 0.2, 0.3])
        shares = {"high_pos": 0.1, "low_pos": low_pos, "high_neg": 0.2, "low_neg": 0.3}
        for q, share in shares.items():
            run.histories[f"tokens/quadrant_{q}_active_mass"] = [(1, share), (2, share)]
            run.histories[f"tokens/quadrant_{q}_clipped_mass"] = [(1, 0.0), (2, 0.02)]
        run.histories["response/length_mean"] = [(1, 30.0)] + [(s, 20.0) for s in range(2, 11)]
        run.histories["bapo/rho_before"] = [(1, 0.35), (2, 0.37)]
        runs.append(run)
    out = report.write_report(runs, tmp_path / "r")
    assert {"quadrants.md", "quadrants.csv"} <= {p.name for p in out.files}
    header, rows = report.quadrant_table(runs)
    (row,) = rows
    assert row[header.index("low_pos active")] == "0.300"  # seed mean of 0.2 and 0.4
    assert row[header.index("low_neg clipped")] == "0.010"  # mean over steps of 0, 0.02
    # push: -high_pos + low_pos + high_neg - low_neg = -0.1 + 0.3 + 0.2 - 0.3
    assert row[header.index("net entropy push")] == "+0.100"
    assert runs[0].values["length start"] == pytest.approx(30.0)  # first 10% of 10 steps
    assert runs[0].values["length final"] == pytest.approx(20.0)
    assert runs[0].values["mean rho before"] == pytest.approx(0.36)
    assert report.quadrant_table([_run("a=1", [0.1])]) is None
