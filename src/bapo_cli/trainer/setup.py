"""`train()`'s set-up, each piece from its own builder (trainer/build.py) in the order they need
each other: the process group and run dir (`start`), then `setup`: the checkpoint to resume
from, the policy, prompts, engine, optimizer, batch layout, collector and regime, and the state
a resume puts back. Nothing here decides where samples come from: the `SampleSource` it is
given did (staleness/source.py), and the run plan showed the same one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from rich.console import Console

from bapo_cli import threads
from bapo_cli.config.schema import TrainConfig
from bapo_cli.models import loading as models
from bapo_cli.models import tiny
from bapo_cli.rollout.base import make_engine
from bapo_cli.staleness.regimes import make_regime
from bapo_cli.staleness.source import SampleSource
from bapo_cli.trainer import checkpoint, distributed, save_resume
from bapo_cli.trainer.build import (
    check_parallel,
    make_collector,
    make_layout,
    make_optimizer,
    make_policy,
    regime_settings,
)
from bapo_cli.trainer.prompts import PromptStream
from bapo_cli.trainer.run import Run, TrainingError
from bapo_cli.trainer.update import loss_spec

__all__ = ["setup", "start"]


def start(
    cfg: TrainConfig, run_dir: Path, console: Console
) -> tuple[distributed.DistContext, Path, Console]:
    """The process group (one process unless started by torchrun), rank 0's run dir on every
    rank, and a console that only rank 0 prints to."""
    ctx = distributed.from_env(cfg.trainer.strategy, cfg.trainer.dist_timeout_min)
    if cfg.trainer.strategy == "fsdp2" and not ctx.enabled:
        raise TrainingError(
            "trainer.strategy=fsdp2 shards the model over torchrun's processes: launch with "
            "bapo train --nproc N (N >= 1) or torchrun"
        )
    if not ctx.is_main:
        console = Console(quiet=True)
    chosen = threads.configure()  # from the cores free now; BAPO_THREADS=legacy: torch's own
    why = f" ({chosen.why})" if chosen else " (BAPO_THREADS=legacy)"
    console.print(f"torch threads: {torch.get_num_threads()}{why}")
    transformers.utils.logging.disable_progress_bar()  # ours is the one to watch
    run_dir = Path(ctx.broadcast(str(run_dir)))  # every rank writes under rank 0's run dir
    run_dir.mkdir(parents=True, exist_ok=True)
    return ctx, run_dir, console


def setup(
    cfg: TrainConfig,
    source: SampleSource,
    ctx: distributed.DistContext,
    run_dir: Path,
    console: Console,
) -> Run:
    """Every piece of the run, built (on resume the policy from the checkpoint, everything else
    from the config) and then resumed: optimizer, regime buffers, data position, RNG, counters
    (`save_resume`)."""
    resume_from, saved = _find_checkpoint(cfg, run_dir, console)
    _say_first_build(cfg, console, resume_from)
    run = _build(cfg, source, ctx, run_dir, console, resume_from)
    if resume_from is not None and saved is not None:
        save_resume.resume(run, resume_from, saved)
    elif cfg.trainer.resume:
        save_resume.restart(run)
    return run


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


def _say_first_build(cfg: TrainConfig, console: Console, resume_from: Path | None) -> None:
    """The first use of tiny settings that do not ship builds the model (minutes, silent
    otherwise): say so before it starts."""
    if resume_from is not None or cfg.model.path != models.TINY:
        return
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


def _build(
    cfg: TrainConfig,
    source: SampleSource,
    ctx: distributed.DistContext,
    run_dir: Path,
    console: Console,
    resume_from: Path | None,
) -> Run:
    """The pieces, each from its builder, in the order they need each other: the batch layout
    before the collector that scores with it, the collector before the regime that draws from
    it."""
    checkpoint.seed_everything(cfg.trainer.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    check_parallel(cfg, ctx)
    model, tokenizer, ref_model, scorer, autocast = make_policy(cfg, ctx, resume_from, source)
    checkpoint.seed_everything(cfg.trainer.seed + ctx.rank)  # ranks sample differently
    prompts = PromptStream(cfg, tokenizer, console, rank=ctx.rank, world_size=ctx.world_size)
    device = next(model.parameters()).device
    console.print(f"rollout engine: [bold]{source.engine.name}[/bold] (rollout={cfg.rollout.name})")
    engine = make_engine(
        source.trainer_engine, model=model, tokenizer=tokenizer, cfg=cfg, autocast=autocast
    )
    optimizer, scheduler = make_optimizer(cfg, model)
    batches = make_layout(cfg, ctx, model, tokenizer, scorer, source)
    collector = make_collector(cfg, engine, tokenizer, prompts, batches.score, ctx)
    settings = regime_settings(cfg, source, ctx, model, collector)
    return Run(
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
        source=source,
        engine=engine,
        spec=loss_spec(cfg.algo, cfg.rollout.max_tokens),
        optimizer=optimizer,
        scheduler=scheduler,
        batches=batches,
        collector=collector,
        regime=make_regime(settings, collector, prompts.draw),  # this rank's share
        last_ckpt=resume_from,
    )
