"""A step's learning half, after its rollouts: each sample's advantage over its prompt group, one
optimizer update per mini-batch (× ppo_epochs) with what each micro-batch needs measured first
(`off_policy.Prepared`: the proximal forward, opsm's forward, the engine's log-probs), and the
accounting of each update (policy version, scheduler, the streak of non-finite updates)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from bapo_cli.algos import advantages as adv_registry
from bapo_cli.algos.shaping import overlong_penalty
from bapo_cli.rollout.base import Sample
from bapo_cli.rollout.scoring import MicroBatch, token_logprobs
from bapo_cli.trainer.off_policy import EngineLogProbs, OffPolicy, Prepared, masked_sequences
from bapo_cli.trainer.run import Run, TrainingError, TrainState
from bapo_cli.trainer.update import Learner, optimizer_update

__all__ = ["account_update", "advantages", "optimize", "prompt_key"]


def advantages(run: Run, batch: list[Sample]) -> dict[str, Any]:
    """Each sample's advantage (algo.advantage over its prompt group, of the reward plus DAPO's
    overlong penalty under algo.overlong_buffer > 0); the estimator's stats (with the mean
    penalty as `overlong_penalty_mean` when shaping is on). A cumulative estimator (DCPO's) reads
    each prompt's statistics of earlier steps from `run.prompt_stats` and updates them (every
    rank's prompts, gathered, so every rank holds the same table)."""
    cfg = run.cfg
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
    estimator = adv_registry.REGISTRY.get(algo.advantage)
    if estimator.cumulative:
        keys = [prompt_key(s) for s in batch]
        unseen = [0.0, 0.0, 0.0]
        prior = torch.tensor([run.prompt_stats.get(k, unseen) for k in keys], dtype=torch.float64)
        adv, adv_stats = estimator(rewards, groups, prior=prior)
        after = estimator.history(rewards, groups, prior=prior).tolist()
        for rank in run.ctx.gather(list(zip(keys, after, strict=True))):
            run.prompt_stats.update(rank)
    else:
        adv, adv_stats = estimator(rewards, groups)
    for s, a in zip(batch, adv.tolist(), strict=True):
        s.advantage = a
    if algo.overlong_buffer > 0:
        adv_stats["overlong_penalty_mean"] = sum(penalties) / max(len(penalties), 1)
    return adv_stats


def prompt_key(sample: Sample) -> str:
    """The prompt a sample answers, across steps: its problem's id (every task and data row
    has one)."""
    return str(getattr(sample.problem, "id", sample.problem))


def optimize(run: Run, batch: list[Sample]) -> tuple[list[dict[str, float]], int, dict[str, float]]:
    """One optimizer update per mini-batch, × ppo_epochs; (per-update metrics, tokens trained,
    the micro-batch layout's perf/pad_frac and perf/micro_batches, and under rollout.seq_mask
    rollout/seq_masked_frac: the share of sequences masked, each update's use counted once, as
    opsm decides against the weights at that update)."""
    cfg = run.cfg
    minis = run.layout(batch, updates=True)  # as scored (FSDP2 ranks may split further)
    mode = OffPolicy.of(cfg, run.spec.hooks)
    learner = Learner(
        run.scorer,
        run.optimizer,
        cfg.rollout.temperature,
        cfg.trainer.grad_clip,
        run.ref_model,
        run.ctx,
    )
    seen: dict[tuple[int, int], Prepared] = {}  # each micro-batch as its last use left it
    update_metrics: list[dict[str, float]] = []
    trained_tokens = 0
    # rollout.seq_mask: (sequences masked, sequences seen) per micro-batch use, as device
    # counts summed once per step (no host sync per micro-batch; nothing without a mask)
    seq_counts: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i in range(len(minis) * cfg.staleness.ppo_epochs):
        k = i % len(minis)
        uses = [
            _prepare(run, mode, mb, seen.get((k, j)), first=i == 0) for j, mb in enumerate(minis[k])
        ]
        for p in uses:
            masked = masked_sequences(p, mode)
            if masked is not None:
                seq_counts.append((masked, p.mb.mask.any(dim=-1).sum()))
        result = optimizer_update(learner, run.spec, uses, run.state.version, mode)
        for j, (p, behaviour) in enumerate(zip(uses, result.behaviour, strict=True)):
            seen[(k, j)] = dataclasses.replace(p, behaviour=behaviour)
        account_update(result, run.state, run.scheduler, cfg.trainer.max_skipped_steps)
        update_metrics.append(result.metrics)
        trained_tokens += result.tokens
    layout = _layout(minis, cfg.staleness.ppo_epochs)
    if seq_counts:  # share of (sequence, update) uses masked to 0
        masked, seen_seqs = (float(sum(c[n] for c in seq_counts)) for n in (0, 1))
        layout["rollout/seq_masked_frac"] = masked / max(seen_seqs, 1.0)
    return update_metrics, trained_tokens, layout


def _layout(minis: list[list[MicroBatch]], epochs: int) -> dict[str, float]:
    """The padding share of the positions the forwards saw (every epoch sees the same layout)
    and how many micro-batch forwards the step ran."""
    micro_all = [mb for micro in minis for mb in micro]
    padded = sum(mb.padded_tokens for mb in micro_all)
    return {
        "perf/pad_frac": 1.0 - sum(mb.real_tokens for mb in micro_all) / max(padded, 1),
        "perf/micro_batches": float(len(micro_all) * epochs),
    }


def _prepare(
    run: Run, mode: OffPolicy, mb: MicroBatch, last: Prepared | None, *, first: bool
) -> Prepared:
    """What micro-batch `mb` needs measured before this use (`last`: its previous use in the
    step, whose behaviour log-probs and proximal forward it keeps). The first mini-batch of a
    step may have its scoring deferred to its first update (`BatchLayout.score`)."""
    deferred = first and mb.unscored
    current = None
    if mode.seq_mask == "opsm" and not deferred:  # pi_old against the weights of this update
        current = _recompute(run, mb)
    if last is not None:
        return dataclasses.replace(
            last, advantages=mb.advantages, deferred=False, current=current, reused=True
        )
    proximal = None
    if mode.old_logprob == "recompute":  # the proximal policy: the weights at first use
        proximal = _recompute(run, mb)
    return Prepared(
        mb,
        mb.advantages,
        None if deferred else mb.old_log_prob,
        deferred=deferred,
        proximal=proximal,
        current=current,
        engine=EngineLogProbs.of(mb) if mode.reads_engine else None,
    )


@torch.no_grad()
def _recompute(run: Run, mb: MicroBatch) -> torch.Tensor:
    """A no-grad forward of the current weights (decoupled PPO's pi_prox, opsm's pi_theta),
    timed as scoring (`perf/score_tokens_per_s`)."""
    with run.batches.clock.timing(mb.num_tokens, mb.mask.device):
        logp, _ = token_logprobs(run.scorer, mb, run.cfg.rollout.temperature)
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
