"""A step's learning half, after its rollouts: each sample's advantage over its prompt group,
each micro-batch's per-token advantages and pi_old (TIS, off-policy sequence masks, decoupled
PPO's recompute), one optimizer update per mini-batch (× ppo_epochs), and the accounting of each
update (policy version, scheduler, the streak of non-finite updates)."""

from __future__ import annotations

import math
from typing import Any

import torch

from bapo_cli.algos import advantages as adv_registry
from bapo_cli.algos.correction import mask_sequences
from bapo_cli.algos.shaping import overlong_penalty
from bapo_cli.config.schema import TrainConfig
from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.scoring import MicroBatch, token_logprobs
from bapo_cli.trainer.run import Run, TrainingError, TrainState
from bapo_cli.trainer.update import behaviour_weights, optimizer_update, tis_weights

__all__ = ["account_update", "advantages", "optimize"]


def advantages(cfg: TrainConfig, batch: list[Sample]) -> dict[str, Any]:
    """Each sample's advantage (algo.advantage over its prompt group, of the reward plus DAPO's
    overlong penalty under algo.overlong_buffer > 0); the estimator's stats (with the mean
    penalty as `overlong_penalty_mean` when shaping is on)."""
    algo = cfg.algo
    penalties = [
        overlong_penalty(
            len(s.response_ids), cfg.rollout.max_tokens, algo.overlong_buffer, algo.overlong_penalty
        )
        for s in batch
    ]
    shaped = [s.reward + p for s, p in zip(batch, penalties, strict=True)]
    rewards = torch.tensor(shaped, dtype=torch.float64)
    groups = torch.tensor([s.group for s in batch])
    adv, adv_stats = adv_registry.REGISTRY.get(algo.advantage)(rewards, groups)
    for s, a in zip(batch, adv.tolist(), strict=True):
        s.advantage = a
    if algo.overlong_buffer > 0:
        adv_stats["overlong_penalty_mean"] = sum(penalties) / max(len(penalties), 1)
    return adv_stats


def optimize(run: Run, batch: list[Sample]) -> tuple[list[dict[str, float]], int, dict[str, float]]:
    """One optimizer update per mini-batch, × ppo_epochs; (per-update metrics, tokens trained,
    the micro-batch layout's perf/pad_frac and perf/micro_batches, and under rollout.seq_mask
    rollout/seq_masked_frac: the share of sequences masked, each update's use counted once, as
    opsm decides against the weights at that update)."""
    minis = run.layout(batch, updates=True)  # as scored (FSDP2 ranks may split further)
    micro_all = [mb for micro in minis for mb in micro]
    padded = sum(mb.padded_tokens for mb in micro_all)
    layout = {
        # padding share of the positions the forwards saw (every epoch sees the same layout)
        "perf/pad_frac": 1.0 - sum(mb.real_tokens for mb in micro_all) / max(padded, 1),
        "perf/micro_batches": float(len(micro_all) * run.cfg.staleness.ppo_epochs),
    }
    recomputed: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
    update_metrics: list[dict[str, float]] = []
    trained_tokens = 0
    # rollout.seq_mask: (sequences masked, sequences seen) per micro-batch use, as device
    # counts summed once per step (no host sync per micro-batch; nothing without a mask)
    seq_counts: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i in range(len(minis) * run.cfg.staleness.ppo_epochs):
        micro = minis[i % len(minis)]
        for j, mb in enumerate(micro):
            masked = _prepare(run, mb, first=i == 0, key=(i % len(minis), j), recomputed=recomputed)
            if masked is not None:
                seq_counts.append((masked, mb.mask.any(dim=-1).sum()))
        result = optimizer_update(
            run.scorer,
            run.optimizer,
            micro,
            run.spec,
            temperature=run.cfg.rollout.temperature,
            grad_clip=run.cfg.trainer.grad_clip,
            version=run.state.version,
            ref_model=run.ref_model,
            dist_ctx=run.ctx,
        )
        account_update(result, run.state, run.scheduler, run.cfg.trainer.max_skipped_steps)
        update_metrics.append(result.metrics)
        trained_tokens += result.tokens
    if seq_counts:  # share of (sequence, update) uses masked to 0
        masked, seen = (float(sum(c[k] for c in seq_counts)) for k in (0, 1))
        layout["rollout/seq_masked_frac"] = masked / max(seen, 1.0)
    return update_metrics, trained_tokens, layout


def _prepare(
    run: Run,
    mb: MicroBatch,
    *,
    first: bool,
    key: tuple[int, int],
    recomputed: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]],
) -> torch.Tensor | None:
    """A micro-batch's advantages (TIS-weighted per token under rollout.tis_cap, sequences
    masked under rollout.seq_mask) and pi_old; under rollout.seq_mask, how many of its sequences
    the mask set to 0 (a 0-dim device tensor: no host sync here), else None."""
    cfg = run.cfg
    mb.advantages = torch.tensor(
        [s.advantage for s in mb.samples], dtype=mb.old_log_prob.dtype, device=mb.mask.device
    )
    if first and mb.unscored:  # deferred: scored by this update's forward
        mb.old_is_current = True
    masked = None
    if cfg.rollout.tis_cap is not None:  # engine/trainer mismatch: per-token weights
        weights = tis_weights(
            mb, cfg.rollout.tis_cap, level=cfg.rollout.tis_level, mode=cfg.rollout.tis_mode
        )
        mb.advantages = mb.advantages[:, None] * weights
    if cfg.rollout.seq_mask != "none":  # off-policy sequence masking: rejected sequences get 0
        if cfg.rollout.seq_mask == "geo":  # the engine/trainer mismatch per sequence, as TIS's
            log_ratio = tis_weights(mb, math.inf).log()
        elif mb.old_is_current:  # opsm on-policy: pi_old is the current policy
            log_ratio = torch.zeros(mb.mask.shape, device=mb.mask.device)
        else:  # opsm: pi_old (what the loss divides by) against the current weights
            log_ratio = mb.old_log_prob - _recompute(run.scorer, mb, cfg.rollout.temperature)
        mb.advantages, keep = mask_sequences(
            cfg.rollout.seq_mask, cfg.rollout.seq_mask_threshold, mb.advantages, mb.mask, log_ratio
        )
        masked = (~keep & mb.mask.any(dim=-1)).sum()
    if cfg.trainer.old_logprob == "recompute":  # the proximal policy: pi_old at first use
        cap = getattr(cfg.algo, "behav_weight_cap", None)
        if key not in recomputed:  # mb.old_log_prob still holds the behaviour log-probs here
            prox = _recompute(run.scorer, mb, cfg.rollout.temperature)
            weight = None
            if cap is not None:  # decoupled PPO: the behaviour correction pi_prox / pi_behav
                weight = behaviour_weights(prox, mb.old_log_prob, mb.mask, cap)
            recomputed[key] = (prox, weight)
            mb.behav_log_prob = mb.old_log_prob  # M2PO and the ESS read the behaviour policy
        prox, weight = recomputed[key]
        if weight is not None:
            adv = mb.advantages if mb.advantages.dim() == 2 else mb.advantages[:, None]
            mb.advantages = adv * weight
        mb.old_log_prob = prox
    return masked


@torch.no_grad()
def _recompute(model, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """Decoupled PPO: pi_old re-scored by the current weights when the batch is first used."""
    logp, _ = token_logprobs(model, mb, temperature)
    return logp


def account_update(result, state: TrainState, scheduler, max_skipped: int) -> None:
    """After one optimizer update: a new policy version and a scheduler step if the optimizer
    stepped. A non-finite update counts toward `trainer.max_skipped_steps` in a row (then stop);
    an update without gradient (`result.no_grad`: every token clipped or A = 0 on every rank)
    is no fault: it neither counts nor breaks the streak, and is logged as actor/no_grad_updates.
    """
    if result.no_grad:
        pass  # the weights did not move: same version, same learning-rate schedule position
    elif result.skipped:
        state.skipped_in_a_row += 1
        if state.skipped_in_a_row >= max_skipped:
            raise TrainingError(
                f"{state.skipped_in_a_row} consecutive updates had a non-finite loss or "
                f"gradient (trainer.max_skipped_steps={max_skipped}); "
                "stopped. Checkpoints in the run dir are from before the trouble: resume "
                "from them with a lower trainer.lr"
            )
    else:
        state.skipped_in_a_row = 0
        state.version += 1
        scheduler.step()
    result.metrics["skipped"] = float(result.skipped)
    result.metrics["no_grad"] = float(result.no_grad)
