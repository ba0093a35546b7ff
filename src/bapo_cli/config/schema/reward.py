"""The `reward` group: how answers are graded (math-verify or the user's function) and how long
grading may take."""

from __future__ import annotations

from dataclasses import dataclass

from bapo_cli.config.errors import ConfigError
from bapo_cli.config.schema.fields import _one_of, _positive, opt

REWARD_GRADERS = ("math", "python")
REWARD_FN_FORMS = "module:function or path/to/file.py:function"


@dataclass
class RewardConfig:
    """How answers are graded (math-verify, or the user's function), and how long it may take."""

    name: str = opt(
        "math",
        "grader: math (last boxed answer vs the reference, math-verify in worker processes; "
        "data=arith/pairs keep their instant exact match) or python (reward.fn)",
    )
    fn: str | None = opt(
        None,
        f"reward=python: the function, {REWARD_FN_FORMS}, called as fn(response, reference, "
        "record) -> float or bool in worker processes (docs/rewards.md)",
    )
    timeout_s: float = opt(
        5.0,
        "hard limit per answer graded (math-verify, or one reward.fn call): past it the worker is "
        "killed and the answer scores 0 (counted in reward/timeouts, eval's grade_timeouts)",
    )
    workers: int = opt(
        4, "grading worker processes: a batch's slow answers are graded this many at once"
    )
    step_budget_s: float | None = opt(
        60.0,
        "training: seconds of grading per step; once spent, the step's answers still waiting for "
        "a worker score 0 (counted in reward/over_budget); null = no limit. Not used by eval",
    )

    def check(self) -> None:
        _one_of("name", self.name, REWARD_GRADERS)
        if self.name == "python":
            target, colon, function = (self.fn or "").rpartition(":")
            if not (colon and target and function):
                raise ConfigError("fn", self.fn, f"reward=python needs reward.fn={REWARD_FN_FORMS}")
        elif self.fn is not None:
            raise ConfigError("fn", self.fn, "only reward=python calls a function; drop reward.fn")
        _positive("timeout_s", self.timeout_s)
        if not 1 <= self.workers <= MAX_GRADER_WORKERS:
            raise ConfigError("workers", self.workers, f"must be within [1, {MAX_GRADER_WORKERS}]")
        if self.step_budget_s is not None:
            _positive("step_budget_s", self.step_budget_s)


MAX_GRADER_WORKERS = 64  # each is a Python process holding sympy (~150 MB)
