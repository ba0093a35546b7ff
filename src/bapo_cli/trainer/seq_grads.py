"""Per-sequence score-gradient norms, for a loss whose advantages are re-centred per update
(`LossHooks.recentre`; VCPO's off-policy minimum-variance baseline, `algo=vcpo`,
`algo.baseline=opob`): each sequence's ||g_i||^2, g_i = grad_theta sum_t log pi_theta(y_it), and
its log weight log w_i = sum_t log pi_theta / pi_behav, handed with the groups and advantages to
the hook (formulas in docs/algorithms.md).

The norms need one gradient per sequence, which a batched backward does not give: one extra
forward per micro-batch (with gradient), then one `torch.autograd.grad` per sequence over that
graph (kept until the micro-batch's last sequence), as VCPO's reference code gets them by
back-propagating each trajectory in its own micro-batch of one (`update_policy_per_traj`). The
pass reads gradients without touching `.grad` (the update's accumulated gradients stay as they
are) and runs on the unwrapped module under DDP (no reducer hooks, no collective: the baseline
is rank-local over the groups of this rank, as VCPO's `compute_opob_baseline`). A group split
over micro-batches is re-centred as one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from bapo_cli.algos import ess as ess_lib
from bapo_cli.rollout.scoring import MicroBatch, token_logprobs
from bapo_cli.trainer.off_policy import Prepared

Tensor = torch.Tensor

__all__ = ["recentre", "score_grad_sq_norms"]


def score_grad_sq_norms(
    model: torch.nn.Module, mb: MicroBatch, temperature: float
) -> tuple[Tensor, Tensor]:
    """(||g_i||^2 [b] float64, the forward's log-probs [b, R] detached) for one micro-batch, on
    the device (no host read); a row without a response token gets 0."""
    module = getattr(model, "module", model)  # DDP: the wrapped module, outside the reducer
    params = [p for p in module.parameters() if p.requires_grad]
    logp, _ = token_logprobs(module, mb, temperature)
    rows = [i for i, s in enumerate(mb.samples) if s.response_ids]  # counted on the host
    norms = [torch.zeros((), dtype=torch.float64, device=logp.device)] * len(mb.samples)
    for n, i in enumerate(rows):
        seq = torch.where(mb.mask[i], logp[i], 0.0).sum()
        grads = torch.autograd.grad(seq, params, retain_graph=n < len(rows) - 1, allow_unused=True)
        total = torch.zeros((), dtype=torch.float64, device=logp.device)
        for g in grads:  # whole weights: the config refuses opob with FSDP2's sharded ones
            if g is not None:
                total = total + g.detach().double().square().sum()
        norms[i] = total
    return torch.stack(norms), logp.detach()


def recentre(
    model: torch.nn.Module,
    temperature: float,
    prepared: Sequence[Prepared],
    hook: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
) -> tuple[list[Prepared], dict[str, float]]:
    """The micro-batches of one update with their per-sequence advantages re-centred by `hook`
    (the loss's `LossHooks.recentre`), from this update's weights; a deferred one's behaviour
    log-probs are this pass's forward. Returns them and `opob_shift`, the mean |shift|."""
    if not prepared:
        return [], {}
    sq, log_w, groups, out = [], [], [], []
    for p in prepared:
        norms, logp = score_grad_sq_norms(model, p.mb, temperature)
        p = p if p.behaviour is not None else p.scored(logp)
        sq.append(norms)
        log_w.append(ess_lib.sequence_log_weights(logp, p.behaviour, p.mb.mask))
        groups.append(torch.tensor([s.group for s in p.mb.samples]))
        out.append(p)
    # the hook runs on the host: each input read once for the update, not per micro-batch
    before = torch.cat([p.advantages.detach() for p in out]).cpu()
    after = hook(torch.cat(sq).cpu(), torch.cat(log_w).cpu(), torch.cat(groups), before)
    after_there, start = after.to(out[0].advantages.device), 0  # one copy back
    for i, p in enumerate(out):
        n = len(p.mb.samples)
        adv = after_there[start : start + n].to(p.advantages.dtype)
        out[i] = dataclasses.replace(p, advantages=adv)
        start += n
    return out, {"opob_shift": float((after.double() - before.double()).abs().mean())}
