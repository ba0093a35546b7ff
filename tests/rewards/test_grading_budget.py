"""Slow answers are graded in parallel and under a budget, with exact counts (real workers)."""

from __future__ import annotations

import itertools
import time

import pytest

from bapo_cli.rewards import MathGrader, StepGrader
from bapo_cli.rollout.base import FINISH_STOP, Generation, SamplingParams
from bapo_cli.rollout.collect import Collector

LIMIT = 1.0  # reward.timeout_s of these tests
# wall-clock slack for worker start-ups and thread hand-offs on a loaded 2-core machine
MARGIN = 4.0
TOWER = r"\boxed{9^{9^{9^9}}}"  # math-verify would run for hours: always hits the limit


_used = itertools.count(100)


def towers(count: int) -> tuple[list[str], list[str]]:
    """`count` slow pairs that share no cache entry with any other (fresh references)."""
    return [TOWER] * count, [str(next(_used)) for _ in range(count)]


@pytest.fixture(scope="module")
def _workers():
    with MathGrader(timeout_s=LIMIT, workers=4) as grader:
        yield grader


@pytest.fixture
def pool(_workers: MathGrader) -> MathGrader:
    """Four started workers (a test's timeouts kill some: their restarts happen here, untimed)."""
    for worker in _workers.pool:
        worker.start()
    return _workers


def test_slow_answers_are_compared_in_parallel_and_counted(pool: MathGrader) -> None:
    responses, references = towers(4)
    timeouts = pool.stats["timeout"]
    t0 = time.perf_counter()
    report = pool.grade_batch(responses, references)
    elapsed = time.perf_counter() - t0
    assert report.verdicts == [False] * 4
    assert (report.timeouts, report.over_budget) == (4, 0)
    assert pool.stats["timeout"] == timeouts + 4
    # one worker needs 4 × LIMIT and 3 restarts; four compare them at once
    assert LIMIT <= elapsed < 3 * LIMIT


def test_budget_bounds_a_batch_and_fast_answers_are_unaffected(pool: MathGrader) -> None:
    slow, refs = towers(12)
    responses = [r"\boxed{\frac{1}{2}}", *slow, r"\boxed{033}", "no box"]
    references = ["0.5", *refs, "33", "1"]
    budget = 2.5
    t0 = time.perf_counter()
    report = pool.grade_batch(responses, references, budget_s=budget)
    elapsed = time.perf_counter() - t0
    assert elapsed < budget + MARGIN  # sequentially: 12 × LIMIT + restarts
    assert report.verdicts == [True, *[False] * 12, True, False]
    assert report.timeouts + report.over_budget == 12  # every slow answer is one or the other
    assert report.timeouts <= 4 * 3  # at most three 1 s rounds of four workers fit in 2.5 s
    assert report.over_budget >= 1


def test_a_spent_budget_scores_slow_answers_zero_without_waiting(pool: MathGrader) -> None:
    slow, refs = towers(5)
    responses = [*slow, r"\boxed{\sqrt{12}}", r"\boxed{033}"]
    references = [*refs, r"2\sqrt3", "33"]
    t0 = time.perf_counter()
    report = pool.grade_batch(responses, references, budget_s=0.0)
    assert time.perf_counter() - t0 < 0.5
    # the math-verify answer is not graded either; the fast path still is
    assert report.verdicts == [False] * 6 + [True]
    assert (report.timeouts, report.over_budget) == (0, 6)
    again = pool.grade_batch(responses[5:6], references[5:6])  # not cached as wrong
    assert again.verdicts == [True]


def test_step_grader_shares_one_budget_per_step_and_reports_metrics(pool: MathGrader) -> None:
    step = StepGrader(pool.grade_batch, budget_s=1.5)
    first = step.grade(*towers(8))  # two rounds of LIMIT would be needed: the budget cuts one
    second = step.grade([r"\boxed{\frac{3}{4}}"], ["0.75"])  # right, but the budget is spent
    assert first == [False] * 8 and second == [False]
    metrics = step.take()
    assert metrics["reward/timeouts"] + metrics["reward/over_budget"] == 9
    assert metrics["reward/over_budget"] >= 1
    assert 1.5 <= metrics["perf/grade_s"] < 1.5 + MARGIN
    # the next step starts with the full budget and a clean count
    for worker in pool.pool:  # (the restarts after the timeouts are not what is tested here)
        worker.start()
    assert step.grade([r"\boxed{\frac{3}{4}}"], ["0.75"]) == [True]
    assert step.take()["reward/timeouts"] == 0.0


class _Towers:
    """An engine whose every response is a distinct slow answer (decoded by `_Decode`)."""

    name, version = "scripted", 0

    def generate(self, requests, params):
        return [Generation([i], None, FINISH_STOP) for i in range(len(requests))]


class _Decode:
    @staticmethod
    def decode(ids, **_):
        return rf"\boxed{{9^{{9^{{9^{{{9 + ids[0]}}}}}}}}}"


def test_collector_grades_a_rounds_samples_together(pool: MathGrader) -> None:
    step = StepGrader(pool.grade_batch, budget_s=None)
    collector = Collector(
        engine=_Towers(),
        tokenizer=_Decode(),
        params=SamplingParams(max_tokens=4),
        n=4,
        encode=lambda p: [1],
        reward=lambda text, p: pytest.fail("graded one by one"),
        score=lambda samples: None,
        reward_many=lambda texts, problems: [float(v) for v in step.grade(texts, problems)],
    )
    t0 = time.perf_counter()
    samples = collector.complete(["7"])
    elapsed = time.perf_counter() - t0
    assert [s.reward for s in samples] == [0.0] * 4
    assert step.take()["reward/timeouts"] == 4
    assert elapsed < 4 * LIMIT  # four workers at once, not one after another
