"""A-3PO's proximal log-probs without a forward pass (`trainer.old_logprob=loglinear`).

Decoupled PPO (`trainer.old_logprob=recompute`) clips the ratio pi_theta / pi_prox around a
proximal policy that a separate no-grad forward pass re-scores. A-3PO (arXiv 2512.06547; AReaL's
`prox_logp_method=loglinear`, `compute_prox_logp_approximations` in
`areal/trainer/ppo/actor.py`) interpolates it instead, in log space, between the behaviour
log-prob recorded at sampling and the current forward's (detached):

    log pi_prox = log pi_behav + alpha * (log pi_theta - log pi_behav),
    alpha = (v_prox - v_behav) / (v_theta - v_behav) = 1 - 1/k,   k = v_theta - v_behav > 0,

with v_prox = v_theta - 1 (AReaL's proximal policy is the last version before the current one)
and k the token's staleness in optimizer updates. alpha = 0 for a fresh token (k = 0: no
interpolation, AReaL's guard) and for a one-step-stale one (k = 1: the behaviour policy *is*
the previous version), and rises to 1 - 1/k for staler tokens. Only torch: a pure function.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

__all__ = ["loglinear_alpha", "loglinear_prox"]


def loglinear_alpha(staleness: Tensor) -> Tensor:
    """alpha = 1 - 1/k for k > 0 updates of staleness, 0 for k <= 0 (float64, detached)."""
    k = staleness.detach().double()
    return torch.where(k > 0, (k - 1.0) / torch.where(k > 0, k, 1.0), 0.0).clamp(0.0, 1.0)


def loglinear_prox(behav_log_prob: Tensor, log_prob: Tensor, staleness: Tensor) -> Tensor:
    """log pi_prox per token, detached, in `behav_log_prob`'s dtype: the behaviour log-prob moved
    alpha of the way to the current one (`log_prob`, the training forward's). A token whose
    current log-prob is not finite keeps its behaviour log-prob (the loss masks it anyway)."""
    with torch.no_grad():
        behav = behav_log_prob.detach().double()
        delta = log_prob.detach().double() - behav
        delta = torch.where(torch.isfinite(delta), delta, 0.0)
        return (behav + loglinear_alpha(staleness) * delta).to(behav_log_prob.dtype)
