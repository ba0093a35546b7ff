"""Entropy-Clip diagnostics: which tokens the clip keeps, and what that does to entropy.

The BAPO paper's Entropy-Clip Rule: for a softmax policy pi = softmax(z), a logit update Delta z
changes the entropy H by, to first order,

    Delta H  ~=  -Cov_{y ~ pi}[ log pi(y), Delta z(y) ]                                   (1)

(dH/dz_y = -pi(y) (log pi(y) + H); the covariance ignores any constant added to Delta z). For the
tabular update Delta z(y) = eta * A(y) * X(y), X = 1 for active (unclipped) tokens and 0 for
clipped ones, this is the spec's  Delta H ~= -eta * Cov[log pi(y), A(y) X(y) + C].  So an active
token raises entropy when log pi(y) and A(y) have opposite signs relative to their means:

    quadrant                 effect on H      (ENTROPY_EFFECT)
    high prob, A > 0         lowers it  (-1)  sharpening what is already likely
    low prob,  A > 0         raises it  (+1)  exploring: the tokens a tight c_high clips
    high prob, A < 0         raises it  (+1)
    low prob,  A < 0         lowers it  (-1)  what a loose c_low keeps in the gradient

and a clipped token has no effect. `quadrant_table` splits one update's tokens by probability
(above / below exp(mean log pi), i.e. log pi above / below its mean over the batch's valid tokens,
the sample estimate of E_pi[log pi] = -H) and by advantage sign, and reports per quadrant the
active and clipped token counts and shares of the loss mass r|A|. Keys are
``<high|low>_<pos|neg>_<active|clipped>`` (counts) and the same with ``_mass`` (shares); a
trainer logs them as ``tokens/quadrant_<key>``.
"""

from __future__ import annotations

import torch

from bapo_cli.algos.losses import prepare_tokens, token_activity

__all__ = [
    "ENTROPY_EFFECT",
    "QUADRANT_KEYS",
    "entropy_clip_prediction",
    "predicted_entropy_change",
    "quadrant_table",
    "softmax_entropy",
]

Tensor = torch.Tensor

QUADRANT_KEYS = tuple(
    f"{prob}_{sign}_{state}"
    for prob in ("high", "low")
    for sign in ("pos", "neg")
    for state in ("active", "clipped")
)
# Sign of an *active* token's first-order effect on entropy, per (probability, advantage sign).
ENTROPY_EFFECT = {"high_pos": -1, "low_pos": +1, "high_neg": +1, "low_neg": -1}


@torch.no_grad()
def quadrant_table(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    bounds: tuple[float, float],
    dual_clip: float | None = 3.0,
    threshold_log_prob: float | Tensor | None = None,
) -> dict[str, Tensor]:
    """The quadrant table of one update, with the same activity masks as the loss clipping at
    `bounds` (c_low, c_high).

    threshold_log_prob: the log-probability that splits high from low (default: the mean of
    log_prob over the valid tokens; a trainer may pass -entropy). Returns detached 0-dim
    tensors: 8 counts and 8 mass shares (summing to 1 when any token carries mass).
    """
    tok = prepare_tokens(log_prob.detach(), old_log_prob.detach(), advantages, mask)
    lp = log_prob.detach()
    if threshold_log_prob is None:
        threshold_log_prob = torch.where(tok.valid, lp, 0.0).sum() / tok.n_valid.clamp(min=1)
    high = lp > threshold_log_prob
    active_pos, active_neg = token_activity(tok, *bounds, dual_clip)
    mass = tok.r * tok.adv.abs()  # r |A|, 0 off the mask
    total = mass.sum()
    total = torch.where(total > 0, total, 1.0)
    cells = {
        "pos": (tok.pos, active_pos),
        "neg": (tok.neg, active_neg),
    }
    out: dict[str, Tensor] = {}
    for prob, in_prob in (("high", high), ("low", ~high)):
        for sign, (in_sign, active) in cells.items():
            for state, sel in (("active", active), ("clipped", in_sign & ~active)):
                cell = in_prob & sel
                key = f"{prob}_{sign}_{state}"
                out[key] = cell.sum(dtype=mass.dtype)
                out[f"{key}_mass"] = torch.where(cell, mass, 0.0).sum() / total
    return out


def softmax_entropy(logits: Tensor) -> Tensor:
    """H(softmax(logits)) over the last dimension."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def predicted_entropy_change(logits: Tensor, delta_logits: Tensor) -> Tensor:
    """First-order change of H(softmax(logits)) when logits += delta_logits, equation (1):
    -Cov_{y ~ pi}[log pi(y), delta(y)] over the last dimension."""
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    centred = logp - (p * logp).sum(dim=-1, keepdim=True)
    return -(p * centred * delta_logits).sum(dim=-1)


def entropy_clip_prediction(
    logits: Tensor, advantages: Tensor, active: Tensor, lr: float
) -> Tensor:
    """The spec's Entropy-Clip Rule for the tabular update z(y) += lr * A(y) * X(y):
    Delta H ~= -lr * Cov_{y ~ pi}[log pi(y), A(y) X(y)] (X = `active` as 0/1)."""
    return predicted_entropy_change(logits, lr * advantages * active.to(advantages.dtype))
