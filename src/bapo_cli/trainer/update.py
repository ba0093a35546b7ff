"""One optimizer update on one mini-batch: micro-batches, BAPO's bound search, loss, backward, step.

Nothing here is specific to one loss: `loss_spec` reads the loss's parameters from the algo config
by the fields of its registered params dataclass, and a loss that searches its bounds
(`LossEntry.searches_bounds`, i.e. BAPO) gets the per-update search below.

The order is the paper's: for BAPO the bounds are solved once per optimizer update over the whole
mini-batch (all micro-batches of gradient accumulation), then every micro-batch's loss uses them.
With one micro-batch that costs nothing extra (the forward that feeds the search is the one that is
back-propagated). With several, a no-grad forward over the micro-batches feeds the search first
(one extra forward per update); `algo.bound_scope=microbatch` skips it by searching per
micro-batch, a cheaper approximation named as such.

Under data parallelism the per-micro-batch search is rank-local: each rank searches the
micro-batch it back-propagates, with no collective. Then W ranks equal one process that trains
on all ranks' micro-batches, each searched on its own (tested), and ranks may run different
numbers of micro-batches (partial rollouts top up their own pools). Pairing rank 0's i-th
micro-batch with rank 1's i-th in an all-reduce would have no meaning beyond that, and it
mismatched the collectives when the counts differ. The exact all-rank search is
`bound_scope=minibatch`.

Aggregation across micro-batches is exact: each micro-batch's loss is divided by the mini-batch's
token (or sequence) count, not its own, so the accumulated gradient equals the mini-batch loss's.

What the loss divides by (`_ratio_inputs`): the behaviour log-probs (`trainer.old_logprob=
behaviour`), the proximal ones the trainer recomputed (`recompute`), A-3PO's interpolation of
the two from this forward (`loglinear`, `algos.proximal`: no extra forward), or the engine's own
(a loss whose params say `ratio_against=inference`, prime-rl's default). Every update logs the
ESS of its sequences' importance weights, behaviour -> current (`algos.ess`, `ess`); VCPO scales
the step's learning rate by it and re-centres its advantages first (`trainer.seq_grads`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from bapo_cli.algos import diagnostics, losses
from bapo_cli.algos import ess as ess_lib
from bapo_cli.algos.bounds import BapoBounds, BoundSearch, rho_from_sums
from bapo_cli.algos.proximal import loglinear_prox
from bapo_cli.rollout.logprobs import accumulate_dtype
from bapo_cli.rollout.scoring import MicroBatch, token_logprobs
from bapo_cli.trainer import seq_grads
from bapo_cli.trainer.distributed import DistContext

Tensor = torch.Tensor


@dataclass
class LossSpec:
    """What the loss needs from the algo config, as plain values."""

    name: str  # losses.REGISTRY key
    params: dict[str, Any]  # the loss's keyword arguments (its params' fields, dual_clip, agg)
    bound_scope: str = "minibatch"  # a bound-searching loss: per optimizer step or micro-batch
    kl_coef: float = 0.0
    # the constant of agg=seq-mean-token-sum-norm (Dr. GRPO): the response budget; None = the
    # widest micro-batch of the update
    norm_len: float | None = None
    old_logprob: str = "behaviour"  # trainer.old_logprob: behaviour | recompute | loglinear
    behav_cap: float | None = None  # algo.behav_weight_cap (applied here under loglinear)
    # trainer settings a loss's params carry (fields marked trainer=True), read by `loss_spec`:
    lr_scale: Callable[[float], float] | None = None  # VCPO: the step's lr factor from the ESS
    opob_baseline: bool = False  # VCPO: re-centre the advantages per update (seq_grads)
    inference_ratio: bool = False  # prime_default: the ratio against the engine's log-probs

    @property
    def searches_bounds(self) -> bool:
        """The loss chooses its bounds with BAPO's search (see `optimizer_update`)."""
        return losses.REGISTRY.get(self.name).searches_bounds

    @property
    def behaviour(self) -> bool:
        """The loss takes `behav_log_prob=` (`LossEntry.behaviour`, M2PO)."""
        return losses.REGISTRY.get(self.name).behaviour

    @property
    def search(self) -> BoundSearch:
        """The bound search's settings, read from the loss's parameters (defaults for any
        that a hand-built spec leaves out)."""
        names = [f.name for f in fields(BoundSearch) if f.name in self.params]
        return BoundSearch(**{name: self.params[name] for name in names})


def loss_spec(algo: Any, max_tokens: int | None = None, old_logprob: str = "behaviour") -> LossSpec:
    """Algo config dataclass → LossSpec, for any registered loss: the fields of the loss's params
    dataclass are read from the config by name (validated there), plus the shared options.
    `max_tokens` (rollout.max_tokens) is Dr. GRPO's constant normaliser (`LossSpec.norm_len`);
    `old_logprob` is trainer.old_logprob. The trainer settings a loss's params may carry:
    `bound_scope` (BAPO), `lr_scale()` and `baseline` (VCPO), `ratio_against` (prime_default)."""
    entry = losses.REGISTRY.get(algo.loss)
    params = entry.read_params(algo)
    return LossSpec(
        entry.name,
        {"dual_clip": algo.dual_clip, "agg": algo.agg, **entry.loss_kwargs(params)},
        bound_scope=params.bound_scope if entry.searches_bounds else "minibatch",
        kl_coef=float(getattr(algo, "kl_coef", 0.0)),
        norm_len=None if max_tokens is None else float(max_tokens),
        old_logprob=old_logprob,
        behav_cap=getattr(algo, "behav_weight_cap", None),
        lr_scale=getattr(params, "lr_scale", None),
        opob_baseline=getattr(params, "baseline", None) == "opob",
        inference_ratio=getattr(params, "ratio_against", None) == "inference",
    )


def inference_log_probs(mb: MicroBatch) -> Tensor:
    """The engine's own log-probs of the micro-batch's tokens, [b, R], where a sample has them
    (vLLM), else the behaviour log-probs (the transformers engine's are the trainer's own)."""
    out = mb.old_log_prob.detach().clone()
    width = out.shape[1]
    for i, s in enumerate(mb.samples):
        known = min(len(s.engine_logprobs), width)
        if known:
            out[i, :known] = torch.tensor(s.engine_logprobs[:known], dtype=out.dtype)
    return out


def _ratio_inputs(
    mb: MicroBatch, logp: Tensor, spec: LossSpec, version: int
) -> tuple[Tensor, Tensor | None, Tensor]:
    """(what the loss divides by, the behaviour log-probs when that is a proximal policy else
    None, the advantages) for one micro-batch, given this update's forward `logp`."""
    if spec.inference_ratio:
        return inference_log_probs(mb), None, mb.advantages
    if spec.old_logprob == "loglinear":  # A-3PO: pi_prox interpolated, no forward of its own
        stale = torch.where(mb.mask, version - mb.versions, 0)
        prox = loglinear_prox(mb.old_log_prob, logp, stale)
        adv = mb.advantages
        if spec.behav_cap is not None:  # decoupled PPO's behaviour weight pi_prox / pi_behav
            weight = behaviour_weights(prox, mb.old_log_prob, mb.mask, spec.behav_cap)
            adv = (adv if adv.dim() == 2 else adv[:, None]) * weight
        return prox, mb.old_log_prob, adv
    if spec.old_logprob == "recompute":
        return mb.old_log_prob, mb.behav_log_prob, mb.advantages
    return mb.old_log_prob, None, mb.advantages


def _behaviour_of(mb: MicroBatch) -> Tensor:
    """The behaviour log-probs (the policy that sampled), whatever the loss divides by."""
    return mb.behav_log_prob if mb.behav_log_prob is not None else mb.old_log_prob


def solve_bounds(
    model: torch.nn.Module,
    micro: Sequence[MicroBatch],
    spec: LossSpec,
    temperature: float,
    group: Any = None,
    version: int = 0,
) -> BapoBounds:
    """BAPO's per-update search over every token of the mini-batch (one extra no-grad forward),
    summed over the ranks of `group`."""
    search = spec.search
    acc = search.accumulator(spec.params["dual_clip"])
    with torch.no_grad():
        for mb in micro:
            logp, _ = token_logprobs(model, mb, temperature)
            if mb.old_is_current:  # see optimizer_update: the behaviour policy is these weights
                mb.old_log_prob, mb.old_is_current = logp, False
            acc.add(**_search_inputs(logp, mb, spec, version))
    return acc.solve(search.rho0, group=group)


def _search_inputs(logp: Tensor, mb: MicroBatch, spec: LossSpec, version: int) -> dict[str, Tensor]:
    old, _, adv = _ratio_inputs(mb, logp.detach(), spec, version)
    return losses.search_inputs(
        logp.detach(),
        old,
        adv,
        mb.mask,
        dual_clip=spec.params["dual_clip"],
        weighting=spec.search.weighting,
        rule=spec.search.rule,
    )


@dataclass
class UpdateResult:
    """One update's outcome. The optimizer stepped unless `skipped` (a non-finite loss or
    gradient on some rank: a fault, counted toward trainer.max_skipped_steps) or `no_grad` (no
    token carried gradient on any rank, e.g. every token clipped or every advantage 0: nothing
    to learn, not a fault). Either way the weights, the optimizer state and the policy version
    stay as they were: AdamW would move the weights on zero gradients (momentum, weight decay).
    """

    metrics: dict[str, float]
    skipped: bool
    tokens: int
    no_grad: bool = False


# The sums rho and rho_before are the shares of (see `losses`), summed over micro-batches/ranks.
RHO_SUMS = ("rho_pos", "rho_neg", "rho_pos_before", "rho_neg_before")


def optimizer_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro: Sequence[MicroBatch],
    spec: LossSpec,
    *,
    temperature: float,
    grad_clip: float | None,
    version: int,
    ref_model: torch.nn.Module | None = None,
    dist_ctx: DistContext | None = None,
) -> UpdateResult:
    """Accumulate gradients over the micro-batches, clip, step. Skips a non-finite step, and an
    update in which no token of any rank carries gradient (see `UpdateResult`).

    `model` is the policy's `ResponseLogits` (wrapped in DDP under data parallelism: then the
    normalisers and BAPO's search cover all ranks' tokens, see `bapo_cli.trainer.distributed`).
    rho and rho_before are the shares of the update's mass summed over its micro-batches and
    ranks (the per-step search's sums as they are); `zero_mass` says that sum is 0."""
    ctx = dist_ctx or DistContext()
    tokens = sum(mb.num_tokens for mb in micro)
    seqs = sum(len(mb.samples) for mb in micro)
    all_tokens, all_seqs = ctx.sum([float(tokens), float(seqs)])
    if spec.norm_len is not None:  # a constant: the same on every rank and every update
        norm_len = spec.norm_len
    else:
        (norm_len,) = ctx.max([float(max(mb.mask.shape[1] for mb in micro))])
    w = float(ctx.world_size)  # DDP averages gradients over ranks: divide by all tokens / W
    norm = {
        "global_tokens": max(all_tokens, 1.0) / w,
        "global_seqs": max(all_seqs, 1.0) / w,
        "norm_len": norm_len,
    }
    per_step_search = spec.searches_bounds and spec.bound_scope == "minibatch"
    bounds: BapoBounds | None = None
    pre: dict[str, float] = {}
    if spec.opob_baseline:  # VCPO: re-centre the advantages before the loss sees them
        pre = seq_grads.opob_advantages(model, micro, temperature)
    if per_step_search and len(micro) > 1:
        bounds = solve_bounds(model, micro, spec, temperature, ctx.group, version)
    weights: list[tuple[dict[str, Any], float]] = []
    # [non-finite losses, active tokens, *RHO_SUMS] summed over the micro-batches on the device;
    # read once after the loop (no per-micro-batch sync) and all-reduced in one call
    tally: Tensor | None = None
    clipped_with: list[tuple[Tensor, Tensor, Tensor, float, float]] = []
    log_ws: list[Tensor] = []  # each sequence's log importance weight, behaviour -> current
    for i, mb in enumerate(micro):
        with ctx.no_sync(model, last=i == len(micro) - 1):
            logp, entropy = token_logprobs(model, mb, temperature, entropy=True)
            if mb.old_is_current:
                # The tokens were sampled by exactly these weights (the first update on a fresh
                # batch): their behaviour log-probs are this forward's, so the trainer skips a
                # separate scoring pass. Kept for later epochs over the same micro-batch.
                mb.old_log_prob, mb.old_is_current = logp.detach(), False
            params = dict(spec.params)
            if per_step_search:
                if bounds is None:  # the mini-batch is this one micro-batch
                    bounds = _single_pass_bounds(logp, mb, spec, ctx.group, version)
                params["bounds"] = bounds
            old, behav, adv = _ratio_inputs(mb, logp, spec, version)
            if spec.behaviour:
                params["behav_log_prob"] = behav
            log_ws.append(ess_lib.sequence_log_weights(logp, _behaviour_of(mb), mb.mask))
            # bound_scope=microbatch: the loss searches this rank's micro-batch alone (no
            # collective), see the module docstring
            loss, m = losses.policy_loss(spec.name, logp, old, adv, mb.mask, **params, **norm)
            if spec.kl_coef > 0 and ref_model is not None:
                with torch.no_grad():
                    ref_logp, _ = token_logprobs(ref_model, mb, temperature)
                kl = _k3(logp, ref_logp, mb.mask)
                loss = loss + spec.kl_coef * kl / norm["global_tokens"]
                m["ref_kl"] = kl.detach() / max(mb.num_tokens, 1)
            # a non-finite loss back-propagates non-finite gradients: the step is skipped below
            # (every rank keeps going, so DDP ranks stay in step)
            row = [~torch.isfinite(loss.detach()), m["active_tokens"], *(m[k] for k in RHO_SUMS)]
            row_t = torch.stack([_on_device(v, loss.device) for v in row])
            tally = row_t if tally is None else tally + row_t
            loss.backward()
            m["entropy"] = torch.where(mb.mask, entropy, 0.0).sum() / max(mb.num_tokens, 1)
            # what the loss clipped with, for the quadrant table after the loop
            clipped_with.append(
                (logp.detach(), old.detach(), adv, float(m["c_low"]), float(m["c_high"]))
            )
            stale = torch.where(mb.mask, (version - mb.versions).float(), 0.0)
            m["staleness_sum"], m["staleness_max"] = stale.sum(), stale.max()
            # a response's staleness is its oldest token's (a response continued by newer
            # weights is as stale as its start): the max over its tokens
            rows = mb.mask.any(dim=1)
            oldest = stale.max(dim=1).values
            m["trajectory_sum"], m["trajectory_seqs"] = oldest.sum(), rows.sum().float()
            m["trajectory_max"] = oldest.max()
            weights.append((m, float(mb.num_tokens)))
    grad_norm = _grad_norm(model, grad_clip)
    local = tally.tolist() if tally is not None else [0.0] * (2 + len(RHO_SUMS))
    if per_step_search and bounds is not None:  # already summed over all micro-batches and ranks
        local[2:] = [0.0] * len(RHO_SUMS)
    # one all-reduce: any rank non-finite → all skip; no active token on any rank → all skip
    nonfinite, active, *rho_sums = ctx.sum(local)
    if per_step_search and bounds is not None:
        rho_sums = [bounds.pos, bounds.neg, bounds.pos_before, bounds.neg_before]
    skipped = nonfinite > 0 or not math.isfinite(grad_norm)
    kl_grad = spec.kl_coef > 0 and ref_model is not None and all_tokens > 0  # the KL term's
    no_grad = not skipped and active == 0 and not kl_grad
    ess = _ess(log_ws, ctx)
    scale = spec.lr_scale(ess) if spec.lr_scale is not None else None
    if not (skipped or no_grad):
        _step(optimizer, scale)
    optimizer.zero_grad(set_to_none=True)
    metrics = _combine(weights, tokens)
    metrics["ess"] = ess
    if scale is not None:
        metrics["lr_scale"] = scale
    metrics.update(pre)
    metrics.update(_quadrants(micro, clipped_with, spec.params["dual_clip"]))
    metrics["grad_norm"] = grad_norm
    metrics.update(zip(RHO_SUMS, rho_sums, strict=True))
    pos, neg, pos_before, neg_before = rho_sums
    metrics["rho"], metrics["rho_before"] = (
        rho_from_sums(pos, neg),
        rho_from_sums(pos_before, neg_before),
    )
    metrics["zero_mass"] = float(pos + neg == 0)
    metrics["search_moved"] = float(metrics.get("search_steps", 0.0) > 0)
    metrics["active_tokens"] = active
    metrics["no_grad"] = float(no_grad)
    return UpdateResult(metrics, skipped, tokens, no_grad)


def _ess(log_ws: Sequence[Tensor], ctx: DistContext) -> float:
    """ESS / N of the update's sequences over all ranks (`algos.ess`): the largest finite log
    weight and then the shifted sums are all-reduced, so the value is the whole update's."""
    log_w = torch.cat([w.cpu() for w in log_ws]) if log_ws else torch.zeros(0, dtype=torch.float64)
    finite = log_w[torch.isfinite(log_w)]
    (top,) = ctx.max([float(finite.max()) if finite.numel() else -math.inf])
    return ess_lib.ess_from_sums(*ctx.sum(ess_lib.weight_sums(log_w, top).tolist()))


def _step(optimizer: torch.optim.Optimizer, scale: float | None) -> None:
    """optimizer.step(), with every group's learning rate times `scale` for this step only (VCPO's
    ESS scaling; the schedule's own lr is put back, as VCPO's `_optimizer_step_with_buffer`)."""
    if scale is None:
        optimizer.step()
        return
    base = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * scale
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, base, strict=True):
            group["lr"] = lr


def _quadrants(
    micro: Sequence[MicroBatch],
    clipped_with: Sequence[tuple[Tensor, Tensor, Tensor, float, float]],
    dual_clip: float | None,
) -> dict[str, float]:
    """The Entropy-Clip quadrant table of the whole update, as `diagnostics.quadrant_table` gives
    it for one micro-batch holding the mini-batch: high/low probability split at the mean log-prob
    of all its valid tokens, counts summed, mass shares of the whole update's mass r|A|. (Per
    micro-batch thresholds and shares would make the table depend on the split.)"""
    if not micro:
        return {}
    toks = [
        losses.prepare_tokens(logp, old, adv, mb.mask)
        for mb, (logp, old, adv, _, _) in zip(micro, clipped_with, strict=True)
    ]
    lp_sum = sum(
        torch.where(t.valid, lp, 0.0).sum() for t, (lp, *_) in zip(toks, clipped_with, strict=True)
    )
    threshold = lp_sum / sum(t.n_valid for t in toks).clamp(min=1)
    counts: dict[str, Tensor] = {}
    for mb, tok, (logp, old, adv, c_low, c_high) in zip(micro, toks, clipped_with, strict=True):
        quad = diagnostics.quadrant_table(
            logp,
            old,
            adv,
            mb.mask,
            c_low=c_low,
            c_high=c_high,
            dual_clip=dual_clip,
            threshold_log_prob=threshold,
        )
        mass = (tok.r * tok.adv.abs()).sum()  # the shares' denominator in this micro-batch
        for key, value in quad.items():
            add = value * mass if key.endswith("_mass") else value
            counts[key] = counts[key] + add if key in counts else add
    total = sum((tok.r * tok.adv.abs()).sum() for tok in toks)
    total = torch.where(total > 0, total, 1.0)
    keys = list(counts)
    values = torch.stack(
        [counts[k] / total if k.endswith("_mass") else counts[k] for k in keys]
    ).tolist()  # one host read
    return {f"quadrant_{k}": float(v) for k, v in zip(keys, values, strict=True)}


def _on_device(value: Tensor | float, device: torch.device) -> Tensor:
    """A 0-dim float64 tensor on `device`; a Python number (a search's sum) is filled in there
    rather than copied from host memory, which would wait for the device queue."""
    if isinstance(value, Tensor):
        return value.detach().to(device=device, dtype=torch.float64)
    return torch.full((), float(value), dtype=torch.float64, device=device)


def _single_pass_bounds(
    logp: Tensor, mb: MicroBatch, spec: LossSpec, group: Any = None, version: int = 0
) -> BapoBounds:
    """One micro-batch is the whole mini-batch: search on the forward we back-propagate."""
    search = spec.search
    acc = search.accumulator(spec.params["dual_clip"])
    acc.add(**_search_inputs(logp, mb, spec, version))
    return acc.solve(search.rho0, group=group)


def behaviour_weights(prox: Tensor, behav: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Decoupled PPO's behaviour weight (AReaL), [b, R], detached: pi_prox / pi_behav per token.

    The clipped ratio pi_theta / pi_prox keeps the update near the proximal policy (the weights
    that first train on the batch, `trainer.old_logprob=recompute`); this factor corrects for the
    tokens having been sampled by pi_behav (older weights). A token whose weight exceeds `cap` is
    dropped (weight 0), as AReaL does, rather than truncated: its correction would dominate the
    batch. Masked positions get 1. The caller multiplies the advantages by it (a positive factor
    per token leaves the side a ratio clips on unchanged)."""
    dtype = accumulate_dtype(torch.promote_types(prox.dtype, behav.dtype))  # float64 testbed
    weight = torch.exp(prox.detach().to(dtype) - behav.detach().to(dtype))
    weight = torch.where(weight <= cap, weight, 0.0)
    return torch.where(mask, weight, 1.0)


def tis_weights(
    mb: MicroBatch, cap: float, *, level: str = "token", mode: str = "truncate"
) -> Tensor:
    """Truncated importance sampling for the train/rollout mismatch (`rollout.tis_cap`), [b, R].

    An engine such as vLLM samples from π_engine, its own kernels' version of the policy; the loss
    takes the trainer's log-probs of the same weights, π_trainer_old, as the behaviour policy. The
    weight min(π_trainer_old(y) / π_engine(y), cap) per token, detached, corrects the gradient
    for sampling from π_engine instead (the numerical mismatch, not policy staleness, which the
    clipped ratio π_θ / π_trainer_old handles). Truncation bounds the variance. Tokens without an
    engine log-prob (the transformers engine) get 1. The caller multiplies the advantages by it:
    a positive factor per token leaves the side a ratio clips on unchanged.

    `level="sequence"`: every token of a sequence gets the sequence's weight, the product of its
    token ratios (`rollout.tis_level`); `mode="mask"` (MIS, `rollout.tis_mode`): a weight over the
    cap becomes 0 (the token, or the whole sequence) instead of the cap; `mode="mask_two_sided"`:
    one below 1 / cap too (verl's rollout_rs token / sequence rejection keeps [1/cap, cap]).
    """
    b, width = mb.mask.shape
    dtype = mb.old_log_prob.dtype  # float32 (float64 only on the testbed, which has no engine's)
    trainer = torch.zeros((b, width), dtype=dtype)
    engine = torch.zeros((b, width), dtype=dtype)
    for i, s in enumerate(mb.samples):
        known = min(len(s.engine_logprobs), len(s.logprobs), width)
        if known:
            trainer[i, :known] = torch.tensor(s.logprobs[:known], dtype=dtype)
            engine[i, :known] = torch.tensor(s.engine_logprobs[:known], dtype=dtype)
    log_ratio = trainer - engine  # 0 where a token has no engine log-prob
    if level == "sequence":  # one weight per sequence: the product of its tokens' ratios
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand(b, width)
    weights = torch.exp(log_ratio)
    if mode == "mask":  # MIS: drop what is over the cap instead of flattening it
        weights = torch.where(weights <= cap, weights, 0.0)
    elif mode == "mask_two_sided":  # verl's rollout_rs rejection: also what is below 1 / cap
        weights = torch.where((weights <= cap) & (weights >= 1.0 / cap), weights, 0.0)
    else:
        weights = weights.clamp(max=cap)
    return torch.where(mb.mask, weights.to(mb.mask.device), 1.0)


def _k3(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(π || π_ref), summed over tokens (non-negative, unbiased)."""
    d = (ref_logp - logp).clamp(-20, 20)
    return torch.where(mask, d.exp() - d - 1, 0.0).sum()


def _grad_norm(model: torch.nn.Module, grad_clip: float | None) -> float:
    """The global gradient norm (clipped to `grad_clip` if set). Under FSDP2 the gradients are
    sharded DTensors: `clip_grad_norm_` reduces over the shards and returns a DTensor."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip is not None else math.inf)
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


MAX_KEYS = ("ratio_max", "staleness_max", "trajectory_max")
SUM_KEYS = (
    "nonfinite_tokens",
    "staleness_sum",
    "active_tokens",
    "trajectory_sum",
    "trajectory_seqs",
    *RHO_SUMS,
)


def _combine(weights: list[tuple[dict[str, Any], float]], tokens: int) -> dict[str, float]:
    """Token-weighted means of per-micro-batch metrics (max for maxima, sums for counts), with a
    single host transfer."""
    if not weights:
        return {}
    keys = [k for k, v in weights[0][0].items() if isinstance(v, (Tensor, float, int))]
    rows = []
    for m, _ in weights:
        rows.append(
            torch.stack([torch.as_tensor(m[k], dtype=torch.float64).detach().cpu() for k in keys])
        )
    table = torch.stack(rows)  # [micro, keys]
    w = torch.tensor([n for _, n in weights], dtype=torch.float64)
    out: dict[str, float] = {}
    values = table.tolist()
    for j, key in enumerate(keys):
        column = [row[j] for row in values]
        if key in MAX_KEYS:
            out[key] = max(column)
        elif key in SUM_KEYS or key.startswith("quadrant_") and not key.endswith("_mass"):
            out[key] = sum(column)
        elif all(c == column[0] for c in column):  # e.g. the bounds of a per-step search: exact
            out[key] = column[0]
        else:
            total = float(w.sum())
            out[key] = sum(c * float(wi) for c, wi in zip(column, w, strict=True)) / max(total, 1.0)
    out["staleness_mean"] = out.pop("staleness_sum", 0.0) / max(tokens, 1)
    seqs = out.pop("trajectory_seqs", 0.0)
    out["trajectory_mean"] = out.pop("trajectory_sum", 0.0) / max(seqs, 1.0)
    return out
