r"""Rewards: is a response right? One function for evaluation and for training rewards.

    >>> from bapo_cli.rewards import grade
    >>> grade(r"... so the answer is \boxed{033}.", "33")
    True
    >>> grade(r"\boxed{\frac{1}{2}}", "0.5")      # needs math-verify: runs in the worker process
    True

`grade(response, reference)` extracts the last ``\boxed{...}`` of the response and compares it with
the reference: first by normalized strings (integers, AIME padding), then with math-verify under a
hard per-sample time limit that holds from any thread or process (see `math_grader` for the steps
and `guard` for the limit). Anything that cannot be graded in time, or at all, is ``False``;
`grade` never raises on model text.

`grade`, `grade_many` and `grade_batch` share one default `MathGrader`, created on first use: its
worker process is the one piece of state in this package that outlives a call, because starting
Python and importing sympy costs seconds. `close()` stops it (it also stops at interpreter exit).
Code that wants its own limit, worker pool or lifetime makes its own ``MathGrader(timeout_s=...,
workers=...)`` (the `reward` config group does); `StepGrader` puts a training step's grading
under one time budget (``reward.step_budget_s``) and counts timeouts.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from bapo_cli.rewards.budget import StepGrader
from bapo_cli.rewards.extract import last_boxed, normalize_answer
from bapo_cli.rewards.math_grader import (
    DEFAULT_TIMEOUT_S,
    GradeReport,
    MathGrader,
    extract_answer,
    verify_latex,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "GradeReport",
    "MathGrader",
    "StepGrader",
    "close",
    "default_grader",
    "extract_answer",
    "grade",
    "grade_batch",
    "grade_many",
    "last_boxed",
    "normalize_answer",
    "verify_latex",
]

_default: MathGrader | None = None
_default_lock = threading.Lock()


def default_grader() -> MathGrader:
    """The shared grader behind `grade` and `grade_many` (created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MathGrader()
        return _default


def grade(response: str, reference: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """True iff the last boxed answer of ``response`` equals ``reference`` (≤ timeout_s each)."""
    return default_grader().grade(response, reference, timeout_s=timeout_s)


def grade_many(
    responses: Sequence[str],
    references: Sequence[str],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[bool]:
    """`grade` over pairs; the fast ones inline, the slow ones each bounded by ``timeout_s``."""
    return default_grader().grade_many(responses, references, timeout_s=timeout_s)


def grade_batch(
    responses: Sequence[str],
    references: Sequence[str],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    budget_s: float | None = None,
) -> GradeReport:
    """`grade_many` with its cost: verdicts, timeouts and answers left unread past ``budget_s``."""
    return default_grader().grade_batch(
        responses, references, timeout_s=timeout_s, budget_s=budget_s
    )


def close() -> None:
    """Stop the shared grader's worker process (a later `grade` starts a new one)."""
    with _default_lock:
        if _default is not None:
            _default.close()
