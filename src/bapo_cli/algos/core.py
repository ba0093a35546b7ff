"""What every loss shares: the registry (`REGISTRY`, `LossEntry`, `policy_loss`), the token
preparation (`prepare_tokens`, `tokens`), the clipped surrogate (`clipped_surrogate`,
`surrogate_dropping`; on the sequence ratio, `sequence_clipped_surrogate`: GSPO, LUSPO) and the
metric set every loss reports (`surrogate_metrics`; `clip_metrics` for a loss that clips a
ratio). A loss's own module keeps its formula and what it decides per
token (which tokens carry gradient, with what weight, which count as clipped); the bookkeeping
from there to the loss and its metrics is here, the loss's inputs and aggregation in `contract`.
The conventions (activity masks, non-finite tokens, shapes, metrics) are in `losses`'s
docstring."""

from __future__ import annotations

import dataclasses
import inspect
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bapo_cli.algos.bapo_path import BoundSearch
from bapo_cli.algos.contract import LOSS_ARGS, Aggregation, LossHooks, RatioInputs
from bapo_cli.algos.registry import Registry

Tensor = torch.Tensor
# the keyword arguments of `policy_loss` that are not the loss's params
CALL_OPTIONS = ("behav_log_prob", "agg", "global_tokens", "global_seqs", "norm_len")


@dataclass(frozen=True)
class LossEntry:
    """A registered loss: its function and the dataclass of its parameters.

    `fn(log_prob, inputs, params, aggregation)` (`contract`); `params` a frozen dataclass whose
    fields (defaults + `help`) are the loss's options, validated on construction (`check()`),
    described in words (`describe()`), and read from an algo config by `read_params`.
    `searches_bounds`: the loss picks its bounds from the data with BAPO's search; then its params
    are a `BoundSearch` with a `bound_scope` and a runtime `bounds` (solved once per optimizer
    step by the trainer, or None to search the call's own tokens). `agg`: the aggregation a
    direct call (`policy_loss`) uses when none is given, the one its paper uses.
    The protocol is checked at registration, so a loss that breaks it fails on import.
    """

    name: str
    fn: Callable[..., tuple[Tensor, dict[str, Any]]]
    params: type
    searches_bounds: bool = False
    agg: str = "token-mean"

    def __post_init__(self) -> None:
        where = f"loss {self.name!r}"
        if not dataclasses.is_dataclass(self.params):
            raise TypeError(f"{where}: params must be a dataclass, got {self.params!r}")
        for method in ("check", "describe"):
            if not callable(getattr(self.params, method, None)):
                raise TypeError(f"{where}: {self.params.__name__} needs a {method}() method")
        takes = tuple(inspect.signature(self.fn).parameters)
        if takes != LOSS_ARGS:
            raise TypeError(
                f"{where}: {self.fn.__name__} takes ({', '.join(takes)}); a loss takes "
                f"({', '.join(LOSS_ARGS)})"
            )
        names = {f.name for f in dataclasses.fields(self.params)}
        if self.searches_bounds and not (
            issubclass(self.params, BoundSearch) and {"bound_scope", "bounds"} <= names
        ):
            raise TypeError(f"{where}: a bound search needs BoundSearch params with bound_scope")
        for f in dataclasses.fields(self.params):
            if f.default is dataclasses.MISSING or not f.metadata.get("help"):
                raise TypeError(
                    f"{where}: {self.params.__name__}.{f.name} needs a default and help"
                )

    def read_params(self, source: Any) -> Any:
        """The validated params, each field read by name from `source` (e.g. an algo config; a
        runtime field keeps its default); a ParamError names the field that is not allowed."""
        return self.params(
            **{
                f.name: getattr(source, f.name)
                for f in dataclasses.fields(self.params)
                if not f.metadata.get("runtime")
            }
        )

    def make_params(self, **options: Any) -> Any:
        """The params from keyword options (defaults for the rest). `dual_clip`, the algo
        group's option, is dropped for a loss that does not use it, as the config's is."""
        if "dual_clip" not in {f.name for f in dataclasses.fields(self.params)}:
            options.pop("dual_clip", None)
        return self.params(**options)

    def hooks(self, params: Any) -> LossHooks:
        """What the loss asks of the trainer (`params.hooks()`; none if it has no such method)."""
        hooks = getattr(params, "hooks", None)
        return hooks() if callable(hooks) else LossHooks()


REGISTRY: Registry[LossEntry] = Registry("loss", entry=LossEntry)


def policy_loss(
    name: str,
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    **options: Any,
) -> tuple[Tensor, dict[str, Any]]:
    """Loss `name` on plain tensors, for a caller without the trainer (another trainer, a test):
    `options` are the loss's params by field name (validated; defaults for the rest) and
    `behav_log_prob`, `agg` (default the loss's `LossEntry.agg`), `global_tokens`,
    `global_seqs`, `norm_len` (see `contract.aggregate`)."""
    entry = REGISTRY.get(name)
    call = {k: options.pop(k) for k in CALL_OPTIONS if k in options}
    params = entry.make_params(**options)
    inputs = RatioInputs(
        old_log_prob, advantages, mask, behav_log_prob=call.pop("behav_log_prob", None)
    )
    aggregation = Aggregation.checked(log_prob.dim(), call.pop("agg", entry.agg), **call)
    return entry.fn(log_prob, inputs, params, aggregation)


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


def check_shapes(
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
    advantages = check_shapes(log_prob, old_log_prob, advantages, mask)
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


def tokens(log_prob: Tensor, inputs: RatioInputs) -> Tokens:
    """`prepare_tokens` of a loss's inputs: the first line of every loss."""
    return prepare_tokens(log_prob, inputs.old_log_prob, inputs.advantages, inputs.mask)


# struct's codes for the dtypes a ratio has (float32, float64): rounded without a tensor
_PACKED = {torch.float32: "f", torch.float64: "d"}


def rounded(value: float, like: Tensor) -> float:
    """`value` rounded to `like`'s dtype, as a Python float. The search rounds the path values
    the same way, and comparing a tensor with a number its dtype represents exactly gives the
    same answer whatever precision torch compares in (and needs no device transfer). Float32
    and float64 round on the host without a tensor (IEEE round-to-nearest-even, as torch's
    cast); another dtype through a host tensor."""
    code = _PACKED.get(like.dtype)
    if code is None:
        return torch.tensor(value, dtype=like.dtype).item()
    try:
        return struct.unpack(code, struct.pack(code, value))[0]
    except OverflowError:  # beyond float32's range: torch's cast gives inf
        return math.copysign(math.inf, value)


@dataclass(frozen=True)
class HostMetric:
    """A metric finished on the host: `fn` of a 0-dim device value, applied when the trainer
    reads the update's metrics (one transfer per update), so the loss never waits for the
    device. VESPO's c_high, math.exp of a log weight: the number it was before, bit for bit
    (torch's exp may differ from math's in the last bit)."""

    value: Tensor
    fn: Callable[[float], float]

    def item(self) -> float:
        return self.fn(self.value.item())

    def __float__(self) -> float:
        return self.item()


def _bound_metric(value: float | Tensor | HostMetric) -> Tensor | HostMetric:
    """A bound as its metric: a float64 0-dim tensor (on the device when the loss computed the
    bound there: no host read), or a `HostMetric` as it is."""
    if isinstance(value, HostMetric):
        return value
    if isinstance(value, Tensor):
        return value.detach().to(torch.float64)
    return torch.tensor(float(value), dtype=torch.float64)


def token_activity(
    tok: Tokens, c_low: float, c_high: float, dual_clip: float | None = None
) -> tuple[Tensor, Tensor]:
    """(active_pos, active_neg) bool masks: A > 0 and r < c_high; A < 0 and c_low < r (< dual).

    Strict comparisons in the ratio's dtype, the same ones the bound search counts with.
    """
    r = tok.r
    active_pos = tok.pos & (r < rounded(c_high, r))  # A > 0: inside while r < c_high
    active_neg = tok.neg & (r > rounded(c_low, r))  # A < 0: inside while r > c_low ...
    if dual_clip is not None:
        active_neg = active_neg & (r < rounded(dual_clip, r))  # ... and below the dual clip
    return active_pos, active_neg


Bound = float | Tensor | HostMetric  # a reported bound (`surrogate_metrics`)


def largest_ratio(r: Tensor, where: Tensor) -> Tensor:
    """max(1, the largest r over `where`), float64, 0-dim, on r's device (1 where `where` holds
    nothing or the largest is not finite): the c_high a loss without an upper clip reports
    (TOPR; M2PO without its ratio clip), read with the update's metrics, not here."""
    with torch.no_grad():
        if r.numel() == 0:
            return torch.ones((), dtype=torch.float64, device=r.device)
        top = torch.where(where, r, 0.0).max().double()
        return torch.where(torch.isfinite(top), top.clamp(min=1.0), 1.0)


def surrogate_metrics(
    tok: Tokens,
    bounds: tuple[Bound, Bound],
    clipped: tuple[Tensor, Tensor],
    *,
    weight: Tensor,
    ratio: Tensor | None = None,
    active: Tensor | None = None,
) -> dict[str, Any]:
    """The metric set every loss reports (module docstring), from what the loss decided per token.

    bounds: (c_low, c_high) the loss reports: numbers, 0-dim tensors (a bound the loss computed
    from the tokens stays on the device) or `HostMetric`s. clipped: the tokens counted in
    (clipfrac_low, clipfrac_high). weight: the gradient weight per unit |A| of a token,
    |d loss_t / d log pi_t| / |A_t| before aggregation (r_t for an active token of the clipped
    surrogate; CISPO: the clipped IS weight; SAPO: the gate's); `w |A|` summed over the active
    positive / negative tokens gives the sums rho is the share of. ratio: the ratio the loss
    clips or gates (default r_t; GSPO: its sequence's s_i), detached. active: the tokens with
    gradient (default every valid token with A != 0).
    """
    ratio = tok.r if ratio is None else ratio
    active_pos = tok.pos if active is None else tok.pos & active
    active_neg = tok.neg if active is None else tok.neg & active
    c_low, c_high = bounds
    with torch.no_grad():
        n = tok.n_valid.clamp(min=1)
        mass = weight * tok.adv.abs()  # [B, T]; 0 off the mask (adv is 0 there)
        r_valid = torch.where(tok.valid, ratio, 0.0)
        # w |A| summed over the active tokens, in float64 like the search's sums
        pos_sum = torch.where(active_pos, mass, 0.0).sum(dtype=torch.float64)
        neg_sum = torch.where(active_neg, mass, 0.0).sum(dtype=torch.float64)
        metrics: dict[str, Any] = {
            "clipfrac_low": clipped[0].sum() / n,
            "clipfrac_high": clipped[1].sum() / n,
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
            c_low=_bound_metric(c_low),
            c_high=_bound_metric(c_high),
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
    active: Tensor,
    bounds: tuple[float, float],
    dropped: Tensor | None = None,
) -> dict[str, Any]:
    """`surrogate_metrics` of a loss that clips `ratio` (r_t; GSPO: s_i) at bounds (c_low,
    c_high): the clipped ratio is its gradient weight, and a token at or beyond its side's bound
    (A < 0: ratio <= c_low, A > 0: ratio >= c_high) counts as clipped, as does one in
    `dropped`. active: the tokens with gradient."""
    low, high = ratio <= rounded(bounds[0], ratio), ratio >= rounded(bounds[1], ratio)
    if dropped is not None:
        low, high = low | dropped, high | dropped
    clipped = (tok.neg & low, tok.pos & high)
    return surrogate_metrics(tok, bounds, clipped, weight=ratio, ratio=ratio, active=active)


def _clip(
    tok: Tokens, bounds: tuple[float, float], dual_clip: float | None, aggregation: Aggregation
) -> tuple[Tensor, Tensor]:
    """The clipped surrogate's loss and the tokens that carry gradient."""
    r, adv = tok.r, tok.adv
    lo, hi = rounded(bounds[0], r), rounded(bounds[1], r)
    upper_neg = None if dual_clip is None else rounded(dual_clip, r)
    # Clip: which tokens carry gradient (the bound search uses these very comparisons).
    active_pos, active_neg = token_activity(tok, *bounds, dual_clip)
    active = active_pos | active_neg
    # Value of the surrogate ratio of a clipped token: min(r, c_high) for A > 0,
    # min(max(r, c_low), dual_clip) for A < 0. Active tokens keep r_t with its gradient.
    r_clipped = torch.where(tok.pos, r.clamp(max=hi), r.clamp(min=lo, max=upper_neg))
    r_eff = torch.where(active, tok.ratio, r_clipped)  # [B, T]
    loss_tok = -adv * r_eff  # [B, T]; 0 off the mask (adv is 0 there)
    return aggregation(loss_tok, tok.valid), active


def clipped_surrogate(
    tok: Tokens, bounds: tuple[float, float], dual_clip: float | None, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """clip -> per-token loss -> masked aggregation, given bounds (c_low, c_high)."""
    loss, active = _clip(tok, bounds, dual_clip, aggregation)
    return loss, clip_metrics(tok, tok.r, active, bounds)


def surrogate_dropping(
    tok: Tokens,
    drop: Tensor,
    bounds: tuple[float, float],
    dual_clip: float | None,
    aggregation: Aggregation,
    *,
    in_denominator: bool,
) -> tuple[Tensor, dict[str, Any]]:
    """`clipped_surrogate` with the tokens in `drop` carrying neither loss nor gradient: the
    tokens Clip-Cov detaches, the tokens M2PO masks.

    in_denominator: a dropped token still counts in the aggregation's normaliser (Clip-Cov: verl
    multiplies its loss by 0) or it does not (M2PO: AReaL takes it out of the loss mask; with a
    mini-batch normaliser, `Aggregation.narrowed`: the call's kept tokens take the call's share
    of it, as AReaL weighs each micro-batch's kept-token mean by its share of the tokens). The
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
    if not in_denominator:  # the dropped tokens leave the call's share of the normaliser too
        aggregation = aggregation.narrowed(tok.valid, kept.valid)
    loss, active = _clip(kept, bounds, dual_clip, aggregation)
    return loss, clip_metrics(tok, tok.r, active, bounds, dropped=drop)


def sequence_clipped_surrogate(
    tok: Tokens, bounds: tuple[float, float], dual_clip: float | None, aggregation: Aggregation
) -> tuple[Tensor, dict[str, Any]]:
    """The clipped surrogate on the sequence ratio s_i = exp(mean_t log r_{i,t}) over the
    sequence's valid tokens (GSPO; LUSPO with another aggregation), [B, T] tokens.

    Written in GSPO's GSPO-token form, s_{i,t} = sg(s_i) * pi(y_t) / sg(pi(y_t)): every token has
    the value s_i and the gradient s_i grad log pi(y_t), so summed over a sequence's tokens the
    gradient is |y_i| A_i grad s_i and averaged over them A_i grad s_i. A whole sequence is
    clipped or not: a positive one carries gradient iff s_i < c_high, a negative one iff
    c_low < s_i (< dual_clip, applied to s_i)."""
    with torch.no_grad():
        n_seq = tok.valid.sum(dim=-1).clamp(min=1).to(tok.r.dtype)
        seq_ratio = torch.exp(tok.log_ratio.sum(dim=-1) / n_seq)  # s_i, [B]
        s = torch.where(tok.valid, seq_ratio[:, None], 1.0)  # s_i on each of its tokens
    lo, hi = rounded(bounds[0], s), rounded(bounds[1], s)
    upper_neg = None if dual_clip is None else rounded(dual_clip, s)
    active_neg = tok.neg & (s > lo)
    if upper_neg is not None:
        active_neg = active_neg & (s < upper_neg)
    active = (tok.pos & (s < hi)) | active_neg
    s_token = s * (tok.ratio / tok.r)  # value s_i, gradient s_i * grad log pi(y_t)
    s_clipped = torch.where(tok.pos, s.clamp(max=hi), s.clamp(min=lo, max=upper_neg))
    loss_tok = -tok.adv * torch.where(active, s_token, s_clipped)
    return aggregation(loss_tok, tok.valid), clip_metrics(tok, s, active, bounds)
