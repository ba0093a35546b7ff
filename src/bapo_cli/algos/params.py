"""What every loss's parameter dataclass is made of: documented fields and one-line errors.

Each registered loss carries a plain frozen dataclass of its own parameters (`ppo.PPOParams`,
`bapo.BapoParams`, ...), usually a `LossParams`: fields with defaults and a `help` text made with
`param()`, a `check()` run on construction and a `describe()` for the run plan. The config layer
turns these fields into the `algo` schema of that loss and reports a `ParamError` as its own
one-line config error (`algo.rho0=1.5: must be within [0, 1]`), so a rule is written once, here or
in the loss's module, and holds for the CLI and for a trainer that calls the losses directly.

Only the standard library is used, so the core stays free of any config system.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ClipRangeParams",
    "LossParams",
    "ParamError",
    "check_dual_clip",
    "check_eps",
    "dual_clip_param",
    "number",
    "one_of",
    "param",
    "positive",
]


class ParamError(ValueError):
    """A parameter value that is not allowed: which key, the value, and what is allowed."""

    def __init__(self, key: str, value: Any, message: str) -> None:
        self.key, self.value, self.message = key, value, message
        super().__init__(f"{key}={value!r}: {message}")


def param(default: Any, help: str, **metadata: Any) -> Any:
    """A dataclass field with its one-line documentation (`help`), as the config schema's `opt`.

    metadata `shared=True`: an option of the whole `algo` group (`dual_clip`), read from the config
    under its own name and not part of this loss's schema; `runtime=True`: no config key at all,
    set by whoever calls the loss (BAPO's solved `bounds`).
    """
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def number(name: str, value: Any) -> float:
    """float(value), or a ParamError naming the parameter."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ParamError(name, value, "must be a number") from None


def one_of(name: str, value: Any, allowed: Sequence[str]) -> str:
    """`value` if it is one of `allowed`, else a ParamError listing them."""
    if value not in allowed:
        raise ParamError(name, value, f"must be one of {', '.join(allowed)}")
    return value


def positive(name: str, value: Any, *, zero: bool = False) -> float:
    """`value` as a float if it is a finite number > 0 (>= 0 with `zero`), else a ParamError."""
    v = number(name, value)
    if not (0.0 <= v < math.inf if zero else 0.0 < v < math.inf):
        raise ParamError(name, value, f"must be a finite number {'>=' if zero else '>'} 0")
    return v


def check_eps(eps_low: float, eps_high: float) -> None:
    """A decoupled clip range [1 - eps_low, 1 + eps_high]: eps_low in (0, 1), eps_high > 0."""
    if not 0.0 < number("eps_low", eps_low) < 1.0:
        raise ParamError("eps_low", eps_low, "must be within (0, 1)")
    positive("eps_high", eps_high)


def check_dual_clip(dual_clip: float | None) -> None:
    """The dual clip of a loss that uses it: > 1 and finite (every c_low here is <= 1), or None."""
    if dual_clip is not None and not 1.0 < number("dual_clip", dual_clip) < math.inf:
        raise ParamError(
            "dual_clip", dual_clip, "must be > 1 and finite (above every c_low), or None"
        )


def dual_clip_param(default: float | None = 3.0) -> Any:
    """The `dual_clip` field of a loss that clips negative advantages from above: the algo
    group's shared option (`AlgoConfig.dual_clip`), read by name."""
    return param(
        default, "dual-clip constant for negative advantages; null turns it off", shared=True
    )


@dataclasses.dataclass(frozen=True)
class LossParams:
    """Base of a loss's params: validated on construction. A subclass writes `check()` (raise
    ParamError naming the key) and `describe()` (the run plan's words), and `hooks()` when the
    loss needs something of the trainer (`contract.LossHooks`)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise a ParamError for a value that is not allowed."""

    def describe(self) -> str:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class ClipRangeParams(LossParams):
    """A loss that clips a ratio to [1 - eps_low, 1 + eps_high] (dual-clipped below for A < 0).
    A subclass declares eps_low and eps_high again with its own defaults and help."""

    eps_low: float = param(0.2, "lower clip range: c_low = 1 - eps_low")
    eps_high: float = param(0.2, "upper clip range: c_high = 1 + eps_high")
    dual_clip: float | None = dual_clip_param()

    def check(self) -> None:
        check_eps(self.eps_low, self.eps_high)
        check_dual_clip(self.dual_clip)

    def bounds(self) -> tuple[float, float]:
        """(c_low, c_high)."""
        return 1.0 - float(self.eps_low), 1.0 + float(self.eps_high)
