"""avg@n, pass@k, maj@n and the results.json entry, checked against plain enumeration."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo_cli.evaluation.metrics import (
    avg_at_n,
    ks_for,
    maj_at_n,
    majority_index,
    pass_at_k,
    pass_at_k_mean,
    summarize,
)


def brute_force_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """Fraction of all k-subsets of n samples (c of them correct) that hold a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(samples[i] for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_enumeration(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(brute_force_pass_at_k(n, c, k)))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    st.integers(1, 2048).flatmap(
        lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))
    )
)
def test_pass_at_k_equals_binomial_form(nck: tuple[int, int, int]) -> None:
    n, c, k = nck
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))  # exact, where floats overflow
    value = pass_at_k(n, c, k)
    assert 0.0 <= value <= 1.0
    assert value == pytest.approx(float(exact), abs=1e-9)


def test_pass_at_k_special_values() -> None:
    assert pass_at_k(16, 0, 4) == 0.0
    assert pass_at_k(16, 16, 1) == 1.0
    assert pass_at_k(16, 13, 4) == 1.0  # only 3 wrong: every 4-subset holds a correct one
    assert pass_at_k(16, 4, 1) == pytest.approx(0.25)  # pass@1 = c / n
    assert pass_at_k(1024, 1, 1024) == 1.0


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((4, 1, 5), ValueError),
        ((4, 5, 1), ValueError),
        ((4, -1, 1), ValueError),
        ((0, 0, 1), ValueError),
        ((4, 1, 0), ValueError),
        ((4.0, 1, 1), TypeError),
        ((4, True, 1), TypeError),
    ],
)
def test_pass_at_k_rejects_bad_arguments(args: tuple, error: type) -> None:
    with pytest.raises(error):
        pass_at_k(*args)


def test_ks_for() -> None:
    assert ks_for(1) == [1]
    assert ks_for(2) == [1, 2]
    assert ks_for(16) == [1, 2, 4, 8, 16]
    assert ks_for(10) == [1, 2, 4, 8, 10]  # n itself is always reported
    with pytest.raises(ValueError):
        ks_for(0)


def test_avg_and_pass_over_problems() -> None:
    correct = [[True, False, False, False], [True, True, True, True], [False] * 4]
    assert avg_at_n(correct) == pytest.approx((0.25 + 1 + 0) / 3)
    assert pass_at_k_mean(correct, 1) == pytest.approx(avg_at_n(correct))
    assert pass_at_k_mean(correct, 4) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="no problems"):
        avg_at_n([])
    with pytest.raises(ValueError, match="no samples"):
        avg_at_n([[]])


@pytest.mark.parametrize(
    ("answers", "winner"),
    [
        (["5", "033", "$33$", "7"], 1),  # "033" and "$33$" are one answer: two votes
        (["7", "5", "5"], 1),
        (["5", "7", "7", "5"], 0),  # tie: the answer seen first wins
        ([None, None, "4"], 2),  # None does not vote
        ([None, None], None),
        ([], None),
        (["", "  "], None),  # empty answers do not vote
    ],
)
def test_majority_index(answers: list, winner: int | None) -> None:
    assert majority_index(answers) == winner


def test_maj_at_n_grades_the_majority_answer() -> None:
    answers = [["5", "6", "6"], ["1", None, None], [None, None, None]]
    seen: list[tuple[str, str]] = []

    def grade_fn(answer: str, reference: str) -> bool:
        seen.append((answer, reference))
        return answer == reference

    assert maj_at_n(answers, ["6", "2", "3"], grade_fn) == pytest.approx(1 / 3)
    assert seen == [("6", "6"), ("1", "2")]  # no grading for a problem without votes
    with pytest.raises(ValueError):
        maj_at_n(answers, ["6"], grade_fn)


def test_summarize_shape_and_values() -> None:
    correct = [[True, False, True, False], [False, False, False, True]]
    answers = [["1", "2", "01", "2"], ["9", "9", None, "4"]]
    out = summarize(correct, answers)
    assert list(out) == ["avg@4", "pass@1", "pass@2", "pass@4", "maj@4", "n", "num_problems"]
    assert out["avg@4"] == pytest.approx(3 / 8)
    assert out["pass@1"] == pytest.approx(out["avg@4"])
    assert out["pass@2"] == pytest.approx((5 / 6 + 1 / 2) / 2)
    assert out["pass@4"] == 1.0
    # problem 0: "1" and "01" tie with "2" twice -> "1" first seen, correct; problem 1: "9" wrong
    assert out["maj@4"] == 0.5
    assert (out["n"], out["num_problems"]) == (4, 2)


def test_summarize_rejects_ragged_input() -> None:
    with pytest.raises(ValueError, match="expected n=2"):
        summarize([[True, False], [True]], [["1", "2"], ["1"]])
    with pytest.raises(ValueError, match="answer rows"):
        summarize([[True]], [])
