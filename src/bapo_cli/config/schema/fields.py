"""The field helper and the two range rules every config group uses.

`opt` puts an option's one-line documentation (`help`) on its dataclass field, where
`bapo config --docs` reads it; `_one_of` and `_positive` are the rules most `check()`s start with,
written once so every group words a bad value the same way (`must be > 0`, `must be one of ...`).
"""

from __future__ import annotations

import math
from dataclasses import field
from typing import Any

from omegaconf import MISSING

from bapo_cli.config.errors import ConfigError


def opt(default: Any = MISSING, help: str = "", **kwargs: Any) -> Any:
    """A dataclass field carrying its one-line documentation (`help`)."""
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata={"help": help}, **kwargs)
    return field(default=default, metadata={"help": help}, **kwargs)


def _one_of(key: str, value: Any, allowed: list[str] | tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(key, value, f"must be one of {', '.join(allowed)}")


def _positive(key: str, value: float | int, *, allow_zero: bool = False) -> None:
    bad = value < 0 if allow_zero else value <= 0
    if bad or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(key, value, "must be >= 0" if allow_zero else "must be > 0")
