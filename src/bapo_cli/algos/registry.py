"""A tiny name -> function registry.

Losses and advantage estimators are chosen by name (`algo=bapo` in the config selects
`losses.REGISTRY["bapo"]`). The registry is the one list of valid names: docs, `--help` and test
parametrization read its keys. It refuses duplicate names and an unknown name raises a ValueError
that lists the valid ones, e.g. ``unknown loss 'foo'; valid: bapo, clip_higher, ppo``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Maps names to callables. `kind` names what is registered ("loss", "advantage estimator")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: ``@REGISTRY.register("ppo")``. Refuses a name that is already taken."""

        def decorate(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = fn
            return fn

        return decorate

    def get(self, name: str) -> F:
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)

    def __getitem__(self, name: str) -> F:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[str]:
        return self.names()
