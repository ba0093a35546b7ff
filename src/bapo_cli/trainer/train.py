"""`bapo train`: the off-policy RL loop, top to bottom.

    config → model + tokenizer → prompts → engine → staleness regime
    each step:  rollouts (behaviour log-probs, policy version per token) → rewards → advantages
                → one optimizer update per mini-batch (BAPO: bounds solved per update)
                → weight sync to the engine → metrics to MLflow → checkpoint

The loop itself knows no algorithm: the loss comes from `algos.losses.REGISTRY[algo.loss]`, the
advantages from `algos.advantages.REGISTRY[algo.advantage]`, the staleness from
`staleness.regimes.REGIMES[staleness.regime]` (updates per batch, deferred first scoring), the
engine from `rollout.base.ENGINES`.

`train()` reads as a recipe: start (processes, run dir), build (`Run`: every piece the steps
use), resume, start tracking, loop over `_train_step(run)`, save, close. Each stage is a
function of the `Run`, so none needs more than it holds.

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

from bapo_cli import threads
from bapo_cli.algos import advantages as adv_registry
from bapo_cli.algos.bounds import rho_from_sums
from bapo_cli.algos.shaping import overlong_penalty
from bapo_cli.config.schema import TrainConfig
from bapo_cli.evaluation import evaluate
from bapo_cli.models import loading as models
from bapo_cli.models import lora
from bapo_cli.rollout.base import Sample, SamplingParams, make_engine, resolve_engine_name
from bapo_cli.rollout.collect import Collector, DynamicSampling
from bapo_cli.staleness.regimes import REGIMES, Regime, make_regime
from bapo_cli.staleness.worker import WorkerError
from bapo_cli.tracking import RUN_DIR_TAG, flatten, make_tracker, redact, start_failure
from bapo_cli.tracking.backends import where_lines as tracking_where_lines
from bapo_cli.trainer import checkpoint, distributed
from bapo_cli.trainer.interrupt import GracefulStop
from bapo_cli.trainer.policy import (
    MicroBatch,
    ResponseLogits,
    collate,
    disable_dropout,
    record_behaviour,
    split_micro,
)
from bapo_cli.trainer.progress import TrainProgress, print_summary
from bapo_cli.trainer.prompts import PromptStream
from bapo_cli.trainer.update import (
    RHO_SUMS,
    LossSpec,
    behaviour_weights,
    loss_spec,
    optimizer_update,
    tis_weights,
)

__all__ = ["PromptStream", "TrainResult", "TrainState", "TrainingError", "run_record", "train"]


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
    interrupted: bool = False  # stopped by Ctrl-C (checkpoint saved, run KILLED)


@dataclass
class Run:
    """Everything one training run built, handed to each stage (resume, step, save, close)."""

    cfg: TrainConfig
    ctx: distributed.DistContext
    console: Console
    run_dir: Path  # rank 0's run dir, on every rank
    model: torch.nn.Module  # the policy itself: checkpoints and the engine read it
    scorer: torch.nn.Module  # what computes log-probs (DDP-wrapped or FSDP2-sharded)
    ref_model: torch.nn.Module | None  # the frozen KL reference (algo.kl_coef > 0)
    tokenizer: Any
    device: torch.device
    prompts: PromptStream
    engine_name: str
    engine: Any
    spec: LossSpec
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    # set by _build once the run exists: the collector scores with `score`, which splits by the
    # regime, which draws from the collector
    collector: Collector = field(init=False)
    regime: Regime = field(init=False)
    state: TrainState = field(default_factory=TrainState)
    run_id: str | None = None  # the MLflow run to continue (resume)
    val_sets: list[Any] = field(default_factory=list)
    last_ckpt: Path | None = None
    updates: list[dict[str, float]] = field(default_factory=list)  # per optimizer update
    batch: list[Sample] = field(default_factory=list)  # the samples of the last step

    def layout(self, samples: list[Sample]) -> list[list[MicroBatch]]:
        """Mini-batches (one per optimizer update) of micro-batches; the same split scores the
        behaviour log-probs and trains, so an on-policy update sees identical tensors."""
        trainer, pad = self.cfg.trainer, self.tokenizer.pad_token_id
        return [
            [
                collate(micro, pad, self.device)
                for micro in split_micro(
                    part, size=trainer.micro_batch_size, tokens=trainer.micro_batch_tokens
                )
            ]
            for part in self.regime.split(samples)
        ]

    def score(self, samples: list[Sample]) -> None:
        """Behaviour log-probs of fresh samples. A regime whose first mini-batch is trained by
        the weights that sampled it (`defer_first`) leaves that one to the first update's own
        forward (not with an engine that reports its own log-probs: those are compared with the
        trainer's)."""
        defer_first = (
            self.regime.defer_first
            and self.cfg.trainer.old_logprob == "behaviour"
            and self.engine_name == "hf"
        )
        for i, mini in enumerate(self.layout(samples)):
            if defer_first and i == 0:
                continue
            for mb in mini:
                record_behaviour(self.scorer, mb, self.cfg.rollout.temperature)

    def rank_state(self) -> dict[str, Any]:
        """What differs between ranks: sampling RNG, data position, the regime's buffers."""
        return {
            "regime": self.regime.state_dict(),
            "prompts": self.prompts.state_dict(),
            "next_group": self.collector.next_group,
            "rng": checkpoint.rng_state(),
        }


def train(
    cfg: TrainConfig,
    run_dir: Path,
    console: Console | None = None,
    *,
    tags: dict[str, str] | None = None,  # extra run tags (a sweep job's parent, overrides)
    swept: list[str] | None = None,  # a sweep job's own values (`rho0=0.3`): its run name
    resume_command: str | None = None,  # what continues this run (shown when Ctrl-C stops it)
) -> TrainResult:
    """Start, build, resume, track, loop, save, close.

    The first Ctrl-C ends the loop after the step in progress and still saves, closes (MLflow:
    KILLED) and prints the summary with `resume_command`; the result says `interrupted`. A second
    Ctrl-C raises KeyboardInterrupt at once (bapo_cli.trainer.interrupt)."""
    ctx, run_dir, console = _start(cfg, run_dir, console)
    resume_from, saved = _find_checkpoint(cfg, run_dir, console)
    _say_first_build(cfg, console, resume_from)
    run = _build(cfg, ctx, run_dir, console, resume_from)
    if resume_from is not None and saved is not None:
        _resume(run, resume_from, saved)
    tracker = _start_tracking(run, tags or {}, resumed=resume_from is not None, swept=swept)
    run.val_sets = (
        evaluate.validation_sets(cfg, grader=run.prompts.math.grade_batch)
        if cfg.trainer.val_every and ctx.is_main
        else []
    )
    if cfg.trainer.val_every and run.state.step == 0:
        tracker.log_metrics(_validate(run), step=0)
    status = "FAILED"
    stop = GracefulStop(_say(console), enabled=not ctx.enabled)
    try:
        # async: the generation worker starts from the weights and version training resumes at
        run.regime.start(cfg, run.model, run.state.version, run_dir=run.run_dir)
        with stop:
            _loop(run, tracker, stop)
        status = "KILLED" if stop.requested else "FINISHED"
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the loop began
        status = "KILLED"
        raise
    except WorkerError as err:
        if getattr(err, "checkpoint_first", False) and run.state.step > 0:  # no server left
            _save(run, tracker)
            raise TrainingError(f"{err}; step {run.state.step} is saved: {run.last_ckpt}") from err
        raise TrainingError(str(err)) from err
    finally:
        _close(run, tracker, status)
    resume = None
    if stop.requested:
        resume = resume_command or (
            f"rerun the same command with trainer.resume=true hydra.run.dir={run_dir}"
        )
    title = "bapo train: summary" + (
        f" (stopped by Ctrl-C at step {run.state.step})" if stop.requested else ""
    )
    print_summary(
        console,
        run.state.history,
        run_dir,
        cfg.tracking.uri,
        tracker.run_id,
        resume=resume,
        title=title,
        mlflow="mlflow" in cfg.tracking.backends,
        others=tracking_where_lines(cfg.tracking, tracker.run_id, run_dir),
    )
    return TrainResult(
        run_dir,
        tracker.run_id,
        run.state.history,
        run.last_ckpt,
        run.updates,
        run.batch,
        interrupted=stop.requested,
    )


def _say(console: Console):
    """A line on the console (rank 0's), unwrapped and without markup."""
    return lambda line: console.print(line, highlight=False, markup=False, soft_wrap=True)


def _say_first_build(cfg: TrainConfig, console: Console, resume_from: Path | None) -> None:
    """The first use of tiny settings that do not ship builds the model (minutes, silent
    otherwise): say so before it starts."""
    if resume_from is not None or cfg.model.path != models.TINY:
        return
    from bapo_cli.models import tiny

    directory = tiny.tiny_dir(cfg.model.tiny)
    if tiny.shipped_dir(cfg.model.tiny) is not None or tiny.is_complete(directory):
        return
    console.print(
        f"first use of these tiny-model settings: building the model now (a supervised warm-up "
        f"on task {cfg.model.tiny.task!r}: minutes on 2 cores, once; cached in {directory})",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )


# --------------------------------------------------------------------------------- start, build


def _start(
    cfg: TrainConfig, run_dir: Path, console: Console | None
) -> tuple[distributed.DistContext, Path, Console]:
    """The process group (one process unless started by torchrun), rank 0's run dir on every
    rank, and a console that only rank 0 prints to."""
    ctx = distributed.from_env(cfg.trainer.strategy, cfg.trainer.dist_timeout_min)
    if cfg.trainer.strategy == "fsdp2" and not ctx.enabled:
        raise TrainingError(
            "trainer.strategy=fsdp2 shards the model over torchrun's processes: launch with "
            "bapo train --nproc N (N >= 1) or torchrun"
        )
    console = console or Console()
    if not ctx.is_main:
        console = Console(quiet=True)
    chosen = threads.configure()  # from the cores free now; BAPO_THREADS=legacy: torch's own
    why = f" ({chosen.why})" if chosen else " (BAPO_THREADS=legacy)"
    console.print(f"torch threads: {torch.get_num_threads()}{why}")
    transformers.utils.logging.disable_progress_bar()  # ours is the one to watch
    run_dir = Path(ctx.broadcast(str(run_dir)))  # every rank writes under rank 0's run dir
    run_dir.mkdir(parents=True, exist_ok=True)
    return ctx, run_dir, console


def _find_checkpoint(
    cfg: TrainConfig, run_dir: Path, console: Console
) -> tuple[Path | None, dict[str, Any] | None]:
    """(checkpoint dir, its trainer state) to resume from (trainer.resume), else (None, None)."""
    if not cfg.trainer.resume:
        return None, None
    ckpt_root = run_dir / "checkpoints"
    found = checkpoint.latest_usable(ckpt_root, console.print)
    if found is None:
        console.print(
            f"trainer.resume=true but no usable checkpoint in {ckpt_root}: starting fresh"
        )
        return None, None
    return found


def _build(
    cfg: TrainConfig,
    ctx: distributed.DistContext,
    run_dir: Path,
    console: Console,
    resume_from: Path | None,
) -> Run:
    """Model, prompts, engine, optimizer, collector and regime (on resume the policy comes from
    the checkpoint, everything else from the config; the rest of the state from `_resume`)."""
    checkpoint.seed_everything(cfg.trainer.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    _check_parallel(cfg, ctx)
    model, tokenizer, ref_model, scorer, autocast = _policy(cfg, ctx, resume_from)
    checkpoint.seed_everything(cfg.trainer.seed + ctx.rank)  # ranks sample differently
    prompts = PromptStream(cfg, tokenizer, console, rank=ctx.rank, world_size=ctx.world_size)
    device = next(model.parameters()).device
    engine_name = resolve_engine_name(cfg.rollout.name, device)
    console.print(f"rollout engine: [bold]{engine_name}[/bold] (rollout={cfg.rollout.name})")
    # async: the worker generates with `engine_name`; this process's engine only validates
    mine = "hf" if REGIMES.get(cfg.staleness.regime).generates_elsewhere else engine_name
    engine = make_engine(mine, model=model, tokenizer=tokenizer, cfg=cfg, autocast=autocast)
    optimizer, scheduler = _optimizer(cfg, model)
    run = Run(
        cfg=cfg,
        ctx=ctx,
        console=console,
        run_dir=run_dir,
        model=model,
        scorer=scorer,
        ref_model=ref_model,
        tokenizer=tokenizer,
        device=device,
        prompts=prompts,
        engine_name=engine_name,
        engine=engine,
        spec=loss_spec(cfg.algo, max_tokens=cfg.rollout.max_tokens),
        optimizer=optimizer,
        scheduler=scheduler,
        last_ckpt=resume_from,
    )
    run.collector = Collector(
        engine=engine,
        tokenizer=tokenizer,
        params=_sampling(cfg),
        n=cfg.rollout.n,
        encode=prompts.encode,
        reward=prompts.reward,
        score=run.score,
        reward_many=prompts.reward_many,
        dynamic=DynamicSampling(cfg.algo.resample_rounds) if cfg.algo.dynamic_sampling else None,
    )
    run.regime = make_regime(
        cfg.staleness.regime,
        k=cfg.staleness.k,
        epochs=cfg.staleness.ppo_epochs,
        collector=run.collector,
        draw=prompts.draw,  # this rank's share of the stream: whole groups on one rank
        prompts_per_step=cfg.trainer.prompts_per_step // ctx.world_size,
    )
    return run


def _policy(
    cfg: TrainConfig, ctx: distributed.DistContext, resume_from: Path | None
) -> tuple[torch.nn.Module, Any, torch.nn.Module | None, torch.nn.Module, torch.dtype | None]:
    """(policy, tokenizer, KL reference, scorer, autocast dtype). Mixed precision: float32
    weights and optimizer state, forwards in model.dtype (autocast; FSDP2 casts through its
    MixedPrecisionPolicy instead)."""
    use_lora = lora.enabled(cfg.model)  # resume: base from model.path, adapter from checkpoint
    from_ckpt = resume_from is not None and not use_lora
    model_cfg = replace(cfg.model, path=str(resume_from)) if from_ckpt else cfg.model
    device = models.resolve_device(model_cfg)
    compute_dtype = models.resolve_dtype(model_cfg, device)
    mixed = cfg.trainer.precision == "mixed" and compute_dtype != torch.float32
    stored_dtype = torch.float32 if mixed else compute_dtype
    autocast = compute_dtype if mixed and not ctx.sharded else None
    if use_lora:
        _check_lora(cfg, ctx)
        if resume_from is not None:  # the adapter's files, before the base's weights load
            lora.check_adapter(resume_from)
    model, tokenizer = models.load_policy(model_cfg, device=device, dtype=stored_dtype)
    if use_lora:
        if resume_from is None:
            model = lora.apply(model, cfg.model.lora)
        else:
            model = lora.load_adapter(model, resume_from)
    disable_dropout(model)
    model.train()
    ref_model = _reference(model, cfg, compute_dtype)  # before sharding: a plain frozen copy
    # what computes log-probs: DDP-wrapped or FSDP2-sharded under torchrun
    chunk = cfg.trainer.logprob_chunk
    scorer = ctx.wrap(ResponseLogits(model, autocast, chunk), compute_dtype)
    if ref_model is not None:  # scored through the same chunked output layer
        ref_model = ResponseLogits(ref_model, None, chunk)
    return model, tokenizer, ref_model, scorer, autocast


def _check_lora(cfg: TrainConfig, ctx: distributed.DistContext) -> None:
    """What LoRA does not support (yet): sharding, and a generation worker of its own."""
    if ctx.sharded:
        raise TrainingError(
            "model.lora with trainer.strategy=fsdp2: not supported; use trainer.strategy=ddp "
            "(the adapters are small: every rank holds them whole)"
        )
    if REGIMES.get(cfg.staleness.regime).generates_elsewhere:
        raise TrainingError(
            f"model.lora with staleness.regime={cfg.staleness.regime}: its generation worker "
            "loads a plain model and cannot take adapter weights; use another regime"
        )


def _sampling(cfg: TrainConfig) -> SamplingParams:
    return SamplingParams(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        max_tokens=cfg.rollout.max_tokens,
        stop=tuple(cfg.rollout.stop),
        seed=cfg.rollout.seed if cfg.rollout.seed is not None else cfg.trainer.seed,
    )


def _optimizer(
    cfg: TrainConfig, model: torch.nn.Module
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW and its LR schedule over the run's optimizer updates: the regime says how many
    updates a rollout batch makes."""
    per_batch = REGIMES.get(cfg.staleness.regime).updates_per_batch(cfg.staleness.k)
    total_updates = cfg.trainer.max_steps * per_batch * cfg.staleness.ppo_epochs
    optimizer = torch.optim.AdamW(  # under LoRA the adapters only: the base is frozen
        lora.trainable(model), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _lr_lambda(cfg.trainer.warmup_steps, total_updates, cfg.trainer.lr_schedule)
    )
    return optimizer, scheduler


def _check_parallel(cfg: TrainConfig, ctx: distributed.DistContext) -> None:
    """What data parallelism needs: equal shares of whole prompt groups on every rank."""
    if not ctx.enabled:
        return
    if not REGIMES.get(cfg.staleness.regime).data_parallel:
        raise TrainingError(
            f"staleness.regime={cfg.staleness.regime} trains in one process: run it without "
            "--nproc / torchrun"
        )
    per_batch = REGIMES.get(cfg.staleness.regime).updates_per_batch(cfg.staleness.k)
    parts = ctx.world_size * per_batch
    if cfg.trainer.prompts_per_step % parts:
        raise TrainingError(
            f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} must split into "
            f"{ctx.world_size} ranks × mini-batches of whole prompt groups (a multiple of {parts})"
        )


# ------------------------------------------------------------------------- resume, track, close


def _resume(run: Run, resume_from: Path, saved: dict[str, Any]) -> None:
    """Optimizer, scheduler, this rank's regime buffers, data position and RNG, and the step and
    policy version from the checkpoint; the engine continues from the restored weights."""
    ctx = run.ctx
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
            f"resume with the same strategy (this run: {run.cfg.trainer.strategy}"
            f"{'' if ctx.enabled else ', one process'})"
        )
    ctx.load_optimizer(run.model, run.optimizer, saved["optimizer"])
    run.scheduler.load_state_dict(saved["scheduler"])
    run.regime.load_state_dict(mine["regime"])
    run.prompts.load_state_dict(mine["prompts"])
    run.collector.next_group = mine["next_group"]
    run.state = TrainState(**saved["state"])
    run.run_id = saved.get("run_id")
    checkpoint.set_rng_state(mine["rng"])
    with ctx.gathered(run.scorer):
        run.engine.sync_weights(run.model, run.state.version)  # tokens sampled from here carry it
    run.console.print(f"resumed from {resume_from} at step {run.state.step}")


def _start_tracking(
    run: Run, tags: dict[str, str], *, resumed: bool, swept: list[str] | None = None
) -> Any:
    """The run's trackers, `tracking.backends` (rank 0; the others get a no-op tracker). Each
    must start now; later outages only delay metrics (bapo_cli.tracking)."""
    cfg = run.cfg
    try:
        tracker = make_tracker(
            cfg.tracking if run.ctx.is_main else None,
            run_name=cfg.tracking.run_name or _run_name(cfg, swept),
            run_id=run.run_id,
            tags={**_tags(cfg, run.engine_name), RUN_DIR_TAG: str(run.run_dir), **tags},
            run_dir=run.run_dir,
        )
        params, config_yaml = run_record(cfg)
        if not resumed:
            tracker.log_params(params)
    except Exception as err:
        run.engine.close()
        hint = "start the server, or pass tracking.uri=... or tracking=none"
        raise TrainingError(start_failure(cfg.tracking, err, hint)) from err
    if not resumed:
        tracker.log_text(config_yaml, "config.yaml")
    return tracker


def _validate(run: Run) -> dict[str, float]:
    """Rank 0 validates; every rank enters (FSDP2 gathers the full weights for it)."""
    with run.ctx.gathered(run.scorer):
        if not run.val_sets:
            return {}
        return evaluate.validate(
            run.val_sets,
            run.engine,
            run.tokenizer,
            n=run.cfg.trainer.val_n,
            max_tokens=run.cfg.rollout.max_tokens,
            max_model_len=run.cfg.model.max_model_len,
        )


def _close(run: Run, tracker: Any, status: str) -> None:
    """The samples file to MLflow, the run closed with `status`, engine, graders and process
    group stopped."""
    run.regime.close()  # first: an async generation worker must not outlive a failure below
    samples_file = run.run_dir / "samples.jsonl"
    if samples_file.exists() and run.ctx.is_main:
        tracker.log_artifact(samples_file)
    tracker.close(status)
    run.engine.close()
    run.prompts.close()
    distributed.shutdown(run.ctx, clean=status == "FINISHED")


# ----------------------------------------------------------------------------- loop, step, save


def _loop(run: Run, tracker: Any, stop: GracefulStop) -> None:
    """Steps until trainer.max_steps or a Ctrl-C (`stop.requested`, seen between steps): metrics
    averaged over ranks, validation, logging and checkpoints at their intervals; the last step
    done is always saved."""
    cfg, state = run.cfg, run.state
    with TrainProgress(cfg.trainer.max_steps, state.step, run.console) as progress:
        stop.say = progress.note  # above the bar
        while state.step < cfg.trainer.max_steps and not stop.requested:
            metrics = _train_step(run)
            metrics.update(run.prompts.take_grading())  # reward/timeouts|over_budget, grade_s
            metrics = run.ctx.mean_metrics(metrics)
            state.step += 1
            at_end = state.step == cfg.trainer.max_steps
            if cfg.trainer.val_every and (at_end or state.step % cfg.trainer.val_every == 0):
                metrics.update(_validate(run))
            state.history.append(metrics)
            last = at_end or stop.requested  # a Ctrl-C during this step: its end is the run's
            if state.step % cfg.trainer.log_every == 0 or last:
                tracker.log_metrics(metrics, step=state.step)
            progress.update(state.step, metrics)
            if last or (cfg.trainer.save_every and state.step % cfg.trainer.save_every == 0):
                _save(run, tracker)
                if stop.requested:
                    progress.note(f"checkpoint saved: {run.last_ckpt}")


def _train_step(run: Run) -> dict[str, float]:
    """Rollouts → rewards → advantages → updates → weight sync; returns the step's metrics and
    keeps the per-update metrics (`run.updates`) and the samples trained on (`run.batch`)."""
    t0 = time.perf_counter()
    tokens_before = run.collector.generated_tokens
    with run.ctx.gathered(run.scorer):  # FSDP2: full weights for generation and behaviour scoring
        batch = run.regime.next_batch()
    rollout_s = time.perf_counter() - t0
    new_tokens = run.collector.generated_tokens - tokens_before
    adv_stats = _advantages(run.cfg, batch)
    t1 = time.perf_counter()
    update_metrics, trained_tokens, layout = _optimize(run, batch)
    train_s = time.perf_counter() - t1
    with run.ctx.gathered(run.scorer):  # FSDP2: an engine with its own copy reads full weights
        policy = getattr(run.scorer, "module", run.scorer).model
        sync_s = run.engine.sync_weights(policy, run.state.version)
        t2 = time.perf_counter()
        run.regime.publish(policy, run.state.version)  # async: into the worker's shared memory
        sync_s += time.perf_counter() - t2
    step_s = time.perf_counter() - t0
    if run.ctx.is_main:
        samples_file = run.run_dir / "samples.jsonl"
        _write_samples(samples_file, run.state.step + 1, batch, run.cfg.trainer.log_samples)
    metrics = _step_metrics(
        batch,
        adv_stats,
        update_metrics,
        run.optimizer,
        rollout_s=rollout_s,
        train_s=train_s,
        sync_s=sync_s,
        step_s=step_s,
        new_tokens=new_tokens,
        trained_tokens=trained_tokens,
        searched=run.spec.searches_bounds,
    )
    metrics.update(layout)  # perf/pad_frac, perf/micro_batches
    metrics.update(run.collector.take_mismatch())  # rollout/logprob_abs_diff_* (engine)
    metrics.update(run.collector.take_dynamic())  # dynamic/* (algo.dynamic_sampling)
    metrics.update(run.regime.take_metrics())  # servers/* (async on generation servers)
    metrics.update(run.prompts.watch(batch))  # reward/silent_steps; warns once when no signal
    if "overlong_penalty_mean" in adv_stats:
        metrics["reward/overlong_penalty_mean"] = adv_stats["overlong_penalty_mean"]
    run.updates += update_metrics
    run.batch = batch
    return metrics


def _advantages(cfg: TrainConfig, batch: list[Sample]) -> dict[str, Any]:
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


def _optimize(
    run: Run, batch: list[Sample]
) -> tuple[list[dict[str, float]], int, dict[str, float]]:
    """One optimizer update per mini-batch, × ppo_epochs; (per-update metrics, tokens trained,
    the micro-batch layout's perf/pad_frac and perf/micro_batches, and under rollout.seq_mask
    rollout/seq_masked_frac: the share of sequences masked, each update's use counted once, as
    opsm decides against the weights at that update)."""
    minis = run.layout(batch)  # the tensors the behaviour log-probs were scored on (reuse)
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
        _account_update(result, run.state, run.scheduler, run.cfg.trainer.max_skipped_steps)
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
        [s.advantage for s in mb.samples], dtype=torch.float32, device=mb.mask.device
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
        from bapo_cli.algos.correction import mask_sequences

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
        prox, weight = recomputed[key]
        if weight is not None:
            adv = mb.advantages if mb.advantages.dim() == 2 else mb.advantages[:, None]
            mb.advantages = adv * weight
        mb.old_log_prob = prox
    return masked


def _save(run: Run, tracker: Any) -> None:
    """A checkpoint: every rank's state gathered, weights and optimizer state in full (FSDP2
    gathers them on all ranks), written by rank 0."""
    ctx = run.ctx
    tracker.flush()
    ranks = ctx.gather(run.rank_state())
    weights, optim_state = ctx.full_state(run.model, run.optimizer)  # all ranks (FSDP2)
    if ctx.is_main:
        try:
            run.last_ckpt = checkpoint.save(
                run.run_dir / "checkpoints",
                run.state.step,
                run.model,
                run.tokenizer,
                {
                    "optimizer": optim_state,
                    "scheduler": run.scheduler.state_dict(),
                    "state": run.state.__dict__,
                    "run_id": tracker.run_id,
                    "ranks": ranks,
                    "strategy": "fsdp2" if ctx.sharded else "ddp",
                },
                weights=weights,
                keep_last=run.cfg.trainer.keep_last,
            )
        except checkpoint.DiskFullError as err:
            raise TrainingError(str(err)) from None
    ctx.barrier()


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
        # responses whose tokens came from more than one policy version: continued by newer
        # weights (staleness.regime=partial, or async with staleness.interrupt)
        "rollout/multi_version_frac": sum(len(set(s.versions)) > 1 for s in batch) / len(batch),
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
        "trajectory_mean": "staleness/trajectory_mean",  # a response's oldest token
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
    out["staleness/trajectory_max"] = max(
        (u.get("trajectory_max", 0.0) for u in updates), default=0.0
    )
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
                "group": s.group,  # the prompt group: unique per prompt drawn in this run
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


def _run_name(cfg: TrainConfig, swept: list[str] | None = None) -> str:
    """`bapo-reuse4-tiny-s0`, and for a sweep job the values it sweeps (`...-s0-rho0=0.3`), so
    the children of one sweep are told apart by name."""
    stale = f"{cfg.staleness.regime}{cfg.staleness.k}"
    name = f"{cfg.algo.name}-{stale}-{cfg.model.name}-s{cfg.trainer.seed}"
    return "-".join([name, *(swept or [])])


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

    package = (package or Path(__file__).parents[1]).resolve()
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
