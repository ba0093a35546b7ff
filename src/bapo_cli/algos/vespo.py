"""VESPO (Variational Sequence-Level Soft Policy Optimization, arXiv 2602.10693): no clip at all;
each sequence's policy gradient is scaled by a smooth, asymmetric function of its whole
importance weight (`vespo`).

    log w_i = sum_t clamp(log r_{i,t}, -20, 20), clamped to [log 1e-8, 20]   (no length mean)
    phi(w)  = e^lambda * w^k * e^(-lambda w)     (a Gamma kernel: phi(1) = 1, peak at k / lambda)
    loss_t  = -sg(phi(w_i)) * A_i * log pi_theta(y_t)
    (k, lambda) = (k_pos, lambda_pos) = (2, 3) for A >= 0,  (k_neg, lambda_neg) = (3, 2) for A < 0

How it differs: PPO / GRPO clip each token's ratio and drop the gradient of a token past a bound;
GSPO clips the length-normalised sequence ratio. VESPO keeps every sequence's gradient direction
(REINFORCE's) and only shrinks its size: phi -> 0 as w -> 0 (a sequence the current policy has
left) and exponentially as w grows (a sequence it now over-weights), smoothly, with phi(1) = 1 so
on-policy data is plain REINFORCE. Positive sequences peak below 1 (k/lambda = 2/3) and fall
faster above it than negative ones (peak 3/2). The paper reports stability up to 64 versions
stale.

Guards: w is computed in log space and clamped first (TRL's: token log-ratios to [-20, 20], the
sequence's to [log 1e-8, 20]), so phi = exp(lambda + k log w - lambda w) never overflows (at
log w = 20 it underflows to 0); a non-finite phi would be 0 (TRL's nan_to_num); non-finite tokens
are out of the mask (`core.prepare_tokens`) and of their sequence's sum.

Source: TRL's `loss_type="vespo"` (huggingface/trl@f2cd577, `trl/trainer/grpo_trainer.py`,
`GRPOTrainer.get_gamma_weights` and `_compute_loss`; TRL PR #5199), defaults from
`GRPOConfig.vespo_k_pos` ... `vespo_lambda_neg`; normalised as TRL's vespo branch, by the global
token count (`agg=token-mean`). One departure, a choice: TRL folds vLLM's token-level IS ratios
(pi_old / pi_sampler, truncated) into log w and multiplies nothing else; here, as for every loss,
`rollout.tis_cap` weights each token's advantage (`RatioInputs.advantages`) and w is
pi_theta / pi_old alone. Per-token advantages choose (k, lambda) by their own sign (a sequence's
sign wherever its weight is not 0). The paper itself was not readable here: the formula is
TRL's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.contract import Aggregation, RatioInputs
from bapo_cli.algos.core import REGISTRY, HostMetric, Tensor, surrogate_metrics, tokens
from bapo_cli.algos.params import LossParams, param, positive

LOG_W_MIN = math.log(1e-8)  # TRL's floor of log w (so log w needs no second clamp)
LOG_R_MAX = 20.0  # TRL's bound on a token's |log r| and on log w


@dataclass(frozen=True)
class VESPOParams(LossParams):
    """VESPO: the sequence weight w = prod_t r_t through phi(w) = e^lambda w^k e^(-lambda w)."""

    k_pos: float = param(2.0, "phi's power k for A >= 0 (TRL's vespo_k_pos, the paper's c1: 2)")
    lambda_pos: float = param(
        3.0, "phi's decay lambda for A >= 0 (TRL's vespo_lambda_pos, the paper's c2: 3)"
    )
    k_neg: float = param(3.0, "phi's power k for A < 0 (TRL's vespo_k_neg: 3)")
    lambda_neg: float = param(2.0, "phi's decay lambda for A < 0 (TRL's vespo_lambda_neg: 2)")

    def check(self) -> None:
        for name in ("k_pos", "k_neg"):
            positive(name, getattr(self, name), zero=True)
        for name in ("lambda_pos", "lambda_neg"):
            positive(name, getattr(self, name))

    def describe(self) -> str:
        return (
            f"no clip; sequence weight phi(w) = e^l w^k e^(-l w), (k, l) = "
            f"({self.k_pos:g}, {self.lambda_pos:g}) for A >= 0, "
            f"({self.k_neg:g}, {self.lambda_neg:g}) for A < 0"
        )


def log_sequence_weight(log_ratio: Tensor, valid: Tensor) -> Tensor:
    """log w_i per sequence [B, 1] (float64): the sum of its valid tokens' log-ratios, each
    clamped to [-20, 20], the sum clamped to [log 1e-8, 20] (TRL's `get_gamma_weights`)."""
    per_token = torch.where(valid, log_ratio.double().clamp(-LOG_R_MAX, LOG_R_MAX), 0.0)
    return per_token.sum(dim=-1, keepdim=True).clamp(LOG_W_MIN, LOG_R_MAX)


def gamma_weight(log_w: Tensor, k: Tensor | float, lam: Tensor | float) -> Tensor:
    """phi(w) = exp(lambda + k log w - lambda w), from log w (float64); 0 where not finite."""
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def weight_bound(top: float) -> float:
    """max(w_max, 1) from the largest log weight of the call (1 when there is none)."""
    return max(math.exp(top), 1.0) if math.isfinite(top) else 1.0


@REGISTRY.register("vespo", params=VESPOParams)
def vespo_loss(
    log_prob: Tensor, inputs: RatioInputs, params: VESPOParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """VESPO (module docstring): every valid token with A != 0 carries the gradient
    -phi(w_i) A grad log pi. No bound clips anything: c_low reports 0, c_high the largest
    sequence weight w_i of the call (as a ratio's bound would read), the clip fractions 0; the
    gradient weight of rho is phi. Needs [B, T] tensors (w is a sequence's)."""
    if log_prob.dim() != 2:
        raise ValueError(
            f"vespo needs [B, T] tensors (its weight is a sequence's), got {tuple(log_prob.shape)}"
        )
    tok = tokens(log_prob, inputs)
    with torch.no_grad():
        log_w = log_sequence_weight(tok.log_ratio, tok.valid)  # [B, 1]
        nonneg = tok.adv >= 0  # TRL: (k_pos, lambda_pos) for A >= 0
        k = torch.where(nonneg, float(params.k_pos), float(params.k_neg)).double()
        lam = torch.where(nonneg, float(params.lambda_pos), float(params.lambda_neg)).double()
        phi = gamma_weight(log_w.expand_as(k), k, lam).to(tok.r.dtype)  # [B, T]
        has = tok.valid.any(dim=-1, keepdim=True)
        top = torch.where(has, log_w, -math.inf).max() if log_w.numel() else None
    # log pi: 0 (value and gradient) off the mask, on non-finite tokens and where pi = 0 (a
    # token the policy already never makes: no 0 * inf, nothing left to push down)
    logp = torch.where(tok.valid & torch.isfinite(log_prob), log_prob, 0.0)
    loss_tok = -tok.adv * phi * logp
    none = torch.zeros_like(tok.valid)
    # c_high: max(w_max, 1), its exp taken on the host when the trainer reads the metrics
    c_high = 1.0 if top is None else HostMetric(top, weight_bound)
    metrics = surrogate_metrics(tok, (0.0, c_high), (none, none), weight=phi)
    return aggregation(loss_tok, tok.valid), metrics
