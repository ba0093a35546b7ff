"""The pair-search task: generator, split, search traces and the strict grader."""

from __future__ import annotations

import itertools
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo_cli.data.pairs import (
    PAIRS_MAX_TOKENS,
    PAIRS_TEMPLATE,
    PairTask,
    all_problems,
    canonical,
    named_pair,
    pairs_reward,
    parse_question,
    search_trace,
    verdict,
)


@pytest.fixture(scope="module")
def task() -> PairTask:
    return PairTask(0)


def _pairs_summing(question: str) -> list[tuple[int, int]]:
    digits, target = parse_question(question)
    return [(a, b) for a, b in itertools.combinations(sorted(digits), 2) if a + b == target]


def test_problems_have_six_distinct_digits_and_one_pair(task: PairTask) -> None:
    problems = task.prompts(2000) + task.held_out(500)
    for p in problems:
        shown, target = p.question.split(":?+?=")
        assert len(shown) == 6 and len(set(shown)) == 6 and shown.isdigit(), p
        assert 1 <= int(target) <= 17
        assert _pairs_summing(p.question) == [tuple(int(x) for x in p.answer.split(","))], p
        assert p.kind == "pairs"
    assert len(all_problems()) == 1740  # every (6-digit set, target with exactly one pair)
    # the shown order is drawn: the same (set, target) appears in several orders
    orders: dict[str, set[str]] = {}
    for p in problems:
        orders.setdefault(canonical(*parse_question(p.question)), set()).add(p.question)
    assert max(len(shown) for shown in orders.values()) > 1


def test_prompts_are_reproducible_per_seed(task: PairTask) -> None:
    assert task.prompts(200) == PairTask(0).prompts(200)
    assert task.prompts(50) == task.prompts(200)[:50]
    assert task.prompts(200) != PairTask(1).prompts(200)
    assert [p.id for p in task.prompts(3)] == ["pairs-0-0", "pairs-0-1", "pairs-0-2"]


def test_split_is_disjoint_by_digit_set_and_the_same_for_every_seed(task: PairTask) -> None:
    train = {canonical(*parse_question(p.question)) for p in task.prompts(20_000)}
    held = {canonical(*parse_question(p.question)) for p in task.held_out(2_000)}
    assert train and held and not train & held
    n_train, n_held = len(task.pool("train")), len(task.pool("heldout"))
    assert (n_train, n_held) == (1600, 140)  # ~10% held out, fixed by the hash
    for seed in (1, 7):
        other = PairTask(seed)
        assert other.held_out(100) == task.held_out(100)
        assert other.pool("heldout") == task.pool("heldout")
    q = task.held_out(1)[0].question
    digits, target = parse_question(q)
    reversed_q = "".join(map(str, digits[::-1])) + f":?+?={target}"
    assert task.is_held_out(q) and task.is_held_out(reversed_q)
    assert not any(task.is_held_out(p.question) for p in task.prompts(500))


def test_search_trace_is_a_right_random_order_search() -> None:
    rng = random.Random(0)
    lengths = []
    for p in PairTask(0).prompts(300):
        trace = search_trace(p.question, rng)
        assert pairs_reward(trace, p.answer) == 1.0, trace
        attempts = re.findall(r"[0-9]\+[0-9]", trace)
        assert len(attempts) == len(set(attempts))  # every pair at most once
        assert trace.count("!") == 1 and trace.endswith("!")
        lengths.append(len(trace) + 1)  # + <eos>
    fits = [n for n in lengths if n <= PAIRS_MAX_TOKENS]
    # a uniform search order: ~40% of searches hit within the budget, and those hit halfway
    assert 0.3 < len(fits) / len(lengths) < 0.5
    assert 20 < sum(fits) / len(fits) < 0.7 * PAIRS_MAX_TOKENS
    with pytest.raises(ValueError, match="expected six digits"):
        search_trace("12+3", rng)
    trace = search_trace("318596:?+?=12", random.Random(3))
    assert trace.endswith(("3+9=12!", "9+3=12!")) and trace.count("!") == 1


def test_template() -> None:
    assert PAIRS_TEMPLATE.format(problem="318596:?+?=12") == "318596:?+?=12!"


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("3+9=12!", "3,9", 1.0),  # found at once
        ("3+1=4<8+5=13>3+9=12!", "3,9", 1.0),  # after a search
        ("3+1=4<9+3=12!", "3,9", 1.0),  # either order
        ("3+9=12!", " 3,9 ", 1.0),
        ("3+9=12!<eos>trailing", "3,9", 1.0),  # cut at <eos>
        (" 3+9=12! \n8+1=9<", "3,9", 1.0),  # cut at a newline, stripped
        ("3+1=4<3+1=4<3+9=12!", "3,9", 1.0),  # a repeat is wasteful, not wrong
        ("3+8=11!", "3,9", 0.0),  # the wrong pair, correctly summed
        ("3+8=11<3+9=12!", "3,9", 1.0),
        ("3+8=11>3+9=12!", "3,9", 0.0),  # a wrong verdict: strict
        ("3+9=12<3+8=11!", "3,9", 0.0),  # passed the hit, named another pair
        ("3+9=13!", "3,9", 0.0),  # wrong sum on the hit
        ("3+1=5<3+9=12!", "3,9", 0.0),  # wrong sum on the way: strict
        ("3+9=012!", "3,9", 0.0),  # sums in plain decimal
        ("3+9=12<", "3,9", 0.0),  # ran out: nothing named
        ("3+1=4<8+5=13>1+6=7<5+9=14>3+", "3,9", 0.0),  # cut by the budget
        ("3+9=12!<", "3,9", 0.0),  # junk after the hit
        ("3+9=12!!", "3,9", 0.0),
        ("3+9=12", "3,9", 0.0),  # no verdict
        ("3+1=4;3+9=12!", "3,9", 0.0),  # ';' is no verdict
        ("3 +9=12!", "3,9", 0.0),
        ("!3,9", "3,9", 0.0),
        ("3+3=6!", "3,3", 0.0),  # a pair is two different digits
        ("3+9=12!", "3,9,1", 0.0),  # a malformed reference never scores
        ("3+9=12!", "", 0.0),
        ("\u0663+9=12!", "3,9", 0.0),  # ASCII digits only (Arabic-Indic 3)
        ("", "3,9", 0.0),
        ("<eos>3+9=12!", "3,9", 0.0),
        ("3+1=4<" * 500 + "3+9=12!", "3,9", 1.0),  # long but well formed
        ("3+1=4<" * 500, "3,9", 0.0),
    ],
)
def test_reward_table(response: str, answer: str, reward: float) -> None:
    assert pairs_reward(response, answer) == reward


def test_verdict() -> None:
    assert [verdict(s, 12) for s in (4, 12, 13)] == ["<", "!", ">"]


def test_named_pair() -> None:
    assert named_pair("3+1=4<9+3=12!") == "3,9"
    assert named_pair("3+1=5>1+3=4!") == "1,3"  # the named pair, whether or not the rest holds
    assert named_pair("3+1=4<") is None and named_pair("garbage") is None


ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=200)
NEAR_MISS = st.lists(
    st.sampled_from(["3", "9", "1", "+", "=", "12", "<", ">", "!", "<eos>", "\n", " ", "\udcff"]),
    max_size=40,
).map("".join)


@settings(derandomize=True, deadline=None, database=None, max_examples=400)
@given(response=st.one_of(ANY_TEXT, NEAR_MISS), answer=st.one_of(ANY_TEXT, st.just("3,9")))
def test_grader_never_raises(response: str, answer: str) -> None:
    assert pairs_reward(response, answer) in (0.0, 1.0)
    assert named_pair(response) is None or len(named_pair(response)) == 3


def test_grader_refuses_non_strings() -> None:
    assert pairs_reward(None, "3,9") == 0.0  # type: ignore[arg-type]
    assert pairs_reward("3+9=12!", None) == 0.0  # type: ignore[arg-type]
    assert named_pair(b"3+9=12!") is None  # type: ignore[arg-type]


def test_rejects_bad_heldout_fraction_and_question() -> None:
    with pytest.raises(ValueError, match="heldout_fraction"):
        PairTask(0, heldout_fraction=0.0)
    with pytest.raises(ValueError, match="expected six digits"):
        PairTask(0).is_held_out("37+45")
    assert parse_question("318596:?+?=12") == ([3, 1, 8, 5, 9, 6], 12)
    assert parse_question("31859:?+?=12") is None and parse_question("318596:12") is None
