"""Metrics that tell the truth: rho weighted by mass over a step's updates, and an update without
gradient that moves nothing (weights, AdamW state, policy version)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.scoring import ResponseLogits, collate, token_logprobs
from bapo_cli.trainer.optimize import account_update
from bapo_cli.trainer.run import TrainState
from bapo_cli.trainer.step_metrics import step_metrics
from bapo_cli.trainer.throughput import StepTimes
from bapo_cli.trainer.update import Learner, LossSpec, UpdateResult, optimizer_update
from tests.train.test_distributed import SPEC, _global_batch, _model

PPO = LossSpec.of("ppo", eps=0.2)


def _update(rho_pos, rho_neg, pos_before, neg_before, steps, no_grad=0.0) -> dict[str, float]:
    """One update's metrics as `optimizer_update` returns them (the parts rho is made of)."""
    total = rho_pos + rho_neg
    return {
        "rho_pos": rho_pos,
        "rho_neg": rho_neg,
        "rho_pos_before": pos_before,
        "rho_neg_before": neg_before,
        "rho": rho_pos / total if total else 1.0,  # 0/0 := 1
        "rho_before": pos_before / (pos_before + neg_before) if total else 1.0,
        "zero_mass": float(total == 0),
        "search_steps": float(steps),
        "search_moved": float(steps > 0),
        "c_low": 0.6,
        "c_high": 1.2,
        "skipped": 0.0,
        "no_grad": no_grad,
    }


def _log(updates, searched: bool) -> dict[str, float]:
    batch = [Sample([1], 0, None, [2, 3], reward=1.0), Sample([1], 0, None, [4], reward=0.0)]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return step_metrics(
        batch,
        {},
        updates,
        optimizer,
        times=StepTimes(1.0, 1.0, 0.0, 2.0, 3, 3),
        searched=searched,
    )


def test_step_rho_is_weighted_by_mass_and_a_massless_update_adds_nothing() -> None:
    updates = [
        _update(1.0, 3.0, 0.5, 3.5, steps=4),  # rho 0.25 on mass 4, searched from 0.125
        _update(6.0, 2.0, 2.0, 6.0, steps=0),  # rho 0.75 on mass 8
        _update(0.0, 0.0, 0.0, 0.0, steps=0, no_grad=1.0),  # nothing active: rho "1" by 0/0
    ]
    logged = _log(updates, searched=True)
    # sum(pos) / sum(pos + neg) = 7 / 12; a plain mean of the updates' rho would say 2/3
    assert logged["actor/rho"] == logged["bapo/rho"] == 7.0 / 12.0
    assert logged["bapo/rho_before"] == 2.5 / 12.0
    assert logged["bapo/zero_mass_frac"] == logged["actor/zero_mass_frac"] == 1.0 / 3.0
    assert logged["bapo/search_moved_frac"] == 1.0 / 3.0
    assert (logged["actor/no_grad_updates"], logged["actor/skipped_steps"]) == (1.0, 0.0)
    fixed = _log(updates, searched=False)  # fixed bounds: the same rho, nothing under bapo/
    assert fixed["actor/rho"] == 7.0 / 12.0 and fixed["actor/zero_mass_frac"] == 1.0 / 3.0
    assert not any(key.startswith("bapo/") for key in fixed)
    # every update massless: the convention, and the fraction that says why
    none = _log([_update(0.0, 0.0, 0.0, 0.0, 0)] * 2, searched=True)
    assert (none["actor/rho"], none["bapo/zero_mass_frac"]) == (1.0, 1.0)


def _micro(model: torch.nn.Module, samples: list[Sample], case: str):
    """Micro-batches of 12 samples; `case` makes every token gradient-free: zero advantages, or
    ratios far outside every bound (r = e^5: positives clipped above any c_high, negatives above
    the dual clip)."""
    micro = []
    for i in range(0, len(samples), 12):
        mb = collate(samples[i : i + 12], 0, torch.device("cpu"))  # A_i from the samples
        if case == "zero_advantages":
            mb = dataclasses.replace(mb, advantages=torch.zeros_like(mb.advantages))
        elif case == "far_outside":
            with torch.no_grad():
                logp, _ = token_logprobs(model, mb, 1.0)
            mb = dataclasses.replace(mb, old_log_prob=torch.where(mb.mask, logp - 5.0, 0.0))
        micro.append(mb)
    return micro


def _state(model, optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    for s in optimizer.state.values():
        tensors += [torch.as_tensor(v).clone() for _, v in sorted(s.items())]
    return tensors


def _run(model, optimizer, micro, spec, ref=None) -> UpdateResult:
    learner = Learner(ResponseLogits(model), optimizer, grad_clip=1.0, ref_model=ref)
    return optimizer_update(learner, spec, micro, version=0)


@pytest.mark.parametrize("case", ["zero_advantages", "far_outside"])
@pytest.mark.parametrize("spec", [SPEC, PPO], ids=["bapo", "ppo"])
def test_an_update_without_gradient_moves_neither_weights_nor_adamw_nor_version(spec, case):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 1.0 / (n + 1))
    samples = _global_batch(model)
    state = TrainState(version=0, skipped_in_a_row=1)
    first = _run(model, optimizer, _micro(model, samples, "normal"), spec)
    before = _state(model, optimizer)
    account_update(first, state, scheduler, max_skipped=3)
    assert (state.version, state.skipped_in_a_row, scheduler.last_epoch) == (1, 0, 1)

    state.skipped_in_a_row = 2  # a non-finite streak is neither extended nor broken by it
    idle = _run(model, optimizer, _micro(model, samples, case), spec)
    account_update(idle, state, scheduler, max_skipped=3)
    after = _state(model, optimizer)
    assert len(after) == len(before)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))  # bit-identical
    assert (state.version, state.skipped_in_a_row, scheduler.last_epoch) == (1, 2, 1)
    assert idle.no_grad and not idle.skipped
    assert not first.no_grad and first.metrics["active_tokens"] > 0
    assert first.metrics["zero_mass"] == 0.0 and 0.0 < first.metrics["rho"] < 1.0
    m = idle.metrics
    assert (m["no_grad"], m["skipped"], m["active_tokens"], m["zero_mass"]) == (1.0, 0.0, 0, 1.0)
    assert (m["rho_pos"], m["rho_neg"], m["search_moved"]) == (0.0, 0.0, 0.0)

    # the same samples with real advantages move everything again
    again = _run(model, optimizer, _micro(model, samples, "normal"), spec)
    account_update(again, state, scheduler, max_skipped=3)
    assert not again.no_grad and state.version == 2
    assert any(not torch.equal(a, b) for a, b in zip(_state(model, optimizer), after, strict=True))


def test_a_kl_term_keeps_gradient_when_every_token_is_clipped() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    samples = _global_batch(model)
    _run(model, optimizer, _micro(model, samples, "normal"), PPO)  # the policy leaves the ref
    before = _state(model, optimizer)
    spec = dataclasses.replace(PPO, kl_coef=0.1)
    ref = ResponseLogits(copy.deepcopy(_model()))
    result = _run(model, optimizer, _micro(model, samples, "far_outside"), spec, ref=ref)
    assert result.metrics["active_tokens"] == 0 and result.metrics["ref_kl"] > 0
    assert not result.no_grad and not result.skipped  # the KL term still pulls: a real step
    assert any(not torch.equal(a, b) for a, b in zip(_state(model, optimizer), before, strict=True))


def test_per_micro_batch_searches_weigh_rho_by_mass_within_an_update() -> None:
    from bapo_cli.algos.bounds import adaptive_bounds
    from bapo_cli.algos.losses import search_inputs
    from tests.train.test_distributed import MICRO_SPEC, SEARCH

    model = _model()
    micro = _micro(model, _global_batch(model), "normal")[:2]
    pos = neg = 0.0
    rhos, tokens = [], []
    for mb in micro:  # each micro-batch's own search, as the loss runs it
        with torch.no_grad():
            logp, _ = token_logprobs(ResponseLogits(model), mb, 1.0)
        inputs = search_inputs(logp, mb.old_log_prob, mb.advantages, mb.mask, dual_clip=3.0)
        b = adaptive_bounds(**inputs, **{k: v for k, v in SEARCH.items() if k != "weighting"})
        pos, neg = pos + b.pos, neg + b.neg
        rhos.append(b.rho)
        tokens.append(mb.num_tokens)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    m = _run(model, optimizer, micro, MICRO_SPEC).metrics
    assert m["rho"] == pytest.approx(pos / (pos + neg), rel=1e-6)
    assert (m["rho_pos"], m["rho_neg"]) == pytest.approx((pos, neg), rel=1e-6)
    by_tokens = sum(r * n for r, n in zip(rhos, tokens, strict=True)) / sum(tokens)
    assert abs(m["rho"] - by_tokens) > 1e-3  # what a token-weighted mean would have said
