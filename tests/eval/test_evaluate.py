"""`bapo eval` end to end on the tiny model and the AIME 2024 file shipped with the package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bapo_cli.config.preflight import PreflightError, preflight
from bapo_cli.evaluation.evaluate import evaluate
from tests.conftest import run_bapo


def test_eval_on_tiny_model_writes_results_and_samples(tmp_path: Path) -> None:
    cfg = preflight(
        "eval",
        [
            "eval.limit=5",  # benchmark=aime24 (the default), its shipped file
            "eval.n=2",
            "tracking=mlflow",
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        ],
    ).config
    results = evaluate(cfg, tmp_path / "run")
    entry = results["aime24"]
    assert set(entry) == {
        "avg@2",
        "pass@1",
        "pass@2",
        "maj@2",
        "n",
        "num_problems",
        "grade_timeouts",
        "grade_s",
    }
    assert entry["grade_timeouts"] == 0 and entry["grade_s"] >= 0.0  # what grading cost
    assert (entry["n"], entry["num_problems"]) == (2, 5)
    assert entry["avg@2"] == entry["pass@1"]
    assert 0.0 <= entry["pass@1"] <= entry["pass@2"] <= 1.0
    assert json.loads((tmp_path / "run" / "results.json").read_text()) == results
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 10
    assert {r["problem_id"] for r in rows} == {
        "2024-I-1",
        "2024-I-2",
        "2024-I-3",
        "2024-I-4",
        "2024-I-5",
    }
    assert {r["sample"] for r in rows} == {0, 1}
    assert all(set(r) >= {"response", "extracted", "correct"} for r in rows)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("bapo").experiment_id])
    assert run.data.metrics["eval/aime24/avg_at_2"] == entry["avg@2"]


def test_eval_cli_several_benchmarks_one_job_each(_output_root: Path) -> None:
    result = run_bapo(
        "eval",
        "benchmark=[aime24,aime25]",
        "eval.limit=2",
        "eval.n=1",
        "tracking=none",
        env={"HF_HUB_OFFLINE": "1"},  # each preset reads its shipped file
    )
    assert result.returncode == 0, result.stderr
    found = sorted(_output_root.glob("sweeps/*/*/*/results.json"))
    assert sorted(next(iter(json.loads(f.read_text()))) for f in found) == ["aime24", "aime25"]


def test_eval_bad_inputs_fail_in_one_line(tmp_path: Path) -> None:
    missing = run_bapo("eval", f"benchmark.path={tmp_path}/none.jsonl", "tracking=none")
    assert missing.returncode == 2
    assert missing.stderr.startswith("error: ") and len(missing.stderr.strip().splitlines()) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1", "solution": "2"}\n')
    no_fields = run_bapo("eval", f"benchmark.path={bad}", "tracking=none")
    assert no_fields.returncode == 2
    assert "problem" in no_fields.stderr and len(no_fields.stderr.strip().splitlines()) == 1
    with pytest.raises(PreflightError, match="eval.n=0"):
        preflight("eval", ["eval.n=0"])
