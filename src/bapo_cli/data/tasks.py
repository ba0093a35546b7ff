"""The synthetic arithmetic task: seeded, exactly checkable, with a difficulty mix.

Five kinds of problem, drawn with equal probability, from easy to hard for a 0.3M-parameter model:

    add1   one-digit + one-digit          7+5=12
    add2   two-digit + two-digit          37+45=82
    sub2   two-digit - two-digit          23-57=-34   (negative answers)
    mul1   one-digit * one-digit          7*8=56
    mul21  two-digit * one-digit (2-9)    37*8=296

so that a weak policy solves some prompts and fails others and group rewards are neither all 0 nor
all 1. The prompt is the question followed by "=" (`ARITH_TEMPLATE`) and the answer is the integer
in plain decimal, so `arith_reward` is an exact string match.

Train / held-out split: every possible question belongs to exactly one split, chosen by a stable
hash of its text (about `heldout_fraction` of each kind is held out). The split does not depend on
the seed, so every seed trains on the same pool and is scored on the same held-out questions, and
no training prompt (nor the tiny model's warm-up) ever shows a held-out question.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

ARITH_TEMPLATE = "{problem}="
"""Prompt format the tiny model is warmed up on (`data=arith` sets `data.template` to it)."""

EOS_STRINGS = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>")
"""End-of-sequence markers cut from a response before grading (when decoded with specials)."""


@dataclass(frozen=True)
class Problem:
    """One prompt: a stable id, the question (before any template) and its reference answer."""

    id: str
    question: str
    answer: str
    kind: str = ""
    """Task kind (e.g. `add2` for arith), empty for dataset rows; for per-kind metrics."""
    record: dict[str, Any] | None = field(default=None, compare=False)
    """The source row (JSON data) a dataset problem came from: reward=python's third argument."""
    messages: tuple[dict[str, str], ...] | None = field(default=None, compare=False)
    """A chat-message prompt (verl / messages data): rendered by the chat template, not by
    data.template."""

    def as_record(self) -> dict[str, Any]:
        """What reward=python gets as the record: the source row, else this problem's fields."""
        if self.record is not None:
            return self.record
        return {"id": self.id, "problem": self.question, "answer": self.answer, "kind": self.kind}


def _kinds() -> dict[str, Callable[[], Iterable[tuple[int, str, int]]]]:
    """Every question of each kind, as (left operand, operator, right operand)."""
    return {
        "add1": lambda: ((a, "+", b) for a in range(10) for b in range(10)),
        "add2": lambda: ((a, "+", b) for a in range(10, 100) for b in range(10, 100)),
        "sub2": lambda: ((a, "-", b) for a in range(10, 100) for b in range(10, 100)),
        "mul1": lambda: ((a, "*", b) for a in range(10) for b in range(10)),
        "mul21": lambda: ((a, "*", b) for a in range(10, 100) for b in range(2, 10)),
    }


KINDS = tuple(_kinds())
"""Kind names in a fixed order; each is drawn with probability 1 / len(KINDS)."""


def _solve(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _held_out(question: str, fraction: float) -> bool:
    digest = hashlib.blake2b(question.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


class ArithTask:
    """Seeded generator of arithmetic problems over a fixed train / held-out split.

    `prompts(n)` is the training prompt set of a seed (the same list for the same seed and n);
    `held_out(n)` a fixed evaluation set (the same for every seed); `sample(n, rng, split=...)`
    draws from either pool with the caller's `random.Random`.
    """

    def __init__(self, seed: int = 0, *, heldout_fraction: float = 0.1) -> None:
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction={heldout_fraction}: must be within (0, 1)")
        self.seed = seed
        self.heldout_fraction = heldout_fraction
        # pools[split][kind] = [(question, answer), ...] in a fixed order.
        self._pools: dict[str, dict[str, list[tuple[str, str]]]] = {"train": {}, "heldout": {}}
        for kind, questions in _kinds().items():
            train, held = [], []
            for a, op, b in questions():
                question = f"{a}{op}{b}"
                pair = (question, str(_solve(a, op, b)))
                (held if _held_out(question, heldout_fraction) else train).append(pair)
            self._pools["train"][kind], self._pools["heldout"][kind] = train, held

    def is_held_out(self, question: str) -> bool:
        """Whether `question` (e.g. "37+45") belongs to the held-out split."""
        return _held_out(question, self.heldout_fraction)

    def pool(self, kind: str, split: str = "train") -> list[tuple[str, str]]:
        """All (question, answer) pairs of one kind in one split."""
        return list(self._pools[split][kind])

    def sample(
        self, n: int, rng: random.Random, *, split: str = "train", id_prefix: str = "arith"
    ) -> list[Problem]:
        """`n` problems (with repeats), each kind equally likely, drawn with `rng`."""
        if split not in self._pools:
            raise ValueError(f"split={split!r}: must be one of train, heldout")
        pools = self._pools[split]
        out = []
        for i in range(n):
            kind = KINDS[rng.randrange(len(KINDS))]
            question, answer = pools[kind][rng.randrange(len(pools[kind]))]
            out.append(Problem(f"{id_prefix}-{i}", question, answer, kind))
        return out

    def prompts(self, num_prompts: int) -> list[Problem]:
        """The training prompt set of this seed: `num_prompts` problems, ids `arith-<seed>-<i>`."""
        return self.sample(num_prompts, random.Random(self.seed), id_prefix=f"arith-{self.seed}")

    def held_out(self, num: int) -> list[Problem]:
        """A fixed held-out evaluation set (independent of the seed), ids `arith-heldout-<i>`."""
        return self.sample(num, random.Random(-1), split="heldout", id_prefix="arith-heldout")


def clean_response(response: str) -> str:
    """The response up to its first newline or end-of-sequence marker, whitespace stripped."""
    text = response
    for stop in ("\n", *EOS_STRINGS):
        text = text.split(stop, 1)[0]
    return text.strip()


def arith_reward(response: str, answer: str) -> float:
    """1.0 when the response (cut at the first newline / EOS, stripped) equals the answer."""
    return 1.0 if clean_response(response) == answer.strip() else 0.0
