"""DAPO's overlong reward shaping (Eq. 13) as a function of the response length."""

from __future__ import annotations

import pytest

from bapo_cli.algos.shaping import overlong_buffer_tokens, overlong_penalty


def test_the_penalty_is_zero_before_the_buffer_and_linear_inside_it() -> None:
    # DAPO's setting: L_max 20480, L_cache 4096 = 0.2 of it
    assert overlong_buffer_tokens(20480, 0.2) == 4096
    assert overlong_penalty(16384, 20480, 0.2) == 0.0  # L_max - L_cache: no penalty yet
    assert overlong_penalty(16384 + 1024, 20480, 0.2) == -0.25
    assert overlong_penalty(20480, 20480, 0.2) == -1.0  # the whole budget
    assert overlong_penalty(100, 20480, 0.2) == 0.0
    assert overlong_penalty(20480, 20480, 0.2, factor=0.5) == -0.5


def test_a_small_budget_keeps_at_least_one_buffer_token_and_zero_turns_it_off() -> None:
    assert overlong_buffer_tokens(16, 0.01) == 1
    assert overlong_penalty(16, 16, 0.01) == -1.0 and overlong_penalty(15, 16, 0.01) == 0.0
    assert [overlong_penalty(n, 16, 0.25) for n in (12, 13, 14, 16)] == [0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(16, 16, 0.0) == 0.0


@pytest.mark.parametrize(
    ("buffer", "factor", "word"), [(1.0, 1.0, "overlong_buffer"), (0.2, -1, "overlong_penalty")]
)
def test_bad_settings_name_themselves(buffer, factor, word) -> None:
    with pytest.raises(ValueError, match=word):
        overlong_penalty(10, 16, buffer, factor)
