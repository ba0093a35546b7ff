"""A sequence-mask threshold without a mask is refused (issue 33 item 8): it used to be accepted
and mask nothing, silently."""

from __future__ import annotations

from tests.conftest import run_bapo


def test_a_threshold_without_a_mask_is_one_error_line() -> None:
    result = run_bapo("config", "rollout.seq_mask=none", "rollout.seq_mask_threshold=2.0")
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr == (
        "error: rollout.seq_mask_threshold=2.0: set while rollout.seq_mask=none, so nothing is "
        "masked; choose rollout.seq_mask=geo or opsm, or drop the threshold (null)\n"
    )
    ok = run_bapo("config", "rollout.seq_mask=geo", "rollout.seq_mask_threshold=2.0")
    assert ok.returncode == 0, ok.stderr
    assert "seq_mask_threshold: 2.0" in ok.stdout
