"""TOPR (Tapered Off-Policy REINFORCE, Le Roux et al., arXiv 2503.14286): REINFORCE that treats
positive and negative trajectories asymmetrically (`topr`). The paper's Eq. (8):

    grad J = sum_{tau in T+} mu(tau) R(tau) grad log pi(tau)
           + sum_{tau in T-} mu(tau) [pi(tau) / mu(tau)]_0^1 R(tau) grad log pi(tau)

with T+ / T- the trajectories of positive / negative reward, mu the behaviour policy and
[x]_0^1 = min(max(x, 0), 1). A positive trajectory is plain REINFORCE (SFT on it, no importance
weight however far off-policy); a negative one is pushed down with the truncated importance
weight of the whole trajectory, so the push fades once the current policy has left it (no
runaway on negatives), yet, unlike PPO's clip, never becomes 0 while pi(tau) > 0.

Per token, with A_i the sequence's advantage (its sign picks the set) and
log W_i = sum_t log r_{i,t} (`ratio="trajectory"`, the paper's):

    loss_t = -sg(alpha_i) * A_i * log pi_theta(y_t),  alpha_i = 1 if A_i >= 0 else min(W_i, 1)

and the trajectory's gradient is the sum over its tokens, grad log pi(tau) = sum_t: the preset's
aggregation is `seq-mean-token-sum` (mean over sequences of token sums).

The public versions disagree off-policy (none is from the authors): `ratio="geometric"` takes
alpha_i = min(exp(mean_t log r_{i,t}), 1) (verl PR #6986, unmerged, with a token mean per
sequence); `ratio="token"` alpha_t = min(r_t, 1) per token (Trinity-RFT's `topr_policy_loss.py`,
token-mean; alibaba/ROLL's `actor_pg_worker.py` `_compute_topr_loss`, which splits by the
episode score, > 0 positive). For one negative sequence with token ratios (2, 0.25), A = -1:
the per-token gradient weights are (0.5, 0.5) (paper, token sum), (0.354, 0.354) (verl PR, token
mean: sqrt(0.5) / 2) and (0.5, 0.125) (Trinity, token mean: (1, 0.25) / 2).

The rewards: Eq. (8) weights by R itself, with no baseline, and its sets are R's signs. This
project's rewards are 1 (right) / 0 (wrong), with which T- would be empty, so the preset takes the
`signed` advantage A = 2R - 1 (right +1, wrong -1; REINFORCE with the constant baseline 1/2,
times 2), not a group baseline; `algo.advantage=grpo` is Trinity's and ROLL's "baseline trick".
Guards: alpha is exp(min(log W, 0)) in log space, in [0, 1] whatever W is; non-finite tokens are
out of the mask and of W (`core.prepare_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.contract import Aggregation, RatioInputs
from bapo_cli.algos.core import (
    REGISTRY,
    Tensor,
    Tokens,
    largest_ratio,
    surrogate_metrics,
    tokens,
)
from bapo_cli.algos.params import LossParams, one_of, param

RATIOS = ("trajectory", "geometric", "token")


@dataclass(frozen=True)
class TOPRParams(LossParams):
    """TOPR: negative trajectories weighted by their importance ratio truncated to [0, 1]."""

    ratio: str = param(
        "trajectory",
        "the ratio a negative trajectory's weight truncates: trajectory (the paper's Eq. 8, "
        "prod_t r_t), geometric (verl PR 6986: exp(mean_t log r_t)) or token (Trinity-RFT, "
        "ROLL: each token's own r_t)",
    )

    def check(self) -> None:
        one_of("ratio", self.ratio, RATIOS)

    def describe(self) -> str:
        return f"REINFORCE; A < 0 weighted by the {self.ratio} ratio truncated to [0, 1]"


def taper(tok: Tokens, ratio: str) -> Tensor:
    """alpha per token [B, T] (detached): 1 where A >= 0; where A < 0 the chosen ratio
    truncated to [0, 1], computed as exp(min(log ratio, 0)) so no weight overflows."""
    with torch.no_grad():
        log_r = tok.log_ratio.double()  # 0 on invalid tokens
        if ratio == "token":
            log_w = log_r
        else:
            log_w = log_r.sum(dim=-1, keepdim=True)
            if ratio == "geometric":
                log_w = log_w / tok.valid.sum(dim=-1, keepdim=True).clamp(min=1)
            log_w = log_w.expand_as(log_r)
        alpha = torch.exp(log_w.clamp(max=0.0)).to(tok.r.dtype)
        return torch.where(tok.neg, alpha, 1.0)


@REGISTRY.register("topr", params=TOPRParams, agg="seq-mean-token-sum")
def topr_loss(
    log_prob: Tensor, inputs: RatioInputs, params: TOPRParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """TOPR (module docstring): every valid token with A != 0 carries the gradient
    -alpha A grad log pi. clipfrac_low counts the negative tokens whose weight was tapered
    (alpha < 1); nothing is clipped above: c_low reports 0, c_high the largest token ratio of the
    call (as kl_cov). The gradient weight of rho is alpha. `ratio="token"` takes flat [N] tensors
    too; the sequence ratios need [B, T]."""
    if params.ratio != "token" and log_prob.dim() != 2:
        raise ValueError(
            f"topr with ratio={params.ratio} needs [B, T] tensors (a sequence's ratio), got "
            f"{tuple(log_prob.shape)}"
        )
    tok = tokens(log_prob, inputs)
    alpha = taper(tok, params.ratio)
    # log pi: 0 (value and gradient) off the mask, on non-finite tokens and where pi = 0 (a
    # token the policy already never makes: no 0 * inf, nothing left to push down)
    logp = torch.where(tok.valid & torch.isfinite(log_prob), log_prob, 0.0)
    loss_tok = -tok.adv * alpha * logp
    tapered = tok.neg & (alpha < 1.0)
    bounds = (0.0, largest_ratio(tok.r, tok.valid))
    metrics = surrogate_metrics(
        tok, bounds, (tapered, torch.zeros_like(tapered)), weight=alpha.detach()
    )
    return aggregation(loss_tok, tok.valid), metrics
