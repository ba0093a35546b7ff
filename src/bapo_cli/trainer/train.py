"""`bapo train`: the off-policy RL loop, top to bottom.

    config → model + tokenizer → prompts → engine → staleness regime
    each step:  rollouts (behaviour log-probs, policy version per token) → rewards → advantages
                → one optimizer update per mini-batch (BAPO: bounds solved per update)
                → weight sync to the engine → metrics to MLflow → checkpoint

The loop itself knows no algorithm: the loss comes from `algos.losses.REGISTRY[algo.loss]`, the
advantages from `algos.advantages.REGISTRY[algo.advantage]`, the staleness from
`staleness.regimes.REGIMES[staleness.regime]`, the engine from `rollout.base.ENGINES`.

Run it: `bapo train algo=bapo staleness=4` (tiny model, synthetic arithmetic, CPU is fine).
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import transformers
from omegaconf import OmegaConf
from rich.console import Console

from bapo_cli.algos import advantages as adv_registry
from bapo_cli.algos.bounds import rho_from_sums
from bapo_cli.config.schema import TrainConfig
from bapo_cli.evaluation import evaluate
from bapo_cli.models import loading as models
from bapo_cli.rewards import GradeReport, MathGrader, StepGrader
from bapo_cli.rollout.base import Sample, SamplingParams, make_engine, resolve_engine_name
from bapo_cli.rollout.collect import Collector
from bapo_cli.staleness.regimes import Regime, make_regime
from bapo_cli.tracking import describe_failure, flatten, make_tracker, redact
from bapo_cli.trainer import checkpoint, distributed
from bapo_cli.trainer.policy import (
    MicroBatch,
    ResponseLogits,
    collate,
    disable_dropout,
    record_behaviour,
)
from bapo_cli.trainer.progress import TrainProgress, summary_table
from bapo_cli.trainer.update import (
    RHO_SUMS,
    LossSpec,
    loss_spec,
    optimizer_update,
    tis_weights,
)


class TrainingError(RuntimeError):
    """Training cannot go on; the message says why and what was kept."""


@dataclass
class TrainState:
    step: int = 0  # rollout steps done
    version: int = 0  # optimizer updates applied = policy version
    skipped_in_a_row: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass
class TrainResult:
    run_dir: Path
    run_id: str | None
    history: list[dict[str, float]]  # one dict of logged metrics per step
    checkpoint: Path | None  # the last checkpoint written
    updates: list[dict[str, float]] = field(
        default_factory=list
    )  # per optimizer update (this process)
    last_batch: list[Sample] = field(default_factory=list)  # the samples of the last step


def train(
    cfg: TrainConfig,
    run_dir: Path,
    console: Console | None = None,
    *,
    tags: dict[str, str] | None = None,  # extra run tags (a sweep job's parent, overrides)
) -> TrainResult:
    # one process unless started by torchrun
    ctx = distributed.from_env(cfg.trainer.strategy, cfg.trainer.dist_timeout_min)
    if cfg.trainer.strategy == "fsdp2" and not ctx.enabled:
        raise TrainingError(
            "trainer.strategy=fsdp2 shards the model over torchrun's processes: launch with "
            "bapo train --nproc N (N >= 1) or torchrun"
        )
    console = console or Console()
    if not ctx.is_main:
        console = Console(quiet=True)
    transformers.utils.logging.disable_progress_bar()  # ours is the one to watch
    run_dir = Path(ctx.broadcast(str(run_dir)))  # every rank writes under rank 0's run dir
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_root = run_dir / "checkpoints"
    found = checkpoint.latest_usable(ckpt_root, console.print) if cfg.trainer.resume else None
    resume_from, saved = found if found is not None else (None, None)
    if cfg.trainer.resume and found is None:
        console.print(
            f"trainer.resume=true but no usable checkpoint in {ckpt_root}: starting fresh"
        )
    checkpoint.seed_everything(cfg.trainer.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    _check_parallel(cfg, ctx)

    # --- model, data, engine -------------------------------------------------------------
    # on resume the policy comes from the checkpoint (HF format), everything else from the config
    model_cfg = cfg.model if resume_from is None else replace(cfg.model, path=str(resume_from))
    device = models.resolve_device(model_cfg)
    compute_dtype = models.resolve_dtype(model_cfg, device)
    # mixed precision: float32 weights and optimizer state, forwards in model.dtype (autocast;
    # FSDP2 casts through its MixedPrecisionPolicy instead)
    mixed = cfg.trainer.precision == "mixed" and compute_dtype != torch.float32
    stored_dtype = torch.float32 if mixed else compute_dtype
    autocast = compute_dtype if mixed and not ctx.sharded else None
    model, tokenizer = models.load_policy(model_cfg, device=device, dtype=stored_dtype)
    disable_dropout(model)
    model.train()
    device = next(model.parameters()).device
    ref_model = _reference(model, cfg, compute_dtype)  # before sharding: a plain frozen copy
    # what computes log-probs: DDP-wrapped or FSDP2-sharded under torchrun
    scorer = ctx.wrap(ResponseLogits(model, autocast), compute_dtype)
    checkpoint.seed_everything(cfg.trainer.seed + ctx.rank)  # ranks sample differently
    prompts = PromptStream(cfg, tokenizer, console, rank=ctx.rank, world_size=ctx.world_size)
    engine_name = resolve_engine_name(cfg.rollout.name, device)
    console.print(f"rollout engine: [bold]{engine_name}[/bold] (rollout={cfg.rollout.name})")
    engine = make_engine(engine_name, model=model, tokenizer=tokenizer, cfg=cfg, autocast=autocast)
    sampling = SamplingParams(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        max_tokens=cfg.rollout.max_tokens,
        stop=tuple(cfg.rollout.stop),
        seed=cfg.rollout.seed if cfg.rollout.seed is not None else cfg.trainer.seed,
    )
    spec = loss_spec(cfg.algo)
    updates_per_batch = max(cfg.staleness.k, 1) if cfg.staleness.regime == "reuse" else 1
    micro_size = cfg.trainer.micro_batch_size

    def layout(samples: list[Sample]) -> list[list[MicroBatch]]:
        """Mini-batches (one per optimizer update) of micro-batches; the same split scores the
        behaviour log-probs and trains, so an on-policy update sees identical tensors."""
        return [
            [
                collate(part[i : i + micro_size], tokenizer.pad_token_id, device)
                for i in range(0, len(part), micro_size)
            ]
            for part in regime.split(samples)
        ]

    # reuse: the first mini-batch is trained right away by the weights that sampled it, so its
    # behaviour log-probs come from that update's own forward instead of a scoring pass (not
    # with an engine that reports its own log-probs: those are compared with the trainer's)
    defer_first = (
        cfg.staleness.regime == "reuse"
        and cfg.trainer.old_logprob == "behaviour"
        and engine_name == "hf"
    )

    def score(samples: list[Sample]) -> None:
        for i, mini in enumerate(layout(samples)):
            if defer_first and i == 0:
                continue
            for mb in mini:
                record_behaviour(scorer, mb, cfg.rollout.temperature)

    collector = Collector(
        engine=engine,
        tokenizer=tokenizer,
        params=sampling,
        n=cfg.rollout.n,
        encode=prompts.encode,
        reward=prompts.reward,
        score=score,
        reward_many=prompts.reward_many,
    )
    regime = make_regime(
        cfg.staleness.regime,
        k=cfg.staleness.k,
        epochs=cfg.staleness.ppo_epochs,
        collector=collector,
        draw=prompts.draw,  # this rank's share of the stream: whole groups on one rank
        prompts_per_step=cfg.trainer.prompts_per_step // ctx.world_size,
    )

    # --- optimizer ------------------------------------------------------------------------
    total_updates = cfg.trainer.max_steps * updates_per_batch * cfg.staleness.ppo_epochs
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _lr_lambda(cfg.trainer.warmup_steps, total_updates, cfg.trainer.lr_schedule)
    )

    def rank_state() -> dict[str, Any]:
        """What differs between ranks: sampling RNG, data position, the regime's buffers."""
        return {
            "regime": regime.state_dict(),
            "prompts": prompts.state_dict(),
            "next_group": collector.next_group,
            "rng": checkpoint.rng_state(),
        }

    # --- tracking and resume --------------------------------------------------------------
    state = TrainState()
    run_id = None
    if resume_from is not None and saved is not None:
        ranks = saved["ranks"]
        if len(ranks) != ctx.world_size:
            raise checkpoint.CheckpointError(
                f"checkpoint {resume_from} was written by {len(ranks)} ranks; resume with as many "
                f"(this run has {ctx.world_size})"
            )
        mine = ranks[ctx.rank]
        written_with = saved.get("strategy", "ddp")
        if (written_with == "fsdp2") != ctx.sharded:
            raise checkpoint.CheckpointError(
                f"checkpoint {resume_from} was written with trainer.strategy={written_with}; "
                f"resume with the same strategy (this run: {cfg.trainer.strategy}"
                f"{'' if ctx.enabled else ', one process'})"
            )
        ctx.load_optimizer(model, optimizer, saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        regime.load_state_dict(mine["regime"])
        prompts.load_state_dict(mine["prompts"])
        collector.next_group = mine["next_group"]
        state = TrainState(**saved["state"])
        run_id = saved.get("run_id")
        checkpoint.set_rng_state(mine["rng"])
        with ctx.gathered(scorer):
            engine.sync_weights(model, state.version)  # tokens sampled from here carry it
        console.print(f"resumed from {resume_from} at step {state.step}")
    try:  # the store must answer at the start; later outages only delay metrics (tracking.py)
        tracker = make_tracker(
            cfg.tracking.backend if ctx.is_main else "none",
            cfg.tracking.uri,
            cfg.tracking.experiment,
            run_name=cfg.tracking.run_name or _run_name(cfg),
            run_id=run_id,
            tags={**_tags(cfg, engine_name), **(tags or {})},
            run_dir=run_dir,
        )
        params, config_yaml = run_record(cfg)
        if resume_from is None:
            tracker.log_params(params)
    except Exception as err:
        engine.close()
        raise TrainingError(
            f"tracking: cannot start the MLflow run at {redact.text(cfg.tracking.uri)} "
            f"({describe_failure(err)}); start the server, or pass tracking.uri=... or "
            "tracking=none"
        ) from err
    if resume_from is None:
        tracker.log_text(config_yaml, "config.yaml")
    samples_file = run_dir / "samples.jsonl"
    val_sets = (
        evaluate.validation_sets(cfg, grader=prompts.math.grade_batch)
        if cfg.trainer.val_every and ctx.is_main
        else []
    )

    def validation() -> dict[str, float]:
        """Rank 0 validates; every rank enters (FSDP2 gathers the full weights for it)."""
        with ctx.gathered(scorer):
            if not val_sets:
                return {}
            return evaluate.validate(
                val_sets,
                engine,
                tokenizer,
                n=cfg.trainer.val_n,
                max_tokens=cfg.rollout.max_tokens,
                max_model_len=cfg.model.max_model_len,
            )

    if cfg.trainer.val_every and state.step == 0:
        tracker.log_metrics(validation(), step=0)

    # --- the loop -------------------------------------------------------------------------
    last_ckpt = resume_from
    all_updates: list[dict[str, float]] = []
    batch: list[Sample] = []
    status = "FAILED"
    try:
        with TrainProgress(cfg.trainer.max_steps, state.step, console) as progress:
            while state.step < cfg.trainer.max_steps:
                metrics, updates, batch = _train_step(
                    cfg,
                    state,
                    scorer,
                    ref_model,
                    optimizer,
                    scheduler,
                    regime,
                    engine,
                    spec,
                    layout,
                    collector,
                    samples_file if ctx.is_main else None,
                    ctx,
                )
                metrics.update(prompts.take_grading())  # reward/timeouts|over_budget, perf/grade_s
                metrics = ctx.mean_metrics(metrics)
                all_updates += updates
                state.step += 1
                at_end = state.step == cfg.trainer.max_steps
                if cfg.trainer.val_every and (at_end or state.step % cfg.trainer.val_every == 0):
                    metrics.update(validation())
                state.history.append(metrics)
                if state.step % cfg.trainer.log_every == 0 or state.step == cfg.trainer.max_steps:
                    tracker.log_metrics(metrics, step=state.step)
                progress.update(state.step, metrics)
                if at_end or (cfg.trainer.save_every and state.step % cfg.trainer.save_every == 0):
                    tracker.flush()
                    ranks = ctx.gather(rank_state())
                    weights, optim_state = ctx.full_state(model, optimizer)  # all ranks (FSDP2)
                    if ctx.is_main:
                        try:
                            last_ckpt = checkpoint.save(
                                ckpt_root,
                                state.step,
                                model,
                                tokenizer,
                                {
                                    "optimizer": optim_state,
                                    "scheduler": scheduler.state_dict(),
                                    "state": state.__dict__,
                                    "run_id": tracker.run_id,
                                    "ranks": ranks,
                                    "strategy": "fsdp2" if ctx.sharded else "ddp",
                                },
                                weights=weights,
                                keep_last=cfg.trainer.keep_last,
                            )
                        except checkpoint.DiskFullError as err:
                            raise TrainingError(str(err)) from None
                    ctx.barrier()
        status = "FINISHED"
    finally:
        if samples_file.exists() and ctx.is_main:
            tracker.log_artifact(samples_file)
        tracker.close(status)
        engine.close()
        prompts.close()
        distributed.shutdown(ctx, clean=status == "FINISHED")
    console.print(summary_table(state.history, run_dir, cfg.tracking.uri, tracker.run_id))
    return TrainResult(run_dir, tracker.run_id, state.history, last_ckpt, all_updates, batch)


def _check_parallel(cfg: TrainConfig, ctx: distributed.DistContext) -> None:
    """What data parallelism needs: equal shares of whole prompt groups on every rank."""
    if not ctx.enabled:
        return
    parts = ctx.world_size * (max(cfg.staleness.k, 1) if cfg.staleness.regime == "reuse" else 1)
    if cfg.trainer.prompts_per_step % parts:
        raise TrainingError(
            f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} must split into "
            f"{ctx.world_size} ranks × mini-batches of whole prompt groups (a multiple of {parts})"
        )


def _train_step(
    cfg,
    state,
    scorer,
    ref_model,
    optimizer,
    scheduler,
    regime: Regime,
    engine,
    spec: LossSpec,
    layout,
    collector: Collector,
    samples_file: Path | None,
    ctx: distributed.DistContext,
) -> tuple[dict[str, float], list[dict[str, float]], list[Sample]]:
    """Rollouts → rewards → advantages → updates → weight sync; returns the step's metrics, the
    per-update metrics and the samples trained on."""
    t0 = time.perf_counter()
    tokens_before = collector.generated_tokens
    with ctx.gathered(scorer):  # FSDP2: full weights for generation and behaviour scoring
        batch = regime.next_batch()
    rollout_s = time.perf_counter() - t0
    new_tokens = collector.generated_tokens - tokens_before
    rewards = torch.tensor([s.reward for s in batch], dtype=torch.float64)
    groups = torch.tensor([s.group for s in batch])
    adv, adv_stats = adv_registry.REGISTRY.get(cfg.algo.advantage)(rewards, groups)
    for s, a in zip(batch, adv.tolist(), strict=True):
        s.advantage = a

    t1 = time.perf_counter()
    update_metrics: list[dict[str, float]] = []
    trained_tokens = 0
    minis = layout(batch)  # the tensors the behaviour log-probs were scored on (reuse)
    recomputed: dict[int, torch.Tensor] = {}
    for i in range(len(minis) * cfg.staleness.ppo_epochs):
        micro = minis[i % len(minis)]
        for j, mb in enumerate(micro):
            mb.advantages = torch.tensor(
                [s.advantage for s in mb.samples], dtype=torch.float32, device=mb.mask.device
            )
            if i == 0 and mb.unscored:  # deferred: scored by this update's forward
                mb.old_is_current = True
            if cfg.rollout.tis_cap is not None:  # engine/trainer mismatch: per-token weights
                mb.advantages = mb.advantages[:, None] * tis_weights(mb, cfg.rollout.tis_cap)
            if cfg.trainer.old_logprob == "recompute":  # decoupled PPO: pi_old at first use
                key = (i % len(minis)) * 100_000 + j
                if key not in recomputed:
                    recomputed[key] = _recompute(scorer, mb, cfg.rollout.temperature)
                mb.old_log_prob = recomputed[key]
        result = optimizer_update(
            scorer,
            optimizer,
            micro,
            spec,
            temperature=cfg.rollout.temperature,
            grad_clip=cfg.trainer.grad_clip,
            version=state.version,
            ref_model=ref_model,
            dist_ctx=ctx,
        )
        _account_update(result, state, scheduler, cfg.trainer.max_skipped_steps)
        update_metrics.append(result.metrics)
        trained_tokens += result.tokens
    train_s = time.perf_counter() - t1
    with ctx.gathered(scorer):  # FSDP2: an engine with its own copy reads the full weights
        sync_s = engine.sync_weights(getattr(scorer, "module", scorer).model, state.version)
    step_s = time.perf_counter() - t0
    if samples_file is not None:
        _write_samples(samples_file, state.step + 1, batch, cfg.trainer.log_samples)
    metrics = _step_metrics(
        batch,
        adv_stats,
        update_metrics,
        optimizer,
        rollout_s=rollout_s,
        train_s=train_s,
        sync_s=sync_s,
        step_s=step_s,
        new_tokens=new_tokens,
        trained_tokens=trained_tokens,
        searched=spec.searches_bounds,
    )
    metrics.update(collector.take_mismatch())  # rollout/logprob_abs_diff_* (engine log-probs)
    return metrics, update_metrics, batch


@torch.no_grad()
def _recompute(model, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """Decoupled PPO: pi_old re-scored by the current weights when the batch is first used."""
    from bapo_cli.trainer.policy import token_logprobs

    logp, _ = token_logprobs(model, mb, temperature)
    return logp


def _account_update(result, state: TrainState, scheduler, max_skipped: int) -> None:
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


def _step_metrics(
    batch,
    adv_stats,
    updates,
    optimizer,
    *,
    rollout_s,
    train_s,
    sync_s,
    step_s,
    new_tokens,
    trained_tokens,
    searched,
) -> dict[str, float]:
    """The step's logged numbers. Every loss reports its bounds and the positive share of the
    active mass (`actor/c_low`, `actor/c_high`, `actor/rho`); a loss that searches its bounds
    (`searched`, BAPO) also logs the search under `bapo/`.

    rho and rho_before are weighted by mass over the step's updates, sum(pos) / sum(pos + neg):
    an update without active mass (rho = 1 by convention) adds nothing, and
    `actor/zero_mass_frac` says how many there were."""
    rewards = [s.reward for s in batch]
    lengths = [len(s.response_ids) for s in batch]
    out: dict[str, float] = {
        "reward/mean": sum(rewards) / len(rewards),
        "reward/acc": sum(r > 0 for r in rewards) / len(rewards),
        "response/length_mean": sum(lengths) / len(lengths),
        "response/clip_frac": sum(s.finish_reason == "length" for s in batch) / len(batch),
        "adv/zero_variance_frac": float(adv_stats.get("zero_variance_frac", 0.0)),
        "actor/lr": optimizer.param_groups[0]["lr"],
        "actor/updates": float(len(updates)),
        "actor/skipped_steps": sum(u["skipped"] for u in updates),
        "actor/no_grad_updates": sum(u.get("no_grad", 0.0) for u in updates),
        "perf/step_s": step_s,
        "perf/rollout_s": rollout_s,
        "perf/rollout_tokens_per_s": new_tokens / max(rollout_s, 1e-9),
        "perf/train_tokens_per_s": trained_tokens / max(train_s, 1e-9),
        "perf/weight_sync_s": sync_s,
    }
    names = {
        "entropy": "actor/entropy",
        "grad_norm": "actor/grad_norm",
        "ppo_kl": "actor/ppo_kl",
        "clipfrac_low": "actor/clipfrac_low",
        "clipfrac_high": "actor/clipfrac_high",
        "ratio_mean": "actor/ratio_mean",
        "pos_mass": "actor/pos_mass",
        "neg_mass": "actor/neg_mass",
        "ref_kl": "actor/ref_kl",
        "nonfinite_tokens": "actor/nonfinite_tokens",
        "c_low": "actor/c_low",
        "c_high": "actor/c_high",
        "zero_mass": "actor/zero_mass_frac",
        "staleness_mean": "staleness/mean",
    }
    if searched:
        names.update(search_steps="bapo/search_steps", search_moved="bapo/search_moved_frac")
    for key, name in names.items():
        values = [u[key] for u in updates if key in u]
        if values:
            out[name] = sum(values) / len(values)
    rho_sums = [sum(u.get(k, 0.0) for u in updates) for k in RHO_SUMS]
    if updates:
        pos, neg, pos_before, neg_before = rho_sums
        out["actor/rho"] = rho_from_sums(pos, neg)
        if searched:
            out["bapo/rho_before"] = rho_from_sums(pos_before, neg_before)
    if searched:
        for key in ("c_low", "c_high", "rho", "zero_mass_frac"):
            if f"actor/{key}" in out:
                out[f"bapo/{key}"] = out[f"actor/{key}"]
    out["staleness/max"] = max((u.get("staleness_max", 0.0) for u in updates), default=0.0)
    out["actor/ratio_max"] = max((u.get("ratio_max", 0.0) for u in updates), default=0.0)
    for key in updates[0] if updates else []:
        if key.startswith("quadrant_"):
            out[f"tokens/{key}"] = sum(u[key] for u in updates) / len(updates)
    return out


def _write_samples(path: Path, step: int, batch: list[Sample], count: int) -> None:
    if count <= 0:
        return
    with path.open("a", encoding="utf-8") as f:
        for s in batch[:count]:
            record = {
                "step": step,
                "id": getattr(s.problem, "id", None),
                "prompt": getattr(s.problem, "question", None),
                "response": s.text,
                "reward": s.reward,
                "versions": [min(s.versions, default=0), max(s.versions, default=0)],
            }
            f.write(json.dumps(record) + "\n")


def _lr_lambda(warmup: int, total: int, schedule: str):
    def factor(update: int) -> float:
        if warmup and update < warmup:
            return (update + 1) / warmup
        if schedule == "cosine":
            progress = (update - warmup) / max(total - warmup, 1)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    return factor


def _reference(
    model: torch.nn.Module, cfg: TrainConfig, dtype: torch.dtype
) -> torch.nn.Module | None:
    """The frozen KL reference (algo.kl_coef > 0): a copy of the initial policy in the compute
    dtype, never sharded (forward only)."""
    if cfg.algo.kl_coef <= 0:
        return None
    ref = copy.deepcopy(model).to(dtype)
    ref.requires_grad_(False)
    return ref


def run_record(cfg: TrainConfig) -> tuple[dict[str, str], str]:
    """What a run records of its config in MLflow: the flattened params and config.yaml, with
    URL credentials and secret-named values masked (bapo_cli.tracking.redact)."""
    params = redact.params(flatten(cfg))
    tree = redact.tree(OmegaConf.to_container(OmegaConf.structured(cfg)))
    return params, OmegaConf.to_yaml(tree)


def _run_name(cfg: TrainConfig) -> str:
    stale = f"{cfg.staleness.regime}{cfg.staleness.k}"
    return f"{cfg.algo.name}-{stale}-{cfg.model.name}-s{cfg.trainer.seed}"


def _exact_batch(reward_fn: Any, texts: Any, answers: Any, *, budget_s: Any = None) -> GradeReport:
    """A per-sample exact-match reward (data=arith) as a batch grader: instant, no budget needed."""
    return GradeReport([reward_fn(t, a) > 0 for t, a in zip(texts, answers, strict=True)])


def _tags(cfg: TrainConfig, engine: str) -> dict[str, str]:
    tags = {
        "algo": cfg.algo.name,
        "staleness": str(cfg.staleness.k),
        "regime": cfg.staleness.regime,
        "model": cfg.model.name,
        "rollout": engine,
    }
    commit = source_commit()
    if commit is not None:
        tags["git_commit"] = commit
    return tags


def _git(cwd: Path, *args: str) -> str:
    """A git command's output, "" when it fails (no git, not a repository)."""
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def source_commit(package: Path | None = None) -> str | None:
    """HEAD of the bapo-cli checkout this package runs from, else None.

    Only when the package is `<top>/src/bapo_cli` of a repository whose pyproject.toml names
    bapo-cli: a package installed into site-packages of a venv that lies inside some other
    repository (or inside this one) must not tag runs with a commit it did not come from.
    """
    import tomllib

    package = (package or Path(__file__).parent).resolve()
    top = _git(package, "rev-parse", "--show-toplevel")
    if not top or package != Path(top).resolve() / "src" / "bapo_cli":
        return None
    try:
        with (Path(top) / "pyproject.toml").open("rb") as f:
            name = tomllib.load(f).get("project", {}).get("name")
    except (OSError, tomllib.TOMLDecodeError):
        return None
    if name != "bapo-cli":
        return None
    return _git(package, "rev-parse", "HEAD") or None


class PromptStream:
    """The training prompts as an endless, seeded, resumable stream (position = prompts drawn).

    Regimes draw different counts per step (partial rollouts top up their pool), so the stream is
    addressed by position, not by step; the order is the prompt set's seeded per-epoch shuffle.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        tokenizer: Any,
        console: Console,
        *,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        from functools import partial

        from bapo_cli.data.datasets import build_prompt_set

        self.tokenizer = tokenizer
        prompt_set = build_prompt_set(cfg.data)
        limit = max(cfg.model.max_model_len - cfg.rollout.max_tokens, 1)
        fmt = partial(models.format_prompt, tokenizer)
        self.prompt_set, dropped = prompt_set.filter_long(tokenizer, limit, format=fmt)
        self.skipped_rows, self.dropped_long = prompt_set.skipped, dropped
        if dropped or prompt_set.skipped:
            console.print(
                f"[yellow]prompts: {prompt_set.skipped} unusable rows skipped, {dropped} longer "
                f"than {limit} tokens dropped; {len(self.prompt_set)} kept[/yellow]"
            )
        self.position = 0  # prompts this rank has drawn
        self.rank, self.world_size = rank, world_size
        # math grading (data.kind=dataset, and validation on math benchmarks) under reward.*;
        # worker processes start on first need, so an arith run never starts one
        self.math = MathGrader(timeout_s=cfg.reward.timeout_s, workers=cfg.reward.workers)
        if cfg.data.kind == "dataset":
            grade = self.math.grade_batch
        else:
            grade = partial(_exact_batch, self.prompt_set.reward_fn)
        self.grading = StepGrader(grade, cfg.reward.step_budget_s)

    def draw(self, count: int) -> list[Any]:
        """The next `count` prompts of this rank's share: global positions rank, rank + W, ...
        (ranks never share a prompt, whatever counts they draw)."""
        w = self.world_size
        out = self.prompt_set.take(self.position * w, count * w)[self.rank :: w]
        self.position += count
        return out

    def encode(self, problem: Any) -> list[int]:
        text = models.format_prompt(self.tokenizer, self.prompt_set.render(problem))
        return list(self.tokenizer(text)["input_ids"])

    def reward(self, text: str, problem: Any) -> float:
        return self.reward_many([text], [problem])[0]

    def reward_many(self, texts: list[str], problems: list[Any]) -> list[float]:
        """Rewards of finished samples, graded together within the step's grading budget."""
        verdicts = self.grading.grade(texts, [p.answer for p in problems])
        return [float(v) for v in verdicts]

    def take_grading(self) -> dict[str, float]:
        """The step's reward/timeouts, reward/over_budget and perf/grade_s; resets the budget."""
        return self.grading.take()

    def close(self) -> None:
        """Stop the math-verify worker processes."""
        self.math.close()

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]
