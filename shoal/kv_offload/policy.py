"""Eviction policies for a secondary KV tier, and the factory that picks one by name.

A policy only orders keys (block hashes); the tier owns the data. The tier asks for a victim
when it needs room, passing `can_evict` so blocks pinned by an in-flight transfer are
skipped. Policies: "lru", "arc" (shoal/kv_offload/arc.py) or "pkg.module:Class"."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable

Key = Hashable
CanEvict = Callable[[Key], bool]

REQUIRED_METHODS = ("insert", "touch", "remove", "evict")
BUILTIN_POLICIES = {"arc": "shoal.kv_offload.arc:ARCPolicy"}


class EvictionPolicy(ABC):
    """The interface. `capacity` is the tier's size in blocks (ARC sizes its ghost lists
    from it)."""

    def __init__(self, capacity: int):
        self.capacity = capacity

    def prepare(self, key: Key) -> None:  # noqa: B027 - optional hook, no-op by default
        """A missing key is about to be inserted; called before room is made for it (ARC
        adapts its target here, since the choice of victim depends on it)."""

    @abstractmethod
    def insert(self, key: Key) -> None:
        """The key became resident."""

    @abstractmethod
    def touch(self, key: Key) -> None:
        """A hit on a resident key."""

    @abstractmethod
    def remove(self, key: Key) -> None:
        """The key left the tier without being chosen as a victim (damaged, cleared)."""

    @abstractmethod
    def evict(self, can_evict: CanEvict) -> Key | None:
        """Chooses a resident key that `can_evict` allows, forgets it as resident and returns
        it; None when nothing may go."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys."""


class LRUPolicy(EvictionPolicy):
    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()  # least recently used first

    def insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def evict(self, can_evict: CanEvict) -> Key | None:
        for key in self._order:
            if can_evict(key):
                del self._order[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)

    def keys(self) -> list[Key]:
        """Resident keys, the next victim first."""
        return list(self._order)


def resolve_policy(name: str) -> Callable[[int], EvictionPolicy]:
    """'lru', 'arc' or 'pkg.module:Class' -> a factory taking the capacity in blocks. Raises
    ValueError naming the problem, so a bad flag fails at start-up, not at the first store."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"kv_offloading_policy must be 'lru', 'arc' or 'pkg.module:Class' "
                         f"(got {name!r})")
    name = name.strip()
    if name.lower() == "lru":
        return LRUPolicy
    # Built-in names of policies in other modules are module paths too, resolved like a
    # user's: arc.py builds on this module, so this one does not import it.
    name = BUILTIN_POLICIES.get(name.lower(), name)
    module_name, sep, cls_name = name.partition(":")
    if not sep or not module_name or not cls_name:
        raise ValueError(f"kv_offloading_policy must be 'lru', 'arc' or 'pkg.module:Class' "
                         f"(got {name!r})")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"kv_offloading_policy {name!r}: cannot import {module_name!r} ({e})") from e
    cls = getattr(module, cls_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"kv_offloading_policy {name!r}: {module_name} has no class {cls_name!r}")
    missing = [m for m in (*REQUIRED_METHODS, "__len__") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(
            f"kv_offloading_policy {name!r}: {cls_name} lacks the EvictionPolicy interface "
            f"(missing {', '.join(missing)}); subclass shoal.kv_offload.policy.EvictionPolicy"
        )
    return cls


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    policy = resolve_policy(name)(capacity)
    if not callable(getattr(policy, "prepare", None)):
        # Duck-typed user classes may leave out the optional hook.
        policy.prepare = lambda key: None  # type: ignore[method-assign]
    return policy
