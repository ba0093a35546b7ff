"""Issue 34 in the real loop: every preset logs the ESS of its importance weights (1 on an
on-policy update, within [0, 1] otherwise); `trainer.old_logprob=loglinear` trains without the
proximal forward pass `recompute` needs (forward passes counted on the real module); VCPO's
step is scaled by the ESS and its baseline re-centres the advantages; prime_default's ratio is
against the engine's log-probs; the config rules that keep these apart."""

from __future__ import annotations

import math

import pytest
import torch

from bapo_cli.config import hydra_runner
from bapo_cli.config.preflight import PreflightError, preflight
from bapo_cli.rollout.scoring import ResponseLogits
from tests.train.conftest import run_train

# reuse k=2: the first update of a step is on-policy, the second one update stale
STALE = ("staleness=2", "trainer.max_steps=1")


@pytest.mark.parametrize("algo", hydra_runner.group_options("algo"))
def test_every_preset_logs_the_ess(tmp_path, algo) -> None:
    result = run_train(
        tmp_path, f"algo={algo}", *STALE, "trainer.prompts_per_step=4", "algo.resample_rounds=1"
    )
    fresh, stale = result.updates
    assert fresh["ess"] == 1.0, algo  # on-policy: every sequence's weight is exactly 1
    assert 0.0 <= stale["ess"] <= 1.0, algo
    logged = result.history[0]["actor/ess"]
    assert logged == pytest.approx((fresh["ess"] + stale["ess"]) / 2), algo
    if algo == "vcpo":  # the step's lr scale is sqrt(ESS / N)
        assert fresh["lr_scale"] == 1.0
        assert stale["lr_scale"] == pytest.approx(math.sqrt(stale["ess"]))


def _forwards(tmp_path, *overrides: str, name: str) -> tuple[int, list[dict[str, float]]]:
    """Forward passes through the trainer's scoring module (ResponseLogits: behaviour scoring,
    the proximal recompute and every training forward) in one run."""
    calls = [0]

    def count(module, args, output):
        if isinstance(module, ResponseLogits):
            calls[0] += 1

    handle = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        result = run_train(tmp_path, *overrides, name=name)
    finally:
        handle.remove()
    return calls[0], result.updates


def test_loglinear_saves_the_proximal_forward(tmp_path) -> None:
    """A-3PO: the proximal log-probs come from the training forward, so loglinear runs exactly
    the forwards `behaviour` runs, and `recompute` one more per micro-batch of each mini-batch
    (its pi_prox pass) plus the first mini-batch's behaviour scoring, which only `recompute`
    cannot leave to the first update's forward. Here: 2 mini-batches of 1 micro-batch each per
    step, 2 steps."""
    args = ("algo=grpo", "staleness=2", "trainer.max_steps=2", "trainer.micro_batch_size=16")
    plain, _ = _forwards(tmp_path, *args, name="behaviour")
    loglinear, lupd = _forwards(tmp_path, *args, "trainer.old_logprob=loglinear", name="loglin")
    recompute, _ = _forwards(tmp_path, *args, "trainer.old_logprob=recompute", name="recompute")
    steps, micro_per_step, first_minibatch_micro = 2, 2, 1
    assert loglinear == plain
    assert recompute - loglinear == steps * (micro_per_step + first_minibatch_micro)
    # the first (fresh) and second (one update stale) mini-batches have alpha = 0: pi_prox is the
    # behaviour policy, so loglinear trains like behaviour there
    assert [u["staleness_max"] for u in lupd] == [0.0, 1.0, 0.0, 1.0]


def test_loglinear_interpolates_for_staler_tokens(tmp_path) -> None:
    """Reuse k=8: once a mini-batch's tokens are k >= 2 versions stale, pi_prox moves 1 - 1/k of
    the way to the current weights and the ratio the loss clips is no longer the one to the
    behaviour policy; before that (alpha = 0) loglinear trains exactly as behaviour does."""
    args = ("algo=grpo", "staleness=8", "trainer.max_steps=1")
    plain = run_train(tmp_path, *args, name="behaviour")
    loglin = run_train(tmp_path, *args, "trainer.old_logprob=loglinear", name="loglinear")
    first = next(i for i, u in enumerate(plain.updates) if u["staleness_max"] >= 2)
    assert loglin.updates[:first] == plain.updates[:first]  # the same updates bit for bit
    assert loglin.updates[first]["ratio_max"] < plain.updates[first]["ratio_max"]
    assert loglin.updates[first]["ess"] == plain.updates[first]["ess"]  # behaviour -> current


def test_vcpo_baseline_moves_the_advantages(tmp_path) -> None:
    """Even on-policy (every w_i = 1) the sequences' score-gradient norms differ, so VCPO's
    baseline is not the group mean: the advantages move, and with them the gradient."""
    result = run_train(tmp_path, "algo=vcpo", *STALE)
    shifted = [i for i, u in enumerate(result.updates) if u["opob_shift"] > 0]
    assert shifted, [u["opob_shift"] for u in result.updates]
    none = run_train(tmp_path, "algo=vcpo", "algo.baseline=none", *STALE, name="none")
    assert "opob_shift" not in none.updates[0]
    first = shifted[0]  # the updates before it were the same in both runs
    assert none.updates[first]["grad_norm"] != result.updates[first]["grad_norm"]


def _error(*overrides: str) -> str:
    with pytest.raises(PreflightError) as info:
        preflight("train", list(overrides))
    return str(info.value)


def test_config_rules() -> None:
    assert _error("algo=prime_default", "trainer.old_logprob=recompute") == (
        "trainer.old_logprob=recompute: algo.ratio_against=inference takes the ratio against the "
        "engine's log-probs: use trainer.old_logprob=behaviour, or algo.ratio_against=old"
    )
    assert _error("algo=vcpo", "rollout.tis_cap=2") == (
        "algo.baseline=opob: re-centres per-sequence advantages; rollout.tis_cap makes them per "
        "token: turn that off, or use algo.baseline=none"
    )
    preflight("train", ["algo=vcpo", "rollout.tis_cap=2", "algo.baseline=none"])
    assert _error("algo=vcpo", "trainer.strategy=fsdp2") == (
        "algo.baseline=opob: takes one gradient per sequence of whole (unsharded) weights: use "
        "trainer.strategy=ddp, or algo.baseline=none"
    )
    preflight("train", ["algo=grpo", "trainer.old_logprob=loglinear", "algo.behav_weight_cap=5"])
    preflight("train", ["algo=clip_cov", "algo.eps_low=1", "algo.eps_high=1"])
    assert "rollout.tis_mode=both: must be one of truncate, mask, mask_two_sided" in _error(
        "rollout.tis_mode=both"
    )
