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
        "masked; choose rollout.seq_mask=geo, opsm, icepop or kpop, or drop the threshold "
        "(null)\n"
    )
    ok = run_bapo("config", "rollout.seq_mask=geo", "rollout.seq_mask_threshold=2.0")
    assert ok.returncode == 0, ok.stderr
    assert "seq_mask_threshold: 2.0" in ok.stdout


def test_kpop_needs_the_proximal_policy_in_one_line() -> None:
    """KPop compares pi_prox with pi_behav (AReaL's rejection sampling): without
    trainer.old_logprob=recompute there is no proximal policy measured before the update."""
    args = ("rollout.seq_mask=kpop", "rollout.seq_mask_threshold=2.0")
    result = run_bapo("config", *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "error: rollout.seq_mask=kpop: compares the proximal policy with the behaviour one "
        "(AReaL's rejection sampling): needs trainer.old_logprob=recompute, which measures it "
        "before the update\n"
    )
    ok = run_bapo("config", *args, "trainer.old_logprob=recompute")
    assert ok.returncode == 0, ok.stderr
    band = ("rollout.seq_mask=icepop", "rollout.seq_mask_threshold=5", "rollout.seq_mask_low=0.5")
    ok = run_bapo("config", *band)
    assert ok.returncode == 0, ok.stderr
    assert "seq_mask_low: 0.5" in ok.stdout
