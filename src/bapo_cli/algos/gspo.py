"""GSPO (arXiv 2507.18071): the clip on the length-normalised sequence ratio (`gspo`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.contract import Aggregation, RatioInputs
from bapo_cli.algos.core import REGISTRY, Tensor, clip_metrics, rounded, tokens
from bapo_cli.algos.params import ClipRangeParams, param


@dataclass(frozen=True)
class GSPOParams(ClipRangeParams):
    """GSPO: clip the length-normalised sequence ratio s_i to [1 - eps_low, 1 + eps_high]."""

    eps_low: float = param(3e-4, "lower clip range of the sequence ratio (GSPO paper: 3e-4)")
    eps_high: float = param(4e-4, "upper clip range of the sequence ratio (GSPO paper: 4e-4)")

    def describe(self) -> str:
        return f"sequence ratio in [{1 - self.eps_low:g}, {1 + self.eps_high:g}]"


@REGISTRY.register("gspo", params=GSPOParams, agg="seq-mean-token-mean")
def gspo_loss(
    log_prob: Tensor, inputs: RatioInputs, params: GSPOParams, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """GSPO (arXiv 2507.18071): the clipped surrogate on the sequence ratio
    s_i = exp(mean_t log r_{i,t}) over the sequence's valid tokens.

    Written in the paper's GSPO-token form, s_{i,t} = sg(s_i) * pi(y_t) / sg(pi(y_t)): every
    token has the value s_i and the gradient s_i grad log pi(y_t), so with
    agg="seq-mean-token-mean" (the paper's 1/G sum_i) the gradient is exactly GSPO's,
    sum_i A_i grad s_i / G, and per-token advantages (rollout.tis_cap) still apply.
    A whole sequence is clipped or not: a positive one carries gradient iff s_i < c_high, a
    negative one iff c_low < s_i (< dual_clip, applied to s_i). Needs [B, T] tensors.
    """
    if log_prob.dim() != 2:
        raise ValueError(
            f"gspo needs [B, T] tensors (its ratio is per sequence), got shape "
            f"{tuple(log_prob.shape)}"
        )
    bounds = params.bounds()
    tok = tokens(log_prob, inputs)
    with torch.no_grad():
        n_seq = tok.valid.sum(dim=-1).clamp(min=1).to(tok.r.dtype)
        seq_ratio = torch.exp(tok.log_ratio.sum(dim=-1) / n_seq)  # s_i, [B]
        s = torch.where(tok.valid, seq_ratio[:, None], 1.0)  # s_i on each of its tokens
    lo, hi = rounded(bounds[0], s), rounded(bounds[1], s)
    upper_neg = None if params.dual_clip is None else rounded(params.dual_clip, s)
    active_neg = tok.neg & (s > lo)
    if upper_neg is not None:
        active_neg = active_neg & (s < upper_neg)
    active = (tok.pos & (s < hi)) | active_neg
    s_token = s * (tok.ratio / tok.r)  # value s_i, gradient s_i * grad log pi(y_t)
    s_clipped = torch.where(tok.pos, s.clamp(max=hi), s.clamp(min=lo, max=upper_neg))
    loss_tok = -tok.adv * torch.where(active, s_token, s_clipped)
    return aggregation(loss_tok, tok.valid), clip_metrics(tok, s, active, bounds)
