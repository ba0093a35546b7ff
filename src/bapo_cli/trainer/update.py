"""One optimizer update on one mini-batch: micro-batches, BAPO's bound search, loss, backward, step.

`optimizer_update` reads as the update does: the mini-batch's normalisers (`Aggregation`), the
per-update hooks a loss asks for (VCPO's re-centred advantages, `trainer/seq_grads.py`; a bound
search over the whole mini-batch), then per micro-batch one forward, its `RatioInputs`
(`trainer/off_policy.py`: what each token's ratio divides by and the weight its advantage
carries), the loss, the backward; then the step. Nothing here is specific to one loss: the loss
is `LossSpec.entry.fn` with the one signature of `algos.contract`, and what it needs of the
trainer is in its `LossHooks`.

The order is the paper's: a loss that searches its bounds (`LossEntry.searches_bounds`, BAPO)
solves them once per optimizer update over the whole mini-batch (all micro-batches of gradient
accumulation), then every micro-batch's loss uses them. With one micro-batch that costs nothing
extra (the forward that feeds the search is the one that is back-propagated); with several, a
no-grad forward over the micro-batches feeds the search first. `algo.bound_scope=microbatch`
skips it by searching per micro-batch, a cheaper approximation named as such, and rank-local
under data parallelism: W ranks then equal one process that trains on all ranks' micro-batches,
each searched on its own, whatever number of micro-batches each rank runs. The exact all-rank
search is `bound_scope=minibatch`.

Nothing in the micro-batch loop reads a tensor to the host (on a GPU each read would stall the
device once per micro-batch): the losses' metrics and bounds stay on the device, and `_step`
reads them once per update (`_host_metrics`), beside the tallies, the gradient norm, the ESS and
the quadrant table (docs/training.md, "Host reads in the update"; tests/train/test_host_reads.py).

Aggregation across micro-batches is exact: each micro-batch's loss is divided by the mini-batch's
token (or sequence) count, not its own, so the accumulated gradient equals the mini-batch loss's.
Every update logs the ESS of its sequences' importance weights, behaviour -> current (`ess`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bapo_cli.algos import diagnostics, losses
from bapo_cli.algos import ess as ess_lib
from bapo_cli.algos.bounds import BapoBounds, rho_from_sums
from bapo_cli.algos.contract import Aggregation, LossHooks
from bapo_cli.algos.core import HostMetric
from bapo_cli.rollout.scoring import MicroBatch, token_logprobs
from bapo_cli.trainer import seq_grads
from bapo_cli.trainer.distributed import DistContext
from bapo_cli.trainer.off_policy import OffPolicy, Prepared, ratio_inputs

Tensor = torch.Tensor


@dataclass(frozen=True)
class LossSpec:
    """The loss and its settings from the algo config, as plain values."""

    name: str  # losses.REGISTRY key
    params: Any  # the loss's params dataclass, validated
    agg: str = "token-mean"
    dual_clip: float | None = 3.0  # algo.dual_clip: the quadrant table's, whatever the loss
    kl_coef: float = 0.0
    # the constant of agg=seq-mean-token-sum-norm (Dr. GRPO): the response budget; None = the
    # widest micro-batch of the update
    norm_len: float | None = None

    @classmethod
    def of(cls, name: str, **options: Any) -> LossSpec:
        """A spec by hand (tests, benchmarks): `agg`, `dual_clip`, `kl_coef`, `norm_len` and the
        loss's params by field name (defaults for the rest)."""
        shared = {k: options.pop(k) for k in ("agg", "kl_coef", "norm_len") if k in options}
        params = losses.REGISTRY.get(name).make_params(**options)
        return cls(name, params, dual_clip=options.get("dual_clip", 3.0), **shared)

    @property
    def entry(self) -> losses.LossEntry:
        return losses.REGISTRY.get(self.name)

    @property
    def hooks(self) -> LossHooks:
        return self.entry.hooks(self.params)

    @property
    def searches_bounds(self) -> bool:
        """The loss chooses its bounds with BAPO's search (see `optimizer_update`)."""
        return self.entry.searches_bounds

    @property
    def per_update_search(self) -> bool:
        """The trainer solves the bounds once per update (`bound_scope=minibatch`)."""
        return self.searches_bounds and self.params.bound_scope == "minibatch"


def loss_spec(algo: Any, max_tokens: int | None = None) -> LossSpec:
    """Algo config dataclass → LossSpec, for any registered loss: the fields of the loss's params
    dataclass are read from the config by name (validated there), plus the shared options.
    `max_tokens` (rollout.max_tokens) is Dr. GRPO's constant normaliser (`LossSpec.norm_len`)."""
    entry = losses.REGISTRY.get(algo.loss)
    return LossSpec(
        entry.name,
        entry.read_params(algo),
        agg=algo.agg,
        dual_clip=algo.dual_clip,
        kl_coef=float(getattr(algo, "kl_coef", 0.0)),
        norm_len=None if max_tokens is None else float(max_tokens),
    )


@dataclass(frozen=True)
class Learner:
    """What an update trains and with what: the policy's `ResponseLogits` (wrapped in DDP or
    sharded by FSDP2 under data parallelism: then the normalisers and BAPO's search cover all
    ranks' tokens), its optimizer, the sampling temperature, the gradient clip, the frozen KL
    reference (algo.kl_coef > 0) and the ranks."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    temperature: float = 1.0
    grad_clip: float | None = None
    ref_model: torch.nn.Module | None = None
    ctx: DistContext = field(default_factory=DistContext)


@dataclass
class UpdateResult:
    """One update's outcome. The optimizer stepped unless `skipped` (a non-finite loss or
    gradient on some rank: a fault, counted toward trainer.max_skipped_steps) or `no_grad` (no
    token carried gradient on any rank, e.g. every token clipped or every advantage 0: nothing
    to learn, not a fault). Either way the weights, the optimizer state and the policy version
    stay as they were: AdamW would move the weights on zero gradients (momentum, weight decay).
    `behaviour`: each micro-batch's behaviour log-probs in this update (a deferred one's scored
    by its first forward here), for its later uses in the step.
    """

    metrics: dict[str, float]
    skipped: bool
    tokens: int
    no_grad: bool = False
    behaviour: list[Tensor] = field(default_factory=list)


# The sums rho and rho_before are the shares of (see `losses`), summed over micro-batches/ranks.
RHO_SUMS = ("rho_pos", "rho_neg", "rho_pos_before", "rho_neg_before")


@dataclass(frozen=True)
class _Update:
    """One update's fixed settings, handed to each of its steps."""

    learner: Learner
    spec: LossSpec
    mode: OffPolicy
    version: int
    aggregation: Aggregation
    all_tokens: float  # response tokens of the mini-batch on every rank


@dataclass
class _Tally:
    """What the micro-batches of one update leave for its step and metrics."""

    # [non-finite losses, active tokens, *RHO_SUMS] summed on the device, read once after the loop
    row: Tensor | None = None
    # (m, tokens) per micro-batch: m's values stay where the loss left them (0-dim device
    # tensors), all read to the host at once after the loop (`_host_metrics`)
    metrics: list[tuple[dict[str, Any], float]] = field(default_factory=list)
    # (log-probs, old log-probs, advantages) per micro-batch: the quadrant table, with the
    # bounds the micro-batch's metrics report
    clipped_with: list[tuple[Tensor, Tensor, Tensor]] = field(default_factory=list)
    log_ws: list[Tensor] = field(default_factory=list)  # sequences' log weights, behav -> current


def optimizer_update(
    learner: Learner,
    spec: LossSpec,
    micro: Sequence[MicroBatch | Prepared],
    version: int,
    mode: OffPolicy | None = None,
) -> UpdateResult:
    """Accumulate gradients over the micro-batches, clip, step. Skips a non-finite step, and an
    update in which no token of any rank carries gradient (see `UpdateResult`). `mode`: the
    off-policy corrections (default: the behaviour policy's ratio, none; the loss's own
    `ratio_against`). rho and rho_before are the shares of the update's mass summed over its
    micro-batches and ranks (the per-step search's sums as they are); `zero_mass` says that sum
    is 0."""
    prepared = [m if isinstance(m, Prepared) else Prepared.of(m) for m in micro]
    mode = mode or OffPolicy(ratio_against=spec.hooks.ratio_against)
    u = _Update(learner, spec, mode, version, *_normalisers(learner.ctx, spec, prepared))
    pre: dict[str, float] = {}
    if spec.hooks.recentre is not None:  # VCPO: re-centre the advantages before the loss
        prepared, pre = seq_grads.recentre(
            learner.model, learner.temperature, prepared, spec.hooks.recentre
        )
    bounds: BapoBounds | None = None
    if spec.per_update_search and len(prepared) > 1:
        bounds, prepared = solve_bounds(u, prepared)
    tally = _Tally()
    for i, p in enumerate(prepared):
        with learner.ctx.no_sync(learner.model, last=i == len(prepared) - 1):
            prepared[i], bounds = _backward(u, p, bounds, tally)
    result = _step(u, tally, bounds, prepared)
    result.metrics.update(pre)
    return result


def _normalisers(
    ctx: DistContext, spec: LossSpec, prepared: Sequence[Prepared]
) -> tuple[Aggregation, float]:
    """The update's aggregation (the mini-batch's token and sequence counts over all ranks, / W
    since DDP averages gradients over ranks) and its token count over all ranks."""
    tokens = sum(p.mb.num_tokens for p in prepared)
    seqs = sum(len(p.mb.samples) for p in prepared)
    all_tokens, all_seqs = ctx.sum([float(tokens), float(seqs)])
    if spec.norm_len is not None:  # a constant: the same on every rank and every update
        norm_len = spec.norm_len
    else:
        (norm_len,) = ctx.max([float(max(p.mb.mask.shape[1] for p in prepared))])
    w = float(ctx.world_size)
    aggregation = Aggregation.checked(
        2,
        spec.agg,
        global_tokens=max(all_tokens, 1.0) / w,
        global_seqs=max(all_seqs, 1.0) / w,
        norm_len=norm_len,
    )
    return aggregation, all_tokens


def solve_bounds(u: _Update, prepared: Sequence[Prepared]) -> tuple[BapoBounds, list[Prepared]]:
    """BAPO's per-update search over every token of the mini-batch (one extra no-grad forward),
    summed over the ranks; the micro-batches with a deferred behaviour forward scored by it."""
    params, out = u.spec.params, []
    acc = params.accumulator(params.dual_clip)
    with torch.no_grad():
        for p in prepared:
            logp, _ = token_logprobs(u.learner.model, p.mb, u.learner.temperature)
            p = p if p.behaviour is not None else p.scored(logp)
            acc.add(**_search_inputs(u, p, logp))
            out.append(p)
    return acc.solve(params.rho0, group=u.learner.ctx.group), out


def _search_inputs(u: _Update, p: Prepared, logp: Tensor) -> dict[str, Tensor]:
    """What one micro-batch adds to the update's bound search (no gradient)."""
    inputs = ratio_inputs(p, u.mode, logp.detach(), u.version)
    return losses.inputs_search(logp.detach(), inputs, u.spec.params)


def _backward(
    u: _Update, p: Prepared, bounds: BapoBounds | None, tally: _Tally
) -> tuple[Prepared, BapoBounds | None]:
    """One micro-batch: forward, its ratio inputs, the loss (+ the KL term), backward; what it
    leaves for the update's metrics goes into `tally`."""
    mb, learner = p.mb, u.learner
    logp, entropy = token_logprobs(learner.model, mb, learner.temperature, entropy=True)
    p = p if p.behaviour is not None else p.scored(logp.detach())  # deferred: these weights
    params = u.spec.params
    if u.spec.per_update_search:
        if bounds is None:  # the mini-batch is this one micro-batch: search on this forward
            acc = params.accumulator(params.dual_clip)
            acc.add(**_search_inputs(u, p, logp))
            bounds = acc.solve(params.rho0, group=learner.ctx.group)
        params = dataclasses.replace(params, bounds=bounds)
    inputs = ratio_inputs(p, u.mode, logp, u.version)
    tally.log_ws.append(ess_lib.sequence_log_weights(logp, p.behaviour, mb.mask))
    # bound_scope=microbatch: the loss searches this rank's micro-batch alone (no collective)
    loss, m = u.spec.entry.fn(logp, inputs, params, u.aggregation)
    loss = _with_kl(u, mb, logp, loss, m)
    # a non-finite loss back-propagates non-finite gradients: the step is skipped after the
    # loop (every rank keeps going, so DDP ranks stay in step)
    row = [~torch.isfinite(loss.detach()), m["active_tokens"], *(m[k] for k in RHO_SUMS)]
    row_t = torch.stack([_on_device(v, loss.device) for v in row])
    tally.row = row_t if tally.row is None else tally.row + row_t
    loss.backward()
    m["entropy"] = torch.where(mb.mask, entropy, 0.0).sum() / max(mb.num_tokens, 1)
    tally.clipped_with.append((logp.detach(), inputs.old_log_prob.detach(), inputs.advantages))
    m.update(_staleness(mb, u.version))
    tally.metrics.append((m, float(mb.num_tokens)))
    return p, bounds


def _with_kl(u: _Update, mb: MicroBatch, logp: Tensor, loss: Tensor, m: dict) -> Tensor:
    """The loss plus algo.kl_coef times the k3 KL to the reference policy (when it has one)."""
    if not (u.spec.kl_coef > 0 and u.learner.ref_model is not None):
        return loss
    with torch.no_grad():
        ref_logp, _ = token_logprobs(u.learner.ref_model, mb, u.learner.temperature)
    kl = _k3(logp, ref_logp, mb.mask)
    m["ref_kl"] = kl.detach() / max(mb.num_tokens, 1)
    return loss + u.spec.kl_coef * kl / u.aggregation.global_tokens


def _staleness(mb: MicroBatch, version: int) -> dict[str, Tensor]:
    """Token and response staleness in policy versions; a response's staleness is its oldest
    token's (a response continued by newer weights is as stale as its start)."""
    stale = torch.where(mb.mask, (version - mb.versions).float(), 0.0)
    oldest = stale.max(dim=1).values
    return {
        "staleness_sum": stale.sum(),
        "staleness_max": stale.max(),
        "trajectory_sum": oldest.sum(),
        "trajectory_seqs": mb.mask.any(dim=1).sum().float(),
        "trajectory_max": oldest.max(),
    }


def _step(
    u: _Update, tally: _Tally, bounds: BapoBounds | None, prepared: Sequence[Prepared]
) -> UpdateResult:
    """After the micro-batches: the gradient norm, one all-reduce of the tallies, the step (or
    not: see `UpdateResult`) at the learning rate the loss's hooks scale, and the metrics."""
    learner, spec = u.learner, u.spec
    grad_norm = _grad_norm(learner.model, learner.grad_clip)
    local = tally.row.tolist() if tally.row is not None else [0.0] * (2 + len(RHO_SUMS))
    searched = spec.per_update_search and bounds is not None  # summed over all ranks already
    if searched:
        local[2:] = [0.0] * len(RHO_SUMS)
    # one all-reduce: any rank non-finite → all skip; no active token on any rank → all skip
    nonfinite, active, *rho_sums = learner.ctx.sum(local)
    if searched:
        rho_sums = [bounds.pos, bounds.neg, bounds.pos_before, bounds.neg_before]
    skipped = nonfinite > 0 or not math.isfinite(grad_norm)
    kl_grad = spec.kl_coef > 0 and learner.ref_model is not None and u.all_tokens > 0
    no_grad = not skipped and active == 0 and not kl_grad
    ess = _ess(tally.log_ws, learner.ctx)
    lr_scale = spec.hooks.lr_scale
    scale = lr_scale(ess) if lr_scale is not None else None
    if not (skipped or no_grad):
        _optimizer_step(learner.optimizer, scale)
    learner.optimizer.zero_grad(set_to_none=True)
    tokens = sum(p.mb.num_tokens for p in prepared)
    host = _host_metrics([m for m, _ in tally.metrics])  # one read of every micro-batch's
    metrics = _combine(host, [n for _, n in tally.metrics], tokens)
    metrics["ess"] = ess
    if scale is not None:
        metrics["lr_scale"] = scale
    bounds_used = [(m["c_low"], m["c_high"]) for m in host]
    metrics.update(_quadrants(prepared, tally.clipped_with, bounds_used, spec.dual_clip))
    metrics["grad_norm"] = grad_norm
    metrics.update(_rho_metrics(rho_sums))
    metrics["search_moved"] = float(metrics.get("search_steps", 0.0) > 0)
    metrics["active_tokens"] = active
    metrics["no_grad"] = float(no_grad)
    behaviour = [p.behaviour for p in prepared]
    return UpdateResult(metrics, skipped, tokens, no_grad, behaviour)


def _rho_metrics(rho_sums: Sequence[float]) -> dict[str, float]:
    """The update's rho and rho_before from their sums (`RHO_SUMS`), and whether it had mass."""
    pos, neg, pos_before, neg_before = rho_sums
    return {
        **dict(zip(RHO_SUMS, rho_sums, strict=True)),
        "rho": rho_from_sums(pos, neg),
        "rho_before": rho_from_sums(pos_before, neg_before),
        "zero_mass": float(pos + neg == 0),
    }


def _ess(log_ws: Sequence[Tensor], ctx: DistContext) -> float:
    """ESS / N of the update's sequences over all ranks (`algos.ess`): the largest finite log
    weight and then the shifted sums are all-reduced, so the value is the whole update's."""
    # one transfer of all micro-batches' weights
    log_w = torch.cat(log_ws).cpu() if log_ws else torch.zeros(0, dtype=torch.float64)
    finite = log_w[torch.isfinite(log_w)]
    (top,) = ctx.max([float(finite.max()) if finite.numel() else -math.inf])
    return ess_lib.ess_from_sums(*ctx.sum(ess_lib.weight_sums(log_w, top).tolist()))


def _optimizer_step(optimizer: torch.optim.Optimizer, scale: float | None) -> None:
    """optimizer.step(), with every group's learning rate times `scale` for this step only (a
    loss's `lr_scale` hook; the schedule's own lr is put back)."""
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
    prepared: Sequence[Prepared],
    clipped_with: Sequence[tuple[Tensor, Tensor, Tensor]],
    bounds: Sequence[tuple[float, float]],
    dual_clip: float | None,
) -> dict[str, float]:
    """The Entropy-Clip quadrant table of the whole update, as `diagnostics.quadrant_table` gives
    it for one micro-batch holding the mini-batch: high/low probability split at the mean log-prob
    of all its valid tokens, counts summed, mass shares of the whole update's mass r|A|. (Per
    micro-batch thresholds and shares would make the table depend on the split.)"""
    if not prepared:
        return {}
    masks = [p.mb.mask for p in prepared]
    toks = [
        losses.prepare_tokens(logp, old, adv, mask)
        for mask, (logp, old, adv) in zip(masks, clipped_with, strict=True)
    ]
    lp_sum = sum(
        torch.where(t.valid, lp, 0.0).sum() for t, (lp, *_) in zip(toks, clipped_with, strict=True)
    )
    threshold = lp_sum / sum(t.n_valid for t in toks).clamp(min=1)
    counts: dict[str, Tensor] = {}
    parts = zip(masks, toks, clipped_with, bounds, strict=True)
    for mask, tok, (logp, old, adv), micro_bounds in parts:
        quad = diagnostics.quadrant_table(
            logp,
            old,
            adv,
            mask,
            bounds=micro_bounds,
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


def _host_metrics(per_micro: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """Each micro-batch's metrics as Python floats (the keys of the first that hold a number, a
    tensor or a `HostMetric`), the tensors read in one transfer per device: the update's one
    host read of them, after its micro-batches, never one per micro-batch."""
    if not per_micro:
        return []
    first = per_micro[0]
    keys = [k for k, v in first.items() if isinstance(v, (Tensor, float, int, HostMetric))]
    out: list[dict[str, float]] = [dict.fromkeys(keys, 0.0) for _ in per_micro]
    pending: dict[torch.device, list[tuple[int, str, Tensor]]] = {}
    for i, m in enumerate(per_micro):
        for key in keys:
            value = m[key].value if isinstance(m[key], HostMetric) else m[key]
            if isinstance(value, Tensor):
                value = value.detach().to(torch.float64)
                pending.setdefault(value.device, []).append((i, key, value))
            else:
                out[i][key] = float(value)
    for items in pending.values():
        read = torch.stack([t for _, _, t in items]).tolist()
        for (i, key, _), number in zip(items, read, strict=True):
            late = per_micro[i][key]
            out[i][key] = late.fn(number) if isinstance(late, HostMetric) else number
    return out


def _combine(
    per_micro: Sequence[dict[str, float]], weights: Sequence[float], tokens: int
) -> dict[str, float]:
    """Token-weighted means of per-micro-batch metrics (max for maxima, sums for counts), on the
    host (`_host_metrics` read them)."""
    if not per_micro:
        return {}
    out: dict[str, float] = {}
    total = sum(weights)
    for key in per_micro[0]:
        column = [m[key] for m in per_micro]
        if key in MAX_KEYS:
            out[key] = max(column)
        elif key in SUM_KEYS or key.startswith("quadrant_") and not key.endswith("_mass"):
            out[key] = sum(column)
        elif all(c == column[0] for c in column):  # e.g. the bounds of a per-step search: exact
            out[key] = column[0]
        else:
            out[key] = sum(c * w for c, w in zip(column, weights, strict=True)) / max(total, 1.0)
    out["staleness_mean"] = out.pop("staleness_sum", 0.0) / max(tokens, 1)
    seqs = out.pop("trajectory_seqs", 0.0)
    out["trajectory_mean"] = out.pop("trajectory_sum", 0.0) / max(seqs, 1.0)
    return out
