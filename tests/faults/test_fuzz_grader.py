"""Hostile model text through the grader and the answer extractor: long, deeply nested, binary,
control characters, any unicode (lone surrogates included). Every call returns (a bool, a str or
None) without an exception, and no call outlives the grader's time limit plus start-up slack.

Seeds are fixed (`derandomize=True`) and example counts bounded, so a run is reproducible and takes
about a minute on 2 cores. `FUZZED` counts the inputs; the module prints the totals at the end.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bapo_cli.rewards as rewards
from bapo_cli.rewards import MathGrader, extract_answer, last_boxed, normalize_answer

LIMIT = 1.0  # the grader's per-sample math-verify limit in these tests
STARTUP = 15.0  # after a timeout the next call waits for a fresh worker (not charged to LIMIT)
PURE_S = 3.0  # linear scans take milliseconds even at 200k chars; the quadratic version took 12 s
FUZZED: Counter[str] = Counter()

FUZZ = settings(
    derandomize=True,
    deadline=None,  # timed by hand below, against the grader's own limit
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# any code point Python allows in a str, lone surrogates included
ANY_CHAR = st.characters(codec=None, exclude_categories=())
LATEX = st.sampled_from(
    [
        "\\boxed{", "\\boxed ", "\\fbox{", "{", "}", "\\{", "\\}", "\\\\", "\\", "$", "\\frac{",
        "\\sqrt{", "^{", "_{", "9", "0", "-", ".", ",", "x", "=", "\\pi", "\\infty", "\\left(",
        "\\right)", "\\text{", "\\dfrac", "%", "\\%", "(C)", "\x00", "\x1b[31m", "\r\n", "\u202e",
        "\udcff", "\U0001f600", "\u0301", "\ufffd", " ", "\t", "\\,", "10^{10^{", "!",
    ]
)  # fmt: skip
FRAGMENTS = st.lists(st.one_of(LATEX, st.text(ANY_CHAR, max_size=8)), max_size=60).map("".join)
BINARY = st.binary(max_size=2000).map(lambda b: b.decode("utf-8", "surrogateescape"))
LONG = st.builds(
    lambda unit, n, tail: unit * n + tail,
    st.sampled_from(["{", "}", "\\boxed{", "\\", "a", "\\{", "{}", "1", "\\boxed{1}", "^{9"]),
    st.integers(1_000, 200_000),
    FRAGMENTS,
)
NESTED = st.builds(
    lambda depth, core, shut: "\\boxed{" + "{" * depth + core + "}" * (depth * shut) + "}",
    st.integers(0, 5_000),
    FRAGMENTS,
    st.booleans(),
)
HOSTILE = st.one_of(
    st.text(ANY_CHAR, max_size=500), FRAGMENTS, BINARY, LONG, NESTED,
    FRAGMENTS.map(lambda s: "\\boxed{" + s + "}"),
)  # fmt: skip
REFERENCES = st.one_of(
    st.sampled_from(["5", "33", "\\frac{1}{2}", "0.5", "\\sqrt{12}", "x^2+1", "(C)", ""]),
    FRAGMENTS,
    st.text(ANY_CHAR, max_size=50),
)


@pytest.fixture(scope="module")
def grader():
    with MathGrader(timeout_s=LIMIT) as g:
        g.grade(r"\boxed{\frac12}", "0.5")  # the worker starts outside the timed calls
        yield g
    print(f"\nfuzzed inputs: {dict(FUZZED)}; grader stats: {g.stats}")


def _timed(fn, *args, limit: float):
    t0 = time.perf_counter()
    out = fn(*args)
    elapsed = time.perf_counter() - t0
    assert elapsed < limit, f"{fn.__name__} took {elapsed:.2f} s on {len(args[0])} chars"
    return out


@settings(FUZZ, max_examples=300)
@given(HOSTILE)
def test_extraction_never_raises_or_hangs(text: str) -> None:
    FUZZED["extract"] += 1
    for fn in (last_boxed, extract_answer):
        out = _timed(fn, text, limit=PURE_S)
        assert out is None or (isinstance(out, str) and out in text)
        if out is not None:
            assert isinstance(_timed(normalize_answer, out, limit=PURE_S), str)
    assert isinstance(_timed(normalize_answer, text, limit=PURE_S), str)


@settings(FUZZ, max_examples=150)
@given(response=HOSTILE, reference=REFERENCES)
def test_grade_returns_a_bool_within_the_limit(grader, response: str, reference: str) -> None:
    FUZZED["grade"] += 1
    assert isinstance(_timed(grader.grade, response, reference, limit=LIMIT + STARTUP), bool)


@settings(FUZZ, max_examples=25)
@given(st.lists(st.tuples(HOSTILE, REFERENCES), min_size=1, max_size=8))
def test_grade_many_returns_one_bool_each(grader, pairs: list[tuple[str, str]]) -> None:
    FUZZED["grade_many"] += len(pairs)
    responses, references = [p[0] for p in pairs], [p[1] for p in pairs]
    # each slow sample may time out (and restart the worker) on its own
    out = _timed(grader.grade_many, responses, references, limit=len(pairs) * (LIMIT + STARTUP))
    assert len(out) == len(pairs) and all(isinstance(v, bool) for v in out)


@settings(FUZZ, max_examples=20)
@given(response=HOSTILE, reference=REFERENCES)
def test_the_shared_grader_functions_too(response: str, reference: str) -> None:
    FUZZED["rewards.grade"] += 1
    assert isinstance(rewards.grade(response, reference, timeout_s=LIMIT), bool)
    assert rewards.grade_many([response], [reference], timeout_s=LIMIT) in ([True], [False])


def _old_strip_outer_braces(s: str) -> str:
    """What `_strip_outer_braces` was before fuzzing found it quadratic: the reference."""
    from bapo_cli.rewards.extract import _brace_group

    while len(s) >= 2 and s[0] == "{" and s[-1] == "}" and _brace_group(s, 0, None) == s[1:-1]:
        s = s[1:-1]
    return s


@settings(FUZZ, max_examples=500)
@given(st.lists(st.sampled_from(["{", "}", "\\", "\\{", "\\}", "x", " ", "{}"]), max_size=40))
def test_linear_brace_stripping_gives_the_old_answers(parts: list[str]) -> None:
    from bapo_cli.rewards.extract import _strip_outer_braces

    s = "".join(parts)
    FUZZED["strip-vs-old"] += 1
    assert _strip_outer_braces(s) == _old_strip_outer_braces(s)


@pytest.mark.parametrize(
    "text",
    ["{" * 20_000 + "1" + "}" * 20_000, "1" + "." * 200_000, "1" + " %" * 100_000],
    ids=["40k-nested", "200k-periods", "200k-percent"],
)
def test_normalize_answer_is_linear_on_what_was_quadratic(text: str) -> None:
    t0 = time.perf_counter()
    assert normalize_answer(text) == "1"
    assert time.perf_counter() - t0 < PURE_S  # was 12 s for 20k nested pairs
