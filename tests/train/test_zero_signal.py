"""No silent zero-signal runs (issue 21): own data graded by a grader the model never satisfies.

The case as a new user met it: a 20-row jsonl ``{"problem": "3+2", "answer": "5"}`` trained with
`data.kind=dataset data.path=mine.jsonl` on the default tiny model and `reward=math`. The tiny
model answers ``5`` (right) but never writes ``\\boxed{}``, the only answer `reward=math` reads,
so every reward was 0, every advantage 0, and nothing said so.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from bapo_cli.config.preflight import preflight
from bapo_cli.data.records import DataError
from bapo_cli.launch.plan import train_rows
from bapo_cli.rewards import MathGrader
from bapo_cli.rewards.selfcheck import PLAIN_REWARD_FN, check_references
from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.collect import SignalWatch
from bapo_cli.trainer.train import train
from tests.train.conftest import FAST


def _mine(tmp_path: Path, answer: str = "5") -> Path:
    path = tmp_path / "mine.jsonl"
    path.write_text(
        "".join(json.dumps({"problem": "3+2", "answer": answer}) + "\n" for _ in range(20))
    )
    return path


def _train(tmp_path: Path, *overrides: str):
    out = io.StringIO()
    cfg = preflight("train", [*FAST, *overrides]).config
    result = train(cfg, tmp_path / "run", Console(file=out, width=300))
    return result, out.getvalue()


def test_the_issue_case_warns_before_and_during_the_run_and_counts_ungradeable(
    tmp_path: Path,
) -> None:
    data = _mine(tmp_path)
    result, out = _train(tmp_path, "trainer.max_steps=5", "data.kind=dataset", f"data.path={data}")
    # the tiny model does answer 5 (right) and is scored 0: the case is reproduced
    assert any(s.text.strip() == "5" for s in result.last_batch)
    assert [step["reward/mean"] for step in result.history] == [0.0] * 5
    assert [step["reward/ungradeable_frac"] for step in result.history] == [1.0] * 5
    assert [step["reward/silent_steps"] for step in result.history] == [1, 2, 3, 4, 5]
    start = [line for line in out.splitlines() if "its answers as written" in line]
    assert len(start) == 1, out
    assert "data.answer_field=answer, e.g. '5'" in start[0]
    assert f"reward.fn={PLAIN_REWARD_FN}" in start[0]
    assert str(data) in start[0]
    during = [line for line in out.splitlines() if "no learning signal" in line]
    assert len(during) == 1, out  # once, at step 3, not at steps 4 and 5
    assert during[0].startswith("warning: no learning signal for 3 steps in a row: 100% of the")
    assert f"reward.fn={PLAIN_REWARD_FN}" in during[0]


@pytest.mark.slow  # reward=python grades in worker processes
def test_the_advised_fix_trains_with_a_signal(tmp_path: Path) -> None:
    data = _mine(tmp_path)
    result, out = _train(
        tmp_path,
        "trainer.max_steps=2",
        "data.kind=dataset",
        f"data.path={data}",
        "reward=python",
        f"reward.fn={PLAIN_REWARD_FN}",
    )
    assert "warning" not in out, out
    assert all(step["reward/mean"] > 0 for step in result.history)


def test_the_plan_names_the_data_file(tmp_path: Path) -> None:
    data = _mine(tmp_path)
    cfg = preflight("train", ["data.kind=dataset", f"data.path={data}"]).config
    assert dict(train_rows(cfg, tmp_path))["data"] == f"{data} (dataset)"
    assert dict(train_rows(preflight("train", []).config, tmp_path))["data"] == "arith (arith)"


def _check(tmp_path: Path, answers: list[str], *overrides: str):
    cfg = preflight("train", ["data.kind=dataset", f"data.path={_mine(tmp_path)}", *overrides])
    problems = [SimpleNamespace(answer=a) for a in answers]
    grader = MathGrader()

    def grade(responses, references, _problems):
        return grader.grade_batch(responses, references)

    try:
        return check_references(problems, grade, cfg.config, "mine.jsonl")
    finally:
        grader.close()


def test_answers_that_nothing_could_match_are_refused(tmp_path: Path) -> None:
    refusal, warning = _check(tmp_path, ["a{b"] * 3)  # \boxed{a{b} never closes
    assert warning is None
    assert refusal.startswith("mine.jsonl: none of 3 reference answers checked (data.answer_field")
    assert refusal.endswith("point data.answer_field=answer at the column of final answers")


def test_the_refusal_stops_the_run_before_any_step(tmp_path: Path) -> None:
    cfg = preflight("train", [*FAST, "data.kind=dataset", f"data.path={_mine(tmp_path, 'a{b')}"])
    with pytest.raises(DataError, match=r"^\S+mine.jsonl: none of 20 reference answers checked"):
        train(cfg.config, tmp_path / "run", Console(file=io.StringIO()))
    assert not (tmp_path / "run" / "samples.jsonl").exists()


def test_boxed_answers_or_a_capable_model_pass_the_check(tmp_path: Path) -> None:
    assert _check(tmp_path, ["\\boxed{5}", "7"]) == (None, None)  # one scores as written
    # a real model on a math preset, whose template asks for \boxed{} (data=arith's does not)
    real = ("model.path=Qwen/Qwen2.5-Math-1.5B", "model.tiny=null", "data=deepscaler")
    assert _check(tmp_path, ["5"], *real) == (None, None)  # the template asks for \boxed{}
    refusal, warning = _check(tmp_path, ["5"], *real, "data.template='{problem} ='")
    assert refusal is None and "data.template does not ask for one" in warning


def _step(*group_rewards: list[float]) -> list[Sample]:
    return [
        Sample(prompt_ids=[1], group=g, problem=None, reward=r)
        for g, rewards in enumerate(group_rewards)
        for r in rewards
    ]


def test_signal_watch_warns_once_per_run_after_patience_steps() -> None:
    watch = SignalWatch(3, "do X")
    silent, live = _step([0, 0], [1, 1]), _step([0, 1], [1, 1])
    assert [watch.observe(silent, 0.0) for _ in range(2)] == [None, None]
    assert watch.observe(live, 0.0) is None and watch.silent_in_a_row == 0  # a streak restarts
    lines = [watch.observe(silent, 0.0) for _ in range(6)]
    assert lines[:2] == [None, None] and lines[3:] == [None] * 3
    assert lines[2] == (
        "no learning signal for 3 steps in a row: every prompt group's responses scored alike "
        "(rewards 0, 1), so every advantage is 0 and no update changes the policy. Fix: the "
        "prompts are too easy or too hard for this model, or the reward does not depend on the "
        "answer: other data, or a reward that tells answers apart"
    )


@pytest.mark.parametrize(
    ("ungradeable", "cause", "fix"),
    [
        (1.0, "100% of the responses had no answer the grader can read", "Fix: do X"),
        (
            0.0,
            "every response scored 0",
            "Fix: the prompts may be too hard for this model, or do X",
        ),
    ],
)
def test_signal_watch_names_the_cause(ungradeable: float, cause: str, fix: str) -> None:
    watch = SignalWatch(1, "do X")
    line = watch.observe(_step([0, 0]), ungradeable)
    assert cause in line and line.endswith(fix)
