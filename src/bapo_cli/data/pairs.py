"""Pair search: a synthetic task where wrong answers are longer than right ones.

What it is for
--------------
BAPO balances the loss mass of positive- and negative-advantage tokens (`algos/bounds.py`): it
widens the clip bounds until positives carry a share rho0 (0.4) of the gradient-carrying mass. On
the arithmetic task (`data.tasks`) right and wrong answers are equally long, so with
group-normalised advantages (the advantages of a group sum to zero) the positive share is ~0.5 >
rho0 and the bound search has nothing to do. Here the wrong answers are the long ones:

    prompt    318596:?+?=12!                     six distinct digits; which two make 12?
    right     8+5=13>3+9=12!                     attempts "a+b=s" + verdict, until the hit
    wrong     3+1=4<8+5=13>1+6=7<5+9=14>...      a failed search runs into the token budget

Each attempt ends in its verdict: '<' (the sum is below the target), '>' (above) or '!' (the hit,
which ends the response).

A group's positive and negative *sequences* carry equal advantage mass, so its token-level positive
share is about len(right) / (len(right) + len(wrong)). A search that tries pairs in random order
hits within its budget of ~6 attempts at a uniformly spread position, so right answers average
half the budget and wrong ones use all of it: the on-policy share is ~1/3 < rho0, and BAPO's
search has work to do -- as on long-reasoning math, where failed solutions ramble on.

The choices that matter are low-probability branching tokens: which of the 15 pairs to try next
(the first digit of an attempt is one of six). The tiny model is warmed up (`models.tiny`, with
`model.tiny.task=pairs`) on random-order search traces, so it learns the format, the digit sums,
the verdicts and when to stop, but not the strategy (try the pairs that can reach the target
first); RL is left to learn that by raising the probability of those rare right choices.

Why verdicts: deciding to stop means comparing the sum with a target far back in the prompt. When
only the hit was marked ("3+1=4;3+9=12!", or "...;3+9=12;!3,9"), that decision came up once per
trace and the 0.3M and 0.6M tiny models still stopped at random after 900-1500 warm-up steps
(2-4% sampled accuracy); a verdict after every attempt supervises the comparison six times per
trace, and the 2-layer model reaches 20% held-out greedy accuracy after 1000 steps. The verdicts
are also the kind of intermediate feedback a search can exploit (a sum below the target calls for
bigger digits), so RL has a strategy to find. The prompt spells the goal "?+?=12!", which the
hit repeats.

The problem set
---------------
Every set of six distinct digits (0-9) and every target that exactly one pair of them sums to:
1740 such (digit set, target) problems. A prompt shows the set in a random order. The train /
held-out split is a stable hash of the *sorted* set and the target (`canonical`), so every order of
a held-out set is held out, and the split does not depend on the seed.

Grading (`pairs_reward`, strict): the response (cut at the first newline / EOS, stripped) must be
exactly `(a+b=s[<>])*a+b=s!`, every sum and every verdict must be right (a sloppy search is not
rewarded, and a longer search has more chances to slip, which keeps wrong answers long), and the
'!' attempt's pair -- the one the response names -- must be the reference pair (in either order;
the target is its sum). Digits are ASCII only.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re

from bapo_cli.data.tasks import Problem, clean_response

PAIRS_TEMPLATE = "{problem}!"
"""Prompt format the tiny model is warmed up on (`data=pairs` sets `data.template` to it)."""

PAIRS_MAX_TOKENS = 40
"""Response budget (one token per character with the tiny tokenizer): about six attempts, so a
random-order search hits within it ~40% of the time. The warm-up truncates its traces here and
`experiment=pairs` sets rollout.max_tokens to it."""

NUM_DIGITS = 6

_ATTEMPT = re.compile(r"([0-9])\+([0-9])=([0-9]{1,2})([<>!])")
_RESPONSE = re.compile(r"(?:[0-9]\+[0-9]=[0-9]{1,2}[<>])*[0-9]\+[0-9]=[0-9]{1,2}!")
_QUESTION = re.compile(rf"([0-9]{{{NUM_DIGITS}}}):\?\+\?=([0-9]{{1,2}})")
_ANSWER = re.compile(r"([0-9]),([0-9])")


def canonical(digits: tuple[int, ...] | list[int], target: int) -> str:
    """The order-free form of a problem, "013578:12": what the split hashes."""
    return "".join(str(d) for d in sorted(digits)) + f":{target}"


def unique_pair(digits: tuple[int, ...] | list[int], target: int) -> tuple[int, int] | None:
    """The one pair (a < b) of `digits` that sums to `target`, or None if none or several do."""
    hits = [(a, b) for a, b in itertools.combinations(sorted(digits), 2) if a + b == target]
    return hits[0] if len(hits) == 1 else None


def all_problems() -> list[tuple[tuple[int, ...], int]]:
    """Every (sorted digit set, target) with exactly one pair summing to the target, in order."""
    out = []
    for digits in itertools.combinations(range(10), NUM_DIGITS):
        sums = [a + b for a, b in itertools.combinations(digits, 2)]
        out += [(digits, t) for t in sorted(set(sums)) if sums.count(t) == 1]
    return out


def _held_out(key: str, fraction: float) -> bool:
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def parse_question(question: str) -> tuple[list[int], int] | None:
    """("318596:?+?=12") -> ([3, 1, 8, 5, 9, 6], 12); None for anything else."""
    match = _QUESTION.fullmatch(question.strip()) if isinstance(question, str) else None
    if match is None:
        return None
    return [int(c) for c in match.group(1)], int(match.group(2))


class PairTask:
    """Seeded generator of pair-search problems over a fixed train / held-out split.

    The same interface as `ArithTask`: `prompts(n)` is a seed's training set, `held_out(n)` a
    fixed evaluation set (the same for every seed), `sample(n, rng, split=...)` draws from either
    pool with the caller's `random.Random`. A problem's answer is its pair, "a,b" with a < b.
    """

    def __init__(self, seed: int = 0, *, heldout_fraction: float = 0.1) -> None:
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction={heldout_fraction}: must be within (0, 1)")
        self.seed = seed
        self.heldout_fraction = heldout_fraction
        self._pools: dict[str, list[tuple[tuple[int, ...], int]]] = {"train": [], "heldout": []}
        for digits, target in all_problems():
            split = "heldout" if _held_out(canonical(digits, target), heldout_fraction) else "train"
            self._pools[split].append((digits, target))

    def is_held_out(self, question: str) -> bool:
        """Whether `question` ("318596:?+?=12", any digit order) belongs to the held-out split."""
        parsed = parse_question(question)
        if parsed is None:
            raise ValueError(f"question={question!r}: expected six digits, ':?+?=' and a target")
        return _held_out(canonical(*parsed), self.heldout_fraction)

    def pool(self, split: str = "train") -> list[tuple[tuple[int, ...], int]]:
        """All (sorted digit set, target) problems of one split."""
        return list(self._pools[split])

    def sample(
        self, n: int, rng: random.Random, *, split: str = "train", id_prefix: str = "pairs"
    ) -> list[Problem]:
        """`n` problems (with repeats): uniform draws from the pool, digits in a random order."""
        if split not in self._pools:
            raise ValueError(f"split={split!r}: must be one of train, heldout")
        pool = self._pools[split]
        out = []
        for i in range(n):
            digits, target = pool[rng.randrange(len(pool))]
            shown = list(digits)
            rng.shuffle(shown)
            a, b = unique_pair(digits, target)  # type: ignore[misc]  # the pool holds only these
            question = "".join(str(d) for d in shown) + f":?+?={target}"
            out.append(Problem(f"{id_prefix}-{i}", question, f"{a},{b}", "pairs"))
        return out

    def prompts(self, num_prompts: int) -> list[Problem]:
        """The training prompt set of this seed: `num_prompts` problems, ids `pairs-<seed>-<i>`."""
        return self.sample(num_prompts, random.Random(self.seed), id_prefix=f"pairs-{self.seed}")

    def held_out(self, num: int) -> list[Problem]:
        """A fixed held-out evaluation set (independent of the seed), ids `pairs-heldout-<i>`."""
        return self.sample(num, random.Random(-1), split="heldout", id_prefix="pairs-heldout")


def search_trace(question: str, rng: random.Random) -> str:
    """A random-order search: every pair once, in an order drawn with `rng`, until the hit.

    Each attempt writes its digits in prompt order ("3+9=12" for 3 shown before 9) and its
    verdict ('<', '>', '!' for the hit, which ends it). The warm-up imitates these, so the model
    learns the format, the sums, the verdicts and when to stop, but no preference among the pairs
    still untried.
    """
    parsed = parse_question(question)
    if parsed is None:
        raise ValueError(f"question={question!r}: expected six digits, ':?+?=' and a target")
    digits, target = parsed
    order = list(itertools.combinations(range(len(digits)), 2))
    rng.shuffle(order)
    parts = []
    for i, j in order:
        a, b = digits[i], digits[j]
        parts.append(f"{a}+{b}={a + b}{verdict(a + b, target)}")
        if a + b == target:
            return "".join(parts)
    raise ValueError(f"question={question!r}: no pair sums to {target}")


def verdict(total: int, target: int) -> str:
    """'<' below the target, '>' above, '!' on it."""
    return "<" if total < target else ">" if total > target else "!"


def _parse(response: str) -> list[tuple[int, int, str, str]] | None:
    """The attempts [(a, b, written sum, verdict)] of a well-formed response (the last is the
    named pair), else None."""
    if not isinstance(response, str):
        return None
    text = clean_response(response)
    if _RESPONSE.fullmatch(text) is None:
        return None
    return [(int(a), int(b), s, v) for a, b, s, v in _ATTEMPT.findall(text)]


def pairs_reward(response: str, answer: str) -> float:
    """1.0 for a well-formed search whose sums and verdicts are all right and whose '!' attempt
    is the answer's pair; 0.0 otherwise (garbage included: it never raises)."""
    attempts = _parse(response)
    reference = _ANSWER.fullmatch(answer.strip()) if isinstance(answer, str) else None
    if attempts is None or reference is None:
        return 0.0
    pair = {int(reference[1]), int(reference[2])}
    target = sum(pair)
    if len(pair) != 2 or any(
        str(a + b) != s or verdict(a + b, target) != v for a, b, s, v in attempts
    ):
        return 0.0
    return 1.0 if set(attempts[-1][:2]) == pair else 0.0


def named_pair(response: str) -> str | None:
    """The pair a well-formed response names (its '!' attempt), "a,b" with a <= b (for maj@n),
    else None."""
    attempts = _parse(response)
    if attempts is None:
        return None
    x, y = sorted(attempts[-1][:2])
    return f"{x},{y}"


FAILURE_CLASSES = ("no_stop", "malformed", "wrong_sum", "false_stop", "wrong_verdict", "wrong_pair")
"""Why a pair-search response failed, in the order `failure_class` tries them (study v3's
held-out read-out, docs/study-v3.md): **no_stop** no '!' at all (the search ran into the budget:
a longer response), **malformed** a '!' but not the grammar `(a+b=s[<>])*a+b=s!`, **wrong_sum** a
written sum that is not a + b, **false_stop** a '!' on a sum that is not the target (a shorter
response), **wrong_verdict** a '<' or '>' that contradicts the sum against the target, and
**wrong_pair** everything else graded wrong: a well-formed, correctly summed search whose '!'
attempt hits the target with a pair that is not the problem's (a digit the prompt does not show,
or one digit twice). The design named the first five; the sixth holds what they leave out, so
every wrong response has exactly one class."""


def failure_class(response: str, answer: str) -> str | None:
    """The first class of `FAILURE_CLASSES` that fits a wrong response; None when
    `pairs_reward(response, answer)` is 1.0. `answer` is the problem's pair "a,b" (its sum is the
    target); garbage never raises: it is no_stop or malformed."""
    reference = _ANSWER.fullmatch(answer.strip()) if isinstance(answer, str) else None
    if reference is None:
        raise ValueError(f"answer={answer!r}: expected a pair 'a,b' of digits")
    if pairs_reward(response, answer) == 1.0:
        return None
    text = clean_response(response) if isinstance(response, str) else ""
    if "!" not in text:
        return "no_stop"
    attempts = _parse(text)
    if attempts is None:
        return "malformed"
    target = int(reference[1]) + int(reference[2])
    if any(str(a + b) != s for a, b, s, _ in attempts):
        return "wrong_sum"
    if int(attempts[-1][2]) != target:
        return "false_stop"
    if any(verdict(int(s), target) != v for _, _, s, v in attempts[:-1]):
        return "wrong_verdict"
    return "wrong_pair"
