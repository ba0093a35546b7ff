"""prime-rl's default loss (`prime_default`): DPPO's binary-TV mask plus Kimi-K2.5's squared
log-ratio penalty, no ratio clip. Written after `default_loss_fn` in prime-rl's
`src/prime_rl/trainer/rl/loss.py` ("DPPO+KL loss ... DPPO-Binary TV Loss (arXiv 2602.04879),
Kimi-K2.5 KL Loss (arXiv 2602.02276)") and its `DefaultLossConfig` (`src/prime_rl/configs/
trainer.py`: dppo_mask_low = dppo_mask_high = 0.2, adv_tau = 1, kl_tau = 1e-3).

With r_t = pi_theta(y_t) / pi_inf(y_t) (not detached; pi_inf the inference engine's log-probs,
which the trainer passes as old_log_prob for this loss) and p, q the two probabilities:

    masked_t = A > 0 and p - q > delta_high,  or  A <= 0 and p - q < -delta_low
    loss_t   = -[not masked_t] * A_t * r_t + tau * (log r_t)^2

over every loss token, the KL term on masked tokens too (prime-rl's `masks.rl`), summed and
divided by the global loss-token count (prime-rl's `rl_loss_scale`): `agg=token-mean` with the
trainer's mini-batch count. A kept token's gradient is -A r grad log pi + 2 tau log r grad log pi;
a masked token keeps only the penalty's, which pulls it back toward pi_inf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.core import (
    REGISTRY,
    Aggregation,
    Tensor,
    prepare_tokens,
    surrogate_metrics,
)
from bapo_cli.algos.params import ParamError, number, one_of, param

RATIO_AGAINST = ("inference", "old")


def _positive(name: str, value: Any, *, zero: bool = False) -> None:
    v = number(name, value)
    if not (0.0 <= v < math.inf if zero else 0.0 < v < math.inf):
        raise ParamError(name, value, f"must be a finite number {'>=' if zero else '>'} 0")


@dataclass(frozen=True)
class PrimeParams:
    """prime-rl's default loss: binary-TV mask, squared log-ratio penalty, no ratio clip."""

    delta_low: float = param(
        0.2, "TV mask for A <= 0: masked once pi_inf - pi_theta > delta_low (prime-rl: 0.2)"
    )
    delta_high: float = param(
        0.2, "TV mask for A > 0: masked once pi_theta - pi_inf > delta_high (prime-rl: 0.2)"
    )
    kl_tau: float = param(
        1e-3, "weight of (log r)^2 on every loss token, masked ones included (prime-rl: 1e-3)"
    )
    adv_tau: float = param(1.0, "scale of the advantages (prime-rl: 1)")
    ratio_against: str = param(
        "inference",
        "inference: the ratio's denominator is the engine's log-probs where the sample has them "
        "(prime-rl), else the behaviour log-probs; old: the trainer's old_log_prob as every "
        "other loss",
        trainer=True,
    )

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        _positive("delta_low", self.delta_low)
        _positive("delta_high", self.delta_high)
        _positive("kl_tau", self.kl_tau, zero=True)
        _positive("adv_tau", self.adv_tau, zero=True)
        one_of("ratio_against", self.ratio_against, RATIO_AGAINST)

    def describe(self) -> str:
        return (
            f"binary-TV mask {self.delta_low:g} / {self.delta_high:g}, no ratio clip, "
            f"{self.kl_tau:g} (log r)^2 on every token, ratio against the "
            f"{'inference' if self.ratio_against == 'inference' else 'behaviour'} log-probs"
        )


@REGISTRY.register("prime_default", params=PrimeParams)
def prime_default_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    delta_low: float = PrimeParams.delta_low,
    delta_high: float = PrimeParams.delta_high,
    kl_tau: float = PrimeParams.kl_tau,
    adv_tau: float = PrimeParams.adv_tau,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """prime-rl's default loss (module docstring). clipfrac_low / clipfrac_high count the masked
    tokens (A < 0 / A > 0, as prime-rl's is_masked_low / is_masked_high); c_low / c_high report
    1 -/+ delta (the thresholds on the ratio scale, as `dppo_tv`). active_tokens counts the
    tokens with gradient: the kept ones with A != 0 and, with kl_tau > 0, every valid token
    whose log-ratio is not 0. dual_clip is not used (prime-rl has none)."""
    PrimeParams(delta_low=delta_low, delta_high=delta_high, kl_tau=kl_tau, adv_tau=adv_tau)
    aggregation = Aggregation.checked(log_prob.dim(), agg, global_tokens, global_seqs, norm_len)
    tok = prepare_tokens(log_prob, old_log_prob, advantages, mask)
    with torch.no_grad():
        diff = log_prob.detach().exp() - old_log_prob.detach().exp()
        masked = torch.where(tok.adv > 0, diff > float(delta_high), diff < -float(delta_low))
        masked = masked & tok.valid
        keep = tok.valid & ~masked
    log_ratio = torch.where(tok.valid, log_prob - old_log_prob, 0.0)  # with grad; 0 off mask
    adv = float(adv_tau) * tok.adv
    loss_tok = -torch.where(keep, adv * tok.ratio, 0.0) + float(kl_tau) * log_ratio.square()
    loss = aggregation(loss_tok, tok.valid)
    metrics = surrogate_metrics(
        tok,
        ratio=tok.r,
        weight=tok.r * float(adv_tau),
        active_pos=tok.pos & keep,
        active_neg=tok.neg & keep,
        clipped_low=tok.neg & masked,
        clipped_high=tok.pos & masked,
        c_low=1.0 - float(delta_low),
        c_high=1.0 + float(delta_high),
    )
    if float(kl_tau) > 0:  # the penalty gives every moved token a gradient
        moved = tok.valid & (tok.log_ratio != 0)
        active = ((tok.pos | tok.neg) & keep) | moved
        metrics["active_tokens"] = active.sum(dtype=torch.float64)
    return loss, metrics
