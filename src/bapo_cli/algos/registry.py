"""A tiny name -> function registry.

Losses and advantage estimators are chosen by name (`algo=bapo` in the config selects
`losses.REGISTRY["bapo"]`). The registry is the one list of valid names: docs, `--help` and test
parametrization read its keys. It refuses duplicate names and an unknown name raises a ValueError
that lists the valid ones, e.g. ``unknown loss 'foo'; valid: bapo, clip_higher, ppo``.

A registry may store an entry built around the function instead of the bare function: the loss
registry keeps each loss with its parameter dataclass,
``@REGISTRY.register("clip_higher", params=ClipHigherParams)`` (see `losses.LossEntry`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

F = TypeVar("F")


class Registry(Generic[F]):
    """Maps names to callables, or to entries built around them by `entry`.

    `kind` names what is registered ("loss", "advantage estimator"). `entry(name, fn, **options)`,
    if given, makes what is stored from the decorated function and the options of `register`.
    """

    def __init__(self, kind: str, entry: Callable[..., F] | None = None) -> None:
        self.kind = kind
        self._entry = entry
        self._items: dict[str, F] = {}

    def register(self, name: str, **options: Any) -> Callable[[Callable], Callable]:
        """Decorator: ``@REGISTRY.register("ppo")``. Refuses a name that is already taken.

        Returns the function unchanged, so it stays a plain function to call and import."""
        if options and self._entry is None:
            raise TypeError(f"a {self.kind} registry takes no options, got {sorted(options)}")

        def decorate(fn: Callable) -> Callable:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = fn if self._entry is None else self._entry(name, fn, **options)
            return fn

        return decorate

    def remove(self, name: str) -> None:
        """Forget `name` (a test that registers a toy loss cleans up with this)."""
        self.get(name)
        del self._items[name]

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

    def registered(self) -> list[str]:
        """Registered names in registration order (the order their module lists them)."""
        return list(self._items)

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
