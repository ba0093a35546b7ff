r"""Before training: do a dataset's own answers score under the configured grader?

A run on one's own data can train nothing without any error: `reward=math` reads only the last
``\boxed{}`` of a response, so a model that answers ``5`` where the grader wants ``\boxed{5}``
scores 0 on every response, every prompt group has zero reward variance, and every advantage
is 0. `check_references` catches the common cases at start-up, before the first step, by
grading a sample of the dataset's reference answers *as responses* through the run's own grader:

- as written (``5``): does an answer in the dataset's own form score? If not, the model must
  write another form (for math, ``\boxed{5}``); fine for a model that follows the template's
  request for one, hopeless for the testbed `tiny` models (warmed up to answer ``37+45=`` with a
  bare ``82``) or a template that never asks for it: a warning, with the fix;
- as ``\boxed{answer}``: if even that scores 0 for every sampled row, the answer field holds no
  gradeable answer at all (wrong column, empty): under `reward=math` the run is refused.

`grading_advice` is the fix in words for a config, shared with the in-run warning
(`rollout.collect.SignalWatch`) that catches what this check cannot (a model that writes
no ``\boxed{}`` though asked).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from bapo_cli.rewards.math_grader import GradeReport

__all__ = ["PLAIN_REWARD_FN", "SAMPLE_ROWS", "check_references", "grading_advice"]

SAMPLE_ROWS = 32  # reference answers graded at start-up (first rows of the shuffled set)
PLAIN_REWARD_FN = "bapo_cli.rewards.examples:plain_exact"
"""A reward=python function that also grades a bare answer: the fix offered for plain answers."""
_TESTBED_MODELS = ("tiny",)  # model.path values of models that answer with a bare number


def _never_boxes(cfg: Any) -> bool:
    """The model cannot be expected to write ``\\boxed{}``: a testbed model, or a template that
    does not ask for one."""
    return cfg.model.path in _TESTBED_MODELS or "boxed" not in cfg.data.template


def grading_advice(cfg: Any) -> str:
    """What to change when responses score nothing under this config's grader, in one clause."""
    plain = f"reward=python reward.fn={PLAIN_REWARD_FN} (bare answers too; docs/rewards.md)"
    if cfg.reward.name == "python":
        return (
            f"check that reward.fn={cfg.reward.fn} reads the answers this model writes "
            "(samples.jsonl in the run dir shows them; docs/rewards.md)"
        )
    if cfg.data.kind != "dataset":
        return f"data={cfg.data.kind} grades by exact match; use the model trained for it"
    if cfg.model.path in _TESTBED_MODELS:
        return (
            f"model={cfg.model.name} answers with a bare number and never writes \\boxed{{}}, the "
            f"only answer reward=math reads: grade with {plain}"
        )
    if "boxed" not in cfg.data.template:
        return (
            "reward=math reads only a response's last \\boxed{}, and data.template does not ask "
            f"for one: add that request to data.template, or grade with {plain}"
        )
    return (
        "reward=math reads only a response's last \\boxed{}: a model that follows data.template's "
        f"request for one, or grade with {plain}"
    )


Grade = Callable[[list[str], list[str], list[Any]], GradeReport]
"""(responses, references, problems) -> report: the run's configured grader, unbudgeted."""


def check_references(
    problems: Sequence[Any], grade: Grade, cfg: Any, source: str
) -> tuple[str | None, str | None]:
    """(refusal, warning) for a dataset run: each a line, or None. `problems` have `.answer`;
    only the first `SAMPLE_ROWS` are graded. Synthetic data (exact match) is not checked."""
    if cfg.data.kind != "dataset" or not problems:
        return None, None
    sample = list(problems[:SAMPLE_ROWS])
    answers = [str(p.answer) for p in sample]
    plain = grade(answers, answers, sample).rewards()
    if any(r > 0 for r in plain):
        return None, None
    boxed = grade([f"\\boxed{{{a}}}" for a in answers], answers, sample).rewards()
    field = f"data.answer_field={cfg.data.answer_field}"
    example = _example(answers)
    if not any(r > 0 for r in boxed):
        line = (
            f"{source}: none of {len(sample)} reference answers checked ({field}, e.g. "
            f"{example}) scores above 0 under reward={cfg.reward.name}, even written as the "
            f"response or as \\boxed{{answer}}, so no response could; point {field} at the "
            "column of final answers"
        )
        if cfg.reward.name == "math":
            return line, None
        return None, f"{line}, or check reward.fn={cfg.reward.fn}"
    if cfg.reward.name != "math" or not _never_boxes(cfg):
        return None, None
    return None, (
        f"{source}: its answers as written ({field}, e.g. {example}) score 0 under reward=math "
        f"(only \\boxed{{{answers[0]}}} would), so this run will likely get no reward and learn "
        f"nothing; {grading_advice(cfg)}"
    )


def _example(answers: Sequence[str]) -> str:
    shown = answers[0] if len(answers[0]) <= 40 else answers[0][:37] + "..."
    return repr(shown)
