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
function of the `Run`, so none needs more than it holds. The pieces live in modules named for
them: `run` (Run, TrainState, TrainingError), `build` (policy, optimizer, sampling, checks),
`optimize` (advantages and the step's optimizer updates), `step_metrics`, `samples`
(samples.jsonl), `run_record` (params, tags, git commit), `save_resume` (checkpoint out and in)
and `stopping` (a stop agreed by every rank, an abandoned step).

Run it: `bapo train algo=bapo staleness=4` (tiny model, synthetic arithmetic, CPU is fine).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from rich.console import Console

from bapo_cli import threads
from bapo_cli.config.schema import TrainConfig
from bapo_cli.evaluation import evaluate
from bapo_cli.models import loading as models
from bapo_cli.rollout.base import Sample, make_engine, resolve_engine_name
from bapo_cli.rollout.collect import Collector, DynamicSampling
from bapo_cli.staleness.regimes import REGIMES, make_regime
from bapo_cli.staleness.worker import WorkerError
from bapo_cli.tracking import RUN_DIR_TAG, make_tracker, start_failure
from bapo_cli.tracking.backends import where_lines as tracking_where_lines
from bapo_cli.trainer import checkpoint, distributed, save_resume
from bapo_cli.trainer.build import check_parallel, make_optimizer, make_policy, sampling_params
from bapo_cli.trainer.interrupt import IDLE, ROLLOUT, UPDATE, GracefulStop, StepAbandoned
from bapo_cli.trainer.optimize import advantages, optimize
from bapo_cli.trainer.progress import TrainProgress, print_summary
from bapo_cli.trainer.prompts import PromptStream
from bapo_cli.trainer.run import Run, TrainingError
from bapo_cli.trainer.run_record import run_name, run_record, run_tags
from bapo_cli.trainer.samples import append_rows, sample_rows
from bapo_cli.trainer.step_metrics import step_metrics
from bapo_cli.trainer.stopping import abandon, agree, step_snapshot
from bapo_cli.trainer.update import loss_spec

__all__ = ["TrainResult", "TrainingError", "train"]


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
    interrupted: bool = False  # stopped by Ctrl-C or a signal (run KILLED, resume printed)
    exit_code: int = 0  # 128 + the signal that stopped it (130 Ctrl-C, 143 SIGTERM)


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

    Ctrl-C, SIGTERM and SIGUSR1 end the loop after the step in progress (or abandon it when it
    cannot end within `trainer.stop_grace_s`) and still save, close (MLflow: KILLED) and print the
    summary with `resume_command`; the result says `interrupted` and the exit code. A second
    Ctrl-C raises KeyboardInterrupt at once; a signal before the model is built raises
    `interrupt.Stopped` (bapo_cli.trainer.interrupt)."""
    stop = GracefulStop(_say(console or Console()), grace_s=cfg.trainer.stop_grace_s)
    with stop:  # SETUP: a stop signal ends at once, nothing to save yet
        ctx, run_dir, console = _start(cfg, run_dir, console)
        stop.say = _say(console)
        resume_from, saved = _find_checkpoint(cfg, run_dir, console)
        _say_first_build(cfg, console, resume_from)
        run = _build(cfg, ctx, run_dir, console, resume_from)
        if resume_from is not None and saved is not None:
            save_resume.resume(run, resume_from, saved)
        elif cfg.trainer.resume:
            save_resume.restart(run)
        stop.phase = IDLE  # from here a stop closes the run KILLED and says how to resume
        # a run continued (resumed, or restarted: save_resume) has its params logged already
        tracker = _start_tracking(run, tags or {}, resumed=run.run_id is not None, swept=swept)
        status, clean, stopped = "FAILED", False, False
        try:
            run.val_sets = (
                evaluate.validation_sets(cfg, grader=run.prompts.math.grade_batch)
                if cfg.trainer.val_every and ctx.is_main
                else []
            )
            if cfg.trainer.val_every and run.state.step == 0:
                tracker.log_metrics(_validate(run), step=0)
            # async: the generation worker starts from the weights and version training resumes
            # (FSDP2: every rank holds the full weights while rank 0 writes them for the servers;
            # a regime that generates with the trainer's engine needs no gather here)
            elsewhere = run.regime.generates_elsewhere
            # the servers' start may wait on a server that hangs: a stop's grace may abandon it
            # as it abandons a rollout (nothing is trained yet)
            stop.phase = ROLLOUT
            with run.ctx.gathered(run.scorer) if elsewhere else contextlib.nullcontext():
                run.regime.start(
                    cfg, run.model, run.state.version, run_dir=run.run_dir, group=run.ctx
                )
            stop.phase = IDLE
            stopped = _loop(run, tracker, stop)
            status = "KILLED" if stopped else "FINISHED"
            clean = True  # every rank is past the last step's collectives
        except StepAbandoned as abandoned:  # saved what could be (abandon), or nothing
            status, clean, stopped = "KILLED", abandoned.phase == ROLLOUT, True
            if abandoned.phase == UPDATE:
                newest = f"step {run.saved_step}" if run.saved_step else "none"
                stop.say(
                    f"{stop.reason}: abandoning step {run.state.step + 1} during its updates "
                    f"({abandoned.why}); nothing more saved (newest checkpoint: {newest})"
                )
        except KeyboardInterrupt:  # a second Ctrl-C
            status = "KILLED"
            raise
        except WorkerError as err:
            # no server left: one process saves its last step; data-parallel ranks may meet the
            # failure at different points, so no collective (the last periodic checkpoint stands)
            first = getattr(err, "checkpoint_first", False) and run.ctx.world_size == 1
            if first and run.state.step > 0:
                save_resume.save(run, tracker)
                raise TrainingError(
                    f"{err}; step {run.state.step} is saved: {run.last_ckpt}"
                ) from err
            raise TrainingError(str(err)) from err
        except BaseException:
            if stop.requested:  # under torchrun: a rank that stopped ends the others' collectives
                status = "KILLED"
            raise
        finally:
            stop.phase = IDLE
            _close(run, tracker, status, clean=clean)
        resume = None
        if stopped:
            resume = resume_command or (
                f"rerun the same command with trainer.resume=true hydra.run.dir={run_dir}"
            )
        title = "bapo train: summary" + (
            f" (stopped by {stop.reason} at step {run.state.step})" if stopped else ""
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
        interrupted=stopped,
        exit_code=stop.exit_code if stopped else 0,
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
    the checkpoint, everything else from the config; the rest of the state from
    `save_resume.resume`)."""
    checkpoint.seed_everything(cfg.trainer.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    check_parallel(cfg, ctx)
    model, tokenizer, ref_model, scorer, autocast = make_policy(cfg, ctx, resume_from)
    checkpoint.seed_everything(cfg.trainer.seed + ctx.rank)  # ranks sample differently
    prompts = PromptStream(cfg, tokenizer, console, rank=ctx.rank, world_size=ctx.world_size)
    device = next(model.parameters()).device
    engine_name = resolve_engine_name(cfg.rollout.name, device)
    console.print(f"rollout engine: [bold]{engine_name}[/bold] (rollout={cfg.rollout.name})")
    # async: the worker generates with `engine_name`; this process's engine only validates
    mine = "hf" if REGIMES.get(cfg.staleness.regime).generates_elsewhere else engine_name
    engine = make_engine(mine, model=model, tokenizer=tokenizer, cfg=cfg, autocast=autocast)
    optimizer, scheduler = make_optimizer(cfg, model)
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
        spec=loss_spec(cfg.algo, cfg.rollout.max_tokens),
        optimizer=optimizer,
        scheduler=scheduler,
        last_ckpt=resume_from,
    )
    run.collector = Collector(
        engine=engine,
        tokenizer=tokenizer,
        params=sampling_params(cfg),
        n=cfg.rollout.n,
        encode=prompts.encode,
        reward=prompts.reward,
        score=run.score,
        reward_many=prompts.reward_many,
        next_group=ctx.rank,  # group ids unique across ranks: rank r's are r, r + W, ...
        group_step=ctx.world_size,
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


# ------------------------------------------------------------------------- resume, track, close


def _start_tracking(
    run: Run, tags: dict[str, str], *, resumed: bool, swept: list[str] | None = None
) -> Any:
    """The run's trackers, `tracking.backends` (rank 0; the others get a no-op tracker). Each
    must start now; later outages only delay metrics (bapo_cli.tracking)."""
    cfg = run.cfg
    try:
        tracker = make_tracker(
            cfg.tracking if run.ctx.is_main else None,
            run_name=cfg.tracking.run_name or run_name(cfg, swept),
            run_id=run.run_id,
            tags={**run_tags(cfg, run.engine_name), RUN_DIR_TAG: str(run.run_dir), **tags},
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


def _close(run: Run, tracker: Any, status: str, *, clean: bool) -> None:
    """The samples file to MLflow, the run closed with `status`, engine, graders and process
    group stopped (`clean`: every rank is past its last collective, so they leave together)."""
    run.regime.close()  # first: an async generation worker must not outlive a failure below
    samples_file = run.run_dir / "samples.jsonl"
    if samples_file.exists() and run.ctx.is_main:
        tracker.log_artifact(samples_file)
    tracker.close(status)
    run.engine.close()
    run.prompts.close()
    distributed.shutdown(run.ctx, clean=clean)


# ----------------------------------------------------------------------------- loop, step, save


def _loop(run: Run, tracker: Any, stop: GracefulStop) -> bool:
    """Steps until trainer.max_steps or a stop (Ctrl-C, SIGTERM, SIGUSR1: `stop.requested`, agreed
    by all ranks after each step): metrics averaged over ranks, validation, logging and
    checkpoints at their intervals; the last step done is always saved. Whether a stop ended it
    (a signal after the last step does not). A step abandoned for want of time
    (`StepAbandoned`) leaves the loop (`_train_step` saved what it could)."""
    cfg, state = run.cfg, run.state
    with TrainProgress(cfg.trainer.max_steps, state.step, run.console) as progress:
        stop.say = progress.note  # above the bar
        stopping = agree(run, stop)[0]  # the loop ends on the same step on every rank
        while state.step < cfg.trainer.max_steps and not stopping:
            stop.step_started = time.monotonic()
            metrics = _train_step(run, stop, tracker)
            stop.last_step_s = time.monotonic() - stop.step_started
            metrics.update(run.prompts.take_grading())  # reward/timeouts|over_budget, grade_s
            metrics = run.ctx.mean_metrics(metrics)
            stopping = agree(run, stop)[0]
            state.step += 1
            at_end = state.step == cfg.trainer.max_steps
            validate = at_end or (cfg.trainer.val_every and state.step % cfg.trainer.val_every == 0)
            # a stop with a deadline skips validation: the checkpoint does not need it
            if cfg.trainer.val_every and validate and not (stopping and stop.deadline):
                metrics.update(_validate(run))
            state.history.append(metrics)
            last = at_end or stopping  # a stop during this step: its end is the run's
            if state.step % cfg.trainer.log_every == 0 or last:
                tracker.log_metrics(metrics, step=state.step)
            progress.update(state.step, metrics)
            if last or (cfg.trainer.save_every and state.step % cfg.trainer.save_every == 0):
                save_resume.save(run, tracker, say=progress.note if stopping else None)
    return stopping


def _train_step(run: Run, stop: GracefulStop, tracker: Any) -> dict[str, float]:
    """Rollouts → rewards → advantages → updates → weight sync; returns the step's metrics and
    keeps the per-update metrics (`run.updates`) and the samples trained on (`run.batch`).

    Under a stop with a deadline the step may be abandoned (bapo_cli.trainer.interrupt): while
    it generates, or before its first update when the previous step's remainder would not fit
    (`abandon` then saves the last completed step), or during its updates (nothing saved)."""
    t0 = time.perf_counter()
    snapshot = step_snapshot(run)
    tokens_before = run.collector.generated_tokens
    abandoned: StepAbandoned | None = None
    try:
        stop.phase = ROLLOUT  # inside the try: an abandonment raised from here on is caught
        with run.ctx.gathered(run.scorer):  # FSDP2: full weights for generation and scoring
            batch = run.regime.next_batch()
        rollout_s = time.perf_counter() - t0
        new_tokens = run.collector.generated_tokens - tokens_before
        adv_stats = advantages(run, batch)
        stop.phase = IDLE  # the point of no return: the updates change the weights
    except StepAbandoned as err:
        stop.phase = IDLE
        abandoned = err
    if abandoned is None and run.rest_s is not None and stop.would_overrun(run.rest_s):
        why = f"its updates took {run.rest_s:.0f} s last step: they would not end in time"
        abandoned = StepAbandoned(ROLLOUT, why)
    if abandoned is None and stop.expired:  # the grace ran out just as the rollout ended
        abandoned = StepAbandoned(ROLLOUT, f"the {stop.grace_s:g} s grace ran out")
    if agree(run, stop, abandon=abandoned is not None)[1]:
        abandon(run, tracker, stop, snapshot, abandoned)
    stop.phase = UPDATE
    t1 = time.perf_counter()
    update_metrics, trained_tokens, layout = optimize(run, batch)
    train_s = time.perf_counter() - t1
    with run.ctx.gathered(run.scorer):  # FSDP2: an engine with its own copy reads full weights
        policy = getattr(run.scorer, "module", run.scorer).model
        sync_s = run.engine.sync_weights(policy, run.state.version)
        t2 = time.perf_counter()
        run.regime.publish(policy, run.state.version)  # async: into the worker's shared memory
        sync_s += time.perf_counter() - t2
    stop.phase = IDLE
    step_s = time.perf_counter() - t0
    run.rest_s = step_s - rollout_s
    wanted = run.cfg.trainer.log_samples
    rows = sample_rows(run.state.step + 1, batch, wanted)
    if run.ctx.enabled and wanted > 0:  # every rank's, in rank order: the step's first ones
        rows = [r for rank in run.ctx.gather(rows) for r in rank][:wanted]
    if run.ctx.is_main:
        append_rows(run.run_dir / "samples.jsonl", rows)
    metrics = step_metrics(
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
