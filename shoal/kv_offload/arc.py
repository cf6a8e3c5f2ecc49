"""Adaptive Replacement Cache (Megiddo and Modha, FAST 2003) as a tier eviction policy.

T1 holds keys seen once recently, T2 keys seen at least twice; B1 and B2 remember keys
recently evicted from each (ghosts, no data). A miss that hits a ghost list moves the target
size p of T1: a B1 ghost hit says T1 was too small, a B2 ghost hit says T2 was. Victims come
from T1 while it is larger than p, so a one-pass scan (all T1) cannot flush the blocks that
are used repeatedly (T2)."""

from __future__ import annotations

from collections import OrderedDict

from shoal.kv_offload.policy import CanEvict, EvictionPolicy, Key


class ARCPolicy(EvictionPolicy):
    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.c = max(1, capacity)
        self.p = 0.0  # target size of T1
        # Each list is ordered least recently used first.
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()
        self._incoming: Key | None = None  # key being inserted, set by prepare
        self._incoming_seen = False  # it was a ghost: goes to T2
        self._incoming_from_b2 = False

    def prepare(self, key: Key) -> None:
        self._incoming, self._incoming_seen, self._incoming_from_b2 = key, False, False
        if key in self.b1:
            self.p = min(float(self.c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self._incoming_seen = True
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self._incoming_seen = self._incoming_from_b2 = True

    def insert(self, key: Key) -> None:
        if key != self._incoming:  # inserted without prepare: treat as a plain miss
            self.prepare(key)
        self.remove(key)
        (self.t2 if self._incoming_seen else self.t1)[key] = None
        self._incoming = None
        self._trim()

    def touch(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        for lst in (self.t1, self.t2, self.b1, self.b2):
            lst.pop(key, None)

    def evict(self, can_evict: CanEvict) -> Key | None:
        # REPLACE from the paper: take T1's LRU while T1 exceeds its target (or meets it when
        # the incoming key is a B2 ghost), else T2's; fall back to the other list when every
        # block of the preferred one is pinned.
        n1 = len(self.t1)
        prefer_t1 = n1 > 0 and (n1 > self.p or (self._incoming_from_b2 and n1 == self.p))
        order = [(self.t1, self.b1), (self.t2, self.b2)]
        if not prefer_t1:
            order.reverse()
        for resident, ghosts in order:
            for key in resident:
                if can_evict(key):
                    del resident[key]
                    ghosts[key] = None
                    self._trim()
                    return key
        return None

    def _trim(self) -> None:
        # The paper's bounds: |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c.
        while self.b1 and len(self.t1) + len(self.b1) > self.c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.c:
            self.b2.popitem(last=False)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)
