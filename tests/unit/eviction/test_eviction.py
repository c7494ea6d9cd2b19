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
    ReusePolicy,
    S3FIFOPolicy,
    TinyLFUPolicy,
    make_policy,
)
from kvtier.server.eviction.tinylfu import FrequencySketch

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
            if not self.policy.admit(key, size, self._evictable):
                return  # refused: the cache asks before it evicts
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
        if isinstance(self.policy, S3FIFOPolicy):  # 90 % of a cache size it learnt: at most 8 x capacity bytes
            assert self.policy.ghost_bytes <= 0.9 * 8 * self.capacity


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


class Cache:
    """A cache of `capacity` keys of size 1 that calls its policy as L1 does (server/l1/store.py and holds.py):
    a hit touches; a store touches the keys it already has, asks admit (when full) and evicts per new key, stops
    at the first refusal and inserts the admitted keys last-first."""

    def __init__(self, policy: EvictionPolicy, capacity: int) -> None:
        self.policy = policy
        self.capacity = capacity
        self.present: set[bytes] = set()
        self.refused = 0

    def get(self, key: bytes) -> bool:
        """One read of `key`, stored on a miss; whether it hit."""
        if key in self.present:
            self.policy.touch(key)
            return True
        self.store([key])
        return False

    def store(self, keys: list[bytes]) -> None:
        admitted: list[bytes] = []
        for key in keys:
            if key in self.present:  # "exists": a hit
                self.policy.touch(key)
                continue
            if len(self.present) + len(admitted) >= self.capacity:
                if not self.policy.admit(key, 1, self.present.__contains__):
                    self.refused += 1
                    break
                victim = self.policy.pick_victim(self.present.__contains__)
                assert victim is not None
                self.present.remove(victim)
                self.policy.remove(victim)
            admitted.append(key)
        for key in reversed(admitted):
            self.policy.insert(key, 1)
            self.present.add(key)


def scan(cache: Cache, keys: list[bytes]) -> None:
    for key in keys:
        assert not cache.get(key)


SCAN = [i.to_bytes(16, "little") for i in range(1000, 1300)]  # one-hit wonders, none of them in KEYS


@pytest.mark.parametrize("touches, survives", [(2, True), (1, False)])
def test_s3fifo_quick_demotion(touches: int, survives: bool) -> None:
    """A key hit twice while in the small FIFO moves to main and outlives a scan; one hit is not enough."""
    cache = Cache(S3FIFOPolicy(), 20)
    for key in KEYS[:20]:
        cache.get(key)
    cache.policy.pick_victim(lambda _k: True)  # learn the size; the first fill keeps its oldest 10 % in S:
    # KEYS[0] and KEYS[1], the rest go to M
    for _ in range(touches):
        cache.get(KEYS[1])
    scan(cache, SCAN)
    assert (KEYS[1] in cache.present) is survives
    assert set(KEYS[3:20]) <= cache.present  # the scan went through the small FIFO only


def test_s3fifo_ghost_hit_goes_to_main() -> None:
    """A key evicted from the small FIFO unhit and stored again soon after goes to main: a scan then passes
    it by, where LRU (and a second pass through the small FIFO) would lose it."""
    cache = Cache(S3FIFOPolicy(), 20)
    scan(cache, SCAN[:40])  # steady state: main holds SCAN's first fill, the small FIFO cycles
    key = KEYS[0]
    cache.get(key)
    scan(cache, SCAN[40:44])
    assert key not in cache.present
    assert not cache.get(key)  # back from the ghost
    scan(cache, SCAN[44:100])
    assert key in cache.present
    policy = cache.policy
    assert isinstance(policy, S3FIFOPolicy) and policy.capacity == 20
    assert 0 < policy.ghost_bytes <= 0.9 * 20


@pytest.mark.timeout(10)
def test_s3fifo_main_is_a_clock() -> None:
    """A key hit in main goes round once more per hit (count lowered as the hand passes it); the hand stops
    at the first key without a count, even when every key had one."""
    policy = S3FIFOPolicy()
    for key in KEYS[:10]:
        policy.insert(key, 1)
    assert policy.pick_victim(lambda _k: True) == KEYS[0]  # the first fill: 10 % (KEYS[0]) stays small
    policy.remove(KEYS[0])
    for key in KEYS[1:10]:
        policy.touch(key)
    policy.touch(KEYS[1])
    assert policy.pick_victim(lambda _k: True) == KEYS[2]  # KEYS[1] had two hits, the others one
    assert policy.pick_victim(lambda key: key != KEYS[2]) == KEYS[3]


def test_s3fifo_and_tinylfu_keep_part_of_a_loop() -> None:
    """A loop of 15 keys through a 10-key cache, as in test_lirs_keeps_a_loop_resident: both keep a stable
    resident set where LRU hits nothing."""
    for policy, least in ((S3FIFOPolicy(), 19 * 5), (TinyLFUPolicy(), 19 * 7)):
        cache = Cache(policy, 10)
        hits = sum(cache.get(key) for _ in range(20) for key in KEYS[:15])
        assert hits >= least, policy.name


def test_tinylfu_scan_goes_through_the_window() -> None:
    """New keys lose their duels against main's equally frequent keys; once the sketch fills up (collisions,
    then halving) they win against keys seen once, but not against a frequent, protected one."""
    cache = Cache(TinyLFUPolicy(), 20)
    for key in KEYS[:20]:
        cache.get(key)
    for _ in range(3):
        cache.get(KEYS[5])  # probation -> protected, and frequent
    scan(cache, SCAN[:50])  # the sketch (4 x 128 counters) still has few collisions
    assert cache.present & set(KEYS[:20]) == set(KEYS[:19])  # only the window's key left
    scan(cache, SCAN[50:])
    assert KEYS[5] in cache.present


def test_tinylfu_door_duel() -> None:
    """Keys beyond the window's share of one store duel at the door: refused while no more frequent than the
    victim, admitted once their own offers have made them so."""
    cache = Cache(TinyLFUPolicy(), 20)
    for _ in range(2):
        for key in KEYS[:20]:
            cache.get(key)  # every resident key seen twice
    late = SCAN[0]
    for attempt, first in enumerate(SCAN[1:4], start=1):
        cache.store([first, late])  # `first` takes the window, `late` would go straight through it
        assert first in cache.present
        assert (late in cache.present) is (attempt == 3)  # counted at each offer: 3 beats the victim's 2
    assert cache.refused == 2


def test_frequency_sketch() -> None:
    sketch = FrequencySketch(64)
    counts = {key: i % 7 for i, key in enumerate(KEYS)}
    for key, n in counts.items():
        for _ in range(n):
            sketch.add(key, period=10**9)
    assert all(sketch.estimate(key) >= n for key, n in counts.items())  # count-min: never under
    before = {key: sketch.estimate(key) for key in KEYS}
    sketch.widen(256)
    assert sketch.width == 256
    assert all(before[key] >= sketch.estimate(key) >= counts[key] for key in KEYS)
    for _ in range(20):
        sketch.add(KEYS[0], period=10**9)
    assert sketch.estimate(KEYS[0]) == 15  # 4-bit counters saturate
    sketch.add(KEYS[1], period=sketch.additions + 1)  # the period ends: every counter halves
    assert sketch.estimate(KEYS[0]) == 7


def test_reuse_keeps_a_loop_resident_through_admission() -> None:
    """A loop of 15 keys through a 10-key cache, every miss stored again: the re-offers are refused, so the
    ~10 keys that fit hit on every pass (LRU, which admits them, hits nothing)."""
    lru, reuse = Cache(LRUPolicy(), 10), Cache(ReusePolicy(), 10)
    hits = {c.policy.name: sum(c.get(key) for _ in range(20) for key in KEYS[:15]) for c in (lru, reuse)}
    assert hits["lru"] == 0
    assert hits["reuse"] >= 19 * 9
    assert reuse.refused >= 19 * 4


def test_reuse_admits_new_content_and_overdue_victims() -> None:
    policy = ReusePolicy()
    cache = Cache(policy, 4)
    for _ in range(3):  # KEYS[0..3] each read three times: short intervals
        for key in KEYS[:4]:
            cache.get(key)
    cache.get(KEYS[10])  # new content: admitted over a key with a short interval (LRU would too)
    assert KEYS[10] in cache.present and cache.refused == 0
    evicted = next(k for k in KEYS[:4] if k not in cache.present)
    for key in KEYS[20:40]:  # much later: what is resident is overdue, new keys keep coming in
        cache.get(key)
    assert cache.refused == 0
    cache.get(evicted)  # an old key offered again, the victims seen once and idle longer than its gap
    assert evicted in cache.present


def test_reuse_trusts_refusals_only_while_they_pay() -> None:
    """A refusal keeps the victim; a kept victim that goes unread lowers the trust, one that is read raises
    it. Below 0.5, only every `explore`-th refusal the rule asks for is made."""
    policy = ReusePolicy(step=0.25, explore=4)
    always = lambda _k: True  # noqa: E731
    for key in KEYS[:10]:
        policy.insert(key, 1)
    answers = []
    for _ in range(12):
        victim = policy.pick_victim(always)
        assert victim is not None
        policy.remove(victim)  # evicted: a ghost...
        for key in KEYS[10:14]:  # ...time passes...
            if key in policy:
                policy.remove(key)
            policy.insert(key, 1)
        kept = policy.pick_victim(always)
        answers.append(policy.admit(victim, 1, always))  # ...offered back: the rule keeps the fresher victim
        assert kept is not None
        policy.remove(kept)  # which nobody reads
    assert answers[0] is False  # trusted at first
    assert policy._trust < 0.5
    assert 1 <= answers[1:].count(False) <= 3  # then one refusal in 4
    low = policy._trust
    victim = policy.pick_victim(always)
    assert victim is not None
    policy.remove(victim)
    while policy.admit(victim, 1, always):  # until an exploring refusal keeps a victim...
        pass
    policy.touch(policy.pick_victim(always))  # ...that is read: the refusal paid
    assert policy._trust > low


def test_reuse_remembers_a_bounded_history() -> None:
    policy = ReusePolicy(history=2.0)
    cache = Cache(policy, 10)
    for key in SCAN:
        cache.get(key)
    assert len(policy) == 10 and policy.ghost_count <= 2 * 10 + 1
