"""What every loss shares: the registry (`REGISTRY`, `LossEntry`, `policy_loss`), the token
preparation (`prepare_tokens`), the masked aggregation (`aggregate`; `Aggregation` carries its
four keyword arguments through a loss), the clipped surrogate (`clipped_surrogate`,
`surrogate_dropping`) and the metric set every loss reports (`surrogate_metrics`; `clip_metrics`
for a loss that clips a ratio). A loss's own module keeps its formula and what it decides per
token (which tokens carry gradient, with what weight, which count as clipped); the bookkeeping
from there to the loss and its metrics is here. The conventions (activity masks, non-finite
tokens, shapes, metrics) are in `losses`'s docstring."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.bapo_path import BoundSearch
from bapo_cli.algos.params import ParamError, number
from bapo_cli.algos.registry import Registry

AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
# Keyword arguments every loss takes besides its own parameters: the algo config's shared
# options and the gradient-accumulation normalisers the trainer passes.
COMMON_KWARGS = ("dual_clip", "agg", "global_tokens", "global_seqs", "norm_len")

Tensor = torch.Tensor


@dataclass(frozen=True)
class LossEntry:
    """A registered loss: its function and the dataclass of its parameters.

    `params` is a frozen dataclass whose fields (defaults + `help`) are the loss's keyword
    arguments, except fields marked ``trainer=True`` (settings the trainer reads); it validates
    itself on construction (`check()`) and says what it does in words (`describe()`).
    `searches_bounds`: the loss picks its bounds from the data with BAPO's search; then its params
    are a `BoundSearch` with a `bound_scope`, and it takes `bounds=` (solved once per optimizer
    step by the trainer) and `group=` (ranks to sum over when it searches itself).
    `behaviour`: the loss also reads the behaviour log-probs when the trainer's old_log_prob is
    a proximal policy (`trainer.old_logprob=recompute|loglinear`): it takes `behav_log_prob=`
    (None when old_log_prob is the behaviour policy itself). M2PO measures its second moment
    against the behaviour policy, as AReaL's decoupled loss does.
    The protocol is checked at registration, so a loss that breaks it fails on import.
    """

    name: str
    fn: Callable[..., tuple[Tensor, dict[str, Any]]]
    params: type
    searches_bounds: bool = False
    behaviour: bool = False

    def __post_init__(self) -> None:
        where = f"loss {self.name!r}"
        if not dataclasses.is_dataclass(self.params):
            raise TypeError(f"{where}: params must be a dataclass, got {self.params!r}")
        for method in ("check", "describe"):
            if not callable(getattr(self.params, method, None)):
                raise TypeError(f"{where}: {self.params.__name__} needs a {method}() method")
        takes = inspect.signature(self.fn).parameters
        wanted = [f.name for f in dataclasses.fields(self.params) if not f.metadata.get("trainer")]
        wanted += list(COMMON_KWARGS)
        if self.searches_bounds:
            wanted += ["bounds", "group"]
            if not issubclass(self.params, BoundSearch) or not hasattr(self.params, "bound_scope"):
                raise TypeError(
                    f"{where}: a bound search needs BoundSearch params with bound_scope"
                )
        if self.behaviour:
            wanted += ["behav_log_prob"]
        missing = [name for name in wanted if name not in takes]
        if missing:
            raise TypeError(f"{where}: {self.fn.__name__} takes no {', '.join(missing)}")
        for f in dataclasses.fields(self.params):
            if f.default is dataclasses.MISSING or not f.metadata.get("help"):
                raise TypeError(
                    f"{where}: {self.params.__name__}.{f.name} needs a default and help"
                )

    def read_params(self, source: Any) -> Any:
        """The validated params, each field read by name from `source` (e.g. an algo config);
        a ParamError names the field that is not allowed."""
        return self.params(
            **{f.name: getattr(source, f.name) for f in dataclasses.fields(self.params)}
        )

    def loss_kwargs(self, params: Any) -> dict[str, Any]:
        """The keyword arguments of `fn` that `params` holds."""
        return {
            f.name: getattr(params, f.name)
            for f in dataclasses.fields(params)
            if not f.metadata.get("trainer")
        }


REGISTRY: Registry[LossEntry] = Registry("loss", entry=LossEntry)


def policy_loss(
    name: str,
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    **params: Any,
) -> tuple[Tensor, dict[str, Any]]:
    """Look up loss `name` in REGISTRY (ppo, clip_higher, bapo) and call it."""
    return REGISTRY.get(name).fn(log_prob, old_log_prob, advantages, mask, **params)


# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tokens:
    """One batch after `prepare_tokens`: shapes [B, T] (or [N]), invalid tokens neutralised."""

    ratio: Tensor  # r_t = pi_theta / pi_rollout, with grad; 1 on masked/non-finite tokens
    r: Tensor  # the same, detached
    log_ratio: Tensor  # log r_t detached; 0 on masked/non-finite tokens
    adv: Tensor  # A_t detached; 0 on masked/non-finite tokens
    valid: Tensor  # bool: in the mask and finite
    pos: Tensor  # bool: valid & A > 0
    neg: Tensor  # bool: valid & A < 0
    n_valid: Tensor  # 0-dim float: number of valid tokens
    nonfinite: Tensor  # 0-dim float: tokens in the mask left out as non-finite


def _check_shapes(
    log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, mask: Tensor
) -> Tensor:
    """Validate shapes; return advantages broadcast to log_prob's shape."""
    shape = log_prob.shape
    if log_prob.dim() not in (1, 2):
        raise ValueError(f"log_prob must be [B, T] or [N], got shape {tuple(shape)}")
    if not log_prob.is_floating_point():
        raise ValueError(f"log_prob must be a floating-point tensor, got {log_prob.dtype}")
    for name, t in (("old_log_prob", old_log_prob), ("mask", mask)):
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if advantages.shape == shape:
        return advantages
    if log_prob.dim() == 2 and advantages.shape == shape[:1]:
        return advantages[:, None].expand(shape)  # one advantage per sequence
    raise ValueError(
        f"advantages has shape {tuple(advantages.shape)}, expected {tuple(shape)}"
        + (f" or {tuple(shape[:1])}" if log_prob.dim() == 2 else "")
    )


def prepare_tokens(
    log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, mask: Tensor
) -> Tokens:
    """ratio -> validity: compute r_t once, mask non-finite tokens, zero their advantage."""
    advantages = _check_shapes(log_prob, old_log_prob, advantages, mask)
    log_ratio = log_prob - old_log_prob  # log r_t, [B, T]
    with torch.no_grad():
        in_mask = mask if mask.dtype == torch.bool else mask != 0
        adv = advantages.detach().to(log_prob.dtype)
        loss_value = log_ratio.exp() * adv  # r_t A_t: NaN/inf iff r, A or their product is
        valid = in_mask & ((loss_value - loss_value) == 0)
        adv = torch.where(valid, adv, 0.0)
        n_valid = valid.sum(dtype=log_prob.dtype)
        nonfinite = in_mask.sum(dtype=log_prob.dtype) - n_valid
    # Neutralise invalid tokens *before* exp so their gradient is 0, never 0 * inf = NaN.
    ratio = torch.exp(torch.where(valid, log_ratio, 0.0))  # r_t, [B, T]
    r = ratio.detach()
    return Tokens(
        ratio=ratio,
        r=r,
        log_ratio=torch.where(valid, log_ratio.detach(), 0.0),
        adv=adv,
        valid=valid,
        pos=adv > 0,  # adv is 0 on invalid tokens, so these are valid & sign
        neg=adv < 0,
        n_valid=n_valid,
        nonfinite=nonfinite,
    )


def _rounded(value: float, like: Tensor) -> float:
    """`value` rounded to `like`'s dtype, as a Python float. The search rounds the path values
    the same way, and comparing a tensor with a number its dtype represents exactly gives the
    same answer whatever precision torch compares in (and needs no device transfer)."""
    return torch.tensor(value, dtype=like.dtype).item()


def _check_dual_clip(dual_clip: float | None, c_low_max: float) -> float | None:
    if dual_clip is None:
        return None
    value = number("dual_clip", dual_clip)
    if not (max(1.0, c_low_max) < value < math.inf):
        raise ParamError(
            "dual_clip", dual_clip, f"must be > 1 and > the largest c_low ({c_low_max}), or None"
        )
    return value


def _check_agg(agg: str, dim: int) -> None:
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
    _check_agg(agg, loss_tok.dim())
    _check_positive("global_tokens", global_tokens)
    _check_positive("global_seqs", global_seqs)
    _check_positive("norm_len", norm_len)
    if agg == "token-mean":
        denom = global_tokens if global_tokens is not None else valid.sum().clamp(min=1)
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
    normalisers, the four keyword arguments every loss takes and hands on unchanged (see
    `aggregate`). ``Aggregation.checked(log_prob.dim(), agg, ...)`` at the top of a loss checks
    the mode against the shapes before any work; ``aggregation(loss_tok, tok.valid)`` at its end
    is `aggregate` with them."""

    agg: str = "token-mean"
    global_tokens: float | Tensor | None = None
    global_seqs: float | Tensor | None = None
    norm_len: float | None = None

    @classmethod
    def checked(
        cls,
        dim: int,
        agg: str,
        global_tokens: float | Tensor | None,
        global_seqs: float | Tensor | None,
        norm_len: float | None,
    ) -> Aggregation:
        """The loss's aggregation, its mode valid for tensors of `dim` dimensions (the
        normalisers are checked when it aggregates, as `aggregate` does)."""
        _check_agg(agg, dim)
        return cls(agg, global_tokens, global_seqs, norm_len)

    def __call__(self, loss_tok: Tensor, valid: Tensor) -> Tensor:
        return aggregate(
            loss_tok,
            valid,
            self.agg,
            global_tokens=self.global_tokens,
            global_seqs=self.global_seqs,
            norm_len=self.norm_len,
        )


def token_activity(
    tok: Tokens, c_low: float, c_high: float, dual_clip: float | None = None
) -> tuple[Tensor, Tensor]:
    """(active_pos, active_neg) bool masks: A > 0 and r < c_high; A < 0 and c_low < r (< dual).

    Strict comparisons in the ratio's dtype, the same ones the bound search counts with.
    """
    r = tok.r
    active_pos = tok.pos & (r < _rounded(c_high, r))  # A > 0: inside while r < c_high
    active_neg = tok.neg & (r > _rounded(c_low, r))  # A < 0: inside while r > c_low ...
    if dual_clip is not None:
        active_neg = active_neg & (r < _rounded(dual_clip, r))  # ... and below the dual clip
    return active_pos, active_neg


def surrogate_metrics(
    tok: Tokens,
    *,
    ratio: Tensor,
    weight: Tensor,
    active_pos: Tensor,
    active_neg: Tensor,
    clipped_low: Tensor,
    clipped_high: Tensor,
    c_low: float,
    c_high: float,
) -> dict[str, Any]:
    """The metric set every loss reports (module docstring), from what the loss decided per token.

    ratio: the ratio the loss clips or gates (r_t; GSPO: its sequence's s_i), detached.
    weight: the gradient weight per unit |A| of a token, |d loss_t / d log pi_t| / |A_t| before
    aggregation (r_t for an active token of the clipped surrogate; CISPO: the clipped IS weight;
    SAPO: the gate's). `w |A|` summed over the active positive / negative tokens gives the sums
    rho is the share of (for the clipped surrogate: r |A|, as the bound search counts).
    clipped_low / clipped_high: the tokens counted in clipfrac_low / clipfrac_high.
    """
    with torch.no_grad():
        n = tok.n_valid.clamp(min=1)
        mass = weight * tok.adv.abs()  # [B, T]; 0 off the mask (adv is 0 there)
        r_valid = torch.where(tok.valid, ratio, 0.0)
        # w |A| summed over the active tokens, in float64 like the search's sums
        pos_sum = torch.where(active_pos, mass, 0.0).sum(dtype=torch.float64)
        neg_sum = torch.where(active_neg, mass, 0.0).sum(dtype=torch.float64)
        metrics: dict[str, Any] = {
            "clipfrac_low": clipped_low.sum() / n,
            "clipfrac_high": clipped_high.sum() / n,
            "ppo_kl": -tok.log_ratio.sum() / n,  # mean of log pi_rollout - log pi_theta
            "ratio_mean": r_valid.sum() / n,
            "ratio_max": r_valid.max() if ratio.numel() else ratio.new_zeros(()),
            "pos_mass": (pos_sum / n).to(ratio.dtype),
            "neg_mass": (neg_sum / n).to(ratio.dtype),
            "active_tokens": (active_pos | active_neg).sum(dtype=torch.float64),
            "nonfinite_tokens": tok.nonfinite,
        }
        # The bounds and the positive share at them: what BAPO's search reports, for any loss.
        total = pos_sum + neg_sum
        rho = torch.where(total > 0, pos_sum / torch.where(total > 0, total, 1.0), 1.0)
        metrics.update(
            c_low=torch.tensor(float(c_low), dtype=torch.float64),
            c_high=torch.tensor(float(c_high), dtype=torch.float64),
            rho_before=rho,
            rho=rho,
            rho_pos=pos_sum,
            rho_neg=neg_sum,
            rho_pos_before=pos_sum,
            rho_neg_before=neg_sum,
            search_steps=torch.zeros((), dtype=torch.float64),
        )
    return metrics


def clip_metrics(
    tok: Tokens,
    ratio: Tensor,
    active_pos: Tensor,
    active_neg: Tensor,
    c_low: float,
    c_high: float,
    *,
    dropped: Tensor | None = None,
) -> dict[str, Any]:
    """`surrogate_metrics` of a loss that clips `ratio` (r_t; GSPO: s_i) at (c_low, c_high): the
    clipped ratio is its gradient weight, and a token at or beyond its side's bound (A < 0:
    ratio <= c_low, A > 0: ratio >= c_high) counts as clipped, as does a token in `dropped`."""
    lo, hi = _rounded(c_low, ratio), _rounded(c_high, ratio)
    low, high = ratio <= lo, ratio >= hi
    if dropped is not None:
        low, high = low | dropped, high | dropped
    return surrogate_metrics(
        tok,
        ratio=ratio,
        weight=ratio,
        active_pos=active_pos,
        active_neg=active_neg,
        clipped_low=tok.neg & low,
        clipped_high=tok.pos & high,
        c_low=c_low,
        c_high=c_high,
    )


def _clip(
    tok: Tokens, c_low: float, c_high: float, dual_clip: float | None, aggregation: Aggregation
) -> tuple[Tensor, Tensor, Tensor]:
    """The clipped surrogate's loss and its (active_pos, active_neg) masks."""
    r, adv = tok.r, tok.adv
    lo, hi = _rounded(c_low, r), _rounded(c_high, r)
    upper_neg = None if dual_clip is None else _rounded(dual_clip, r)
    # Clip: which tokens carry gradient (the bound search uses these very comparisons).
    active_pos, active_neg = token_activity(tok, c_low, c_high, dual_clip)
    active = active_pos | active_neg
    # Value of the surrogate ratio of a clipped token: min(r, c_high) for A > 0,
    # min(max(r, c_low), dual_clip) for A < 0. Active tokens keep r_t with its gradient.
    r_clipped = torch.where(tok.pos, r.clamp(max=hi), r.clamp(min=lo, max=upper_neg))
    r_eff = torch.where(active, tok.ratio, r_clipped)  # [B, T]
    loss_tok = -adv * r_eff  # [B, T]; 0 off the mask (adv is 0 there)
    return aggregation(loss_tok, tok.valid), active_pos, active_neg


def clipped_surrogate(
    tok: Tokens,
    c_low: float,
    c_high: float,
    *,
    dual_clip: float | None = 3.0,
    agg: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """clip -> per-token loss -> masked aggregation, given bounds (c_low, c_high)."""
    aggregation = Aggregation(agg, global_tokens, global_seqs, norm_len)
    loss, active_pos, active_neg = _clip(tok, c_low, c_high, dual_clip, aggregation)
    return loss, clip_metrics(tok, tok.r, active_pos, active_neg, c_low, c_high)


def check_eps(eps_low: float, eps_high: float) -> None:
    """A decoupled clip range [1 - eps_low, 1 + eps_high]: eps_low in (0, 1), eps_high > 0."""
    if not 0.0 < number("eps_low", eps_low) < 1.0:
        raise ParamError("eps_low", eps_low, "must be within (0, 1)")
    if not 0.0 < number("eps_high", eps_high) < math.inf:
        raise ParamError("eps_high", eps_high, "must be a finite number > 0")


def surrogate_dropping(
    tok: Tokens,
    drop: Tensor,
    c_low: float,
    c_high: float,
    *,
    in_denominator: bool,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """`clipped_surrogate` with the tokens in `drop` carrying neither loss nor gradient: the
    tokens Clip-Cov detaches, the tokens M2PO masks.

    in_denominator: a dropped token still counts in the aggregation's normaliser (Clip-Cov: verl
    multiplies its loss by 0) or it does not (M2PO: AReaL takes it out of the loss mask). The
    metrics count a dropped token as clipped on its side (clipfrac_low for A < 0, clipfrac_high
    for A > 0), so the clip fractions say how many tokens lost their gradient either way.
    """
    drop = drop & tok.valid
    adv = torch.where(drop, 0.0, tok.adv)
    kept = dataclasses.replace(
        tok,
        adv=adv,
        pos=adv > 0,
        neg=adv < 0,
        valid=tok.valid if in_denominator else tok.valid & ~drop,
    )
    aggregation = Aggregation(agg, global_tokens, global_seqs, norm_len)
    loss, active_pos, active_neg = _clip(kept, c_low, c_high, dual_clip, aggregation)
    return loss, clip_metrics(tok, tok.r, active_pos, active_neg, c_low, c_high, dropped=drop)
