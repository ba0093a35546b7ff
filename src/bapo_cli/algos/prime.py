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

from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.contract import Aggregation, LossHooks, RatioInputs
from bapo_cli.algos.core import REGISTRY, Tensor, surrogate_metrics, tokens
from bapo_cli.algos.params import LossParams, one_of, param, positive

RATIO_AGAINST = ("inference", "old")


@dataclass(frozen=True)
class PrimeParams(LossParams):
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
    )

    def check(self) -> None:
        positive("delta_low", self.delta_low)
        positive("delta_high", self.delta_high)
        positive("kl_tau", self.kl_tau, zero=True)
        positive("adv_tau", self.adv_tau, zero=True)
        one_of("ratio_against", self.ratio_against, RATIO_AGAINST)

    def describe(self) -> str:
        return (
            f"binary-TV mask {self.delta_low:g} / {self.delta_high:g}, no ratio clip, "
            f"{self.kl_tau:g} (log r)^2 on every token, ratio against the "
            f"{'inference' if self.ratio_against == 'inference' else 'behaviour'} log-probs"
        )

    def hooks(self) -> LossHooks:
        return LossHooks(ratio_against=self.ratio_against)


@REGISTRY.register("prime_default", params=PrimeParams)
def prime_default_loss(
    log_prob: Tensor, inputs: RatioInputs, params: PrimeParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """prime-rl's default loss (module docstring). clipfrac_low / clipfrac_high count the masked
    tokens (A < 0 / A > 0, as prime-rl's is_masked_low / is_masked_high); c_low / c_high report
    1 -/+ delta (the thresholds on the ratio scale, as `dppo_tv`). active_tokens counts the
    tokens with gradient: the kept ones with A != 0 and, with kl_tau > 0, every valid token
    whose log-ratio is not 0. The algo group's dual_clip does not apply (prime-rl has none)."""
    old = inputs.old_log_prob
    tok = tokens(log_prob, inputs)
    with torch.no_grad():
        diff = log_prob.detach().exp() - old.detach().exp()
        masked = torch.where(
            tok.adv > 0, diff > float(params.delta_high), diff < -float(params.delta_low)
        )
        masked = masked & tok.valid
        keep = tok.valid & ~masked
    log_ratio = torch.where(tok.valid, log_prob - old, 0.0)  # with grad; 0 off mask
    adv = float(params.adv_tau) * tok.adv
    loss_tok = -torch.where(keep, adv * tok.ratio, 0.0) + float(params.kl_tau) * log_ratio.square()
    bounds = 1.0 - float(params.delta_low), 1.0 + float(params.delta_high)
    clipped = (tok.neg & masked, tok.pos & masked)
    weight = tok.r * float(params.adv_tau)
    metrics = surrogate_metrics(tok, bounds, clipped, weight=weight, active=keep)
    if float(params.kl_tau) > 0:  # the penalty gives every moved token a gradient
        moved = tok.valid & (tok.log_ratio != 0)
        active = ((tok.pos | tok.neg) & keep) | moved
        metrics["active_tokens"] = active.sum(dtype=torch.float64)
    return aggregation(loss_tok, tok.valid), metrics
