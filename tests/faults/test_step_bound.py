"""An upper bound on one training step's work (issue 22): `rollout.n=100000` passed preflight,
loaded the model and started generating 3.2M sequences. Refused now in one line that names the
number and the limit (bapo_cli.config.preflight.step_work_error)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from bapo_cli.cli import app
from bapo_cli.config import preflight

runner = CliRunner()


def _cfg(prompts: int, n: int, tokens: int) -> SimpleNamespace:
    return SimpleNamespace(
        trainer=SimpleNamespace(prompts_per_step=prompts),
        rollout=SimpleNamespace(n=n, max_tokens=tokens),
    )


def test_the_limits_leave_room_for_the_largest_published_recipe() -> None:
    assert preflight.step_work_error(_cfg(512, 16, 20_480)) is None  # DAPO
    assert preflight.step_work_error(_cfg(32, 2048, 16)) is None  # 65,536 sequences: the limit


@pytest.mark.parametrize(
    ("prompts", "n", "tokens", "line"),
    [
        (
            32,
            100_000,
            16,
            "trainer.prompts_per_step=32 × rollout.n=100000 = 3,200,000 sequences per step; "
            "the limit is 65,536 (8x the largest published recipe's); lower one of them",
        ),
        (
            1024,
            64,
            32_768,
            "trainer.prompts_per_step=1024 × rollout.n=64 × rollout.max_tokens=32768 = "
            "2,147,483,648 response tokens per step; the limit is 1,073,741,824 (6x the largest "
            "published recipe's); lower one of them",
        ),
    ],
)
def test_too_much_work_per_step_is_one_line(prompts: int, n: int, tokens: int, line: str) -> None:
    assert preflight.step_work_error(_cfg(prompts, n, tokens)) == line


def test_bapo_train_refuses_rollout_n_100000_before_loading_anything() -> None:
    result = runner.invoke(app, ["train", "rollout.n=100000"])
    assert result.exit_code == 2, result.output
    shown = " ".join(result.output.split())
    assert shown == (
        "error: trainer.prompts_per_step=32 × rollout.n=100000 = 3,200,000 sequences per step; "
        "the limit is 65,536 (8x the largest published recipe's); lower one of them"
    )
