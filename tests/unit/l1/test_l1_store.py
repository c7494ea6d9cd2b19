"""L1Store with its Holds: stateful property test of the page accounting, holds and room-making, plus
targeted cases of the store's own rules (lookup, the prefix index, removed entries still read, eviction
order, admission). The cases about reservations alone are in test_l1_holds.py."""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvtier.server import protocol as p
from kvtier.server.cache import Cache
from kvtier.server.eviction import DEFAULT_POLICY, make_policy
from kvtier.server.keys import chunk_keys, digest
from kvtier.server.l1.holdings import Reservation
from kvtier.server.l1.holds import Holds
from kvtier.server.l1.pool import PagePool, extent_pages, from_extents
from kvtier.server.l1.store import L1Store, ResizeRefused
from kvtier.server.metrics import Metrics
from kvtier.shm.client_lock import ClientLock, LockDirectory
from l1_helpers import (
    BPC,
    FAMILIES,
    MIN_BLOCK_BYTES,
    NS,
    PAGE,
    FakeClock,
    RefuseAll,
    block_key,
    full_l1,
    hello,
    item,
    make_l1,
)

pytestmark = pytest.mark.unit


class StoreMachine(RuleBasedStateMachine):
    """The store and holds against a model of who may touch which pages: every page is owned by exactly one
    of the free list, an entry, a reservation (live or lapsed) or a removed entry still being read; a lapsed
    holding keeps its pages until its client settles it or its lock file dies (real lock files)."""

    @initialize(policy=st.sampled_from(["lru", DEFAULT_POLICY]), num_pages=st.integers(4, 24))
    def start(self, policy: str, num_pages: int) -> None:
        self.clock = FakeClock()
        self.dir = tempfile.mkdtemp(prefix="kvtier-locks-")
        metrics = Metrics()
        self.store = L1Store(PagePool(num_pages, PAGE), make_policy(policy), metrics, min_block_bytes=MIN_BLOCK_BYTES)
        self.holds = Holds(self.store, metrics, lease_ttl_s=5.0, reservation_ttl_s=5.0, client_timeout_s=20.0,
                           clock=self.clock, locks=LockDirectory(self.dir, "seg"))
        self.cache = Cache(self.store, self.holds, metrics)
        self.idents = [b"client-a", b"client-b"]
        self.locks: dict[bytes, ClientLock] = {}
        for ident in self.idents:
            self._hello(ident)
        self.fp = self.holds.register(NS, self.holds.clients[self.idents[0]])
        self.rids: list[tuple[bytes, int]] = []  # reservations handed out (may have lapsed since)
        self.lids: list[tuple[bytes, int]] = []

    def teardown(self) -> None:
        for lock in self.locks.values():
            lock.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- helpers ---------------------------------------------------------------------------------

    def _hello(self, ident: bytes) -> None:
        if ident not in self.locks:
            self.locks[ident] = ClientLock(self.dir, "seg")
        self.holds.hello(ident, ident.decode(), 1, self.locks[ident].name)
        self.holds.register(NS, self.holds.clients[ident])

    def _client(self, i: int):
        ident = self.idents[i]
        if ident not in self.holds.clients:  # retired or dropped: register again, as a client does
            self._hello(ident)
        return self.holds.client(ident)

    def _held(self) -> set[int]:
        """Ids of entries that must survive any room-making: pinned or leased."""
        return {id(e) for e in self.store.entries.values() if e.pins or e.readers}

    def _check_survivors(self, held_before: set[int]) -> None:
        alive = {id(e) for e in self.store.entries.values()}
        assert held_before <= alive, "a pinned or leased entry was evicted"

    # -- rules -----------------------------------------------------------------------------------

    @rule(c=st.integers(0, 1), family=st.integers(0, FAMILIES - 1), blocks=st.integers(1, BPC),
          size=st.integers(1, 6 * PAGE))
    def reserve(self, c: int, family: int, blocks: int, size: int) -> None:
        owner = self._client(c)
        it = item(family, blocks, size)
        store, holds = self.store, self.holds
        needed = store.pool.pages_for(size)
        free = store.pool.free_pages
        room = free + store.evictable_pages
        found = store.index.get(it.key)
        exists = found is not None and found[1] >= blocks
        busy = it.key in store.busy
        held = self._held()
        [result] = holds.reserve(owner, self.fp, [it])
        self._check_survivors(held)
        if exists:
            assert result == [p.EXISTS]
        elif busy:
            assert result == [p.BUSY]
        elif needed > store.pool.num_pages:
            assert result == [p.REFUSED, p.TOO_LARGE]
        elif room < needed:
            assert result == [p.REFUSED, p.NO_SPACE]
        elif result == [p.REFUSED, p.NOT_ADMITTED]:  # the policy's admission: asked only when it must evict
            assert free < needed
        else:
            assert result[0] == p.RESERVED, f"store refused although {room} pages could be had for {needed}"
            rid, extents = result[1], result[2]
            assert sum(extents[1::2]) == needed
            assert store.busy[it.key] is holds.reservations[rid]
            self.rids.append((owner.ident, rid))

    @rule(family=st.integers(0, FAMILIES - 1), blocks=st.integers(2, BPC))
    def reserve_alias_of_itself(self, family: int, blocks: int) -> None:
        """An item naming its own key as an alias would leave an index entry behind: refused on the wire."""
        it = item(family, blocks, PAGE)
        with pytest.raises(p.ProtocolError):
            p.StoreItem.from_wire([it.key, it.size, blocks, [it.key, *it.aliases[1:]]])

    @precondition(lambda self: self.rids)
    @rule(data=st.data(), commit=st.booleans())
    def finish(self, data, commit: bool) -> None:
        """A commit or abort, also from a client retired meanwhile (a stopped process that resumed)."""
        ident, rid = data.draw(st.sampled_from(self.rids))
        self.rids.remove((ident, rid))
        store, holds = self.store, self.holds
        res = holds.reservations.get(rid)
        caller = holds.caller(ident)
        if commit:
            n = holds.commit(caller, [rid])
            assert n == int(res is not None and not res.lapsed)
            if n and res.item.key in store.entries:  # (over budget after a shrink it may leave at once)
                entry = store.entries[res.item.key]
                assert store.index.get(res.item.key) == (entry, res.item.blocks)
            pool = store.pool
            assert pool.used_pages <= pool.num_pages or store.evictable_pages == 0, "commit left L1 over budget"
        else:
            assert holds.abort(caller, [rid]) == int(res is not None)
        assert rid not in holds.reservations

    @rule(c=st.integers(0, 1), rid=st.integers(0, 50))
    def commit_foreign_or_unknown(self, c: int, rid: int) -> None:
        """Committing someone else's or an unknown reservation is a no-op."""
        owner = self._client(c)
        res = self.holds.reservations.get(rid)
        if res is not None and res.owner.ident == owner.ident:
            return
        assert self.holds.commit(owner, [rid]) == 0
        assert self.holds.abort(owner, [rid]) == 0

    @rule(c=st.integers(0, 1), families=st.lists(st.integers(0, FAMILIES - 1), min_size=1, max_size=4),
          blocks=st.integers(1, BPC))
    def acquire(self, c: int, families: list[int], blocks: int) -> None:
        owner = self._client(c)
        keys = [block_key(f, blocks) for f in families]
        expect = [self.store.index.get(k) for k in keys]
        lid, out = self.holds.acquire(owner, self.fp, keys)
        for found, got in zip(expect, out, strict=True):
            if found is None:
                assert got is None
            else:
                entry, match = found
                assert got is not None and got.match == match and got.extents == entry.extents
                assert entry.readers > 0
        if any(e is not None for e in expect):
            assert lid in self.holds.leases
            self.lids.append((owner.ident, lid))
        else:
            assert lid == 0

    @precondition(lambda self: self.lids)
    @rule(data=st.data())
    def release(self, data) -> None:
        """A release confirms the read only while the lease had not lapsed."""
        ident, lid = data.draw(st.sampled_from(self.lids))
        self.lids.remove((ident, lid))
        lease = self.holds.leases.get(lid)
        caller = self.holds.caller(ident)
        assert self.holds.release(caller, lid) == (lease is not None and not lease.lapsed)
        assert lid not in self.holds.leases
        assert self.holds.release(caller, lid) is False

    @rule(family=st.integers(0, FAMILIES - 1), blocks=st.integers(1, BPC), unpin=st.booleans())
    def pin(self, family: int, blocks: int, unpin: bool) -> None:
        key = block_key(family, blocks)
        entry = self.store.resolve(key)  # the chunk's own key, or a leading-block key of a stored chunk
        before = entry.pins if entry else 0
        found, missing, n = self.store.pin_keys([key], -1 if unpin else 1)
        assert (found, missing) == (([], [key]) if entry is None else ([key], []))
        if entry is None or (unpin and before == 0):
            assert n == 0
        else:
            assert n == 1
            assert entry.pins == before + (-1 if unpin else 1)

    @rule(families=st.lists(st.integers(0, FAMILIES - 1), min_size=1, max_size=3),
          cut=st.integers(1, BPC))
    def lookup(self, families: list[int], cut: int) -> None:
        chunks = [[block_key(f, j) for j in range(1, BPC + 1)] for f in families[:-1]]
        chunks.append([block_key(families[-1], j) for j in range(1, cut + 1)])
        self._client(0)  # a namespace is known while a client names it (or chunks are in it)
        hits = self.store.lookup(self.fp, chunks)
        assert len(hits) <= len(chunks)
        for (entry, match), block_keys in zip(hits, chunks, strict=False):
            assert entry.key in self.store.entries and self.store.entries[entry.key] is entry
            assert 1 <= match <= len(block_keys)
            assert self.store.index.get(block_keys[match - 1]) == (entry, match)
        # All but the last hit are full-chunk hits; a miss or partial hit stops the lookup.
        for _entry, match in hits[:-1]:
            assert match == BPC
        if len(hits) < len(chunks):
            nxt = chunks[len(hits)]
            if not hits or hits[-1][1] == len(chunks[len(hits) - 1]):
                assert all(k not in self.store.index for k in nxt)

    @rule()
    def clear(self) -> None:
        n, _ = self.store.clear()
        assert not self.store.entries and not self.store.index
        assert self.store.evictable_pages == 0 and self.store.pinned_pages == 0
        assert n >= 0

    @rule(pages=st.integers(1, 24))
    def resize(self, pages: int) -> None:
        pool = self.store.pool
        try:
            self.store.resize(min(pages, pool.segment_pages))
        except ResizeRefused:
            return
        assert pool.used_pages <= pool.num_pages or self.store.evictable_pages == 0

    @rule(dt=st.sampled_from([0.5, 3.0, 6.0, 25.0]))
    def advance_and_sweep(self, dt: float) -> None:
        self.clock.now += dt
        held = {id(e) for e in self.store.entries.values() if e.pins}
        self.holds.sweep()
        self._check_survivors(held)
        now = self.clock.now
        assert all(le.deadline >= now for le in self.holds.leases.values() if not le.lapsed)
        assert all(r.deadline >= now for r in self.holds.reservations.values() if not r.lapsed)

    @rule(c=st.integers(0, 1))
    def touch_client(self, c: int) -> None:
        self._client(c)

    @rule(c=st.integers(0, 1))
    def reconnect(self, c: int) -> None:
        """hello on a known identity: its old holdings lapse, their pages stay held back."""
        ident = self.idents[c]
        holds = self.holds
        before = {id(r) for r in holds.reservations.values() if r.owner.ident == ident}
        used = self.store.pool.used_pages
        self._hello(ident)
        assert self.store.pool.used_pages == used
        assert all(r.lapsed for r in holds.reservations.values() if id(r) in before)
        assert all(le.lapsed for le in holds.leases.values()
                   if le.owner.ident == ident and le.owner is not holds.clients[ident])

    @rule(c=st.integers(0, 1))
    def die(self, c: int) -> None:
        """The client process dies (its lock goes): the next sweep frees everything it held."""
        ident = self.idents[c]
        lock = self.locks.pop(ident, None)
        if lock is not None:
            lock.close()
        self.holds.sweep()
        assert not any(r.owner.ident == ident for r in self.holds.reservations.values())
        assert not any(le.owner.ident == ident for le in self.holds.leases.values())
        assert ident not in self.holds.clients

    # -- invariants ------------------------------------------------------------------------------

    def _doomed(self) -> dict:
        """Removed entries still being read (by a lease), by id()."""
        return {id(e): e for le in self.holds.leases.values() for e in le.entries if e.doomed}

    @invariant()
    def no_page_is_owned_twice(self) -> None:
        s, h = self.store, self.holds
        owners = [from_extents(e.extents) for e in s.entries.values()]
        owners += [from_extents(r.extents) for r in h.reservations.values()]
        owners += [from_extents(e.extents) for e in self._doomed().values()]
        owners.append(s.pool._free[: s.pool._top])
        pages = np.sort(np.concatenate(owners))
        assert np.array_equal(pages, np.arange(s.pool.segment_pages)), "a page is owned twice, or by nobody"

    @invariant()
    def pages_are_accounted(self) -> None:
        s, h = self.store, self.holds
        entry_pages = sum(e.pages for e in s.entries.values())
        res_pages = sum(sum(r.extents[1::2]) for r in h.reservations.values())
        doomed = self._doomed()
        assert s.doomed == doomed, "the store's removed-but-held entries are not the ones leases still read"
        doomed_pages = sum(e.pages for e in doomed.values())
        assert s.pool.used_pages == entry_pages + res_pages + doomed_pages
        assert s.pool.free_pages + s.pool.used_pages == s.pool.num_pages

    @invariant()
    def hold_counts_match_recomputation(self) -> None:
        s = self.store
        assert s.evictable_pages == sum(e.pages for e in s.entries.values() if e.evictable)
        assert s.pinned_pages == sum(e.pages for e in s.entries.values() if e.pins)
        readers: dict[int, int] = {}
        for le in self.holds.leases.values():
            for e in le.entries:
                readers[id(e)] = readers.get(id(e), 0) + 1
        for e in s.entries.values():
            assert e.readers == readers.get(id(e), 0)
            assert not e.doomed

    @invariant()
    def index_points_only_at_live_entries(self) -> None:
        s = self.store
        for key, (entry, match) in s.index.items():
            assert s.entries.get(entry.key) is entry, "index points to a removed entry"
            assert key == entry.key or key in entry.aliases
            assert 1 <= match <= entry.blocks
        for entry in s.entries.values():
            assert s.index.get(entry.key) == (entry, entry.blocks)
            assert entry.key in s.policy
        assert len(s.policy) == len(s.entries)

    @invariant()
    def holdings_belong_to_their_clients(self) -> None:
        """Live holdings are a registered client's; lapsed ones a registered or retired client's."""
        h = self.holds
        assert {r.item.key: r for r in h.reservations.values() if not r.lapsed} == self.store.busy
        registered = {id(c) for c in h.clients.values()}
        for holding, ids in [(r, r.owner.reservations) for r in h.reservations.values()] + [
                (le, le.owner.leases) for le in h.leases.values()]:
            rid = holding.rid if isinstance(holding, Reservation) else holding.lid
            assert rid in ids
            assert id(holding.owner) in registered or (holding.lapsed and id(holding.owner) in h.retired)

    @invariant()
    def stats_agree(self) -> None:
        st_ = self.cache.status()
        ps = self.store.pool.page_size
        assert st_["l1_used_bytes"] == self.store.pool.used_pages * ps
        assert st_["entries"] == len(self.store.entries)
        lapsed = sum(extent_pages(r.extents) for r in self.holds.reservations.values() if r.lapsed)
        assert st_["held_back_bytes"] >= lapsed * ps


StoreMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestStoreMachine = StoreMachine.TestCase


# -- targeted cases ----------------------------------------------------------------------------


def test_partial_entry_does_not_block_storing_the_full_chunk():
    store, holds, fp = make_l1()
    a = hello(holds, b"a")
    [r] = holds.reserve(a, fp, [item(5, 2, PAGE)])
    holds.commit(a, [r[1]])
    [r] = holds.reserve(a, fp, [item(5, BPC, 2 * PAGE)])
    assert r[0] == p.RESERVED
    holds.commit(a, [r[1]])
    chunks = [[block_key(5, j) for j in range(1, BPC + 1)]]
    [(entry, match)] = store.lookup(fp, chunks)
    assert match == BPC and entry.blocks == BPC


def test_lookup_ending_inside_a_chunk_returns_alias_block_count():
    store, holds, fp = make_l1()
    a = hello(holds, b"a")
    tokens = list(range(1000, 1000 + 3 * NS.chunk_size))
    chunks = chunk_keys(NS, tokens)
    items = [p.StoreItem(c.key, PAGE, len(c.block_keys), c.aliases) for c in chunks]
    results = holds.reserve(a, fp, items)
    assert holds.commit(a, [r[1] for r in results]) == 3
    # A prompt sharing 2 chunks and 3 blocks of the third, then diverging.
    other = tokens[: 2 * NS.chunk_size + 3 * NS.block_size] + [7] * (NS.chunk_size - 3 * NS.block_size)
    q = chunk_keys(NS, other)
    hits = store.lookup(fp, [list(c.block_keys) for c in q])
    assert [m for _, m in hits] == [BPC, BPC, 3]
    assert hits[2][0].key == chunks[2].key
    # A prompt that ends inside the third chunk, on a block boundary.
    q = chunk_keys(NS, tokens[: 2 * NS.chunk_size + NS.block_size + 5])
    assert [m for _, m in store.lookup(fp, [list(c.block_keys) for c in q])] == [BPC, BPC, 1]
    # A miss in the first chunk is a miss for everything after it.
    q = chunk_keys(NS, [1] + tokens[1:])
    assert store.lookup(fp, [list(c.block_keys) for c in q]) == []


def test_leased_entry_removed_by_clear_frees_pages_on_release():
    store, holds, fp = make_l1(num_pages=8)
    a = hello(holds, b"a")
    [r] = holds.reserve(a, fp, [item(1, BPC, 4 * PAGE)])
    holds.commit(a, [r[1]])
    lid, [got] = holds.acquire(a, fp, [block_key(1, BPC)])
    assert got is not None
    store.clear()
    assert store.pool.used_pages == 4  # doomed but still being read
    assert holds.reserve(a, fp, [item(2, BPC, 5 * PAGE)]) == [[p.REFUSED, p.NO_SPACE]]
    assert holds.release(a, lid)
    assert store.pool.used_pages == 0


def test_full_chunk_stays_findable_by_its_aliases_after_partial_entry_is_evicted():
    store, holds, fp = make_l1(num_pages=8)
    a = hello(holds, b"a")
    # A document ending inside chunk 7 (2 blocks) is stored first, then a longer prompt fills the chunk.
    [r] = holds.reserve(a, fp, [item(7, 2, PAGE)])
    holds.commit(a, [r[1]])
    [r] = holds.reserve(a, fp, [item(7, BPC, 2 * PAGE)])
    holds.commit(a, [r[1]])
    # Fill the pool so the (older) partial entry is evicted; pin the full chunk so it stays.
    assert store.pin_keys([block_key(7, BPC)])[2] == 1
    for f in range(20, 30):
        [r] = holds.reserve(a, fp, [item(f, BPC, PAGE)])
        if r[0] == p.RESERVED:
            holds.commit(a, [r[1]])
    assert block_key(7, 2) not in store.entries and block_key(7, BPC) in store.entries
    # A query that shares the chunk's first block, then diverges, should still hit the full chunk.
    hits = store.lookup(fp, [[block_key(7, 1), digest(b"diverged")]])
    assert [m for _, m in hits] == [1]


def test_shared_leading_blocks_stay_findable_after_first_full_chunk_is_evicted():
    store, holds, fp = make_l1(num_pages=8)
    a = hello(holds, b"a")
    first = item(7, BPC, PAGE)  # document + question 1 fill the chunk
    second = p.StoreItem(digest(b"q2"), PAGE, BPC, (block_key(7, 1), digest(b"q2/2"), digest(b"q2/3")))
    for it in (first, second):
        [r] = holds.reserve(a, fp, [it])
        holds.commit(a, [r[1]])
    assert store.pin_keys([second.key])[2] == 1
    for f in range(20, 30):
        [r] = holds.reserve(a, fp, [item(f, BPC, PAGE)])
        if r[0] == p.RESERVED:
            holds.commit(a, [r[1]])
    assert first.key not in store.entries and second.key in store.entries
    # Document + question 3: the shared first block is resident (in `second`), so it should hit.
    hits = store.lookup(fp, [[block_key(7, 1), digest(b"q3/2")]])
    assert [m for _, m in hits] == [1]


@pytest.mark.parametrize("policy", ["lru", DEFAULT_POLICY])
def test_queued_lookup_touches_count_before_the_next_eviction(policy):
    """Lookups queue their policy touches; an eviction that follows, with no flush between, still sees
    the looked-up chunk as recent and evicts the other one."""
    store, holds, fp = make_l1(num_pages=2, policy=policy)
    a = hello(holds, b"a")
    for family in (1, 2):  # family 1 is the older entry
        [r] = holds.reserve(a, fp, [item(family, BPC, PAGE)])
        holds.commit(a, [r[1]])
    [hit] = store.lookup(fp, [[block_key(1, j) for j in range(1, BPC + 1)]])
    assert hit[1] == BPC and store._touch_backlog  # queued, not applied yet
    [r] = holds.reserve(a, fp, [item(3, BPC, PAGE)])  # needs one page: evicts a victim
    assert r[0] == p.RESERVED
    assert block_key(1, BPC) in store.entries and block_key(2, BPC) not in store.entries


@pytest.mark.parametrize("policy", ["lru", DEFAULT_POLICY])
def test_peek_finds_what_lookup_finds_and_touches_nothing(policy):
    """A peek (the admin lookup's) answers as a lookup but queues no touch: the entry peeked at stays the
    older one and is the victim of the next eviction."""
    store, holds, fp = make_l1(num_pages=2, policy=policy)
    a = hello(holds, b"a")
    for family in (1, 2):  # family 1 is the older entry
        [r] = holds.reserve(a, fp, [item(family, BPC, PAGE)])
        holds.commit(a, [r[1]])
    chunks = [[block_key(1, j) for j in range(1, BPC + 1)]]
    assert store.peek(fp, chunks) == store.lookup(fp, chunks) and store.peek(fp, chunks)[0][1] == BPC
    store.flush_touches()
    for _ in range(3):
        store.peek(fp, [[block_key(2, j) for j in range(1, BPC + 1)]])
    assert not store._touch_backlog
    [r] = holds.reserve(a, fp, [item(3, BPC, PAGE)])  # needs one page: evicts a victim
    assert r[0] == p.RESERVED
    assert block_key(1, BPC) in store.entries and block_key(2, BPC) not in store.entries


def test_a_refused_offer_is_counted_and_evicts_nothing():
    store, holds, fp, a = full_l1(RefuseAll())
    assert holds.reserve(a, fp, [item(3, BPC, PAGE)]) == [[p.REFUSED, p.NOT_ADMITTED]]
    assert set(store.entries) == {block_key(1, BPC), block_key(2, BPC)}
    assert store.metrics.refused.labels(p.NOT_ADMITTED)._value.get() == 1
    store.clear()
    assert holds.reserve(a, fp, [item(3, BPC, PAGE)])[0][0] == p.RESERVED  # room free: no admission asked


def test_no_room_even_with_evictions_is_no_space_and_no_admission_is_asked():
    """Every page pinned: eviction could not make room, so the answer is no_space (what the client can act
    on), not the policy's refusal; the policy is not asked about an offer it could not take anyway."""
    store, holds, fp, a = full_l1(RefuseAll())
    assert store.pin_keys([block_key(1, BPC), block_key(2, BPC)])[2] == 2
    assert holds.reserve(a, fp, [item(3, BPC, PAGE)]) == [[p.REFUSED, p.NO_SPACE]]
    assert store.metrics.refused.labels(p.NOT_ADMITTED)._value.get() == 0
