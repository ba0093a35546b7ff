"""What every loss's parameter dataclass is made of: documented fields and one-line errors.

Each registered loss carries a plain frozen dataclass of its own parameters (`losses.PPOParams`,
`losses.ClipHigherParams`, `losses.BapoParams`): fields with defaults and a `help` text made with
`param()`, a `check()` run on construction and a `describe()` for the run plan. The config layer
turns these fields into the `algo` schema of that loss and reports a `ParamError` as its own
one-line config error (`algo.rho0=1.5: must be within [0, 1]`), so a rule is written once, here in
the core, and holds for the CLI and for a trainer that calls the losses directly.

Only the standard library is used, so the core stays free of any config system.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = ["ParamError", "number", "one_of", "param"]


class ParamError(ValueError):
    """A parameter value that is not allowed: which key, the value, and what is allowed."""

    def __init__(self, key: str, value: Any, message: str) -> None:
        self.key, self.value, self.message = key, value, message
        super().__init__(f"{key}={value!r}: {message}")


def param(default: Any, help: str, **metadata: Any) -> Any:
    """A dataclass field with its one-line documentation (`help`), as the config schema's `opt`.

    metadata `trainer=True` marks a setting the trainer reads (e.g. BAPO's `bound_scope`) rather
    than a keyword argument of the loss function.
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
