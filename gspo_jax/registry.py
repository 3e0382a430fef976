"""What a config selects by name, one registry style for each kind: objectives
(`gspo_jax.objectives.REGISTRY`), group advantage estimators
(`gspo_jax.advantages.GROUP_ESTIMATORS`), tasks (`gspo_jax.tasks.REGISTRY`) and verifiers
(`gspo_jax.verifiers.VERIFIERS`).

    REGISTRY = Registry("objective")
    REGISTRY.register("gspo", Objective(...))     a second thing of one name is refused
    REGISTRY.get("gspo")                          ValueError naming the known ones
    REGISTRY.names()                              what the config's choices list

This module imports nothing from gspo_jax.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Things of one ``kind`` by name.

    Args:
      kind: what they are, for messages ("objective", "task").
      discover: called before the first lookup (the tasks import their modules, which
        register themselves).
      sort: `names` sorted (the same whatever registered first); else in the order
        registered (the built-in ones as their module declares them).
    """

    def __init__(self, kind: str, *, discover: Callable[[], None] | None = None, sort=False):
        self.kind, self._discover, self._sort = kind, discover, sort
        self._items: dict[str, T] = {}

    def _ready(self) -> dict[str, T]:
        if self._discover is not None:
            discover, self._discover = self._discover, None
            discover()
        return self._items

    def register(self, name: str, item: T) -> T:
        """Add ``item`` as ``name``; a second, different item of one name is refused.
        Returns ``item``."""
        if name in self._items and self._items[name] is not item:
            raise ValueError(f"a {self.kind} named {name!r} is already registered")
        self._items[name] = item
        return item

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a test's, or a plug-in's)."""
        self._items.pop(name, None)

    def names(self) -> tuple[str, ...]:
        """Every registered name."""
        names = tuple(self._ready())
        return tuple(sorted(names)) if self._sort else names

    def get(self, name: str) -> T:
        """The item registered as ``name``; ValueError naming the known ones."""
        items = self._ready()
        if name not in items:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {self.names()}")
        return items[name]

    def __contains__(self, name: object) -> bool:
        return name in self._ready()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
