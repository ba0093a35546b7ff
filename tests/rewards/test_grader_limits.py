"""Hostile responses: every one is graded False, without an exception, within the time limit."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bapo_cli.rewards as rewards
from bapo_cli.rewards import MathGrader

LIMIT = 1.0
# A call that follows a timeout also waits for the replacement worker to start (not charged to
# the limit, but on the wall clock): allow for that on a loaded 2-core CI machine.
STARTUP = 10.0

TOWER = r"\boxed{9^{9^{9^9}}}"

FAST_PATH_HOSTILE = {
    "1MB-no-box": "a" * 1_000_000,
    "1MB-in-box": "\\boxed{" + "1" * 1_000_000 + "}",
    "1MB-unclosed": "\\boxed{" + "{" * 1_000_000,
    "5000-nested": "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",
    "11-nested": "\\boxed{" + "{" * 11 + "1" + "}" * 11 + "}",
    "200k-boxes": "\\boxed{" * 200_000,
    "backslashes": "\\" * 1_000_000,
    "null-bytes": "\\boxed{\x00" * 1000,
}

SLOW_HOSTILE = {
    "tower": TOWER,
    "tower-10": r"\boxed{10^{10^{10^{10}}}}",
    "factorial": r"\boxed{(10^{10})!}",
    "control-chars": "\\boxed{\x1b[31m5\x07\x08\r\x7f}",
    "binary": "\\boxed{" + bytes(range(256)).decode("latin-1") + "}",
    "surrogates": "\\boxed{\udcff\udc80 5}",
    "unicode": "\\boxed{\u2603\u0301\ufffd\U0001f600 \u202e5}",
    "bad-latex": r"\boxed{\frac{\sqrt{}{}}^^_}",
    "deep-but-allowed": "\\boxed{" + "{" * 10 + "x" + "}" * 10 + "}",
}


@pytest.fixture(scope="module")
def grader():
    with MathGrader(timeout_s=LIMIT) as g:
        g.grade(r"\boxed{\frac12}", "0.5")  # start the worker outside the timed tests
        yield g


@pytest.mark.parametrize("name", sorted(FAST_PATH_HOSTILE))
def test_hostile_input_is_rejected_before_parsing(grader: MathGrader, name: str) -> None:
    before = grader.stats["fast"]
    t0 = time.perf_counter()
    assert grader.grade(FAST_PATH_HOSTILE[name], "5") is False
    assert time.perf_counter() - t0 < 1.0
    assert grader.stats["fast"] == before + 1  # never sent to math-verify


@pytest.mark.parametrize("name", sorted(SLOW_HOSTILE))
def test_hostile_input_is_false_within_the_limit(grader: MathGrader, name: str) -> None:
    t0 = time.perf_counter()
    assert grader.grade(SLOW_HOSTILE[name], "5") is False
    assert time.perf_counter() - t0 < LIMIT + STARTUP


def test_timeout_kills_restarts_and_logs_one_short_line(
    grader: MathGrader, caplog: pytest.LogCaptureFixture
) -> None:
    answer = r"9^{9^{9^9}}+" + "x+" * 600 + "1"
    timeouts = grader.stats["timeout"]
    with caplog.at_level(logging.WARNING, logger="bapo_cli.rewards"):
        t0 = time.perf_counter()
        assert grader.grade("\\boxed{" + answer + "}", "5") is False
        elapsed = time.perf_counter() - t0
    assert LIMIT <= elapsed < LIMIT + STARTUP
    assert grader.stats["timeout"] == timeouts + 1
    assert len(caplog.records) == 1
    assert len(caplog.records[0].getMessage()) < 200
    starts = grader.worker.starts
    assert grader.grade(r"\boxed{\sqrt{12}}", r"2\sqrt3") is True  # a fresh worker grades on
    assert grader.worker.starts == starts + 1


def test_timeouts_are_cached(grader: MathGrader) -> None:
    grader.grade(TOWER, "7")
    t0 = time.perf_counter()
    assert grader.grade(TOWER, "7") is False
    assert time.perf_counter() - t0 < 0.1


def test_limit_holds_outside_the_main_thread(grader: MathGrader) -> None:
    """math-verify's own signal timeout would raise here; ours works from any thread."""
    out: list[bool] = []
    t = threading.Thread(target=lambda: out.append(grader.grade(TOWER, "11")))
    t0 = time.perf_counter()
    t.start()
    t.join(LIMIT + STARTUP + 5)
    assert out == [False]
    assert time.perf_counter() - t0 < LIMIT + STARTUP


def test_default_grader_functions() -> None:
    assert rewards.grade(r"\boxed{033}", "33") is True
    assert rewards.grade_many([r"\boxed{1/2}", "no"], ["0.5", "1"], timeout_s=5) == [True, False]
    rewards.close()
    rewards.close()  # idempotent


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    st.one_of(
        st.text(max_size=300),
        st.binary(max_size=300).map(lambda b: b.decode("utf-8", "surrogateescape")),
        st.text(alphabet="{}\\^_0123456789x!", max_size=60),
    )
)
def test_fuzzed_boxed_text_never_raises_or_hangs(grader: MathGrader, text: str) -> None:
    t0 = time.perf_counter()
    assert isinstance(grader.grade("\\boxed{" + text + "}", "5"), bool)
    assert time.perf_counter() - t0 < LIMIT + STARTUP
