"""Issue 45, item 2, at the trainer: an optimizer update of M2PO over two micro-batches moves the
weights as AReaL's loss does, each micro-batch's kept tokens' mean weighted by its share of the
mini-batch's tokens. Until issue 45 the trainer divided the kept tokens by every token of the
mini-batch, masked ones included, and each step was n_kept / n of AReaL's."""

from __future__ import annotations

import torch

from bapo_cli.rollout.scoring import ResponseLogits, collate, token_logprobs
from bapo_cli.trainer.update import Learner, LossSpec, optimizer_update
from tests.algos.test_rivals import areal_m2po
from tests.train.test_micro_batch_tokens import _batch, _model


def test_an_m2po_update_over_micro_batches_moves_the_weights_as_areal() -> None:
    samples = _batch([(3, 7), (2, 5), (4, 9), (3, 2)] * 2, seed=7)  # two groups of four
    micro = [collate(part, 0, torch.device("cpu")) for part in (samples[:4], samples[4:])]
    spec = LossSpec.of("m2po", m2_threshold=0.04, dual_clip=None)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    result = optimizer_update(Learner(ResponseLogits(model, chunk=7), optimizer), spec, micro, 1)
    assert not result.skipped and not result.no_grad
    # AReaL, restated: per micro-batch its own M2PO mask and kept tokens' mean, weighted by
    # the micro-batch's tokens over the mini-batch's
    oracle = _model()
    scorer = ResponseLogits(oracle, chunk=7)
    total = sum(mb.mask.sum() for mb in micro)
    for mb in micro:
        logp, _ = token_logprobs(scorer, mb, 1.0)
        adv = mb.advantages[:, None].expand_as(mb.mask).to(logp.dtype)
        old = mb.old_log_prob.to(logp.dtype)
        loss, kept = areal_m2po(
            logp, old, adv, mb.mask, m2_threshold=0.04, eps=None, c_clip=None, agg="token-mean"
        )
        assert 0 < kept.sum() < mb.mask.sum()  # M2PO masked some tokens of each micro-batch
        (loss * mb.mask.sum() / total).backward()
    for p, p0, q in zip(model.parameters(), before, oracle.parameters(), strict=True):
        torch.testing.assert_close(p0 - p.detach(), q.grad, rtol=1e-4, atol=1e-6)
