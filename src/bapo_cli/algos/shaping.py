"""DAPO's overlong reward shaping (arXiv 2503.14476, Sec. 3.4, Eq. 13), a pure function of lengths.

A response cut off at the token budget is usually wrong because it ran out of room, not because
its reasoning was bad; a flat penalty for truncation is noise. DAPO instead penalises length
softly inside a buffer of the last L_cache tokens before the budget L_max:

    R_length(y) = 0                                  |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                = -1                                 L_max < |y|

times a penalty factor, added to the task reward. Here L_max = rollout.max_tokens (a response
never exceeds it, so the last case is |y| = L_max, penalty 1) and L_cache = algo.overlong_buffer
x L_max (DAPO: L_max 20480 with L_cache 4096, i.e. 0.2), at least one token.

The trainer adds the penalty to the rewards the advantages are computed from; `reward/*` keeps
logging the task reward, and `reward/overlong_penalty_mean` the mean penalty.
"""

from __future__ import annotations

import math

__all__ = ["overlong_buffer_tokens", "overlong_penalty"]


def overlong_buffer_tokens(max_tokens: int, buffer: float) -> int:
    """L_cache in tokens: `buffer` x `max_tokens` rounded, at least 1 (0 when buffer is 0)."""
    if not 0.0 <= buffer < 1.0:
        raise ValueError(f"overlong_buffer must be within [0, 1), got {buffer!r}")
    if buffer == 0.0:
        return 0
    return max(1, round(buffer * max_tokens))


def overlong_penalty(length: int, max_tokens: int, buffer: float, factor: float = 1.0) -> float:
    """The (non-positive) reward added to a response of `length` tokens under a budget of
    `max_tokens`, with the last `buffer` x max_tokens tokens as DAPO's soft buffer."""
    if not (factor >= 0.0 and math.isfinite(factor)):
        raise ValueError(f"overlong_penalty must be a finite number >= 0, got {factor!r}")
    cache = overlong_buffer_tokens(max_tokens, buffer)
    if cache == 0:
        return 0.0
    over = length - (max_tokens - cache)
    return -factor * min(max(over, 0) / cache, 1.0)
