"""What both bound searches share, owned here so that they import it and not each other: the
settings (`BoundSearch`, `PAPER`), the fixed path of bound pairs (`BoundPath`), the result
(`BapoBounds`) and the accumulator's base (`PathAccumulator`: the path, the dual clip, the bin
sums, their one all-reduce and host read). The paper's Algorithm 1 (`bapo_algorithm1`) and the
authors' public recipe (`bapo_recipe`) subclass it, each registering under its `rule`, so that
`BoundSearch.accumulator` picks one by name without importing either. What the search does and
why: `bounds` (the family's module docstring and entry point)."""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from bapo_cli.algos.params import ParamError, number, one_of, param

# Token weight w in rho: 1, or pi_rollout(y_t) (the paper's Eq. 8).
WEIGHTINGS = ("none", "rollout_prob")
# paper: Algorithm 1 as written above; recipe: the authors' public verl recipe (`RecipeAccumulator`)
RULES = ("paper", "recipe")
# The recipe's target test: P / (N + RECIPE_EPS) >= target (its `eps`).
RECIPE_EPS = 1e-8

# A path longer than this is a configuration mistake (e.g. a step of 1e-9), not a search.
MAX_PATH_POINTS = 100_000
# Tolerance in units of one step when counting how many steps fit into a range.
STEP_TOLERANCE = 1e-9


@dataclass(frozen=True)
class BapoBounds:
    """Result of the search; plain Python numbers, ready to log or to pass to `bapo_loss`.

    c_low, c_high: the chosen bounds. rho_before: rho at the start point (a_low, a_high).
    rho: rho at the chosen point. steps: path steps taken (0 = start point).
    pos_before, neg_before / pos, neg: the sums P and N that rho_before / rho are the shares of
    (w r |A| over the searched tokens, all ranks summed), so that a caller can weight rho by mass
    across several searches: sum(pos) / sum(pos + neg), where a search with no mass adds nothing
    (its rho is 1 only by the 0/0 convention).
    """

    c_low: float
    c_high: float
    rho_before: float
    rho: float
    steps: int
    pos_before: float = 0.0
    neg_before: float = 0.0
    pos: float = 0.0
    neg: float = 0.0


def range_pair(name: str, value: Any) -> tuple[float, float]:
    """(min, max) of a range such as `low_range`: two numbers with min <= max."""
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ParamError(name, value, "must be [min, max], two numbers") from None
    if lo > hi:
        raise ParamError(name, value, "min must be <= max")
    return lo, hi


def _check_range(name: str, value: Any) -> tuple[float, float]:
    lo, hi = range_pair(name, value)
    if not (lo > 0.0 and hi < math.inf):
        raise ParamError(name, value, "must satisfy 0 < min <= max < inf")
    return lo, hi


def _check_step(name: str, value: Any) -> float:
    step = number(name, value)
    if not (0.0 < step < math.inf):
        raise ParamError(name, value, "must be a finite number > 0")
    return step


def check_rho0(rho0: Any) -> float:
    """The target share as a float; a ParamError naming `rho0` unless it lies in [0, 1]."""
    value = number("rho0", rho0)
    if not (0.0 <= value <= 1.0):
        raise ParamError("rho0", rho0, "must be within [0, 1]")
    return value


def _n_steps(name: str, step: float, lo: float, hi: float) -> int:
    n = math.floor((hi - lo) / step + STEP_TOLERANCE)
    if n >= MAX_PATH_POINTS:
        raise ParamError(name, step, f"too small: the path would have {n} points on its range")
    return n


def _decimals(x: float) -> int:
    """Digits after the decimal point in the shortest repr of x (0.02 -> 2, 1e-05 -> 5)."""
    exponent = Decimal(repr(float(x))).as_tuple().exponent
    return max(0, -exponent) if isinstance(exponent, int) else 0


def path_value(start: float, k: int, step: float, stop: float) -> float:
    """Path value after k steps: start + k * step in float64 (never an accumulated sum), rounded
    to the decimals that start and step are written with (0.6 + 15 * 0.02 is 0.9, not
    0.8999999999999999) and clamped to the range's max. k = 0 gives start exactly."""
    if k == 0:
        return start
    return min(round(start + k * step, max(_decimals(start), _decimals(step))), stop)


@dataclass(frozen=True)
class BoundSearch:
    """The settings of Algorithm 1, with the paper's defaults; validated on construction.

    The one place these defaults and rules are written: `losses.bapo_loss`'s keyword arguments,
    `BoundAccumulator`, `adaptive_bounds`, the trainer and the `algo` schema of `bapo` (its
    fields, help texts and checks) all come from here. Ranges are stored as tuples of floats.
    """

    rho0: float = param(0.4, "target share of positive-advantage tokens in the active loss mass")
    low_range: tuple[float, float] = param((0.6, 0.9), "[a-, b-]: where c_low may move")
    high_range: tuple[float, float] = param((1.2, 3.0), "[a+, b+]: where c_high may move")
    low_step: float = param(0.02, "delta2: step of c_low along the search path")
    high_step: float = param(0.05, "delta1: step of c_high along the search path")
    weighting: str = param(
        "none", "token weight in rho: none (w=1) or rollout_prob (w=pi_rollout, paper Eq. 8)"
    )
    rule: str = param(
        "paper",
        "paper = Algorithm 1 (active tokens only, c_high first, share >= rho0); recipe = the "
        "authors' public verl recipe (clipped tokens counted at their clipped value, c_low "
        "first, stop when P/N >= rho0/(1-rho0)); docs/bapo.md",
    )

    def __post_init__(self) -> None:
        self.check()
        for name in ("low_range", "high_range"):
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))

    def check(self) -> None:
        """rho0 in [0, 1], ranges 0 < min <= max < inf, steps > 0 (and not so small that the path
        explodes), weighting one of WEIGHTINGS. Raises a ParamError naming the setting."""
        check_rho0(self.rho0)
        one_of("rule", self.rule, RULES)
        self.path()
        one_of("weighting", self.weighting, WEIGHTINGS)

    def path(self) -> BoundPath:
        """The fixed path these settings walk (memoised)."""
        return BoundPath.build(
            self.low_range, self.high_range, self.low_step, self.high_step, rule=self.rule
        )

    def accumulator(self, dual_clip: float | None = None) -> PathAccumulator:
        """An empty accumulator over this path, the search of this rule (`BoundAccumulator`;
        `RecipeAccumulator` for rule=recipe); `solve(self.rho0)` it after adding."""
        return PathAccumulator.of_rule(self.rule)(
            low_range=self.low_range,
            high_range=self.high_range,
            low_step=self.low_step,
            high_step=self.high_step,
            dual_clip=dual_clip,
        )


@dataclass(frozen=True)
class BoundPath:
    """The fixed path of Algorithm 1: point 0, then n_high c_high steps, then n_low c_low steps.

    `high_values[i]` is c_high after i c_high steps, `low_values[j]` is c_low after j c_low steps;
    path point k is (low_values[max(0, k - n_high)], high_values[min(k, n_high)]).
    rule=recipe (`low_first`): c_low's steps come first, point k is
    (low_values[min(k, n_low)], high_values[max(0, k - n_low)]); each range is walked to its
    max, the last step clamped to it (the recipe's ``min(c + step, max)`` while ``c < max``), and
    c_high moves even when c_low cannot (no literal loop guard).
    """

    high_values: tuple[float, ...]
    low_values: tuple[float, ...]
    low_first: bool = False

    @classmethod
    def build(
        cls,
        low_range: Sequence[float] = BoundSearch.low_range,
        high_range: Sequence[float] = BoundSearch.high_range,
        low_step: float = BoundSearch.low_step,
        high_step: float = BoundSearch.high_step,
        rule: str = BoundSearch.rule,
    ) -> BoundPath:
        a_low, b_low = _check_range("low_range", low_range)
        a_high, b_high = _check_range("high_range", high_range)
        low_step = _check_step("low_step", low_step)
        high_step = _check_step("high_step", high_step)
        one_of("rule", rule, RULES)
        return _build_path(a_low, b_low, a_high, b_high, low_step, high_step, rule)

    @property
    def n_high(self) -> int:
        return len(self.high_values) - 1

    @property
    def n_low(self) -> int:
        return len(self.low_values) - 1

    def __len__(self) -> int:
        """Number of path points K (the start point included)."""
        return 1 + self.n_high + self.n_low

    def point(self, k: int) -> tuple[float, float]:
        """(c_low, c_high) at path point k."""
        if self.low_first:
            return self.low_values[min(k, self.n_low)], self.high_values[max(0, k - self.n_low)]
        return self.low_values[max(0, k - self.n_high)], self.high_values[min(k, self.n_high)]


def _n_steps_to_max(name: str, step: float, lo: float, hi: float) -> int:
    """Steps of ``c = min(c + step, hi)`` while ``c < hi`` (the recipe's loop): ceil, not floor."""
    n = math.ceil((hi - lo) / step - STEP_TOLERANCE)
    if n >= MAX_PATH_POINTS:
        raise ParamError(name, step, f"too small: the path would have {n} points on its range")
    return max(n, 0)


@functools.lru_cache(maxsize=64)
def _build_path(
    a_low: float,
    b_low: float,
    a_high: float,
    b_high: float,
    low_step: float,
    high_step: float,
    rule: str = "paper",
) -> BoundPath:
    """The path for validated numbers; memoised (a pure function of immutable inputs) so that a
    loss called every micro-batch does not rebuild it."""
    if rule == "recipe":
        n_low = _n_steps_to_max("low_step", low_step, a_low, b_low)
        n_high = _n_steps_to_max("high_step", high_step, a_high, b_high)
    else:
        n_low = _n_steps("low_step", low_step, a_low, b_low)
        # Literal loop guard: no c_low step possible -> the loop never runs, c_high stays too.
        n_high = _n_steps("high_step", high_step, a_high, b_high) if n_low > 0 else 0
    high = tuple(path_value(a_high, i, high_step, b_high) for i in range(n_high + 1))
    low = tuple(path_value(a_low, j, low_step, b_low) for j in range(n_low + 1))
    return BoundPath(high_values=high, low_values=low, low_first=rule == "recipe")


PAPER = BoundSearch()  # the paper's settings: the defaults of the functions below


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; float32 and narrower dtypes are compared in float32 (exact: every
    bfloat16/float16 value and every path value rounded to them is a float32 value)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rho_from_sums(pos: float, neg: float) -> float:
    """rho = P / (P + N), with the convention rho = 1 when no token carries mass (0/0)."""
    total = pos + neg
    return pos / total if total > 0 else 1.0


def _checked_dual_clip(dual_clip: float | None, path: BoundPath) -> float | None:
    """The dual clip as a float, above every c_low the path can take (or None)."""
    dual = None if dual_clip is None else number("dual_clip", dual_clip)
    if dual is not None and not (path.low_values[-1] < dual < math.inf):
        raise ParamError(
            "dual_clip",
            dual_clip,
            f"must be finite and > the largest c_low ({path.low_values[-1]}), or None",
        )
    return dual


def _summed_to_host(sums: torch.Tensor | None, size: int, group: Any) -> list[float]:
    """A search's bin sums (zeros when nothing was added), all-reduced over `group` when given,
    read to the host: the one sync of a search. A rank with no tokens still joins the reduce, on
    the GPU when the backend is NCCL."""
    sums = sums if sums is not None else torch.zeros(size, dtype=torch.float64)
    if group is not None:
        sums = sums.clone()
        if dist.get_backend(group) == "nccl" and sums.device.type != "cuda":
            sums = sums.cuda()
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return sums.tolist()


class PathAccumulator(abc.ABC):
    """What both searches' accumulators hold and do alike: additive per-bin sums over one path,
    so that micro-batches and ranks are solved once together.

    A subclass is one search, registered under its rule by its class statement
    (``class BoundAccumulator(PathAccumulator, rule="paper")``); `BoundSearch.accumulator` looks
    it up by name (`of_rule`). The path follows the rule; with a dual clip a leading bin holds
    the dual-clipped negatives. `add` bins tokens (no host sync), `solve` all-reduces the sums
    over `group` (optional), reads them once and walks the path.
    """

    rule: ClassVar[str]
    _by_rule: ClassVar[dict[str, type[PathAccumulator]]] = {}

    def __init_subclass__(cls, *, rule: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if rule is None:  # a subclass of a search: same rule, not registered again
            return
        if rule not in RULES or rule in PathAccumulator._by_rule:
            raise TypeError(f"{cls.__name__}: rule {rule!r} is not one of {RULES} or is taken")
        cls.rule = rule
        PathAccumulator._by_rule[rule] = cls

    @staticmethod
    def of_rule(rule: str) -> type[PathAccumulator]:
        """The accumulator class of `rule` (both are defined when `bapo_cli.algos` is imported:
        the package imports `bounds`, which imports them)."""
        one_of("rule", rule, RULES)
        return PathAccumulator._by_rule[rule]

    def __init__(
        self,
        *,
        low_range: Sequence[float] = PAPER.low_range,
        high_range: Sequence[float] = PAPER.high_range,
        low_step: float = PAPER.low_step,
        high_step: float = PAPER.high_step,
        dual_clip: float | None = None,
    ) -> None:
        self.path = BoundPath.build(low_range, high_range, low_step, high_step, rule=self.rule)
        self.dual_clip = _checked_dual_clip(dual_clip, self.path)
        self._lead = 0 if dual_clip is None else 1  # leading bin: dual-clipped negatives
        self._sums: torch.Tensor | None = None

    @property
    def _size(self) -> int:
        """Bins per sum: the K + 3 of the path, plus the leading bin with a dual clip."""
        return self.path.n_high + self.path.n_low + 4 + self._lead

    def _host_values(self, group: Any, per_bin: int = 1) -> list[float]:
        """The sums (`per_bin` per bin, one after the other), all-reduced and read to the host."""
        return _summed_to_host(self._sums, per_bin * self._size, group)

    @abc.abstractmethod
    def add(
        self,
        ratio: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> None:
        """Add one batch of tokens (any shape, all four tensors the same shape); no host sync."""

    @abc.abstractmethod
    def solve(self, rho0: float = PAPER.rho0, group: Any = None) -> BapoBounds:
        """Walk the path on everything added so far (one all-reduce, one host read)."""

    def reset(self) -> None:
        """Forget the added sums (start the next optimizer step)."""
        self._sums = None
