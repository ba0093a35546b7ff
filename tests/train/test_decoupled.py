"""Decoupled PPO (`trainer.old_logprob=recompute` + `algo.behav_weight_cap`): clip around the
recomputed proximal policy, weight each token by pi_prox / pi_behav, drop tokens over the cap;
and importance weights refused where the trainer's log-probs are not the sampling distribution's.
"""

from __future__ import annotations

import math

import pytest
import torch

from bapo_cli.config.preflight import PreflightError, preflight
from bapo_cli.trainer.off_policy import behaviour_weights
from tests.train.conftest import run_train


def test_behaviour_weight_is_prox_over_behav_and_drops_tokens_over_the_cap() -> None:
    prox = torch.tensor([[-1.0, -1.0, -2.0], [-0.5, 0.0, 0.0]])
    behav = torch.tensor([[-1.0, -2.0, -1.0], [-0.5, -9.0, 0.0]])  # ratios 1, e, 1/e | 1, e^9, -
    mask = torch.tensor([[True, True, True], [True, True, False]])
    w = behaviour_weights(prox, behav, mask, cap=3.0)
    expected = torch.tensor([[1.0, math.e, math.exp(-1.0)], [1.0, 0.0, 1.0]])
    torch.testing.assert_close(w, expected)
    assert not w.requires_grad


def _error(*overrides: str) -> str:
    with pytest.raises(PreflightError) as info:
        preflight("train", list(overrides))
    return str(info.value)


def test_config_rules() -> None:
    assert _error("algo.behav_weight_cap=2") == (
        "algo.behav_weight_cap=2.0: needs trainer.old_logprob=recompute or loglinear (the "
        "proximal policy it divides by)"
    )
    assert _error("algo.behav_weight_cap=0.5", "trainer.old_logprob=recompute") == (
        "algo.behav_weight_cap=0.5: must be >= 1 (or null to disable)"
    )
    truncated = (
        "is an importance weight over the trainer's log-probs, which are on the full distribution "
        "while rollout.top_p < 1 / top_k > 0 truncate sampling (biased): use top_p=1 and "
        "top_k=-1, or null"
    )
    assert _error("rollout.tis_cap=2", "rollout.top_p=0.9") == f"rollout.tis_cap=2.0: {truncated}"
    assert _error(
        "algo.behav_weight_cap=2", "trainer.old_logprob=recompute", "rollout.top_k=20"
    ) == (f"algo.behav_weight_cap=2.0: {truncated}")


def test_behaviour_weight_changes_only_the_updates_on_stale_data(tmp_path) -> None:
    # lag k=1: step 1 trains on the starting weights' samples (pi_prox = pi_behav: weight 1),
    # later steps on samples one version old (weight != 1)
    args = ("staleness=1", "staleness.regime=lag", "trainer.max_steps=3")
    args += ("trainer.old_logprob=recompute", "algo=grpo")
    plain = run_train(tmp_path, *args, name="plain")
    weighted = run_train(tmp_path, *args, "algo.behav_weight_cap=5", name="weighted")
    assert [u["staleness_max"] for u in weighted.updates] == [0.0, 1.0, 1.0]
    same = {k: v for k, v in plain.updates[0].items()}
    assert weighted.updates[0] == same  # nothing stale: the behaviour weight is exactly 1
    assert weighted.updates[1]["ratio_max"] == 1.0  # still clipped around pi_prox
    assert weighted.updates[1]["grad_norm"] != plain.updates[1]["grad_norm"]


def test_m2po_masks_under_recompute(tmp_path) -> None:
    """Issue 34, fix 2: under trainer.old_logprob=recompute the loss divides by pi_prox, which
    the first update on a mini-batch *is*: a second moment taken against it is exactly 0 and
    M2PO masked nothing. Taken between the behaviour and the proximal policy (AReaL), it masks
    the stale mini-batch's tokens; the fresh one (pi_prox = pi_behav) keeps all of them."""
    args = ("algo=m2po", "algo.m2_threshold=1e-12", "staleness=2", "trainer.max_steps=1")
    result = run_train(tmp_path, *args, "trainer.old_logprob=recompute")
    fresh, stale = result.updates
    assert fresh["clipfrac_low"] == fresh["clipfrac_high"] == 0.0
    assert stale["clipfrac_low"] + stale["clipfrac_high"] > 0.0  # the tokens whose log-prob moved
