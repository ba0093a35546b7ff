"""The synthetic arithmetic task and its exact-match reward."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from bapo_cli.data.tasks import ARITH_TEMPLATE, KINDS, ArithTask, arith_reward


@pytest.fixture(scope="module")
def task() -> ArithTask:
    return ArithTask(0)


def _check(question: str) -> int:
    for op in "+-*":
        left, sep, right = question[1:].partition(op)
        if sep:
            a, b = int(question[0] + left), int(right)
            return a + b if op == "+" else a - b if op == "-" else a * b
    raise AssertionError(question)


def test_prompts_are_reproducible_per_seed(task: ArithTask) -> None:
    assert task.prompts(200) == ArithTask(0).prompts(200)
    assert task.prompts(50) == task.prompts(200)[:50]
    assert task.prompts(200) != ArithTask(1).prompts(200)
    assert task.sample(30, random.Random(5)) == task.sample(30, random.Random(5))


def test_answers_are_correct(task: ArithTask) -> None:
    problems = task.prompts(2000) + task.held_out(500)
    for p in problems:
        assert int(p.answer) == _check(p.question), p
        assert p.answer == str(int(p.answer))  # plain decimal, "-34" for negatives
    assert any(p.answer.startswith("-") for p in problems if p.kind == "sub2")


def test_each_kind_has_its_operands(task: ArithTask) -> None:
    digits = {"add1": (1, 1), "add2": (2, 2), "sub2": (2, 2), "mul1": (1, 1), "mul21": (2, 1)}
    for p in task.prompts(1000):
        a, b = p.question.replace("+", " ").replace("-", " ").replace("*", " ").split()
        assert (len(a), len(b)) == digits[p.kind], p
        assert len(p.answer) <= 8


def test_train_and_held_out_are_disjoint(task: ArithTask) -> None:
    train = {p.question for p in task.prompts(20_000)}
    held = {p.question for p in task.held_out(2_000)}
    assert train and held and not train & held
    assert all(task.is_held_out(q) for q in held)
    for kind in KINDS:  # every kind is held out in part: ~10%, never all or nothing
        n_train, n_held = len(task.pool(kind, "train")), len(task.pool(kind, "heldout"))
        assert 0.04 < n_held / (n_train + n_held) < 0.2, kind
    assert ArithTask(7).held_out(100) == task.held_out(100)  # the same for every seed


def test_mix_is_uniform_over_kinds(task: ArithTask) -> None:
    counts = Counter(p.kind for p in task.prompts(10_000))
    assert set(counts) == set(KINDS)
    for kind in KINDS:
        assert abs(counts[kind] / 10_000 - 1 / len(KINDS)) < 0.02, counts


def test_ids_and_template(task: ArithTask) -> None:
    prompts = task.prompts(10)
    assert [p.id for p in prompts] == [f"arith-0-{i}" for i in range(10)]
    assert len({p.id for p in task.held_out(100)}) == 100
    assert ARITH_TEMPLATE.format(problem="37+45") == "37+45="


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("82", "82", 1.0),
        (" 82 ", "82", 1.0),
        ("82\n37+45=82", "82", 1.0),
        ("82<eos>garbage", "82", 1.0),
        ("82<|im_end|>", "82", 1.0),
        ("-34", "-34", 1.0),
        ("34", "-34", 0.0),
        ("082", "82", 0.0),
        ("82.0", "82", 0.0),
        ("8 2", "82", 0.0),
        ("", "82", 0.0),
        ("\n82", "82", 0.0),
        ("821", "82", 0.0),
    ],
)
def test_reward_is_exact_match(response: str, answer: str, reward: float) -> None:
    assert arith_reward(response, answer) == reward


def test_rejects_bad_heldout_fraction() -> None:
    with pytest.raises(ValueError, match="heldout_fraction"):
        ArithTask(0, heldout_fraction=1.0)
