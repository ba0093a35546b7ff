"""What passes between the trainer and a loss. Every registered loss is one pure function,

    loss_fn(log_prob, inputs: RatioInputs, params, aggregation: Aggregation) -> (loss, metrics)

`log_prob` this forward's log-probs (with gradient), `inputs` what the ratio divides by and the
advantage each token carries (`RatioInputs`; the trainer builds it in `trainer/off_policy.py`),
`params` the loss's own frozen params dataclass (validated once, when the config is read), and
`aggregation` how per-token losses become the loss (`Aggregation`: the mode and the mini-batch's
normalisers). What a loss needs of the trainer besides its inputs it says in `LossHooks`
(`params.hooks()`), so the trainer names no method. `core.LossEntry` checks the signature when
a loss registers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.params import number

Tensor = torch.Tensor

AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
# the one signature of a registered loss, by parameter name (checked at registration)
LOSS_ARGS = ("log_prob", "inputs", "params", "aggregation")


@dataclass(frozen=True, eq=False)
class RatioInputs:
    """One micro-batch as its loss sees it, besides this forward's log-probs: the ratio's
    denominator, the advantage each token carries and the tokens that count. Shapes [B, T] (or
    flat [N]); `advantages` may be [B], one per sequence."""

    old_log_prob: Tensor  # r_t = exp(log_prob - old_log_prob): behaviour, proximal or engine
    advantages: Tensor  # A_i, times `weights` where there are any (multiplied in that order)
    mask: Tensor  # bool: the tokens the loss and its normaliser count
    # the behaviour policy's log-probs when old_log_prob is a proximal policy's (M2PO's second
    # moment reads them); None when old_log_prob is the behaviour policy's
    behav_log_prob: Tensor | None = None
    # [B, T]: the off-policy weight each token's advantage already carries (TIS/MIS x sequence
    # mask x behaviour weight); None = 1. For a loss that needs the weight itself, never to be
    # multiplied into `advantages` again
    weights: Tensor | None = None


@dataclass(frozen=True)
class LossHooks:
    """What a loss asks of the trainer around it; each optional, none by default. A params
    dataclass that needs one defines ``hooks()`` returning these."""

    # whose log-probs the ratio divides by: "old" (what trainer.old_logprob says) or "inference"
    # (the engine's own, where a sample has them: prime-rl's default)
    ratio_against: str = "old"
    # the optimizer step's learning-rate factor from the update's ESS (VCPO's step scaling)
    lr_scale: Callable[[float], float] | None = None
    # per update, before the loss: (||g_i||^2 [B], log w_i [B], groups [B], A_i [B]) -> new A_i,
    # from each sequence's score-gradient norm and importance weight (VCPO's baseline)
    recentre: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor] | None = None


def check_agg(agg: str, dim: int) -> None:
    """`agg` is an aggregation mode tensors of `dim` dimensions allow."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown agg {agg!r}; valid: {', '.join(AGGREGATIONS)}")
    if dim == 1 and agg != "token-mean":
        raise ValueError(f"agg={agg!r} needs [B, T] tensors; flat [N] tensors allow token-mean")


def _check_positive(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, Tensor) and not number(name, value) > 0:
        raise ValueError(f"{name} must be > 0 (or None), got {value!r}")


def aggregate(
    loss_tok: Tensor,
    valid: Tensor,
    agg: str = "token-mean",
    *,
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_len: float | None = None,
) -> Tensor:
    """Masked aggregation of per-token losses [B, T] (loss_tok is 0 off the mask).

    token-mean:              sum_{b,t} l / n_tokens
    seq-mean-token-sum:      sum_b (sum_t l) / n_seqs
    seq-mean-token-mean:     sum_b (sum_t l / n_tokens_b) / n_seqs
    seq-mean-token-sum-norm: sum_{b,t} l / (n_seqs * norm_len)   (Dr. GRPO; norm_len default T)

    n_tokens / n_seqs default to this batch's valid tokens / sequences with a valid token;
    `global_tokens` / `global_seqs` replace them (e.g. the whole mini-batch's counts, so the
    micro-batch losses of gradient accumulation add up to the exact mini-batch loss).
    """
    check_agg(agg, loss_tok.dim())
    _check_positive("global_tokens", global_tokens)
    _check_positive("global_seqs", global_seqs)
    _check_positive("norm_len", norm_len)
    if agg == "token-mean":
        denom = global_tokens if global_tokens is not None else valid.sum().clamp(min=1)
        if isinstance(global_tokens, Tensor) and global_tokens.is_floating_point():
            # in the loss's dtype, as a number divides (M2PO's narrowed count: the loss it
            # had as a number, bit for bit)
            denom = global_tokens.to(loss_tok.dtype)
        return loss_tok.sum() / denom
    seq_loss = loss_tok.sum(dim=-1)  # [B]
    n_seqs = global_seqs if global_seqs is not None else valid.any(dim=-1).sum().clamp(min=1)
    if agg == "seq-mean-token-sum":
        return seq_loss.sum() / n_seqs
    if agg == "seq-mean-token-mean":
        seq_tokens = valid.sum(dim=-1).clamp(min=1)  # [B]
        return (seq_loss / seq_tokens).sum() / n_seqs
    horizon = norm_len if norm_len is not None else loss_tok.shape[-1]
    return seq_loss.sum() / (n_seqs * horizon)


@dataclass(frozen=True)
class Aggregation:
    """How a loss turns its per-token losses into the loss: `agg` and the gradient-accumulation
    normalisers (see `aggregate`). Built once per update by the trainer (``checked``: the mode
    against the tensors' dimensions); a loss ends with ``aggregation(loss_tok, tok.valid)``."""

    agg: str = "token-mean"
    global_tokens: float | Tensor | None = None
    global_seqs: float | Tensor | None = None
    norm_len: float | None = None

    @classmethod
    def checked(cls, dim: int, agg: str, **normalisers: Any) -> Aggregation:
        """The aggregation, its mode valid for tensors of `dim` dimensions (the normalisers are
        checked when it aggregates, as `aggregate` does)."""
        check_agg(agg, dim)
        return cls(agg, **normalisers)

    def narrowed(self, valid: Tensor, kept: Tensor) -> Aggregation:
        """This aggregation for a loss call that takes some of its `valid` tokens out of the
        normaliser, keeping `kept` (M2PO's mask, as AReaL counts it). Without a mini-batch
        count the call's own kept tokens are the token-mean's count already. With one (gradient
        accumulation), the call's kept tokens share the call's part of it: the count becomes
        global_tokens x n_kept / n_valid, so a call's loss is its kept tokens' mean weighted by
        its share of the mini-batch's tokens (AReaL's per micro-batch loss mask, weighted by the
        micro-batch's tokens, `loss_weight_fn`); with one micro-batch, the kept tokens' mean.
        The sequence counts are unchanged (seq-mean-token-mean counts each sequence's kept
        tokens already). The count stays on the device (a float64 0-dim tensor, no host read)."""
        if self.global_tokens is None:
            return self
        n_valid, n_kept = valid.sum(dtype=torch.float64), kept.sum(dtype=torch.float64)
        # nothing taken out, or no token left to weigh: the count as it is (x 1, exactly)
        same = (n_kept == n_valid) | (n_kept == 0.0)
        share = torch.where(same, 1.0, n_kept / torch.where(same, 1.0, n_valid))
        count = self.global_tokens
        if isinstance(count, Tensor):
            count = count.to(device=share.device, dtype=torch.float64)  # a count, exactly
        return dataclasses.replace(self, global_tokens=count * share)

    def __call__(self, loss_tok: Tensor, valid: Tensor) -> Tensor:
        return aggregate(
            loss_tok,
            valid,
            self.agg,
            global_tokens=self.global_tokens,
            global_seqs=self.global_seqs,
            norm_len=self.norm_len,
        )
