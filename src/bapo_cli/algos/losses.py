"""Clipped policy-gradient losses: PPO, clip-higher (DAPO) and BAPO, as pure functions on tensors.

All three minimise the negated PPO surrogate, token by token,

    loss_t = -min(r_t A_t, clip(r_t, c_low, c_high) A_t),   r_t = exp(log pi_theta - log pi_old)

and differ only in where the bounds come from: `ppo` uses (1 - eps, 1 + eps), `clip_higher` uses
(1 - eps_low, 1 + eps_high) (DAPO: 0.2 / 0.28), `bapo` chooses them per update with Algorithm 1
(`bounds.adaptive_bounds`) or takes them already solved (`bounds=`, e.g. from a `BoundAccumulator`
over all micro-batches and ranks of the optimizer step). GRPO is not a loss: it is the `ppo` loss
with group-normalised advantages (`advantages.grpo`).

Activity is decided by explicit masks, never by torch.min/max tie-breaking, with the same strict
comparisons as the bound search (in the ratio's dtype): a positive token (A > 0) carries gradient
iff r < c_high, a negative token (A < 0) iff c_low < r (< dual_clip). Clipped tokens contribute
their clipped value to the loss and exactly zero gradient.

Dual clip (negative advantages, as verl): loss_t = min(max(-A r, -A clip(r)), -A * dual_clip);
default 3.0, None turns it off. With BAPO, negative tokens at r >= dual_clip carry no gradient
whatever c_low is, so they are left out of the search's mass.

Non-finite tokens: a token whose ratio, advantage or loss (r * A) is NaN or infinite is masked
out (zero loss, zero gradient) and counted in the `nonfinite_tokens` metric, so one bad token
does not poison the step. Shapes: [B, T] (advantages may be [B], one per sequence), or flat [N]
with agg="token-mean". Gradient-accumulation normalisers (`global_tokens`, `global_seqs`) make
the micro-batch losses sum to the exact mini-batch loss.

Returns ``(loss, metrics)``; every loss reports the same metrics, detached 0-dim tensors (no
host sync), averaged over the valid tokens unless said otherwise:

    clipfrac_low / clipfrac_high  A < 0 with r <= c_low / A > 0 with r >= c_high (dual-clipped
                                  negatives are in neither)
    ppo_kl                        mean of log pi_rollout - log pi_theta
    ratio_mean, ratio_max         of r_t
    pos_mass, neg_mass            r |A| of the active positive / negative tokens, per valid token
    active_tokens                 count of gradient-carrying tokens (0: the loss has no gradient)
    nonfinite_tokens              count of masked-out non-finite tokens
    c_low, c_high                 the bounds the loss clipped with (CPU tensors)
    rho                           positive share of the active mass, pos / (pos + neg) (1 if 0/0)
    rho_pos, rho_neg              the sums rho is the share of, in the bound search's units
                                  (sum of w r |A|, not per token): fixed bounds: pos_mass and
                                  neg_mass times the valid tokens; BAPO: the search's P and N
    rho_before, search_steps      BAPO: rho at the search's start point and the steps it walked
                                  (with `rho`, c_low and c_high: Python floats from the search);
                                  fixed bounds: rho_before = rho, search_steps = 0
    rho_pos_before, rho_neg_before  the sums rho_before is the share of (fixed: = rho_pos/neg)

A trainer averages rho over micro-batches and updates by these sums, sum(pos) / sum(pos + neg),
so a call without active mass (rho = 1 by convention) does not count as rho = 1.

Each loss is registered with the dataclass of its parameters (`LossEntry`): fields with defaults
and help, a `check()` and a `describe()`. The CLI builds the `algo` schema of each loss from it
and maps the config onto the loss's keyword arguments by field name, so a new loss is this file's
function and dataclass, a YAML in conf/algo/ and a test (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.bounds import (
    PAPER,
    RULES,
    WEIGHTINGS,
    BapoBounds,
    BoundAccumulator,
    BoundSearch,
    compute_dtype,
    range_pair,
)
from bapo_cli.algos.params import ParamError, number, one_of, param
from bapo_cli.algos.registry import Registry

__all__ = [
    "AGGREGATIONS",
    "BOUND_SCOPES",
    "BapoParams",
    "ClipHigherParams",
    "LossEntry",
    "PPOParams",
    "Tokens",
    "aggregate",
    "prepare_tokens",
    "token_activity",
    "REGISTRY",
    "WEIGHTINGS",
    "bapo_loss",
    "clip_higher_loss",
    "clipped_surrogate",
    "policy_loss",
    "ppo_loss",
    "search_inputs",
]

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
    The protocol is checked at registration, so a loss that breaks it fails on import.
    """

    name: str
    fn: Callable[..., tuple[Tensor, dict[str, Any]]]
    params: type
    searches_bounds: bool = False

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
    loss = aggregate(
        loss_tok,
        tok.valid,
        agg,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_len=norm_len,
    )
    clipped_low = tok.neg & (r <= lo)
    clipped_high = tok.pos & (r >= hi)
    metrics = surrogate_metrics(
        tok,
        ratio=r,
        weight=r,
        active_pos=active_pos,
        active_neg=active_neg,
        clipped_low=clipped_low,
        clipped_high=clipped_high,
        c_low=c_low,
        c_high=c_high,
    )
    return loss, metrics


# --------------------------------------------------------------------------------------------
# The registered losses, each with the dataclass of its parameters
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PPOParams:
    """Symmetric clipping [1 - eps, 1 + eps] (ppo, grpo)."""

    eps: float = param(0.2, "clip range: ratios outside [1 - eps, 1 + eps] are clipped")

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        if not 0.0 < number("eps", self.eps) < 1.0:
            raise ParamError("eps", self.eps, "must be within (0, 1)")

    def describe(self) -> str:
        return f"[{1 - self.eps:g}, {1 + self.eps:g}]"


@REGISTRY.register("ppo", params=PPOParams)
def ppo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps: float = PPOParams.eps,
    dual_clip: float | None = 3.0,
    agg: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """PPO-clip with symmetric bounds (1 - eps, 1 + eps); with GRPO advantages this is GRPO."""
    PPOParams(eps=eps)
    return clip_higher_loss(
        log_prob,
        old_log_prob,
        advantages,
        mask,
        eps_low=eps,
        eps_high=eps,
        dual_clip=dual_clip,
        agg=agg,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_len=norm_len,
    )


def check_eps(eps_low: float, eps_high: float) -> None:
    """A decoupled clip range [1 - eps_low, 1 + eps_high]: eps_low in (0, 1), eps_high > 0."""
    if not 0.0 < number("eps_low", eps_low) < 1.0:
        raise ParamError("eps_low", eps_low, "must be within (0, 1)")
    if not 0.0 < number("eps_high", eps_high) < math.inf:
        raise ParamError("eps_high", eps_high, "must be a finite number > 0")


@dataclass(frozen=True)
class ClipHigherParams:
    """Decoupled clip range [1 - eps_low, 1 + eps_high] (DAPO's clip-higher)."""

    eps_low: float = param(0.2, "lower clip range: c_low = 1 - eps_low")
    eps_high: float = param(0.28, "upper clip range: c_high = 1 + eps_high (DAPO default)")

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        check_eps(self.eps_low, self.eps_high)

    def describe(self) -> str:
        return f"[{1 - self.eps_low:g}, {1 + self.eps_high:g}]"


@REGISTRY.register("clip_higher", params=ClipHigherParams)
def clip_higher_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = ClipHigherParams.eps_low,
    eps_high: float = ClipHigherParams.eps_high,
    dual_clip: float | None = 3.0,
    agg: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """Asymmetric bounds (1 - eps_low, 1 + eps_high), DAPO's clip-higher (0.2 / 0.28)."""
    ClipHigherParams(eps_low=eps_low, eps_high=eps_high)
    c_low, c_high = 1.0 - float(eps_low), 1.0 + float(eps_high)
    dual_clip = _check_dual_clip(dual_clip, c_low)
    _check_agg(agg, log_prob.dim())
    tok = prepare_tokens(log_prob, old_log_prob, advantages, mask)
    return clipped_surrogate(
        tok,
        c_low,
        c_high,
        dual_clip=dual_clip,
        agg=agg,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_len=norm_len,
    )


def _search_key_mass(tok: Tokens, old_log_prob: Tensor, weighting: str) -> tuple[Tensor, Tensor]:
    """key = copysign(r, A) and mass = w r |A| for the bound search, from prepared tokens (the
    accumulator, built with the loss's dual clip, leaves out dual-clipped negatives itself)."""
    cd = compute_dtype(tok.r.dtype)
    adv = tok.adv.to(cd)
    key = torch.copysign(tok.r.to(cd), adv)  # +r for A > 0, -r for A < 0
    mass = key * adv  # r |A| (same signs); 0 on invalid tokens (A = 0 there)
    if weighting == "rollout_prob":  # paper Eq. 8: w = pi_rollout(y_t)
        w = torch.where(tok.valid, old_log_prob.detach().exp(), 0.0)  # as `search_inputs`
        mass = mass * w.to(cd)
    return key, mass


def search_inputs(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    dual_clip: float | None = 3.0,
    weighting: str = PAPER.weighting,
    rule: str = PAPER.rule,
) -> dict[str, Tensor]:
    """The (ratio, advantages, mask, weights) that `bapo_loss` feeds its bound search, for a
    trainer that accumulates over micro-batches: ``acc.add(**search_inputs(...))``. Applies the
    same non-finite masking, dual-clip exclusion and weighting as the loss (rule=recipe keeps the
    dual-clipped negatives: the recipe counts them, and its accumulator, built with the dual
    clip, sets them apart)."""
    one_of("weighting", weighting, WEIGHTINGS)
    one_of("rule", rule, RULES)
    with torch.no_grad():
        tok = prepare_tokens(log_prob, old_log_prob, advantages, mask)
        keep = tok.valid
        if dual_clip is not None and rule == "paper":
            keep = keep & ~(tok.neg & (tok.r >= _rounded(dual_clip, tok.r)))
        weights = None
        if weighting == "rollout_prob":
            weights = torch.where(tok.valid, old_log_prob.detach().exp(), 0.0)
    return {"ratio": tok.r, "advantages": tok.adv, "mask": keep, "weights": weights}


BOUND_SCOPES = ("minibatch", "microbatch")


@dataclass(frozen=True)
class BapoParams(BoundSearch):
    """BAPO: per-update adaptive (c_low, c_high) so positive tokens carry a share rho0 of loss.

    The search's settings are `BoundSearch`'s (paper defaults); training also keeps the bounds a
    trust region around r = 1 (c_low within (0, 1], c_high >= 1) and chooses where to search.
    """

    bound_scope: str = param(
        "minibatch",
        "minibatch = paper (one search per optimizer step over all micro-batches and ranks); "
        "microbatch = cheaper approximation, one search per micro-batch of each rank",
        trainer=True,
    )

    def check(self) -> None:
        low, high = (
            range_pair("low_range", self.low_range),
            range_pair("high_range", self.high_range),
        )
        if not (low[0] > 0.0 and low[1] <= 1.0):
            raise ParamError("low_range", self.low_range, "c_low must stay within (0, 1]")
        if high[0] < 1.0:
            raise ParamError("high_range", self.high_range, "c_high must stay >= 1")
        super().check()
        one_of("bound_scope", self.bound_scope, BOUND_SCOPES)

    def describe(self) -> str:
        lo, hi = self.low_range, self.high_range
        if self.rule == "recipe":
            return (
                f"adaptive (public recipe): c_low {lo[0]}→{lo[1]} by {self.low_step}, then "
                f"c_high {hi[0]}→{hi[1]} by {self.high_step}, clipped tokens at their clipped "
                f"value, until P/N ≥ {self.rho0}/(1-{self.rho0}) (per {self.bound_scope})"
            )
        return (
            f"adaptive: c_high {hi[0]}→{hi[1]} by {self.high_step}, then c_low {lo[0]}→{lo[1]} "
            f"by {self.low_step}, until rho ≥ {self.rho0} (per {self.bound_scope})"
        )


@REGISTRY.register("bapo", params=BapoParams, searches_bounds=True)
def bapo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    rho0: float = PAPER.rho0,
    low_range: tuple[float, float] = PAPER.low_range,
    high_range: tuple[float, float] = PAPER.high_range,
    low_step: float = PAPER.low_step,
    high_step: float = PAPER.high_step,
    weighting: str = PAPER.weighting,
    rule: str = PAPER.rule,
    bounds: BapoBounds | None = None,
    group: Any = None,
    dual_clip: float | None = 3.0,
    agg: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """BAPO: the clipped surrogate with bounds chosen by Algorithm 1 (see `bounds`).

    bounds=None searches on this call's tokens (all-reduced over `group` if given): called once
    per optimizer step that is the paper's method; called per micro-batch it is the cheaper
    per-micro-batch approximation. For the exact per-step search with gradient accumulation,
    sum a `BoundAccumulator` over the micro-batches (`search_inputs`), `solve` once and pass the
    result as `bounds` (then rho0, ranges, steps, weighting and group are not used).
    The search settings (rho0 ... weighting) are `bounds.BoundSearch`'s, with its defaults.
    """
    _check_agg(agg, log_prob.dim())
    if bounds is None:
        search = BoundSearch(
            rho0=rho0,
            low_range=low_range,
            high_range=high_range,
            low_step=low_step,
            high_step=high_step,
            weighting=weighting,
            rule=rule,
        )
        dual_clip = _check_dual_clip(dual_clip, search.path().low_values[-1])
        acc = search.accumulator(dual_clip)
        tok = prepare_tokens(log_prob, old_log_prob, advantages, mask)
        if isinstance(acc, BoundAccumulator):
            key, mass = _search_key_mass(tok, old_log_prob, search.weighting)
            acc.add_keyed(key, mass, tok.r.dtype)
        else:  # the recipe's search also sums |A| per bin: the plain interface
            acc.add(
                **search_inputs(
                    log_prob,
                    old_log_prob,
                    advantages,
                    mask,
                    dual_clip=dual_clip,
                    weighting=search.weighting,
                    rule=search.rule,
                )
            )
        bounds = acc.solve(search.rho0, group=group)
    elif not isinstance(bounds, BapoBounds):
        raise ParamError("bounds", bounds, "must be a BapoBounds or None")
    else:
        dual_clip = _check_dual_clip(dual_clip, bounds.c_low)
        tok = prepare_tokens(log_prob, old_log_prob, advantages, mask)
    loss, metrics = clipped_surrogate(
        tok,
        bounds.c_low,
        bounds.c_high,
        dual_clip=dual_clip,
        agg=agg,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_len=norm_len,
    )
    metrics.update(
        c_low=bounds.c_low,
        c_high=bounds.c_high,
        rho_before=bounds.rho_before,
        rho=bounds.rho,
        rho_pos=bounds.pos,
        rho_neg=bounds.neg,
        rho_pos_before=bounds.pos_before,
        rho_neg_before=bounds.neg_before,
        search_steps=float(bounds.steps),
    )
    return loss, metrics


# --------------------------------------------------------------------------------------------
# Beyond the per-token clipped surrogate: GSPO (sequence-level ratio), CISPO (clipped IS weight),
# SAPO (soft gate). Formulas and papers: docs/algorithms.md.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GSPOParams:
    """GSPO: clip the length-normalised sequence ratio s_i to [1 - eps_low, 1 + eps_high]."""

    eps_low: float = param(3e-4, "lower clip range of the sequence ratio (GSPO paper: 3e-4)")
    eps_high: float = param(4e-4, "upper clip range of the sequence ratio (GSPO paper: 4e-4)")

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        check_eps(self.eps_low, self.eps_high)

    def describe(self) -> str:
        return f"sequence ratio in [{1 - self.eps_low:g}, {1 + self.eps_high:g}]"


@REGISTRY.register("gspo", params=GSPOParams)
def gspo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = GSPOParams.eps_low,
    eps_high: float = GSPOParams.eps_high,
    dual_clip: float | None = 3.0,
    agg: str = "seq-mean-token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """GSPO (arXiv 2507.18071): the clipped surrogate on the sequence ratio
    s_i = exp(mean_t log r_{i,t}) over the sequence's valid tokens.

    Written in the paper's GSPO-token form, s_{i,t} = sg(s_i) * pi(y_t) / sg(pi(y_t)): every
    token has the value s_i and the gradient s_i grad log pi(y_t), so with
    agg="seq-mean-token-mean" (the default, the paper's 1/G sum_i) the gradient is exactly
    GSPO's, sum_i A_i grad s_i / G, and per-token advantages (rollout.tis_cap) still apply.
    A whole sequence is clipped or not: a positive one carries gradient iff s_i < c_high, a
    negative one iff c_low < s_i (< dual_clip, applied to s_i). Needs [B, T] tensors.
    """
    GSPOParams(eps_low=eps_low, eps_high=eps_high)
    if log_prob.dim() != 2:
        raise ValueError(
            f"gspo needs [B, T] tensors (its ratio is per sequence), got shape "
            f"{tuple(log_prob.shape)}"
        )
    c_low, c_high = 1.0 - float(eps_low), 1.0 + float(eps_high)
    dual_clip = _check_dual_clip(dual_clip, c_low)
    _check_agg(agg, log_prob.dim())
    tok = prepare_tokens(log_prob, old_log_prob, advantages, mask)
    with torch.no_grad():
        n_seq = tok.valid.sum(dim=-1).clamp(min=1).to(tok.r.dtype)
        seq_ratio = torch.exp(tok.log_ratio.sum(dim=-1) / n_seq)  # s_i, [B]
        s = torch.where(tok.valid, seq_ratio[:, None], 1.0)  # s_i on each of its tokens
    lo, hi = _rounded(c_low, s), _rounded(c_high, s)
    upper_neg = None if dual_clip is None else _rounded(dual_clip, s)
    active_pos = tok.pos & (s < hi)
    active_neg = tok.neg & (s > lo)
    if upper_neg is not None:
        active_neg = active_neg & (s < upper_neg)
    active = active_pos | active_neg
    s_token = s * (tok.ratio / tok.r)  # value s_i, gradient s_i * grad log pi(y_t)
    s_clipped = torch.where(tok.pos, s.clamp(max=hi), s.clamp(min=lo, max=upper_neg))
    loss_tok = -tok.adv * torch.where(active, s_token, s_clipped)
    loss = aggregate(
        loss_tok,
        tok.valid,
        agg,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_len=norm_len,
    )
    metrics = surrogate_metrics(
        tok,
        ratio=s,
        weight=s,
        active_pos=active_pos,
        active_neg=active_neg,
        clipped_low=tok.neg & (s <= lo),
        clipped_high=tok.pos & (s >= hi),
        c_low=c_low,
        c_high=c_high,
    )
    return loss, metrics


@dataclass(frozen=True)
class CISPOParams:
    """CISPO: the detached IS weight clipped to [max(0, 1 - eps_low), 1 + eps_high]."""

    eps_low: float = param(
        1.0, "lower clip range of the IS weight; >= 1 = no lower bound (MiniMax-M1's setting)"
    )
    eps_high: float = param(
        0.28,
        "upper clip range of the IS weight: w <= 1 + eps_high (MiniMax-M1 tunes only this one "
        "and does not publish it; 0.28 as verl's and Trinity-RFT's CISPO)",
    )

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        if not 0.0 < number("eps_low", self.eps_low) < math.inf:
            raise ParamError("eps_low", self.eps_low, "must be a finite number > 0")
        if not 0.0 < number("eps_high", self.eps_high) < math.inf:
            raise ParamError("eps_high", self.eps_high, "must be a finite number > 0")

    def describe(self) -> str:
        return f"IS weight clipped to [{max(0.0, 1 - self.eps_low):g}, {1 + self.eps_high:g}]"


@REGISTRY.register("cispo", params=CISPOParams)
def cispo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = CISPOParams.eps_low,
    eps_high: float = CISPOParams.eps_high,
    dual_clip: float | None = 3.0,
    agg: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, Eq. 4): loss_t = -sg(clip(r_t, c_low, c_high)) A_t
    log pi_theta(y_t), c_low = max(0, 1 - eps_low), c_high = 1 + eps_high.

    The weight, not the token, is clipped: every valid token with A != 0 carries gradient
    -w_t A_t grad log pi (a low-probability token with a large ratio keeps the gradient w = c_high
    instead of none). clipfrac_low / clipfrac_high count the tokens whose weight was clipped
    (either sign). dual_clip is not used: the weight is already at most c_high.
    """
    CISPOParams(eps_low=eps_low, eps_high=eps_high)
    c_low, c_high = max(0.0, 1.0 - float(eps_low)), 1.0 + float(eps_high)
    _check_agg(agg, log_prob.dim())
    tok = prepare_tokens(log_prob, old_log_prob, advantages, mask)
    lo, hi = _rounded(c_low, tok.r), _rounded(c_high, tok.r)
    weight = tok.r.clamp(min=lo, max=hi)  # detached IS weight
    logp = torch.where(tok.valid, log_prob, 0.0)  # no 0 * inf on masked or non-finite tokens
    loss_tok = -tok.adv * weight * logp
    loss = aggregate(
        loss_tok,
        tok.valid,
        agg,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_len=norm_len,
    )
    signed = tok.pos | tok.neg
    metrics = surrogate_metrics(
        tok,
        ratio=tok.r,
        weight=weight,
        active_pos=tok.pos,
        active_neg=tok.neg,
        clipped_low=signed & (tok.r <= lo) if c_low > 0 else torch.zeros_like(signed),
        clipped_high=signed & (tok.r >= hi),
        c_low=c_low,
        c_high=c_high,
    )
    return loss, metrics


# Where the soft gate's gradient weight sech^2(tau (r - 1) / 2) has fallen to one half:
# |tau (r - 1)| = 2 arcosh(sqrt 2) = 2 ln(1 + sqrt 2).
SAPO_HALF_WIDTH = 2.0 * math.log(1.0 + math.sqrt(2.0))


@dataclass(frozen=True)
class SAPOParams:
    """SAPO: a sigmoid gate instead of a hard clip, sharper for negative advantages."""

    tau_pos: float = param(1.0, "gate temperature for A > 0 (SAPO paper: 1.0)")
    tau_neg: float = param(1.05, "gate temperature for A < 0 (SAPO paper: 1.05)")

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        for name in ("tau_pos", "tau_neg"):
            if not 0.0 < number(name, getattr(self, name)) < math.inf:
                raise ParamError(name, getattr(self, name), "must be a finite number > 0")

    def describe(self) -> str:
        return f"soft gate, tau {self.tau_pos:g} (A > 0) / {self.tau_neg:g} (A < 0)"

    def half_bounds(self) -> tuple[float, float]:
        """(c_low, c_high): where a negative / positive token's gate weight has halved."""
        return (
            max(0.0, 1.0 - SAPO_HALF_WIDTH / float(self.tau_neg)),
            1.0 + SAPO_HALF_WIDTH / float(self.tau_pos),
        )


@REGISTRY.register("sapo", params=SAPOParams)
def sapo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    tau_pos: float = SAPOParams.tau_pos,
    tau_neg: float = SAPOParams.tau_neg,
    dual_clip: float | None = 3.0,
    agg: str = "seq-mean-token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347): loss_t = -A_t f(r_t),
    f(r) = (4 / tau) sigmoid(tau (r - 1)), tau = tau_pos if A > 0 else tau_neg.

    Its gradient is -A_t g(r_t) r_t grad log pi with the gate g(r) = 4 s (1 - s) =
    sech^2(tau (r - 1) / 2), s = sigmoid(tau (r - 1)): 1 on-policy, decaying smoothly off-policy
    instead of dropping to 0 at a bound. Every valid token with A != 0 carries gradient. SAPO has
    no bounds; c_low / c_high report where the gate has halved (1 -/+ 2 ln(1 + sqrt 2) / tau,
    c_low at least 0), and clipfrac_low / clipfrac_high count the tokens beyond them.
    dual_clip is not used: f is bounded by 4 / tau.
    """
    params = SAPOParams(tau_pos=tau_pos, tau_neg=tau_neg)
    _check_agg(agg, log_prob.dim())
    tok = prepare_tokens(log_prob, old_log_prob, advantages, mask)
    tau = torch.where(tok.pos, float(tau_pos), float(tau_neg)).to(tok.r.dtype)
    loss_tok = -tok.adv * (4.0 / tau) * torch.sigmoid(tau * (tok.ratio - 1.0))
    loss = aggregate(
        loss_tok,
        tok.valid,
        agg,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_len=norm_len,
    )
    c_low, c_high = params.half_bounds()
    with torch.no_grad():
        gate = torch.sigmoid(tau * (tok.r - 1.0))
        weight = 4.0 * gate * (1.0 - gate) * tok.r
    lo, hi = _rounded(c_low, tok.r), _rounded(c_high, tok.r)
    metrics = surrogate_metrics(
        tok,
        ratio=tok.r,
        weight=weight,
        active_pos=tok.pos,
        active_neg=tok.neg,
        clipped_low=tok.neg & (tok.r <= lo) if c_low > 0 else torch.zeros_like(tok.neg),
        clipped_high=tok.pos & (tok.r >= hi),
        c_low=c_low,
        c_high=c_high,
    )
    return loss, metrics
