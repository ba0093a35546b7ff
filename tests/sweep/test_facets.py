"""`bapo report` compares runs by their config facets, wherever they came from (issue 23 item 3).

Runs started one by one carry no sweep overrides, only the config they record; before facets,
`bapo report --experiment NAME --baseline algo=grpo` refused them ("no group has it"). Here real
`bapo train` runs (tiny settings, one step, a real SQLite store under tmp) started one at a time
and the jobs of one `-m` sweep land in one experiment and are grouped and compared together.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from bapo_cli import report
from bapo_cli.cli import app

runner = CliRunner()
EXPERIMENT = "facets"
TINY = [
    "experiment=smoke",
    "tracking=mlflow",
    f"tracking.experiment={EXPERIMENT}",
    "rollout=hf",
    "trainer.max_steps=1",
    "trainer.prompts_per_step=4",
    "rollout.n=2",
]


def _train(*overrides: str) -> None:
    result = runner.invoke(app, ["train", *TINY, *overrides])
    assert result.exit_code == 0, result.output


def _final_rewards(client: MlflowClient, runs: list, algo: str) -> list[float]:
    out = []
    for run in runs:
        if run.data.params["algo.name"] == algo:
            (point,) = client.get_metric_history(run.info.run_id, "reward/mean")
            out.append(point.value)
    return out


@pytest.mark.slow
def test_runs_started_one_by_one_and_a_sweep_compare_by_facets(_output_root: Path) -> None:
    _train("algo=grpo", "trainer.seed=0")  # one by one: no sweep, no overrides tag
    _train("algo=bapo", "trainer.seed=0")
    # a sweep whose jobs type the default lr in another spelling than the one recorded
    _train("-m", "algo=grpo,bapo", "trainer.seed=1", "trainer.lr=1e-4")
    uri = f"sqlite:///{_output_root}/mlflow.db"
    out = _output_root / "report"
    result = runner.invoke(
        app,
        ["report", "--experiment", EXPERIMENT, "--uri", uri, "--out", str(out)]
        + ["--baseline", "algo=grpo"],
    )
    assert result.exit_code == 0, result.output
    assert "4 runs compared" in result.output

    with (out / "runs.csv").open() as f:
        labels = sorted(r["run"] for r in csv.DictReader(f))
    assert labels == [
        "algo=bapo trainer.seed=0",
        "algo=bapo trainer.seed=1",
        "algo=grpo trainer.seed=0",
        "algo=grpo trainer.seed=1",
    ]
    assert "| algo=grpo | 2 |" in (out / "groups.md").read_text()

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    runs = [r for r in runs if r.data.tags.get("bapo.role") != "sweep"]
    assert sorted("bapo.overrides" in r.data.tags for r in runs) == [False, False, True, True]
    bapo, grpo = _final_rewards(client, runs, "bapo"), _final_rewards(client, runs, "grpo")
    with (out / "comparisons.csv").open() as f:
        (row,) = list(csv.DictReader(f))
    assert (row["group"], row["vs"], row["seeds"]) == ("algo=bapo", "algo=grpo", "2 vs 2")
    diff = sum(bapo) / 2 - sum(grpo) / 2
    assert row["final reward diff"] == f"{diff:+.3f}"
    assert row["final reward p"] == f"{report.permutation_p(bapo, grpo):.3f}"

    # a facet only a sweep's overrides could tell: refused in one line, naming what works
    blind = runner.invoke(
        app, ["report", "--experiment", EXPERIMENT, "--uri", uri, "--facet", "experiment"]
    )
    assert blind.exit_code == 2
    said = " ".join(blind.output.split())
    singles = sorted(r.info.run_id[:12] for r in runs if "bapo.overrides" not in r.data.tags)
    assert f"--facet experiment: not recorded by 2 run(s) ({', '.join(singles)})" in said
    assert "use a config key they record (e.g. staleness.k, trainer.lr, algo)" in said
