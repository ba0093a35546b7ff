"""M2PO (Zheng et al. 2025, "Prosperity before Collapse", arXiv 2510.01161): instead of trusting
the ratio clip alone on very stale data, mask the tokens with the largest squared log-ratio until
the batch's second moment is under a threshold, and train the rest without a ratio clip.
Written after AReaL (`m2_threshold`, `get_m2po_loss_mask`, `ppo_actor_loss_fn`); formulas in
docs/algorithms.md.

Per loss call (AReaL: per micro-batch given to the loss), over the valid tokens:

    m2_t = (log pi_theta(y_t) - log pi_old(y_t))^2          (detached)
    sort m2 descending; mask the first k, with k the smallest number such that the mean of the
    remaining m2 is < m2_threshold (all but one if no k gets there)

The kept tokens get the policy gradient loss -r_t A_t: the paper's objective (as AReaL's docs
print it, sum_t M_t r_t A_t) has no ratio clip; `eps_low` / `eps_high` add one (AReaL hands its
`eps_clip` to the same PPO loss; its M2PO example sets eps_clip 0.0, a zero-width clip of
pi_theta / pi_prox, which is 1 at the example's one update per batch: no clip). Masked tokens
leave the loss and its token count, as AReaL's code takes them out of the loss mask (its docs'
formula divides by all tokens instead). Under gradient accumulation AReaL's loss of a
micro-batch is its kept tokens' mean, weighted by the micro-batch's share of the mini-batch's
tokens (`loss_weight_fn`: the loss mask before M2PO): `Aggregation.narrowed` gives the
trainer's mini-batch count that form (until issue 45 the kept tokens were divided by every
token of the mini-batch, masked ones included, and each step shrank by n_kept / n).
Which two policies m2 compares, as AReaL: its decoupled loss (`use_decoupled_loss`, the M2PO
example's setting) takes m2 = (log pi_behav - log pi_prox)^2, the behaviour policy against the
proximal one (the weights at the start of the training step). Under
`trainer.old_logprob=recompute|loglinear` the loss's old_log_prob is that proximal policy and its
inputs carry the behaviour log-probs (`RatioInputs.behav_log_prob`):
m2 = (log pi_prox - log pi_behav)^2.
Under `trainer.old_logprob=behaviour` (no proximal policy) m2 = (log pi_theta - log pi_behav)^2,
the current weights against the behaviour policy, which is AReaL's quantity at the first update
on a batch (there pi_prox = pi_theta).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.contract import Aggregation, RatioInputs
from bapo_cli.algos.core import (
    REGISTRY,
    Tensor,
    Tokens,
    largest_ratio,
    surrogate_dropping,
    tokens,
)
from bapo_cli.algos.params import (
    LossParams,
    ParamError,
    check_dual_clip,
    check_eps,
    dual_clip_param,
    param,
    positive,
)


@dataclass(frozen=True)
class M2POParams(LossParams):
    """M2PO: second-moment masking of the log-ratios, then the clipped surrogate."""

    m2_threshold: float = param(
        0.04,
        "mask the largest squared log-ratios until their mean over the rest is below this "
        "(AReaL's M2PO example and the paper: 0.04; AReaL's own default is null = off)",
    )
    eps_low: float | None = param(
        None,
        "ratio clip of the kept tokens, c_low = 1 - eps_low; null = no clip (the paper's "
        "objective masks instead of clipping)",
    )
    eps_high: float | None = param(
        None, "ratio clip of the kept tokens, c_high = 1 + eps_high; null = no clip"
    )
    dual_clip: float | None = dual_clip_param()

    def check(self) -> None:
        positive("m2_threshold", self.m2_threshold)
        if (self.eps_low is None) != (self.eps_high is None):
            raise ParamError("eps_high", self.eps_high, "set both eps_low and eps_high, or neither")
        if self.eps_low is not None:
            check_eps(self.eps_low, self.eps_high)
        check_dual_clip(self.dual_clip)

    def bounds(self) -> tuple[float, float]:
        """(c_low, c_high) of the ratio clip; (0, inf) when there is none."""
        if self.eps_low is None:
            return 0.0, math.inf
        return 1.0 - float(self.eps_low), 1.0 + float(self.eps_high)

    def describe(self) -> str:
        clip = "no ratio clip"
        if self.eps_low is not None:
            clip = f"then [{1 - self.eps_low:g}, {1 + self.eps_high:g}]"
        return f"tokens masked until mean (log r)^2 < {self.m2_threshold:g}, {clip}"


def m2_mask(log_ratio: Tensor, valid: Tensor, threshold: float) -> Tensor:
    """Bool, log_ratio's shape: the valid tokens M2PO masks (largest (log r)^2 first; of equal
    ones the first in row-major order). Over every position at a fixed shape, the others sorted
    last: no host read (a `[valid]` selection or a count read back would wait for the device)."""
    with torch.no_grad():
        flat = valid.reshape(-1)
        if flat.numel() == 0:
            return torch.zeros_like(valid)
        m2 = torch.where(flat, log_ratio.detach().double().square().reshape(-1), 0.0)
        _, order = torch.sort(torch.where(flat, m2, -1.0), descending=True, stable=True)
        suffix = m2[order].flip(0).cumsum(0).flip(0)  # sum of the sorted m2 from i on
        place = torch.arange(flat.numel(), device=flat.device)
        left = flat.sum() - place  # valid tokens from sorted place i on
        below = (suffix / left.clamp(min=1) < threshold) & (left > 0)
        # how many of the largest to mask: up to the first mean below the threshold, else all
        # but one (nothing when no token is valid)
        k = torch.where(below.any(), below.int().argmax(), flat.sum() - 1)
        drop = torch.zeros_like(flat).scatter(0, order, place < k)
        return drop.reshape(valid.shape) & valid


def m2_drop(tok: Tokens, inputs: RatioInputs, threshold: float) -> Tensor:
    """The tokens M2PO masks: m2 of the current weights against the behaviour policy, or of the
    proximal policy (old_log_prob) against it when the inputs carry both (module docstring);
    a token whose behaviour log-prob is not finite is masked first."""
    behav = inputs.behav_log_prob
    if behav is None:  # the current weights against the behaviour policy
        return m2_mask(tok.log_ratio, tok.valid, threshold)
    if behav.shape != tok.r.shape:
        raise ValueError(
            f"behav_log_prob has shape {tuple(behav.shape)}, expected {tuple(tok.r.shape)}"
        )
    prox_behav = (inputs.old_log_prob - behav).detach()
    finite = torch.isfinite(prox_behav)
    drop = m2_mask(torch.where(finite, prox_behav, 0.0), tok.valid & finite, threshold)
    return drop | (tok.valid & ~finite)


@REGISTRY.register("m2po", params=M2POParams)
def m2po_loss(
    log_prob: Tensor, inputs: RatioInputs, params: M2POParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """M2PO (module docstring). clipfrac_low / clipfrac_high count the M2-masked tokens with the
    ratio-clipped ones (A < 0 / A > 0): the tokens that lost their gradient. Without a ratio clip
    c_low reports 0 and c_high the largest kept ratio (nothing above it was clipped).

    Masked tokens leave the normaliser: the call's kept tokens take its share of the
    mini-batch's token count (`Aggregation.narrowed`; module docstring)."""
    bounds = params.bounds()
    tok = tokens(log_prob, inputs)
    drop = m2_drop(tok, inputs, float(params.m2_threshold))
    loss, metrics = surrogate_dropping(
        tok, drop, bounds, params.dual_clip, aggregation, in_denominator=False
    )
    if math.isinf(bounds[1]):  # no clip: report the largest ratio kept, as kl_cov (finite to log)
        metrics["c_high"] = largest_ratio(tok.r, tok.valid & ~drop)
    return loss, metrics
