"""Study v3's held-out failure classes (`data.pairs.failure_class`): one class per wrong
response, none for a right one, in the design's order (docs/study-v3.md)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo_cli.data.pairs import (
    FAILURE_CLASSES,
    PairTask,
    failure_class,
    pairs_reward,
    search_trace,
)

PROBLEMS = PairTask(0).sample(200, random.Random(5))


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("6+8=14!", "6,8", None),  # right
        ("1+6=7<6+8=14!", "6,8", None),  # right after a miss
        ("1+6=7<0+2=2<1+", "6,8", "no_stop"),  # ran into the budget
        ("", "6,8", "no_stop"),
        ("6+8=14!!", "6,8", "malformed"),  # a '!' but not the grammar
        ("6+8=14", "6,8", "no_stop"),  # no verdict at all: never stopped
        ("6+8=14<6+8=14!", "6,8", "wrong_verdict"),  # '<' on the target's sum
        ("1+6=8<6+8=14!", "6,8", "wrong_sum"),  # 1 + 6 written as 8
        ("1+6=7!", "6,8", "false_stop"),  # stops on 7, the target is 14
        ("1+6=7>6+8=14!", "6,8", "wrong_verdict"),  # 7 is below 14, not above
        ("7+7=14!", "6,8", "wrong_pair"),  # the target's sum from a pair that is not the answer
        ("1+6=8!", "6,8", "wrong_sum"),  # wrong sum comes before false stop
        ("6+8=14!\nmore", "6,8", None),  # cut at the newline, as graded
    ],
)
def test_examples(response: str, answer: str, expected: str | None) -> None:
    assert failure_class(response, answer) == expected


def test_bad_answer_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="expected a pair"):
        failure_class("6+8=14!", "14")


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(PROBLEMS) - 1), st.integers(0, 2**31), st.integers(0, 60))
def test_right_iff_none_and_every_truncation_is_no_stop(index: int, seed: int, cut: int) -> None:
    """A random-order search trace is right (None); cut anywhere before its '!' it never
    stopped; every response gets None exactly when the grader gives 1."""
    problem = PROBLEMS[index]
    trace = search_trace(problem.question, random.Random(seed))
    assert failure_class(trace, problem.answer) is None
    cut_trace = trace[: min(cut, len(trace) - 1)]
    assert failure_class(cut_trace, problem.answer) == "no_stop"
    assert pairs_reward(cut_trace, problem.answer) == 0.0


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="0123456789+=<>!,x \n", max_size=45), st.integers(0, len(PROBLEMS) - 1))
def test_any_text_gets_exactly_one_outcome(text: str, index: int) -> None:
    answer = PROBLEMS[index].answer
    got = failure_class(text, answer)
    assert (got is None) == (pairs_reward(text, answer) == 1.0)
    assert got is None or got in FAILURE_CLASSES


@settings(max_examples=200, deadline=None)
@given(st.integers(0, len(PROBLEMS) - 1), st.integers(0, 2**31), st.data())
def test_one_changed_verdict_or_sum_is_named(index: int, seed: int, data: st.DataObject) -> None:
    """Flip one '<'/'>' of a right trace: wrong_verdict; add 1 to one written sum: wrong_sum."""
    problem = PROBLEMS[index]
    trace = search_trace(problem.question, random.Random(seed))
    verdicts = [i for i, c in enumerate(trace) if c in "<>"]
    if verdicts:
        i = data.draw(st.sampled_from(verdicts))
        flipped = trace[:i] + ("<" if trace[i] == ">" else ">") + trace[i + 1 :]
        assert failure_class(flipped, problem.answer) == "wrong_verdict"
    attempts = [a for part in trace.split("<") for a in part.split(">")]
    k = data.draw(st.integers(0, len(attempts) - 1))
    a, rest = attempts[k].split("=")
    digits = "".join(c for c in rest if c.isdigit())
    wrong = attempts[k].replace(f"={digits}", f"={int(digits) + 1}", 1)
    changed = trace.replace(attempts[k], wrong, 1)
    assert failure_class(changed, problem.answer) == "wrong_sum"
