"""The pieces `setup` assembles from the config, each from its own group: the policy (LoRA, the KL
reference, the scorer that computes log-probs under DDP or FSDP2, mixed precision), the
optimizer and its LR schedule, the sampling parameters, the collector, the regime's settings,
and the checks that refuse a run the process layout or LoRA cannot train."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bapo_cli.config.schema import TrainConfig
from bapo_cli.models import loading as models
from bapo_cli.models import lora
from bapo_cli.rollout.base import SamplingParams
from bapo_cli.rollout.collect import Collector, DynamicSampling
from bapo_cli.rollout.scoring import ResponseLogits, disable_dropout, logprob_dtype
from bapo_cli.staleness.regimes import REGIMES, RegimeSettings
from bapo_cli.staleness.source import WORKER, SampleSource, parallel_refusal
from bapo_cli.staleness.worker import WorkerSpec
from bapo_cli.trainer import distributed
from bapo_cli.trainer.layout import BatchLayout
from bapo_cli.trainer.prompts import PromptStream
from bapo_cli.trainer.run import TrainingError

__all__ = [
    "check_parallel",
    "make_collector",
    "make_layout",
    "make_optimizer",
    "make_policy",
    "regime_settings",
    "sampling_params",
]


def make_policy(
    cfg: TrainConfig, ctx: distributed.DistContext, resume_from: Path | None, source: SampleSource
) -> tuple[torch.nn.Module, Any, torch.nn.Module | None, torch.nn.Module, torch.dtype | None]:
    """(policy, tokenizer, KL reference, scorer, autocast dtype). Mixed precision: float32
    weights and optimizer state, forwards in model.dtype (autocast; FSDP2 casts through its
    MixedPrecisionPolicy instead). Only a dtype narrower than float32 is mixed: float32 runs as
    it is, and float64 (the replication testbed, docs/study-v3.md) keeps weights, optimizer state
    and forwards in float64 under either trainer.precision (autocast has no float64)."""
    use_lora = lora.enabled(cfg.model)  # resume: base from model.path, adapter from checkpoint
    from_ckpt = resume_from is not None and not use_lora
    model_cfg = replace(cfg.model, path=str(resume_from)) if from_ckpt else cfg.model
    device = models.resolve_device(model_cfg)
    compute_dtype = models.resolve_dtype(model_cfg, device)
    mixed = cfg.trainer.precision == "mixed" and compute_dtype.itemsize < 4  # bf16 / fp16
    stored_dtype = torch.float32 if mixed else compute_dtype
    autocast = compute_dtype if mixed and not ctx.sharded else None
    if use_lora:
        _check_lora(cfg, ctx, source)
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


def _check_lora(cfg: TrainConfig, ctx: distributed.DistContext, source: SampleSource) -> None:
    """What LoRA does not support (yet): sharding, and a generation worker of its own."""
    if ctx.sharded:
        raise TrainingError(
            "model.lora with trainer.strategy=fsdp2: not supported; use trainer.strategy=ddp "
            "(the adapters are small: every rank holds them whole)"
        )
    if source.place == WORKER:
        raise TrainingError(
            f"model.lora with staleness.regime={cfg.staleness.regime}: its generation worker "
            "loads a plain model and cannot take adapter weights; use another regime"
        )


def sampling_params(cfg: TrainConfig) -> SamplingParams:
    return SamplingParams(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        max_tokens=cfg.rollout.max_tokens,
        stop=tuple(cfg.rollout.stop),
        seed=cfg.rollout.seed if cfg.rollout.seed is not None else cfg.trainer.seed,
    )


def make_optimizer(
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


def check_parallel(cfg: TrainConfig, ctx: distributed.DistContext) -> None:
    """What data parallelism needs (`staleness.source.parallel_refusal`)."""
    refusal = parallel_refusal(cfg, ctx.world_size) if ctx.enabled else None
    if refusal is not None:
        raise TrainingError(refusal)


def make_layout(
    cfg: TrainConfig,
    ctx: distributed.DistContext,
    model: torch.nn.Module,
    tokenizer: Any,
    scorer: torch.nn.Module,
    source: SampleSource,
) -> BatchLayout:
    """How the run's samples become tensors and are scored (`trainer.layout`)."""
    return BatchLayout(
        regime=REGIMES.get(cfg.staleness.regime),
        k=cfg.staleness.k,
        trainer=cfg.trainer,
        temperature=cfg.rollout.temperature,
        pad_id=tokenizer.pad_token_id,
        device=next(model.parameters()).device,
        dtype=logprob_dtype(model),  # float64 under model.dtype=float64, else float32
        ctx=ctx,
        scorer=scorer,
        engine_logprobs=source.engine.name != "hf",
    )


def make_collector(
    cfg: TrainConfig,
    engine: Any,
    tokenizer: Any,
    prompts: PromptStream,
    score: Any,
    ctx: distributed.DistContext,
) -> Collector:
    """Rounds of generation with `engine`, graded by the prompt stream, scored by `score`."""
    return Collector(
        engine=engine,
        tokenizer=tokenizer,
        params=sampling_params(cfg),
        n=cfg.rollout.n,
        encode=prompts.encode,
        reward=prompts.reward,
        score=score,
        reward_many=prompts.reward_many,
        next_group=ctx.rank,  # group ids unique across ranks: rank r's are r, r + W, ...
        group_step=ctx.world_size,
        dynamic=DynamicSampling(cfg.algo.resample_rounds) if cfg.algo.dynamic_sampling else None,
    )


def regime_settings(
    cfg: TrainConfig,
    source: SampleSource,
    ctx: distributed.DistContext,
    model: torch.nn.Module,
    collector: Collector,
) -> RegimeSettings:
    """The regime's settings: this rank's share of the prompts, and for the async regime what
    generates (the servers', or its worker process's spec: the trainer's engine choice, weight
    dtype, mixed precision and sampling)."""
    generator: Any = source.servers
    if source.place == WORKER:
        generator = WorkerSpec(
            engine=source.engine.name,
            cfg=cfg,
            dtype=next(model.parameters()).dtype,
            autocast=getattr(collector.engine, "autocast", None),
            params=collector.params,
            seed=collector.params.seed or 0,
        )
    return RegimeSettings(
        name=cfg.staleness.regime,
        k=cfg.staleness.k,
        epochs=cfg.staleness.ppo_epochs,
        prompts_per_step=cfg.trainer.prompts_per_step // ctx.world_size,
        generator=generator,
    )


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
