r"""Answer equivalence: one table of (response, reference, expected) that the grader must get right.

The cases cover what models write for the references in AIME and MATH-500: integers (padded,
signed, with thousands separators), fractions in several notations, radicals, intervals, tuples,
sets, expressions, units and choices, wrong answers, multiple boxes and no box. Cases that need
math-verify run in one shared worker (module-scoped grader).
"""

from __future__ import annotations

import json

import pytest

from bapo_cli.rewards import MathGrader, verify_latex
from bapo_cli.rewards.math_grader import extract_answer, fast_verdict, reference_answer
from tests.conftest import BENCHMARKS

T, F = True, False
CASES: list[tuple[str, str, str, bool]] = [
    # integers (AIME)
    ("int", r"so \boxed{33}", "33", T),
    ("int-wrong", r"\boxed{34}", "33", F),
    ("int-padded-answer", r"\boxed{033}", "33", T),
    ("int-padded-reference", r"\boxed{33}", "033", T),
    ("int-zero", r"\boxed{0}", "000", T),
    ("int-negative", r"\boxed{-5}", "-5", T),
    ("int-sign-wrong", r"\boxed{5}", "-5", F),
    ("int-dollars", r"$\boxed{$42$}$", "42", T),
    ("int-thousands", r"\boxed{1{,}000}", "1000", T),
    ("int-decimal-form", r"\boxed{1000.0}", "1000", T),
    ("int-assignment", r"\boxed{x = 33}", "33", T),
    ("int-period", "\\boxed 7.", "7", T),
    ("int-vs-decimal", r"\boxed{33.5}", "33", F),
    # fractions
    ("frac-decimal", r"\boxed{\frac{1}{2}}", "0.5", T),
    ("dfrac-short", r"\boxed{\dfrac{1}{2}}", r"\frac12", T),
    ("slash-frac", r"\boxed{1/2}", r"\frac{1}{2}", T),
    ("tfrac-frac", r"\boxed{\tfrac34}", r"\frac{3}{4}", T),
    ("decimal-short-frac", r"\boxed{0.75}", r"\frac34", T),
    ("frac-unreduced", r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", T),
    ("frac-wrong", r"\boxed{\frac{1}{3}}", r"\frac12", F),
    ("frac-rounded-wrong", r"\boxed{0.33}", r"\frac13", F),
    ("decimal-equal", r"\boxed{0.50}", "0.5", T),
    ("frac-in-dollars", r"\boxed{$\frac{1}{2}$}", "0.5", T),
    # radicals
    ("sqrt-simplified", r"\boxed{2\sqrt{3}}", r"\sqrt{12}", T),
    ("sqrt-unsimplified", r"\boxed{\sqrt{12}}", r"2\sqrt3", T),
    ("sqrt-frac", r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{1}{2}\sqrt{3}", T),
    ("sqrt-18", r"\boxed{3\sqrt{2}}", r"\sqrt{18}", T),
    ("sqrt-wrong", r"\boxed{\sqrt{2}}", "2", F),
    # intervals
    ("interval-half-open", r"\boxed{[1, 2)}", "[1,2)", T),
    ("interval-left-right", r"\boxed{\left(-\infty, 3\right]}", r"(-\infty,3]", T),
    ("interval-closed-vs-open", r"\boxed{[1,2]}", "(1,2)", F),
    ("interval-infinite", r"\boxed{(0, \infty)}", r"(0,\infty)", T),
    # tuples
    ("tuple-polar", r"\boxed{(3, \frac{\pi}{2})}", r"\left( 3, \frac{\pi}{2} \right)", T),
    ("tuple-wrong", r"\boxed{(3, \pi)}", r"\left( 3, \frac{\pi}{2} \right)", F),
    # sets
    ("set-order", r"\boxed{\{1, 2, 3\}}", r"\{3,2,1\}", T),
    ("list-order", r"\boxed{1, 2, 3}", "3, 2, 1", T),
    ("set-missing", r"\boxed{\{1,2\}}", r"\{1,2,3\}", F),
    # expressions
    ("poly-factored", r"\boxed{(x+1)^2}", "x^2+2x+1", T),
    ("linear-factored", r"\boxed{2x + 2}", "2(x+1)", T),
    ("pi-over-2", r"\boxed{\pi/2}", r"\frac{\pi}{2}", T),
    ("poly-wrong", r"\boxed{x^2+1}", "x^2-1", F),
    ("variable-wrong", r"\boxed{y+1}", "x+1", F),
    ("power", r"\boxed{2^{10}}", "1024", T),
    ("matrix", r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}", T),
    # units, degrees, percent, choices
    ("unit", r"\boxed{5\text{ cm}}", "5", T),
    ("degrees", r"\boxed{30^\circ}", "30", T),
    ("percent", r"\boxed{10\%}", "10", T),
    ("choice-text", r"\boxed{\text{(C)}}", "C", T),
    ("choice-wrong", r"\boxed{\text{(B)}}", r"\text{(C)}", F),
    # multiple boxes, box forms, references in a box
    ("last-box-wins", r"\boxed{3}. Wait, actually \boxed{5}.", "5", T),
    ("earlier-box-ignored", r"\boxed{5}. No: \boxed{3}.", "5", F),
    ("fbox", r"\fbox{12}", "12", T),
    ("boxed-reference", r"\boxed{7}", r"$\boxed{7}$", T),
    # no answer
    ("no-box", "The answer is 5.", "5", F),
    ("empty-response", "", "5", F),
    ("unclosed-box", r"\boxed{5", "5", F),
    ("empty-box", r"\boxed{}", "5", F),
    ("empty-reference", r"\boxed{5}", "", F),
]


@pytest.fixture(scope="module")
def grader():
    with MathGrader(timeout_s=10.0) as g:
        yield g


def test_table_is_large_and_named_uniquely() -> None:
    assert len(CASES) >= 40
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    ("name", "response", "reference", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_grade(
    grader: MathGrader, name: str, response: str, reference: str, expected: bool
) -> None:
    assert grader.grade(response, reference) is expected


def test_grade_many_matches_grade(grader: MathGrader) -> None:
    """A batch gives each case's own verdict, and a batch after the cases were graded one by one
    takes every math-verify verdict from the cache. Self-contained: the module's grader may have
    graded any of the cases before (the parametrized cases, on this xdist worker) or none."""
    responses = [c[1] for c in CASES]
    references = [c[2] for c in CASES]
    slow = {
        (reference_answer(ref), answer)
        for resp, ref in zip(responses, references, strict=True)
        if fast_verdict(answer := extract_answer(resp), reference_answer(ref)) is None
    }
    assert len(slow) >= 10  # the table exercises math-verify, not only the fast path
    one_by_one = [grader.grade(r, ref) for r, ref in zip(responses, references, strict=True)]
    before = dict(grader.stats)
    assert grader.grade_many(responses, references) == one_by_one == [c[3] for c in CASES]
    # every "False" above is a real verdict, not a timeout or a dead worker
    assert grader.stats["timeout"] == grader.stats["crashed"] == grader.stats["error"] == 0
    # the batch re-used the one-by-one verdicts: each slow answer once from the cache, none again
    assert grader.stats["cached"] - before["cached"] == len(slow)
    assert grader.stats["math_verify"] == before["math_verify"]


def test_aime_integers_never_reach_math_verify() -> None:
    for response, reference in [(r"\boxed{033}", "33"), (r"\boxed{34}", "33"), ("none", "5")]:
        assert fast_verdict(extract_answer(response), reference_answer(reference)) is not None


def test_grade_many_rejects_mismatched_lengths(grader: MathGrader) -> None:
    with pytest.raises(ValueError, match="one each"):
        grader.grade_many(["a", "b"], ["a"])


def test_references_need_latex_context() -> None:
    """Every MATH-500 reference (every 5th, for time) parses and equals itself in math-verify."""
    rows = [json.loads(line) for line in (BENCHMARKS / "math500.jsonl").read_text().splitlines()]
    refs = [r["answer"] for r in rows[::5]]
    failed = [ref for ref in refs if not verify_latex(ref, ref)]
    assert failed == []
