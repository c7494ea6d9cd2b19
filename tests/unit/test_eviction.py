"""Stateful property tests: every eviction policy against a model of the present and pinned keys."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from kvtier.server.eviction import (
    DEFAULT_POLICY,
    POLICIES,
    EvictionPolicy,
    LIRSPolicy,
    LRUPolicy,
    make_policy,
)

pytestmark = pytest.mark.unit

KEYS = [i.to_bytes(16, "little") for i in range(40)]
keys = st.sampled_from(KEYS)


class PolicyMachine(RuleBasedStateMachine):
    """Drives one policy like the cache does: evict a victim before inserting once `capacity` keys exist."""

    def __init__(self) -> None:
        super().__init__()
        self.policy: EvictionPolicy
        self.present: dict[bytes, int] = {}
        self.pinned: set[bytes] = set()
        self.order: list[bytes] = []  # recency order, for the LRU check

    @initialize(name=st.sampled_from(sorted(POLICIES)), capacity=st.integers(1, 12))
    def start(self, name: str, capacity: int) -> None:
        self.policy = make_policy(name)
        self.capacity = capacity

    def _evictable(self, key: bytes) -> bool:
        assert key in self.present, "pick_victim asked about an absent key"
        return key not in self.pinned

    @rule(key=keys, size=st.integers(1, 8))
    def insert(self, key: bytes, size: int) -> None:
        if key in self.present:
            return
        if len(self.present) >= self.capacity:
            victim = self.policy.pick_victim(self._evictable)
            if victim is None:
                return  # the cache refuses the store: nothing evictable
            self._remove(victim)
        self.policy.insert(key, size)
        self.present[key] = size
        self.order.append(key)

    @rule(key=keys)
    def touch(self, key: bytes) -> None:
        if key in self.present:
            self.policy.touch(key)
            self.order.remove(key)
            self.order.append(key)

    @rule(key=keys)
    def remove(self, key: bytes) -> None:
        self._remove(key)  # absent keys included: a no-op

    @rule(key=keys)
    def pin(self, key: bytes) -> None:
        self.pinned.add(key)

    @rule(key=keys)
    def unpin(self, key: bytes) -> None:
        self.pinned.discard(key)

    @rule()
    def pick_victim(self) -> None:
        victim = self.policy.pick_victim(self._evictable)
        if victim is None:
            assert all(key in self.pinned for key in self.present)
        else:
            assert victim in self.present and victim not in self.pinned
            if isinstance(self.policy, LRUPolicy):
                assert victim == next(k for k in self.order if k not in self.pinned)

    @rule()
    def clear(self) -> None:
        for key in list(self.present):
            self._remove(key)

    def _remove(self, key: bytes) -> None:
        self.policy.remove(key)
        if self.present.pop(key, None) is not None:
            self.order.remove(key)

    @invariant()
    def consistent(self) -> None:
        assert len(self.policy) == len(self.present)
        assert all(key in self.policy for key in self.present)
        assert not any(key in self.policy for key in KEYS if key not in self.present)

    @invariant()
    def bounded_history(self) -> None:
        if isinstance(self.policy, LIRSPolicy):
            assert self.policy.ghost_count <= 2 * len(self.present) + 1
            assert 0.0 < self.policy.hir_share < 1.0


PolicyMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestPolicies = PolicyMachine.TestCase


def test_registry() -> None:
    assert DEFAULT_POLICY in POLICIES and "lru" in POLICIES
    for name, cls in POLICIES.items():
        assert cls.name == name and isinstance(make_policy(name), cls)
    with pytest.raises(ValueError, match="lirs, lru"):
        make_policy("nope")


def test_lirs_keeps_a_loop_resident() -> None:
    """A loop of 15 keys through a 10-key cache: LIRS hits ~9 per pass where LRU hits none."""
    loop = KEYS[:15]
    hits = {}
    for policy in (LRUPolicy(), LIRSPolicy()):
        present: set[bytes] = set()
        hits[policy.name] = 0
        for _ in range(20):
            for key in loop:
                if key in present:
                    hits[policy.name] += 1
                    policy.touch(key)
                    continue
                if len(present) >= 10:
                    victim = policy.pick_victim(lambda _k: True)
                    assert victim is not None
                    present.remove(victim)
                    policy.remove(victim)
                policy.insert(key, 1)
                present.add(key)
    assert hits["lru"] == 0
    assert hits["lirs"] >= 19 * 8
