"""A training step's grading budget: one time allowance shared by every grading call of a step.

The trainer grades samples as they finish: once per step for ordinary rollouts, several times for
partial rollouts, whose responses finish over several rounds. A per-call budget would let a step
with many rounds spend many budgets, so `StepGrader` keeps the step's account: each `grade` call
gets what is left of ``budget_s`` (passed on as the grading function's ``budget_s``), and `take()`
returns the step's counts as metrics and opens the next step with the full budget:

    reward/timeouts     responses whose comparison ran out of the per-answer limit (scored 0)
    reward/errors       reward=python: responses whose reward function failed (scored 0)
    reward/over_budget  responses scored 0 unread (or cut) because the step's budget was spent
    reward/ungradeable_frac  share of the step's responses with no answer the grader can read
                        (math: no ``\\boxed{}``); near 1 means the model never writes that form
    perf/grade_s        seconds spent grading this step (wall time of the grading calls)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bapo_cli.rewards.math_grader import GradeReport

__all__ = ["BatchGrade", "StepGrader"]

BatchGrade = Callable[..., GradeReport]
"""``grade(responses, references, *, budget_s)`` -> GradeReport, e.g. `MathGrader.grade_batch`
(`PythonReward.grade_batch` also takes records: ``grade(responses, references, records, ...)``)."""


class StepGrader:
    """Grades a step's batches under one shared ``budget_s`` (None: unbounded) and counts the
    cost."""

    def __init__(self, grade: BatchGrade, budget_s: float | None) -> None:
        if budget_s is not None and not budget_s > 0:
            raise ValueError(f"budget_s must be > 0 or None, got {budget_s!r}")
        self._grade = grade
        self.budget_s = budget_s
        self._spent = 0.0
        self._timeouts = 0
        self._over_budget = 0
        self._errors = 0
        self._ungradeable = 0
        self._graded = 0

    @property
    def ungradeable_frac(self) -> float:
        """The share of this step's graded responses so far that had no readable answer."""
        return self._ungradeable / self._graded if self._graded else 0.0

    def grade(
        self,
        responses: Sequence[str],
        references: Sequence[str],
        records: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[float]:
        """Rewards of one batch, graded within what is left of this step's budget (``records``
        go to graders that take them: reward=python)."""
        left = None if self.budget_s is None else max(self.budget_s - self._spent, 0.0)
        t0 = time.perf_counter()
        extra = () if records is None else (records,)
        try:
            report = self._grade(responses, references, *extra, budget_s=left)
        finally:
            self._spent += time.perf_counter() - t0
        self._timeouts += report.timeouts
        self._over_budget += report.over_budget
        self._errors += report.errors
        self._ungradeable += report.ungradeable
        self._graded += len(responses)
        return report.rewards()

    def take(self) -> dict[str, float]:
        """This step's ``reward/timeouts``, ``reward/over_budget``, ``reward/errors``,
        ``reward/ungradeable_frac``, ``perf/grade_s``; then a new step begins with the full
        budget."""
        out = {
            "reward/timeouts": float(self._timeouts),
            "reward/over_budget": float(self._over_budget),
            "reward/errors": float(self._errors),
            "reward/ungradeable_frac": self.ungradeable_frac,
            "perf/grade_s": self._spent,
        }
        self._spent, self._timeouts, self._over_budget, self._errors = 0.0, 0, 0, 0
        self._ungradeable = self._graded = 0
        return out
