"""VCPO's off-policy minimum-variance baseline at the update (`algo=vcpo`, `algo.baseline=opob`):
each sequence's score-gradient norm ||g_i||^2, g_i = grad_theta sum_t log pi_theta(y_it), and its
weight w_i = prod_t pi_theta / pi_behav, then each prompt group's advantages re-centred on their
||g_i||^2 w_i^2-weighted mean (`algos.vcpo.opob_recentre`; formulas in docs/algorithms.md).

The norms need one gradient per sequence, which a batched backward does not give: one extra
forward per micro-batch (with gradient), then one `torch.autograd.grad` per sequence over that
graph (kept until the micro-batch's last sequence). VCPO's reference code gets the same norms by
back-propagating each trajectory in its own micro-batch of one (`update_policy_per_traj`). The
pass reads gradients without touching `.grad` (the update's accumulated gradients stay as they
are) and runs on the unwrapped module under DDP (no reducer hooks, no collective: the baseline
is rank-local over the groups of this rank, as VCPO's `compute_opob_baseline` over its local
records). A group split over micro-batches is re-centred as one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bapo_cli.algos import ess as ess_lib
from bapo_cli.algos import vcpo
from bapo_cli.rollout.scoring import MicroBatch, token_logprobs

Tensor = torch.Tensor

__all__ = ["opob_advantages", "score_grad_sq_norms"]


def score_grad_sq_norms(
    model: torch.nn.Module, mb: MicroBatch, temperature: float
) -> tuple[Tensor, Tensor]:
    """(||g_i||^2 [b] float64, the forward's log-probs [b, R] detached) for one micro-batch; a
    row without a response token gets 0."""
    module = getattr(model, "module", model)  # DDP: the wrapped module, outside the reducer
    params = [p for p in module.parameters() if p.requires_grad]
    logp, _ = token_logprobs(module, mb, temperature)
    rows = [i for i in range(mb.mask.shape[0]) if bool(mb.mask[i].any())]
    out = torch.zeros(mb.mask.shape[0], dtype=torch.float64)
    for n, i in enumerate(rows):
        seq = torch.where(mb.mask[i], logp[i], 0.0).sum()
        grads = torch.autograd.grad(seq, params, retain_graph=n < len(rows) - 1, allow_unused=True)
        total = torch.zeros((), dtype=torch.float64, device=logp.device)
        for g in grads:  # whole weights: the config refuses opob with FSDP2's sharded ones
            if g is not None:
                total = total + g.detach().double().square().sum()
        out[i] = float(total)
    return out, logp.detach()


def opob_advantages(
    model: torch.nn.Module, micro: Sequence[MicroBatch], temperature: float
) -> dict[str, float]:
    """Re-centre the per-sequence advantages of every micro-batch of one update in place (the
    trainer resets them from the samples before each update, so this never accumulates).
    Returns the pass's metrics: `opob_shift`, the mean |baseline shift| over the sequences."""
    sq, log_w, adv, groups, sizes = [], [], [], [], []
    for mb in micro:
        if mb.advantages.dim() != 1:
            raise ValueError(
                "algo.baseline=opob re-centres per-sequence advantages; this micro-batch has "
                "per-token ones (rollout.tis_cap, rollout.seq_mask or algo.behav_weight_cap)"
            )
        norms, logp = score_grad_sq_norms(model, mb, temperature)
        if mb.old_is_current:  # deferred scoring: the behaviour log-probs are these weights'
            mb.old_log_prob, mb.old_is_current = logp, False
        behav = mb.behav_log_prob if mb.behav_log_prob is not None else mb.old_log_prob
        sq.append(norms)
        log_w.append(ess_lib.sequence_log_weights(logp, behav, mb.mask).cpu())
        adv.append(mb.advantages.detach().cpu())
        groups.append(torch.tensor([s.group for s in mb.samples]))
        sizes.append(len(mb.samples))
    if not micro:
        return {}
    g = torch.cat(groups)
    v = vcpo.baseline_weights(torch.cat(sq), torch.cat(log_w), g)
    before = torch.cat(adv)
    after = vcpo.opob_recentre(before, g, v)
    start = 0
    for mb, n in zip(micro, sizes, strict=True):
        mb.advantages = after[start : start + n].to(mb.advantages.device, mb.advantages.dtype)
        start += n
    return {"opob_shift": float((after.double() - before.double()).abs().mean())}
