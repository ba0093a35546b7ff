r"""Benchmark metrics from graded samples: avg@n, pass@k, maj@n. Pure functions, no I/O.

Every problem gets ``n`` sampled responses; each response has an extracted answer (or None) and a
correctness bit. Per benchmark:

- **avg@n**: mean over problems of the fraction of correct samples (the expected accuracy of one
  sample; the paper's headline AIME number is avg@16 or avg@32).
- **pass@k**: the probability that at least one of ``k`` samples, drawn without replacement from
  the ``n``, is correct, averaged over problems. With ``c`` correct of ``n`` the unbiased estimator
  (Chen et al. 2021, "Evaluating Large Language Models Trained on Code") is

      pass@k = 1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i)

  computed in the product form: binomials of n = 1024 overflow floats, the product does not.
  Sampling k *independently* and reporting "any correct" would be biased; so would 1-(1-c/n)^k.
  pass@1 equals avg@n.
- **maj@n**: the answer most samples agree on (votes keyed by `normalize_answer`, so "033",
  "$33$" and "33." are one vote) is the problem's answer; maj@n is how often it is right. Samples
  without an answer do not vote; a problem where none answered counts as wrong. Ties go to the
  answer seen first, so the result does not depend on dict or hash order.

`summarize` returns one benchmark's entry of ``results.json``::

    {"avg@16": 0.41, "pass@1": 0.41, "pass@2": 0.52, ..., "pass@16": 0.80, "maj@16": 0.55,
     "n": 16, "num_problems": 30}

with pass@k for k in `ks_for(n)`: powers of two up to n, plus n itself when it is not one (so
pass@n, every sample's coverage, is always reported).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from bapo_cli.rewards.extract import normalize_answer

__all__ = [
    "avg_at_n",
    "ks_for",
    "maj_at_n",
    "majority_index",
    "pass_at_k",
    "pass_at_k_mean",
    "summarize",
]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``c`` correct out of ``n`` samples."""
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}] (cannot draw {k} of {n} samples), got {k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def _check_problems(correct: Sequence[Sequence[bool]]) -> None:
    if len(correct) == 0:
        raise ValueError("no problems to score")
    for p, row in enumerate(correct):
        if len(row) == 0:
            raise ValueError(f"problem {p} has no samples")


def pass_at_k_mean(correct: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over problems (each row: one problem's correctness bits)."""
    _check_problems(correct)
    return sum(pass_at_k(len(row), sum(map(bool, row)), k) for row in correct) / len(correct)


def avg_at_n(correct: Sequence[Sequence[bool]]) -> float:
    """Mean over problems of the fraction of correct samples."""
    _check_problems(correct)
    return sum(sum(map(bool, row)) / len(row) for row in correct) / len(correct)


def ks_for(n: int) -> list[int]:
    """The k of pass@k to report for n samples: 1, 2, 4, ... <= n, and n itself."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ks = []
    k = 1
    while k <= n:
        ks.append(k)
        k *= 2
    if ks[-1] != n:
        ks.append(n)
    return ks


def majority_index(answers: Sequence[str | None]) -> int | None:
    """Index of the first sample carrying the most common normalized answer (None: no votes)."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, answer in enumerate(answers):
        if answer is None:
            continue
        key = normalize_answer(answer)
        if not key:
            continue
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, i)
    if not counts:
        return None
    # max() keeps the first maximum in iteration order, and dicts iterate in first-seen order.
    winner = max(counts, key=counts.__getitem__)
    return first[winner]


def maj_at_n(
    answers: Sequence[Sequence[str | None]],
    references: Sequence[str],
    grade_fn: Callable[[str, str], bool],
) -> float:
    """Fraction of problems whose majority answer ``grade_fn(answer, reference)`` accepts.

    ``grade_fn`` takes an *extracted* answer, e.g.
    ``lambda a, r: bapo_cli.rewards.grade("\\boxed{" + a + "}", r)``.
    """
    if len(answers) != len(references):
        raise ValueError(f"{len(answers)} answer rows but {len(references)} references")
    if len(answers) == 0:
        raise ValueError("no problems to score")
    hits = 0
    for row, reference in zip(answers, references, strict=True):
        w = majority_index(row)
        if w is not None and grade_fn(row[w], reference):
            hits += 1
    return hits / len(answers)


def summarize(
    correct: Sequence[Sequence[bool]],
    answers: Sequence[Sequence[str | None]],
    n: int | None = None,
) -> dict[str, float | int]:
    """One benchmark's ``results.json`` entry from per-sample correctness and extracted answers.

    ``correct[p][s]`` and ``answers[p][s]`` describe sample ``s`` of problem ``p``; every problem
    must have exactly ``n`` samples (``n`` defaults to the first row's length). maj@n reuses the
    grade of the first sample that carries the winning answer, so nothing is graded twice.
    """
    _check_problems(correct)
    if len(answers) != len(correct):
        raise ValueError(f"{len(correct)} correctness rows but {len(answers)} answer rows")
    n = len(correct[0]) if n is None else n
    for p, (row, ans) in enumerate(zip(correct, answers, strict=True)):
        if len(row) != n or len(ans) != n:
            raise ValueError(
                f"problem {p} has {len(row)} grades and {len(ans)} answers, expected n={n} each"
            )
    result: dict[str, float | int] = {f"avg@{n}": avg_at_n(correct)}
    for k in ks_for(n):
        result[f"pass@{k}"] = pass_at_k_mean(correct, k)
    maj_hits = 0
    for row, ans in zip(correct, answers, strict=True):
        w = majority_index(ans)
        maj_hits += int(w is not None and bool(row[w]))
    result[f"maj@{n}"] = maj_hits / len(correct)
    result["n"] = n
    result["num_problems"] = len(correct)
    return result
