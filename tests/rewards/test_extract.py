"""last_boxed and normalize_answer: hand-written cases plus bounded property tests."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo_cli.rewards.extract import brace_depth, is_integer, last_boxed, normalize_answer

FUZZ = settings(max_examples=200, deadline=None, derandomize=True)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{5}", "5"),
        (r"\boxed{3} wait \boxed{5}.", "5"),
        (r"\boxed{\frac{1}{\{2\}}}", r"\frac{1}{\{2\}}"),
        (r"\boxed{a\\{b}}", r"a\\{b}"),
        (r"\boxed {8}", "8"),
        ("\\boxed 7$.", "7"),
        (r"\fbox{12}", "12"),
        (r"\boxed{1} then \fbox{2}", "2"),
        (r"\fbox{1} then \boxed{2}", "2"),
        (r"\boxed{}", ""),
        (r"\boxed{1} \boxed{2", None),  # the last box is unclosed: no answer
        (r"\boxed{1} \boxed", None),
        (r"\boxedsymbol{3}", None),
        ("the answer is 5", None),
        ("", None),
    ],
)
def test_last_boxed(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


def test_last_boxed_max_chars() -> None:
    assert last_boxed(r"\boxed{12345}", max_chars=5) == "12345"
    assert last_boxed(r"\boxed{123456}", max_chars=5) is None
    assert last_boxed(r"\boxed 123456", max_chars=5) is None


def test_last_boxed_is_linear_on_hostile_input() -> None:
    hostile = [
        "\\boxed{" + "{" * 1_000_000,
        "\\boxed{" * 200_000,
        "x" * 1_000_000 + "\\boxed{5}",
        "\\" * 1_000_000 + "\\boxed{5}",
    ]
    t0 = time.perf_counter()
    results = [last_boxed(h, max_chars=2000) for h in hostile]
    assert results == [None, None, "5", "5"]
    assert time.perf_counter() - t0 < 2.0


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("$033$", "33"),
        ("33.", "33"),
        ("x = 33", "33"),
        ("+7", "7"),
        ("-0", "0"),
        ("12.00", "12"),
        ("000", "0"),
        ("1{,}000", "1000"),
        (r"1\,000", "1000"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\tfrac34", r"\frac34"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"10\%", "10"),
        (r"30^\circ", "30"),
        (r"30^{\circ}", "30"),
        (r"5\text{ cm}", "5"),
        (r"5 \mbox{cm}^2", "5"),
        (r"\text{(A)}", "A"),
        ("(b)", "b"),
        ("{5}", "5"),
        (r"\pi r^2", r"\pi r^2"),  # the space ends a control word: kept
        (r"\frac 3 4", r"\frac34"),
        (r"\rightarrow", r"\rightarrow"),  # \right inside a longer command is not \right
        (r"x \text{ if } y", r"x\text{if}y"),  # text after a non-number is not a unit
        ("0.50", "0.50"),  # decimals are left to math-verify
        ("٣٣", "٣٣"),  # Arabic-Indic digits are not ASCII integers
        ("9" * 5000, "9" * 5000),  # no int() conversion, so no digit-limit error
    ],
)
def test_normalize_answer(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


def test_is_integer_and_brace_depth() -> None:
    assert is_integer("33") and is_integer("-7")
    assert not any(is_integer(s) for s in ("", "-", "3.5", "٣", "²", "x"))
    assert brace_depth("a{b{c}}{d}") == 2
    assert brace_depth(r"\{\{\{") == 0


PIECES = st.sampled_from(["{", "}", "\\", "$", " ", "1", "x", ".", "\\boxed", "\\boxed{", "\\fbox"])
TEXT = st.lists(PIECES, max_size=30).map("".join)


@FUZZ
@given(TEXT)
def test_last_boxed_returns_a_balanced_substring(text: str) -> None:
    answer = last_boxed(text)
    if answer is not None:
        assert answer in text
        assert brace_depth(answer) <= brace_depth(text)


@FUZZ
@given(st.text(max_size=80))
def test_normalize_never_raises_and_is_idempotent_on_integers(text: str) -> None:
    once = normalize_answer(text)
    assert isinstance(once, str)
    if is_integer(once):
        assert normalize_answer(once) == once
