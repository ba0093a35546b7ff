r"""Reward functions in the reward=python shape, ``fn(response, reference, record) -> float``.

`boxed_exact` is reward=python's default ``reward.fn`` and a template to copy: a copy in
``my_rewards.py`` runs as ``reward=python reward.fn=my_rewards.py:boxed_exact``. `plain_exact`
also reads a bare answer, for models that never write ``\boxed{}`` (the testbed `tiny` models):
``reward=python reward.fn=bapo_cli.rewards.examples:plain_exact``.

    >>> boxed_exact(r"so \boxed{033}", "33", {})
    1.0
    >>> boxed_exact(r"\boxed{\frac12}", "0.5", {})   # no math-verify: strings only
    0.0
    >>> [plain_exact(r, "5", {}) for r in ("5", "it is 5", r"\boxed{5}")]
    [1.0, 0.0, 1.0]
"""

from __future__ import annotations

from typing import Any

from bapo_cli.rewards.extract import last_boxed, normalize_answer


def boxed_exact(response: str, reference: str, record: dict[str, Any]) -> float:
    """1.0 when the last ``\boxed{}`` of the response equals the reference after
    `normalize_answer` (``$033$`` = ``33``), else 0.0; no math-verify, so never slow."""
    answer = last_boxed(response, max_chars=2000)
    if answer is None:
        return 0.0
    return float(normalize_answer(answer) == normalize_answer(reference) != "")


def plain_exact(response: str, reference: str, record: dict[str, Any]) -> float:
    """1.0 when the response's answer equals the reference after `normalize_answer`: its last
    ``\\boxed{}`` if it has one, else its first line as a whole (``5``, not ``it is 5``)."""
    answer = last_boxed(response, max_chars=2000)
    if answer is None:
        answer = response.strip().split("\n", 1)[0] if response.strip() else ""
    return float(normalize_answer(answer) == normalize_answer(reference) != "")
