"""Eviction policies: LRU order, ARC's adaptation and scan resistance, the factory."""

from __future__ import annotations

import textwrap

import pytest

from shoal.kv_offload.arc import ARCPolicy
from shoal.kv_offload.policy import EvictionPolicy, LRUPolicy, make_policy, resolve_policy


def _fill(policy: EvictionPolicy, keys, capacity: int, pinned=()) -> list:
    """Inserts keys the way a tier does (prepare, evict while full, insert); returns victims."""
    victims = []
    for k in keys:
        policy.prepare(k)
        while len(policy) >= capacity:
            v = policy.evict(lambda x: x not in pinned)
            if v is None:
                break
            victims.append(v)
        policy.insert(k)
    return victims


def test_lru_evicts_least_recently_used_first():
    p = LRUPolicy(3)
    _fill(p, "abc", 3)
    p.touch("a")  # order now b, c, a
    assert p.keys() == ["b", "c", "a"]
    assert _fill(p, "d", 3) == ["b"]
    assert p.evict(lambda k: k != "c") == "a"  # pinned keys are skipped
    p.remove("c")
    assert p.keys() == ["d"] and len(p) == 1
    assert p.evict(lambda k: False) is None


def test_arc_resists_a_scan():
    working = ["w1", "w2"]
    scan = [f"s{i}" for i in range(20)]
    results = {}
    for name, policy in [("lru", LRUPolicy(4)), ("arc", ARCPolicy(4))]:
        _fill(policy, working, 4)
        for k in working:  # used twice: ARC moves them to T2
            policy.touch(k)
        victims = _fill(policy, scan, 4)
        results[name] = set(working) & set(victims)
    assert results["lru"] == set(working)  # the scan flushed the working set
    assert results["arc"] == set()  # the scan only evicted itself
    arc = ARCPolicy(4)
    _fill(arc, working, 4)
    for k in working:
        arc.touch(k)
    _fill(arc, scan, 4)
    assert set(arc.t2) == set(working) and len(arc) == 4


def test_arc_ghost_hits_move_the_target():
    arc = ARCPolicy(4)
    _fill(arc, ["a", "b", "c", "d"], 4)
    arc.touch("c")
    arc.touch("d")  # T1 = a, b; T2 = c, d
    victims = _fill(arc, ["e"], 4)
    assert victims == ["a"] and "a" in arc.b1 and arc.p == 0
    _fill(arc, ["a"], 4)  # a miss that hits the B1 ghost: T1 deserved more room
    assert arc.p >= 1 and "a" in arc.t2
    # Now a recently-seen-twice key evicted to B2 and requested again lowers p.
    for k in list(arc.t1):
        arc.touch(k)  # everything to T2
    p_before = arc.p
    victims = _fill(arc, ["x"], 4)
    assert victims and victims[0] in arc.b2
    _fill(arc, [victims[0]], 4)
    assert arc.p < p_before
    assert len(arc) == 4
    assert len(arc.t1) + len(arc.b1) <= 4 and len(arc.t1) + len(arc.t2) + len(arc.b1) + len(arc.b2) <= 8


def test_arc_skips_pinned_and_falls_back_to_the_other_list():
    arc = ARCPolicy(3)
    _fill(arc, ["a", "b", "c"], 3)
    arc.touch("c")  # T1 = a, b; T2 = c
    assert arc.evict(lambda k: k not in ("a", "b")) == "c"
    assert arc.evict(lambda k: False) is None
    arc.remove("a")
    assert len(arc) == 1 and "a" not in arc.t1


def test_factory_names_and_user_classes(tmp_path, monkeypatch):
    assert isinstance(make_policy("lru", 4), LRUPolicy)
    assert isinstance(make_policy("ARC", 4), ARCPolicy)
    (tmp_path / "my_policies.py").write_text(textwrap.dedent("""
        from collections import deque

        from shoal.kv_offload.policy import EvictionPolicy

        class FIFO(EvictionPolicy):
            def __init__(self, capacity):
                super().__init__(capacity)
                self.q = deque()
            def insert(self, key): self.q.append(key)
            def touch(self, key): pass
            def remove(self, key):
                if key in self.q: self.q.remove(key)
            def evict(self, can_evict):
                for k in self.q:
                    if can_evict(k):
                        self.q.remove(k)
                        return k
                return None
            def __len__(self): return len(self.q)

        class DuckFIFO:  # no base class, no prepare: still accepted
            def __init__(self, capacity): self.q = []
            def insert(self, key): self.q.append(key)
            def touch(self, key): pass
            def remove(self, key): self.q.remove(key)
            def evict(self, can_evict): return self.q.pop(0) if self.q else None
            def __len__(self): return len(self.q)

        class NotAPolicy:
            def insert(self, key): pass

        not_a_class = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    fifo = make_policy("my_policies:FIFO", 2)
    _fill(fifo, "ab", 2)
    fifo.touch("a")
    assert _fill(fifo, "c", 2) == ["a"]  # FIFO ignores the touch
    duck = make_policy("my_policies:DuckFIFO", 2)
    assert _fill(duck, "abc", 2) == ["a"]
    for bad, msg in [("my_policies:NotAPolicy", "lacks the EvictionPolicy interface"),
                     ("my_policies:not_a_class", "no class"),
                     ("my_policies:Missing", "no class"),
                     ("no_such_module_xyz:Cls", "cannot import"),
                     ("mru", "'lru', 'arc' or 'pkg.module:Class'"),
                     ("", "'lru', 'arc' or 'pkg.module:Class'"),
                     ("my_policies:", "'lru', 'arc' or 'pkg.module:Class'")]:
        with pytest.raises(ValueError, match=msg):
            resolve_policy(bad)
