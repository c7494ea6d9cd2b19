"""ChunkStore: stateful property test of the page accounting, holds and room-making, plus targeted cases."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvtier.server import protocol as p
from kvtier.server.chunk_store import ChunkStore
from kvtier.server.eviction import DEFAULT_POLICY, make_policy
from kvtier.server.keys import Namespace, chunk_keys, digest
from kvtier.server.l1_pool import PagePool
from kvtier.server.metrics import Metrics

pytestmark = pytest.mark.unit

NS = Namespace(model="m", dtype="bf16", num_layers=2, kv_heads=2, head_size=8, block_size=64,
               layout="NHD", chunk_size=256)
BPC = NS.blocks_per_chunk  # 4
PAGE = 1024
FAMILIES = 10


def block_key(family: int, j: int) -> bytes:
    """Key of the first j blocks of chunk family `family` (the j = BPC case is the chunk's own key)."""
    return digest(b"fam%d/%d" % (family, j))


def item(family: int, blocks: int, size: int) -> p.StoreItem:
    return p.StoreItem(block_key(family, blocks), size, blocks,
                       tuple(block_key(family, j) for j in range(1, blocks)))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class StoreMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["lru", DEFAULT_POLICY]), num_pages=st.integers(4, 24))
    def start(self, policy: str, num_pages: int) -> None:
        self.clock = FakeClock()
        self.store = ChunkStore(PagePool(num_pages, PAGE), make_policy(policy), Metrics(), lease_ttl_s=5.0,
                                reservation_ttl_s=5.0, client_timeout_s=20.0, clock=self.clock)
        self.fp = self.store.register(NS)
        self.idents = [b"client-a", b"client-b"]
        for ident in self.idents:
            self.store.hello(ident, ident.decode(), 1)
        self.rids: list[tuple[bytes, int]] = []  # reservations handed out (may have expired since)
        self.lids: list[tuple[bytes, int]] = []
        self.cleared = False

    # -- helpers ---------------------------------------------------------------------------------

    def _client(self, i: int):
        ident = self.idents[i]
        if ident not in self.store.clients:  # dropped after a timeout: reconnect, as a client does
            self.store.hello(ident, ident.decode(), 1)
        return self.store.client(ident)

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
        store = self.store
        needed = store.pool.pages_for(size)
        room = store.pool.free_pages + store.evictable_pages
        found = store.index.get(it.key)
        exists = found is not None and found[1] >= blocks
        busy = it.key in store.pending
        held = self._held()
        [result] = store.reserve(owner, self.fp, [it])
        self._check_survivors(held)
        if exists:
            assert result == [p.EXISTS]
        elif busy:
            assert result == [p.BUSY]
        elif needed > store.pool.num_pages:
            assert result == [p.REFUSED, p.TOO_LARGE]
        elif room < needed:
            assert result == [p.REFUSED, p.NO_SPACE]
        else:
            assert result[0] == p.RESERVED, f"store refused although {room} pages could be had for {needed}"
            rid, extents = result[1], result[2]
            assert sum(extents[1::2]) == needed
            assert store.pending[it.key] == rid
            self.rids.append((owner.ident, rid))

    @precondition(lambda self: self.rids)
    @rule(data=st.data(), commit=st.booleans())
    def finish(self, data, commit: bool) -> None:
        ident, rid = data.draw(st.sampled_from(self.rids))
        self.rids.remove((ident, rid))
        owner = self.store.clients.get(ident)
        if owner is None:
            return
        live = rid in self.store.reservations
        res = self.store.reservations.get(rid)
        if commit:
            n = self.store.commit(owner, [rid])
            assert n == int(live)
            if live:
                entry = self.store.entries[res.item.key]
                assert self.store.index[res.item.key] == (entry, res.item.blocks)
        else:
            assert self.store.abort(owner, [rid]) == int(live)
        assert rid not in self.store.reservations

    @rule(c=st.integers(0, 1), rid=st.integers(0, 50))
    def commit_foreign_or_unknown(self, c: int, rid: int) -> None:
        """Committing someone else's or an unknown reservation is a no-op."""
        owner = self._client(c)
        res = self.store.reservations.get(rid)
        if res is not None and res.owner == owner.ident:
            return
        assert self.store.commit(owner, [rid]) == 0
        assert self.store.abort(owner, [rid]) == 0

    @rule(c=st.integers(0, 1), families=st.lists(st.integers(0, FAMILIES - 1), min_size=1, max_size=4),
          blocks=st.integers(1, BPC))
    def acquire(self, c: int, families: list[int], blocks: int) -> None:
        owner = self._client(c)
        keys = [block_key(f, blocks) for f in families]
        expect = [self.store.index.get(k) for k in keys]
        lid, out = self.store.acquire(owner, keys)
        for found, got in zip(expect, out, strict=True):
            if found is None:
                assert got is None
            else:
                entry, match = found
                assert got is not None and got.match == match and got.extents == entry.extents
                assert entry.readers > 0
        if any(e is not None for e in expect):
            assert lid in self.store.leases
            self.lids.append((owner.ident, lid))
        else:
            assert lid == 0

    @precondition(lambda self: self.lids)
    @rule(data=st.data())
    def release(self, data) -> None:
        ident, lid = data.draw(st.sampled_from(self.lids))
        self.lids.remove((ident, lid))
        owner = self.store.clients.get(ident)
        if owner is None:
            return
        live = lid in self.store.leases
        assert self.store.release(owner, lid) == live
        assert self.store.release(owner, lid) is False

    @rule(family=st.integers(0, FAMILIES - 1), blocks=st.integers(1, BPC), unpin=st.booleans())
    def pin(self, family: int, blocks: int, unpin: bool) -> None:
        key = block_key(family, blocks)
        entry = self.store.entries.get(key)
        before = entry.pins if entry else 0
        n = self.store.unpin([key]) if unpin else self.store.pin([key])
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
        hits = self.store.lookup(self.fp, chunks)
        assert len(hits) <= len(chunks)
        for (entry, match), block_keys in zip(hits, chunks, strict=False):
            assert entry.key in self.store.entries and self.store.entries[entry.key] is entry
            assert 1 <= match <= len(block_keys)
            assert self.store.index[block_keys[match - 1]] == (entry, match)
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

    @rule(dt=st.sampled_from([0.5, 3.0, 6.0, 25.0]))
    def advance_and_sweep(self, dt: float) -> None:
        self.clock.now += dt
        held = {id(e) for e in self.store.entries.values() if e.pins}
        self.store.sweep()
        self._check_survivors(held)
        now = self.clock.now
        assert all(le.deadline >= now for le in self.store.leases.values())
        assert all(r.deadline >= now for r in self.store.reservations.values())

    @rule(c=st.integers(0, 1))
    def touch_client(self, c: int) -> None:
        self._client(c)

    @rule(c=st.integers(0, 1))
    def reconnect(self, c: int) -> None:
        """hello on a known identity drops whatever it held (a client restart)."""
        ident = self.idents[c]
        self.store.hello(ident, ident.decode(), 2)
        assert not any(r.owner == ident for r in self.store.reservations.values())
        assert not any(le.owner == ident for le in self.store.leases.values())

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def pages_are_accounted(self) -> None:
        s = self.store
        entry_pages = sum(e.pages for e in s.entries.values())
        res_pages = sum(sum(r.extents[1::2]) for r in s.reservations.values())
        doomed = {id(e): e for le in s.leases.values() for e in le.entries if e.doomed}
        doomed_pages = sum(e.pages for e in doomed.values())
        assert s.pool.used_pages == entry_pages + res_pages + doomed_pages
        assert s.pool.free_pages + s.pool.used_pages == s.pool.num_pages

    @invariant()
    def hold_counts_match_recomputation(self) -> None:
        s = self.store
        assert s.evictable_pages == sum(e.pages for e in s.entries.values() if e.evictable)
        assert s.pinned_pages == sum(e.pages for e in s.entries.values() if e.pins)
        readers: dict[int, int] = {}
        for le in s.leases.values():
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
            assert s.index[entry.key] == (entry, entry.blocks)
            assert entry.key in s.policy
        assert len(s.policy) == len(s.entries)

    @invariant()
    def pending_matches_reservations(self) -> None:
        s = self.store
        assert {r.item.key: r.rid for r in s.reservations.values()} == s.pending
        for r in s.reservations.values():
            assert r.rid in s.clients[r.owner].reservations
        for le in s.leases.values():
            assert le.lid in s.clients[le.owner].leases

    @invariant()
    def stats_agree(self) -> None:
        st_ = self.store.stats()
        ps = self.store.pool.page_size
        assert st_["l1_used_bytes"] == self.store.pool.used_pages * ps
        assert st_["l1_used_bytes"] <= st_["l1_capacity_bytes"]
        assert st_["entries"] == len(self.store.entries)


StoreMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)
TestStoreMachine = StoreMachine.TestCase


# -- targeted cases ----------------------------------------------------------------------------


def _store(num_pages: int = 32, policy: str = "lru") -> tuple[ChunkStore, bytes]:
    store = ChunkStore(PagePool(num_pages, PAGE), make_policy(policy), Metrics(), clock=FakeClock())
    return store, store.register(NS)


def _hello(store: ChunkStore, name: bytes):
    store.hello(name, name.decode(), 1)
    return store.client(name)


def test_concurrent_reserve_of_one_key_is_deduplicated():
    store, fp = _store()
    a, b = _hello(store, b"a"), _hello(store, b"b")
    it = item(1, BPC, 3 * PAGE)
    [first] = store.reserve(a, fp, [it])
    assert first[0] == p.RESERVED
    used = store.pool.used_pages
    assert store.reserve(b, fp, [it]) == [[p.BUSY]]
    assert store.reserve(a, fp, [it]) == [[p.BUSY]]
    assert store.pool.used_pages == used  # the duplicate took no pages
    # The writer aborts: the key can be reserved again.
    assert store.abort(a, [first[1]]) == 1
    [again] = store.reserve(b, fp, [it])
    assert again[0] == p.RESERVED
    assert store.commit(b, [again[1]]) == 1
    assert store.reserve(a, fp, [it]) == [[p.EXISTS]]
    # Within one batch, the same key twice: one writer.
    it2 = item(2, BPC, PAGE)
    results = store.reserve(a, fp, [it2, it2])
    assert results[0][0] == p.RESERVED and results[1] == [p.BUSY]


def test_exists_on_stored_key_and_on_leading_block_alias():
    store, fp = _store()
    a = _hello(store, b"a")
    [r] = store.reserve(a, fp, [item(3, BPC, 2 * PAGE)])
    store.commit(a, [r[1]])
    used = store.pool.used_pages
    for blocks in range(1, BPC + 1):  # a shorter prompt's partial chunk is already covered
        assert store.reserve(a, fp, [item(3, blocks, PAGE)]) == [[p.EXISTS]]
    assert store.pool.used_pages == used
    # A different family is not covered.
    assert store.reserve(a, fp, [item(4, 1, PAGE)])[0][0] == p.RESERVED


def test_partial_entry_does_not_block_storing_the_full_chunk():
    store, fp = _store()
    a = _hello(store, b"a")
    [r] = store.reserve(a, fp, [item(5, 2, PAGE)])
    store.commit(a, [r[1]])
    [r] = store.reserve(a, fp, [item(5, BPC, 2 * PAGE)])
    assert r[0] == p.RESERVED
    store.commit(a, [r[1]])
    chunks = [[block_key(5, j) for j in range(1, BPC + 1)]]
    [(entry, match)] = store.lookup(fp, chunks)
    assert match == BPC and entry.blocks == BPC


def test_lookup_ending_inside_a_chunk_returns_alias_block_count():
    store, fp = _store()
    a = _hello(store, b"a")
    tokens = list(range(1000, 1000 + 3 * NS.chunk_size))
    chunks = chunk_keys(NS, tokens)
    items = [p.StoreItem(c.key, PAGE, len(c.block_keys), c.aliases) for c in chunks]
    results = store.reserve(a, fp, items)
    assert store.commit(a, [r[1] for r in results]) == 3
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
    store, fp = _store(num_pages=8)
    a = _hello(store, b"a")
    [r] = store.reserve(a, fp, [item(1, BPC, 4 * PAGE)])
    store.commit(a, [r[1]])
    lid, [got] = store.acquire(a, [block_key(1, BPC)])
    assert got is not None
    store.clear()
    assert store.pool.used_pages == 4  # doomed but still being read
    assert store.reserve(a, fp, [item(2, BPC, 5 * PAGE)]) == [[p.REFUSED, p.NO_SPACE]]
    assert store.release(a, lid)
    assert store.pool.used_pages == 0


def test_same_key_with_more_blocks_does_not_leak_pages():
    """A client that reuses a stored key with a larger block count must not orphan the old entry."""
    store, fp = _store(num_pages=8)
    a = _hello(store, b"a")
    key = block_key(9, 1)
    [r] = store.reserve(a, fp, [p.StoreItem(key, 2 * PAGE, 1, ())])
    store.commit(a, [r[1]])
    [r] = store.reserve(a, fp, [p.StoreItem(key, 2 * PAGE, 2, (block_key(9, 7),))])
    if r[0] == p.RESERVED:
        store.commit(a, [r[1]])
    store.clear()
    assert store.pool.used_pages == 0, "pages of an overwritten entry leaked"
    assert store.evictable_pages == 0


def test_expired_reservation_cannot_be_committed():
    store, fp = _store()
    a = _hello(store, b"a")
    [r] = store.reserve(a, fp, [item(1, BPC, PAGE)])
    store.clock.now += store.reservation_ttl_s + 1
    store.client(a.ident)  # still alive
    store.sweep()
    assert store.pool.used_pages == 0
    assert store.commit(a, [r[1]]) == 0
    assert block_key(1, BPC) not in store.entries


def test_full_chunk_stays_findable_by_its_aliases_after_partial_entry_is_evicted():
    store, fp = _store(num_pages=8)
    a = _hello(store, b"a")
    # A document ending inside chunk 7 (2 blocks) is stored first, then a longer prompt fills the chunk.
    [r] = store.reserve(a, fp, [item(7, 2, PAGE)])
    store.commit(a, [r[1]])
    [r] = store.reserve(a, fp, [item(7, BPC, 2 * PAGE)])
    store.commit(a, [r[1]])
    # Fill the pool so the (older) partial entry is evicted; pin the full chunk so it stays.
    assert store.pin([block_key(7, BPC)]) == 1
    for f in range(20, 30):
        [r] = store.reserve(a, fp, [item(f, BPC, PAGE)])
        if r[0] == p.RESERVED:
            store.commit(a, [r[1]])
    assert block_key(7, 2) not in store.entries and block_key(7, BPC) in store.entries
    # A query that shares the chunk's first block, then diverges, should still hit the full chunk.
    hits = store.lookup(fp, [[block_key(7, 1), digest(b"diverged")]])
    assert [m for _, m in hits] == [1]


def test_shared_leading_blocks_stay_findable_after_first_full_chunk_is_evicted():
    store, fp = _store(num_pages=8)
    a = _hello(store, b"a")
    first = item(7, BPC, PAGE)  # document + question 1 fill the chunk
    second = p.StoreItem(digest(b"q2"), PAGE, BPC, (block_key(7, 1), digest(b"q2/2"), digest(b"q2/3")))
    for it in (first, second):
        [r] = store.reserve(a, fp, [it])
        store.commit(a, [r[1]])
    assert store.pin([second.key]) == 1
    for f in range(20, 30):
        [r] = store.reserve(a, fp, [item(f, BPC, PAGE)])
        if r[0] == p.RESERVED:
            store.commit(a, [r[1]])
    assert first.key not in store.entries and second.key in store.entries
    # Document + question 3: the shared first block is resident (in `second`), so it should hit.
    hits = store.lookup(fp, [[block_key(7, 1), digest(b"q3/2")]])
    assert [m for _, m in hits] == [1]


@pytest.mark.parametrize("policy", ["lru", DEFAULT_POLICY])
def test_queued_lookup_touches_count_before_the_next_eviction(policy):
    """Lookups queue their policy touches; an eviction that follows, with no flush between, still sees
    the looked-up chunk as recent and evicts the other one."""
    store, fp = _store(num_pages=2, policy=policy)
    a = _hello(store, b"a")
    for family in (1, 2):  # family 1 is the older entry
        [r] = store.reserve(a, fp, [item(family, BPC, PAGE)])
        store.commit(a, [r[1]])
    [hit] = store.lookup(fp, [[block_key(1, j) for j in range(1, BPC + 1)]])
    assert hit[1] == BPC and store._touch_backlog  # queued, not applied yet
    [r] = store.reserve(a, fp, [item(3, BPC, PAGE)])  # needs one page: evicts a victim
    assert r[0] == p.RESERVED
    assert block_key(1, BPC) in store.entries and block_key(2, BPC) not in store.entries
