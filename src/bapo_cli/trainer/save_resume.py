"""The `Run` to and from a checkpoint: `save` gathers every rank's state (regime buffers, data
position, RNG) and the full weights and optimizer state, and rank 0 writes them
(bapo_cli.trainer.checkpoint); `resume` puts them back, rank by rank, and trims samples.jsonl to
the checkpoint's step; `restart` is a resume with no checkpoint to resume from (an earlier
attempt stopped before its first save): its samples are dropped and its MLflow run continued."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bapo_cli import tracking
from bapo_cli.trainer import checkpoint
from bapo_cli.trainer.run import Run, TrainingError, TrainState
from bapo_cli.trainer.samples import trim_samples

__all__ = ["restart", "resume", "save"]


def resume(run: Run, resume_from: Path, saved: dict[str, Any]) -> None:
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
    run.prompt_stats = mine.get("prompt_stats", {})  # absent in checkpoints from before issue 45
    run.state = TrainState(**saved["state"])
    run.saved_step = run.state.step
    run.run_id = saved.get("run_id")
    if ctx.is_main:
        trim_samples(run.run_dir / "samples.jsonl", run.state.step)
    checkpoint.set_rng_state(mine["rng"])
    with ctx.gathered(run.scorer):
        run.engine.sync_weights(run.model, run.state.version)  # tokens sampled from here carry it
    run.console.print(f"resumed from {resume_from} at step {run.state.step}")


def restart(run: Run) -> None:
    """`trainer.resume=true` in a run dir without a checkpoint: training starts at step 0 again
    (the same seed, so the same steps), so an earlier attempt's samples.jsonl rows are dropped
    and its unfinished MLflow run (tagged with this run dir) is continued: the steps it logged are
    not logged twice (bapo_cli.tracking.writer), the rest follow in the same run."""
    if not run.ctx.is_main:
        return
    trim_samples(run.run_dir / "samples.jsonl", 0)
    settings = run.cfg.tracking
    if "mlflow" in settings.backends:
        run.run_id = tracking.unfinished_run(settings.uri, settings.experiment, str(run.run_dir))
    if run.run_id is not None:
        run.console.print(f"continuing MLflow run {run.run_id}, left unfinished in this run dir")


def save(run: Run, tracker: Any, *, ranks: dict[str, Any] | None = None, say: Any = None) -> None:
    """A checkpoint: every rank's state gathered (`ranks`: this rank's, taken earlier; default
    now), weights and optimizer state in full (FSDP2 gathers them on all ranks), written by rank
    0. `say`: a line that names it and how long it took (a stop: the kill wait must fit it)."""
    ctx = run.ctx
    t0 = time.monotonic()
    tracker.flush()
    ranks = ctx.gather(run.rank_state() if ranks is None else ranks)
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
    run.saved_step = run.state.step
    if say is not None:
        say(f"checkpoint saved in {time.monotonic() - t0:.1f} s: {run.last_ckpt}")
