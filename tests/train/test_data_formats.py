"""One real training step on verl-format parquet and on a messages jsonl (tiny model)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from bapo_cli.models.tiny import build_tokenizer
from tests.data.test_formats import verl_row, write_jsonl, write_verl
from tests.train.conftest import run_train

CHECKS = textwrap.dedent(
    """
    def verl(response, reference, record):
        assert record["reward_model"]["ground_truth"] == reference, record
        return 1.0 if record["data_source"] == "arith" else 0.5

    def messages(response, reference, record):
        assert record["messages"][0]["content"].endswith("="), record
        return 0.25
    """
)


def _questions(n: int) -> list[tuple[str, str]]:
    return [(f"{a}+{a % 7}=", str(a + a % 7)) for a in range(1, n + 1)]


def _prompts_are_the_message_text(result) -> None:
    """The tiny tokenizer has no chat template: the prompt is the user message as written."""
    tokenizer = build_tokenizer()
    for sample in result.last_batch:
        assert sample.problem.messages is not None
        assert sample.prompt_ids == tokenizer(sample.problem.question)["input_ids"]


def test_one_step_on_verl_parquet(tmp_path: Path) -> None:
    (tmp_path / "checks.py").write_text(CHECKS)
    rows = [verl_row(q, a, i) for i, (q, a) in enumerate(_questions(12))]
    path = write_verl(tmp_path / "train.parquet", rows)
    result = run_train(
        tmp_path,
        "trainer.max_steps=1",
        "data.kind=dataset",
        f"data.path={path}",
        "reward=python",
        f"reward.fn={tmp_path / 'checks.py'}:verl",
    )
    (step,) = result.history
    assert step["reward/mean"] == 1.0 and step["reward/errors"] == 0.0
    _prompts_are_the_message_text(result)


def test_one_step_on_a_messages_jsonl(tmp_path: Path) -> None:
    (tmp_path / "checks.py").write_text(CHECKS)
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        for q, a in _questions(12)
    ]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    result = run_train(
        tmp_path,
        "trainer.max_steps=1",
        "data.kind=dataset",
        f"data.path={path}",
        "data.format=messages",
        "reward=python",
        f"reward.fn={tmp_path / 'checks.py'}:messages",
    )
    (step,) = result.history
    assert step["reward/mean"] == 0.25 and step["reward/errors"] == 0.0
    _prompts_are_the_message_text(result)
    first = json.loads((result.run_dir / "samples.jsonl").read_text().splitlines()[0])
    assert first["prompt"].endswith("=")


def test_math_grading_of_verl_rows_uses_the_ground_truth(tmp_path: Path) -> None:
    rows = [verl_row(q, a, i) for i, (q, a) in enumerate(_questions(8))]
    result = run_train(
        tmp_path,
        "trainer.max_steps=1",
        "data.kind=dataset",
        f"data.path={write_verl(tmp_path / 't.parquet', rows)}",
    )
    (step,) = result.history  # the tiny model writes no \\boxed{}: math grading scores 0
    assert (step["reward/mean"], step["reward/errors"], step["reward/timeouts"]) == (0.0, 0.0, 0.0)
    assert {s.problem.answer for s in result.last_batch} <= {a for _, a in _questions(8)}
