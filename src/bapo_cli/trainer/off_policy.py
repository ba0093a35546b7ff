"""What one token's ratio divides by and what weight its advantage carries, decided in one place.

`ratio_inputs(prepared, mode, logp, version)` is a pure function from a collated micro-batch (and
the log-probs the trainer measured for it) and the off-policy mode of the config to the loss's
frozen `RatioInputs`. Read top to bottom it answers, per token:

1. The ratio's denominator: the behaviour policy (`trainer.old_logprob=behaviour`, the log-probs
   recorded at sampling, or this update's own forward where scoring was deferred to it), the
   proximal policy (`recompute`: a no-grad forward at the micro-batch's first use;
   `loglinear`: A-3PO's interpolation, `algos.proximal`), or the engine's own log-probs (a loss
   whose hooks say `ratio_against="inference"`, prime-rl's default).
2. The weight its advantage carries, multiplied in this order: TIS / MIS (`rollout.tis_cap`,
   the trainer's over the engine's log-probs, per token or per sequence, truncated or masked),
   the off-policy sequence or token mask (`rollout.seq_mask`, `algos.correction`: 0 or 1; geo,
   opsm, IcePop's band, AReaL's KPop), decoupled PPO's behaviour weight pi_prox / pi_behav
   (`algo.behav_weight_cap`, under a proximal policy).
3. Which tokens count: the collated mask (the normaliser is the update's, `trainer/update.py`).
   A masked token keeps its place in the normaliser at weight 0 (docs/algorithms.md); a loss
   that takes tokens out of it (M2PO) does so itself (`Aggregation.narrowed`).

The MicroBatch is never changed: what is measured about it (a deferred behaviour forward, the
proximal forward, opsm's forward with the current weights, the engine's log-probs as tensors)
lives in a `Prepared`, made once per use by `trainer/optimize.py`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos import correction
from bapo_cli.algos.contract import LossHooks, RatioInputs
from bapo_cli.algos.proximal import loglinear_prox
from bapo_cli.rollout.logprobs import accumulate_dtype
from bapo_cli.rollout.scoring import MicroBatch

Tensor = torch.Tensor
ENGINE_MASKS = ("geo", "icepop")  # the rollout.seq_mask kinds that read the engine's log-probs

__all__ = [
    "EngineLogProbs",
    "OffPolicy",
    "Prepared",
    "behaviour_weights",
    "masked_sequences",
    "ratio_inputs",
    "tis_weights",
]


@dataclass(frozen=True)
class OffPolicy:
    """The off-policy corrections the config asks for (each validated there), as plain values."""

    old_logprob: str = "behaviour"  # trainer.old_logprob: behaviour | recompute | loglinear
    tis_cap: float | None = None  # rollout.tis_cap (None: no TIS / MIS)
    tis_level: str = "token"  # rollout.tis_level: token | sequence
    tis_mode: str = "truncate"  # rollout.tis_mode: truncate | mask | mask_two_sided
    seq_mask: str = "none"  # rollout.seq_mask: none | geo | opsm | icepop | kpop
    seq_mask_threshold: float | None = None
    seq_mask_low: float | None = None  # icepop's lower bound (None: 1 / threshold)
    behav_cap: float | None = None  # algo.behav_weight_cap (under a proximal policy)
    ratio_against: str = "old"  # the loss's hook: old | inference (the engine's log-probs)

    @classmethod
    def of(cls, cfg: Any, hooks: LossHooks) -> OffPolicy:
        """From a TrainConfig (trainer.old_logprob, rollout's TIS and sequence mask, the algo's
        behaviour weight cap) and what the loss asks (`LossHooks.ratio_against`)."""
        rollout = cfg.rollout
        return cls(
            old_logprob=cfg.trainer.old_logprob,
            tis_cap=rollout.tis_cap,
            tis_level=rollout.tis_level,
            tis_mode=rollout.tis_mode,
            seq_mask=rollout.seq_mask,
            seq_mask_threshold=rollout.seq_mask_threshold,
            seq_mask_low=rollout.seq_mask_low,
            behav_cap=getattr(cfg.algo, "behav_weight_cap", None),
            ratio_against=hooks.ratio_against,
        )

    @property
    def reads_engine(self) -> bool:
        """Whether some correction reads the engine's own log-probs."""
        return self.tis_cap is not None or self.seq_mask in ENGINE_MASKS or self.inference

    @property
    def inference(self) -> bool:
        return self.ratio_against == "inference"


@dataclass(frozen=True, eq=False)
class EngineLogProbs:
    """The engine's own log-probs of a micro-batch's tokens (vLLM reports them; 0 where a token
    has none), as tensors on the device, made from the samples before an update (copied there
    then, not inside the update's micro-batch loop, where a copy would wait for the device)."""

    log_ratio: Tensor  # [b, R]: log pi_trainer - log pi_engine where both are known, else 0
    log_probs: Tensor  # [b, R] on the device: the engine's log-probs
    known: Tensor  # [b, R] bool on the device: the tokens that have one

    @classmethod
    def of(cls, mb: MicroBatch) -> EngineLogProbs:
        b, width = mb.mask.shape
        dtype = mb.old_log_prob.dtype  # float32 (float64 only on the testbed, without an engine)
        trainer, engine = torch.zeros((b, width), dtype=dtype), torch.zeros((b, width), dtype=dtype)
        own = torch.zeros((b, width), dtype=dtype)
        known = torch.zeros((b, width), dtype=torch.bool)
        for i, s in enumerate(mb.samples):
            both = min(len(s.engine_logprobs), len(s.logprobs), width)
            if both:
                trainer[i, :both] = torch.tensor(s.logprobs[:both], dtype=dtype)
                engine[i, :both] = torch.tensor(s.engine_logprobs[:both], dtype=dtype)
            has = min(len(s.engine_logprobs), width)
            own[i, :has] = torch.tensor(s.engine_logprobs[:has], dtype=dtype)
            known[i, :has] = True
        device = mb.mask.device
        return cls((trainer - engine).to(device), own.to(device), known.to(device))


@dataclass(frozen=True, eq=False)
class Prepared:
    """One micro-batch ready for one update: the collated batch and what the trainer measured
    for it before the update (`trainer/optimize.py` makes it, once per use)."""

    mb: MicroBatch
    advantages: Tensor  # [b] A_i: collated, or re-centred for this update (`LossHooks.recentre`)
    behaviour: Tensor | None  # pi_behav's log-probs; None until this update's first forward
    deferred: bool = False  # scoring was deferred to this update: its first forward is pi_behav
    proximal: Tensor | None = None  # recompute: the no-grad forward at the first use
    current: Tensor | None = None  # seq_mask=opsm: the no-grad forward of this update's weights
    engine: EngineLogProbs | None = None  # where a correction reads the engine's log-probs
    reused: bool = False  # an earlier update of this step used it

    @classmethod
    def of(cls, mb: MicroBatch) -> Prepared:
        """A collated micro-batch as it is: its advantages, its behaviour log-probs."""
        return cls(mb, mb.advantages, mb.old_log_prob)

    def scored(self, logp: Tensor) -> Prepared:
        """This update's first forward as the behaviour log-probs (deferred scoring: the weights
        that sampled the tokens are the ones training on them)."""
        return dataclasses.replace(self, behaviour=logp)


def ratio_inputs(p: Prepared, mode: OffPolicy, logp: Tensor, version: int) -> RatioInputs:
    """The loss's inputs for micro-batch `p` at policy version `version`, given this update's
    forward `logp` (read by loglinear and, for deferred scoring, as the behaviour policy)."""
    mask = p.mb.mask
    behaviour = p.behaviour if p.behaviour is not None else logp.detach()
    if mode.inference:  # the engine's own log-probs where the sample has them
        old, behav = torch.where(p.engine.known, p.engine.log_probs, behaviour), None
    elif mode.old_logprob == "recompute":  # the weights that first trained on the batch
        old, behav = p.proximal, behaviour
    elif mode.old_logprob == "loglinear":  # A-3PO: interpolated from this forward, no extra one
        stale = torch.where(mask, version - p.mb.versions, 0)
        old, behav = loglinear_prox(behaviour, logp, stale), behaviour
    else:
        old, behav = behaviour, None
    adv, weights, _ = _rollout_corrections(p, mode)
    if mode.behav_cap is not None and behav is not None:  # decoupled PPO: pi_prox / pi_behav
        w = behaviour_weights(old, behav, mask, mode.behav_cap)
        adv = (adv if adv.dim() == 2 else adv[:, None]) * w
        weights = w if weights is None else weights * w
    return RatioInputs(old, adv, mask, behav_log_prob=behav, weights=weights)


def masked_sequences(p: Prepared, mode: OffPolicy) -> Tensor | None:
    """Under rollout.seq_mask, how many of the micro-batch's sequences the mask sets to 0 at
    this use (a 0-dim device tensor: no host sync), else None."""
    keep = _rollout_corrections(p, mode)[2]
    if keep is None:
        return None
    return (~keep & p.mb.mask.any(dim=-1)).sum()


def _rollout_corrections(
    p: Prepared, mode: OffPolicy
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The rollout group's corrections: (A_i times the TIS/MIS weight and the sequence mask,
    that weight [b, R] or None, the sequences the mask kept [b] or None)."""
    adv, weights, keep = p.advantages, None, None
    mask = p.mb.mask
    if mode.tis_cap is not None:  # engine/trainer mismatch: per-token weights
        weights = _tis(p.engine.log_ratio, mask, mode.tis_cap, mode.tis_level, mode.tis_mode)
        adv = adv[:, None] * weights
    if mode.seq_mask != "none":  # off-policy masking: rejected sequences or tokens get 0
        tokens = correction.sequence_keep(
            mode.seq_mask,
            mode.seq_mask_threshold,
            adv,
            mask,
            _seq_log_ratio(p, mode),
            low=mode.seq_mask_low,
            log_q=p.behaviour if mode.seq_mask == "kpop" else None,
        )
        adv, keep = correction.apply_keep(adv, tokens, mask)
        kept = tokens if tokens.dim() == 2 else tokens[:, None].expand(mask.shape)
        factor = torch.where(mask, kept, True).to(adv.dtype)  # 1 off the mask, as TIS's
        weights = factor if weights is None else weights * factor
    return adv, weights, keep


def _seq_log_ratio(p: Prepared, mode: OffPolicy) -> Tensor:
    """The per-token log-ratio the mask reads: geo and icepop, the trainer's over the engine's
    log-probs (as TIS; 0 for a token without an engine log-prob); kpop, the proximal policy's
    over the behaviour one (trainer.old_logprob=recompute: measured before the update); opsm,
    pi_old (the behaviour policy, or once a previous update of this step recomputed it, the
    proximal one) over this update's weights, 0 when scoring is deferred to this update (pi_old
    is these weights)."""
    mask = p.mb.mask
    if mode.seq_mask in ENGINE_MASKS:
        return _tis(p.engine.log_ratio, mask, math.inf, "token", "truncate").log()
    if mode.seq_mask == "kpop":
        if p.proximal is None or p.behaviour is None:
            raise ValueError(
                "rollout.seq_mask=kpop needs the proximal and behaviour log-probs before the "
                "update (trainer.old_logprob=recompute)"
            )
        return p.proximal - p.behaviour
    if p.deferred:
        return torch.zeros(mask.shape, device=mask.device)
    old = p.proximal if mode.old_logprob == "recompute" and p.reused else p.behaviour
    return old - p.current


def tis_weights(
    mb: MicroBatch, cap: float, *, level: str = "token", mode: str = "truncate"
) -> Tensor:
    """Truncated importance sampling for the train/rollout mismatch (`rollout.tis_cap`), [b, R].

    An engine such as vLLM samples from pi_engine, its own kernels' version of the policy; the
    loss takes the trainer's log-probs of the same weights, pi_trainer_old, as the behaviour
    policy. The weight min(pi_trainer_old(y) / pi_engine(y), cap) per token, detached, corrects
    the gradient for sampling from pi_engine instead (the numerical mismatch, not policy
    staleness, which the clipped ratio handles). Truncation bounds the variance. Tokens without
    an engine log-prob (the transformers engine) get 1.

    `level="sequence"`: every token of a sequence gets the sequence's weight, the product of its
    token ratios (`rollout.tis_level`); `mode="mask"` (MIS, `rollout.tis_mode`): a weight over the
    cap becomes 0 (the token, or the whole sequence) instead of the cap; `mode="mask_two_sided"`:
    one below 1 / cap too (verl's rollout_rs token / sequence rejection keeps [1/cap, cap]).
    """
    return _tis(EngineLogProbs.of(mb).log_ratio, mb.mask, cap, level, mode)


def _tis(log_ratio: Tensor, mask: Tensor, cap: float, level: str, mode: str) -> Tensor:
    """`tis_weights` from the log-ratios of `EngineLogProbs` (0 where a token has none)."""
    if level == "sequence":  # one weight per sequence: the product of its tokens' ratios
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand(log_ratio.shape)
    weights = torch.exp(log_ratio)
    if mode == "mask":  # MIS: drop what is over the cap instead of flattening it
        weights = torch.where(weights <= cap, weights, 0.0)
    elif mode == "mask_two_sided":  # verl's rollout_rs rejection: also what is below 1 / cap
        weights = torch.where((weights <= cap) & (weights >= 1.0 / cap), weights, 0.0)
    else:
        weights = weights.clamp(max=cap)
    return torch.where(mask, weights.to(mask.device), 1.0)


def behaviour_weights(prox: Tensor, behav: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Decoupled PPO's behaviour weight (AReaL), [b, R], detached: pi_prox / pi_behav per token.

    The clipped ratio pi_theta / pi_prox keeps the update near the proximal policy; this factor
    corrects for the tokens having been sampled by pi_behav (older weights). A token whose
    weight exceeds `cap` is dropped (weight 0), as AReaL does, rather than truncated: its
    correction would dominate the batch. Masked positions get 1. A positive factor per token
    leaves the side a ratio clips on unchanged."""
    dtype = accumulate_dtype(torch.promote_types(prox.dtype, behav.dtype))  # float64 testbed
    weight = torch.exp(prox.detach().to(dtype) - behav.detach().to(dtype))
    weight = torch.where(weight <= cap, weight, 0.0)
    return torch.where(mask, weight, 1.0)
