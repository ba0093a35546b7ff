"""`bapo train`: the off-policy RL loop, top to bottom.

    config → model + tokenizer → prompts → engine → staleness regime
    each step:  rollouts (behaviour log-probs, policy version per token) → rewards → advantages
                → one optimizer update per mini-batch (BAPO: bounds solved per update)
                → weight sync to the engine → metrics to MLflow → checkpoint

The loop knows no algorithm: the loss comes from `algos.losses.REGISTRY[algo.loss]`, the
advantages from `algos.advantages.REGISTRY[algo.advantage]`, the staleness from
`staleness.regimes.REGIMES[staleness.regime]`, and where samples come from from the
`SampleSource` decided once before the run (staleness/source.py).

`train()` is the recipe: set up (trainer/setup.py builds every piece into a `Run`), start
tracking, begin (validation at step 0, the regime's generator), loop over `_train_step(run)`;
`StopProtocol` (trainer/stopping.py) is the one context around it that decides how the run
ends. Run it: `bapo train algo=bapo staleness=4` (tiny model, synthetic arithmetic, CPU).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from bapo_cli.config.schema import TrainConfig
from bapo_cli.evaluation import evaluate
from bapo_cli.models import loading as models
from bapo_cli.rollout.base import Sample
from bapo_cli.staleness.source import SampleSource, sample_source
from bapo_cli.tracking import RUN_DIR_TAG, make_tracker, start_failure
from bapo_cli.trainer import save_resume, throughput
from bapo_cli.trainer.interrupt import IDLE, ROLLOUT, UPDATE, GracefulStop, StepAbandoned
from bapo_cli.trainer.optimize import advantages, optimize
from bapo_cli.trainer.progress import TrainProgress
from bapo_cli.trainer.run import Run, TrainingError, TrainResult
from bapo_cli.trainer.run_record import run_name, run_record, run_tags
from bapo_cli.trainer.samples import append_rows, sample_rows
from bapo_cli.trainer.setup import setup, start
from bapo_cli.trainer.step_metrics import step_metrics
from bapo_cli.trainer.stopping import StopProtocol, abandon, agree, step_snapshot

__all__ = ["TrainResult", "TrainingError", "train"]


def train(
    cfg: TrainConfig,
    run_dir: Path,
    console: Console | None = None,
    *,
    tags: dict[str, str] | None = None,  # extra run tags (a sweep job's parent, overrides)
    swept: list[str] | None = None,  # a sweep job's own values (`rho0=0.3`): its run name
    resume_command: str | None = None,  # what continues this run (shown when Ctrl-C stops it)
    source: SampleSource | None = None,  # who samples (the run plan's); decided here if None
) -> TrainResult:
    """Set up, track, begin, loop. Ctrl-C, SIGTERM and SIGUSR1 end the loop after the step in
    progress (or abandon it when it cannot end within `trainer.stop_grace_s`) and still save,
    close (MLflow: KILLED) and print the summary with `resume_command`; the result says
    `interrupted` and the exit code (trainer/stopping.py, trainer/interrupt.py)."""
    source = source or sample_source(cfg)
    with StopProtocol(cfg, console or Console(), resume_command) as stop:
        ctx, run_dir, console = start(cfg, run_dir, stop.console)  # processes, run dir
        stop.speak_to(console)
        run = setup(cfg, source, ctx, run_dir, console)  # every piece built, resumed
        stop.built(run)
        # a run continued (resumed, or restarted: save_resume) has its params logged already
        tracker = stop.tracking(_start_tracking(run, tags or {}, swept=swept))
        _begin(run, tracker, stop.signals)
        stop.stopped = _loop(run, tracker, stop.signals)
    return stop.result()


# ----------------------------------------------------------------------- track, begin, validate


def _start_tracking(run: Run, tags: dict[str, str], *, swept: list[str] | None = None) -> Any:
    """The run's trackers, `tracking.backends` (rank 0; the others get a no-op tracker). Each
    must start now; later outages only delay metrics (bapo_cli.tracking). A continued run
    (`run.run_id`) has its params and config logged already."""
    cfg, resumed = run.cfg, run.run_id is not None
    try:
        tracker = make_tracker(
            cfg.tracking if run.ctx.is_main else None,
            run_name=cfg.tracking.run_name or run_name(cfg, swept),
            run_id=run.run_id,
            tags={**run_tags(cfg, run.source.engine.name), RUN_DIR_TAG: str(run.run_dir), **tags},
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


def _begin(run: Run, tracker: Any, stop: GracefulStop) -> None:
    """Before the first step: the validation sets (and validation at step 0), then the regime's
    generator from the weights and version training resumes at (FSDP2: every rank holds the
    full weights while rank 0 writes them for the servers). A server start may hang: a stop's
    grace may abandon it as it abandons a rollout (nothing is trained yet)."""
    cfg = run.cfg
    if cfg.trainer.val_every and run.ctx.is_main:
        run.val_sets = evaluate.validation_sets(cfg, grader=run.prompts.math.grade_batch)
    if cfg.trainer.val_every and run.state.step == 0:
        tracker.log_metrics(_validate(run), step=0)
    elsewhere = run.regime.generates_elsewhere
    stop.phase = ROLLOUT
    with run.ctx.gathered(run.scorer) if elsewhere else contextlib.nullcontext():
        notes = run.regime.start(run.model, run.state.version, run_dir=run.run_dir, group=run.ctx)
    for line in notes:  # generation servers that did not answer: the run goes on without them
        run.console.print(f"[yellow]warning: {line}[/yellow]", soft_wrap=True)
    stop.phase = IDLE


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
            for line in run.regime.take_notes():  # generation servers down, back, joined, left
                progress.note(line)
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
    keeps the per-update metrics (`run.updates`) and the samples trained on (`run.batch`)."""
    t0 = time.perf_counter()
    run.batches.clock.take()  # scoring outside a step (validation) is no stage's
    batch, adv_stats, new_tokens, rollout_s = _rollout(run, stop, tracker)
    in_rollout = run.batches.clock.take()  # the behaviour scoring, inside rollout_s
    stop.phase = UPDATE
    t1 = time.perf_counter()
    update_metrics, trained_tokens, layout = optimize(run, batch)
    train_s = time.perf_counter() - t1
    scored = (in_rollout, run.batches.clock.take())
    sync_s = _sync(run)
    stop.phase = IDLE
    step_s = time.perf_counter() - t0
    run.rest_s = step_s - rollout_s
    _write_samples(run, batch)
    metrics = step_metrics(
        batch,
        adv_stats,
        update_metrics,
        run.optimizer,
        times=throughput.StepTimes(
            rollout_s=rollout_s,
            train_s=train_s,
            sync_s=sync_s,
            step_s=step_s,
            new_tokens=new_tokens,
            trained_tokens=trained_tokens,
            scored=scored,
            **_update_costs(run),
        ),
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


def _update_costs(run: Run) -> dict[str, Any]:
    """The update's FLOPs per trained token and the chip's peak for its compute dtype (None off
    the table: no MFU), for `perf/update_mfu` (`trainer.throughput`)."""
    policy = getattr(run.scorer, "module", run.scorer).model
    device = next(policy.parameters()).device
    dtype = models.resolve_dtype(run.cfg.model, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    checkpointing = bool(run.cfg.model.gradient_checkpointing)
    return {
        "per_token": throughput.flops_per_token(policy, checkpointing=checkpointing),
        "peak": throughput.peak_flops(name, dtype),
    }


def _rollout(
    run: Run, stop: GracefulStop, tracker: Any
) -> tuple[list[Sample], dict[str, float], int, float]:
    """(samples, advantage stats, tokens generated, seconds generating) of this step. Under a
    stop with a deadline the step may be abandoned here (bapo_cli.trainer.interrupt): while it
    generates, or before its first update when the previous step's remainder would not fit
    (`abandon` then saves the last completed step and raises StepAbandoned)."""
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
    except BaseException as err:  # also an abandonment the interrupted code re-raised as another
        abandoned = stop.abandonment(err)
        if abandoned is None:
            raise
        stop.phase = IDLE
    if abandoned is None and run.rest_s is not None and stop.would_overrun(run.rest_s):
        why = f"its updates took {run.rest_s:.0f} s last step: they would not end in time"
        abandoned = StepAbandoned(ROLLOUT, why)
    if abandoned is None and stop.expired:  # the grace ran out just as the rollout ended
        abandoned = StepAbandoned(ROLLOUT, f"the {stop.grace_s:g} s grace ran out")
    if agree(run, stop, abandon=abandoned is not None)[1]:
        abandon(run, tracker, stop, snapshot, abandoned)
    return batch, adv_stats, new_tokens, rollout_s


def _sync(run: Run) -> float:
    """The new weights to the engine and to the regime's generator; the seconds it took."""
    with run.ctx.gathered(run.scorer):  # FSDP2: an engine with its own copy reads full weights
        policy = getattr(run.scorer, "module", run.scorer).model
        sync_s = run.engine.sync_weights(policy, run.state.version)
        t0 = time.perf_counter()
        run.regime.publish(policy, run.state.version)  # async: into the worker's shared memory
        return sync_s + time.perf_counter() - t0


def _write_samples(run: Run, batch: list[Sample]) -> None:
    """The step's first `trainer.log_samples` samples, every rank's in rank order, appended to
    samples.jsonl by rank 0."""
    wanted = run.cfg.trainer.log_samples
    rows = sample_rows(run.state.step + 1, batch, wanted)
    if run.ctx.enabled and wanted > 0:
        rows = [r for rank in run.ctx.gather(rows) for r in rank][:wanted]
    if run.ctx.is_main:
        append_rows(run.run_dir / "samples.jsonl", rows)
