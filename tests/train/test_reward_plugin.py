"""reward=python in a real training step and a real `bapo eval` on the tiny model."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from bapo_cli.config.preflight import preflight
from bapo_cli.evaluation.evaluate import evaluate
from tests.conftest import BENCHMARKS
from tests.train.conftest import run_train

REWARDS = textwrap.dedent(
    """
    def knows_the_record(response, reference, record):
        # the record is the prompt's own row: its answer is the reference
        if not isinstance(response, str) or record["answer"] != reference:
            raise AssertionError(f"record {record} does not match {reference!r}")
        return 0.5 if record["kind"] else 0.0

    def always_fails(response, reference, record):
        raise RuntimeError("no grader here")

    def benchmark_row(response, reference, record):
        return 0.25 if record["id"].startswith("2024-I-") and "problem" in record else -1.0
    """
)


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rewards") / "rewards.py"
    path.write_text(REWARDS)
    return path


def test_training_rewards_are_what_the_function_returns(tmp_path: Path, reward_file: Path) -> None:
    result = run_train(
        tmp_path,
        "trainer.max_steps=1",
        "reward=python",
        f"reward.fn={reward_file}:knows_the_record",
    )
    (step,) = result.history
    assert step["reward/mean"] == 0.5  # every arith problem has a kind, every record matched
    assert (step["reward/errors"], step["reward/timeouts"]) == (0.0, 0.0)


def test_a_failing_function_scores_zero_and_the_run_goes_on(
    tmp_path: Path, reward_file: Path
) -> None:
    result = run_train(
        tmp_path, "trainer.max_steps=2", "reward=python", f"reward.fn={reward_file}:always_fails"
    )
    assert [s["reward/errors"] for s in result.history] == [32.0, 32.0]  # 8 prompts x 4
    assert [s["reward/mean"] for s in result.history] == [0.0, 0.0]


def test_eval_grades_with_the_configured_function(tmp_path: Path, reward_file: Path) -> None:
    cfg = preflight(
        "eval",
        [
            f"benchmark.path={BENCHMARKS / 'aime24.jsonl'}",
            "eval.limit=2",
            "eval.n=2",
            "eval.max_tokens=8",
            "tracking=none",
            "reward=python",
            f"reward.fn={reward_file}:benchmark_row",
        ],
    ).config
    entry = evaluate(cfg, tmp_path / "run")["aime24"]
    assert (entry["avg@2"], entry["reward_mean"], entry["grade_errors"]) == (1.0, 0.25, 0)
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").open()]
    assert [r["reward"] for r in rows] == [0.25] * 4
