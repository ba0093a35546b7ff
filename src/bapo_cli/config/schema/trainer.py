"""The `trainer` group: the RL loop's steps, optimiser, batch shape, checkpoints, validation and
data-parallel strategy."""

from __future__ import annotations

from dataclasses import dataclass

from bapo_cli.config.errors import ConfigError
from bapo_cli.config.schema.fields import _one_of, _positive, opt

LR_SCHEDULES = ("constant", "cosine")
OLD_LOGPROBS = ("behaviour", "recompute", "loglinear")
STRATEGIES = ("ddp", "fsdp2")
PRECISIONS = (
    "mixed",
    "pure",
)  # bapo_cli.trainer.distributed.STRATEGIES (not imported: keeps torch out)


@dataclass
class TrainerConfig:
    """The RL loop: steps, optimiser, batch shape, checkpoints, validation."""

    max_steps: int = opt(300, "rollout batches to train on")
    lr: float = opt(1e-4, "AdamW learning rate (paper: 1e-6 to 2e-6 for 7B models)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float | None = opt(1.0, "max global grad norm; null = off")
    prompts_per_step: int = opt(32, "prompts per rollout batch (each sampled rollout.n times)")
    micro_batch_size: int = opt(
        64,
        "sequences per forward/backward (gradient accumulation), in arrival order; used when "
        "micro_batch_tokens is null",
    )
    micro_batch_tokens: int | None = opt(
        None,
        "padded tokens (prompt + response) per forward/backward instead of a sample count: each "
        "mini-batch's samples sorted by length and packed greedily under this budget (a sample "
        "longer than the budget gets a micro-batch of its own); null = micro_batch_size",
    )
    logprob_chunk: int = opt(
        256,
        "response tokens per chunk through the output layer when computing log-probs and "
        "entropy (memory ~2 x chunk x vocabulary x 4 bytes, whatever the response length)",
    )
    seed: int = opt(0, "seed of everything (0 is a seed)")
    save_every: int = opt(0, "checkpoint every N steps; 0 = only at the end")
    keep_last: int | None = opt(
        None, "keep only the newest N complete checkpoints (older ones deleted); null = keep all"
    )
    resume: bool = opt(
        False,
        "continue from the last checkpoint in the run dir (hydra.run.dir=...); none there: start "
        "at step 0 in it, dropping an earlier attempt's samples and continuing its MLflow run",
    )
    stop_grace_s: float = opt(
        20.0,
        "after SIGTERM or SIGUSR1: seconds the step in progress gets to end before it is "
        "abandoned (the checkpoint follows: SLURM sends SIGKILL 30 s after SIGTERM by "
        "default); 0 = finish the step however long it takes",
    )
    val_every: int = opt(0, "validate every N steps; 0 = never")
    val_benchmarks: list[str] = opt(
        [],
        "validation sets (val_every > 0): arith or pairs (held-out synthetic), a benchmark preset "
        "(aime24, aime25, math500, amc23, minerva_math, olympiadbench) or a local "
        ".jsonl/.json/.parquet",
    )
    val_n: int = opt(4, "samples per validation problem (logged as val/<set>/avg_at_<n>)")
    val_limit: int | None = opt(None, "first N problems of each validation set; null = all")
    log_every: int = opt(1, "log metrics every N steps")
    warmup_steps: int = opt(0, "optimizer updates of linear learning-rate warm-up")
    lr_schedule: str = opt("constant", "after warm-up: constant or cosine (to 10% at the end)")
    old_logprob: str = opt(
        "behaviour",
        "ratio denominator: behaviour (log-prob recorded when the token was sampled) or "
        "recompute (pi_old re-scored by the current weights when the batch is first used: the "
        "proximal policy of decoupled PPO; without algo.behav_weight_cap the behaviour policy's "
        "correction is dropped) or loglinear (A-3PO: pi_prox interpolated in log space between "
        "the behaviour and the current log-probs, weight 1 - 1/k for a token k updates stale; "
        "no extra forward)",
    )
    log_samples: int = opt(
        4, "samples per step written to samples.jsonl (prompt, response, reward)"
    )
    max_skipped_steps: int = opt(
        5, "consecutive non-finite updates (skipped) before training stops with an error"
    )
    precision: str = opt(
        "mixed",
        "mixed: float32 weights and AdamW state, forwards in model.dtype (autocast; FSDP2's "
        "MixedPrecisionPolicy); pure: weights in model.dtype (half the memory, but bfloat16 "
        "weights round away updates below ~0.4% of a weight, e.g. lr 1e-6); model.dtype="
        "float32 or float64 is the same under both",
    )
    dist_timeout_min: float = opt(
        60.0,
        "under torchrun: minutes a rank waits for the others in a collective before failing (rank "
        "0 validates and writes checkpoints alone; NCCL's own default is 10)",
    )
    strategy: str = opt(
        "ddp",
        "data parallelism under torchrun (bapo train --nproc N): ddp (whole model per rank) or "
        "fsdp2 (parameters, gradients and optimizer state sharded; float32 master weights)",
    )

    def check(self) -> None:
        _positive("max_steps", self.max_steps)
        _one_of("strategy", self.strategy, STRATEGIES)
        _one_of("precision", self.precision, PRECISIONS)
        _positive("dist_timeout_min", self.dist_timeout_min)
        _positive("warmup_steps", self.warmup_steps, allow_zero=True)
        _one_of("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _one_of("old_logprob", self.old_logprob, OLD_LOGPROBS)
        _positive("log_samples", self.log_samples, allow_zero=True)
        _positive("max_skipped_steps", self.max_skipped_steps)
        _positive("lr", self.lr)
        _positive("weight_decay", self.weight_decay, allow_zero=True)
        if self.grad_clip is not None:
            _positive("grad_clip", self.grad_clip)
        _positive("prompts_per_step", self.prompts_per_step)
        _positive("micro_batch_size", self.micro_batch_size)
        if self.micro_batch_tokens is not None:
            _positive("micro_batch_tokens", self.micro_batch_tokens)
        _positive("logprob_chunk", self.logprob_chunk)
        _positive("save_every", self.save_every, allow_zero=True)
        _positive("stop_grace_s", self.stop_grace_s, allow_zero=True)
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError("keep_last", self.keep_last, "must be >= 1 (or null to keep all)")
        _positive("val_every", self.val_every, allow_zero=True)
        _positive("log_every", self.log_every)
        _positive("val_n", self.val_n)
        if self.val_limit is not None:
            _positive("val_limit", self.val_limit)
        if self.val_every and not self.val_benchmarks:
            raise ConfigError("val_benchmarks", [], "val_every > 0 needs at least one benchmark")
