"""The L1 journal (server/l1/journal.py) against a random workload on L1Store and Holds.

After every operation the journal must replay to exactly the store's entries (in commit order) and its pages
allocated to no entry. And at every single write to the journal (each record appended, each compaction), as
if the daemon were killed right there: every entry the replay adopts must hold its own bytes in the pages it
names (a model of what each page holds), and no page a writer may still be filling (an open reservation, live
or lapsed, a promotion in flight) may be free or another entry's after the replay.
"""

from __future__ import annotations

import mmap
import random
import threading
from collections.abc import Iterable

import msgpack
import numpy as np
import pytest
from kvtier.server.eviction import make_policy
from kvtier.server.l1.entry import Entry
from kvtier.server.l1.holds import Holds
from kvtier.server.l1.journal import L1Journal
from kvtier.server.l1.journal_records import ALLOC, COMMIT, FREE, NAMESPACE, REMOVE, VERSION, half_bytes
from kvtier.server.l1.pool import PagePool, extent_pages, from_extents
from kvtier.server.l1.reconfig import drain_policy
from kvtier.server.l1.replay import replay
from kvtier.server.l1.store import L1Store
from kvtier.server.metrics import Metrics
from kvtier.shm.journal import Journal, JournalDamaged, JournalMismatch, Staging, frame, journal_bytes, parse
from kvtier.shm.segment import Segment
from l1_helpers import BPC, MIN_BLOCK_BYTES, NS, PAGE, FakeClock, block_key, item

pytestmark = pytest.mark.unit

PAGES = 24
GEOMETRY = (PAGES * PAGE, PAGE, PAGES, 1)


def anonymous_segment(size: int) -> Segment:
    return Segment("anonymous", size, -1, mmap.mmap(-1, size), owner=False)


class RecordingJournal(Journal):
    """Calls `on_write` after each append, rewrite and switch: the instants a kill would leave this journal.
    A staged snapshot lets `let_through()` appends into the active half before its worker may write it and is
    waited for: the switch comes at a point the workload's seed decides, not the threads' timing."""

    on_write = staticmethod(lambda: None)
    let_through = staticmethod(lambda: 0)
    _left = 0
    _gate = threading.Event()

    def stage(self, parts: Iterable[bytes]) -> Staging:
        self._gate, self._left = threading.Event(), self.let_through()
        return super().stage(parts)

    def _write_staged(self, staging: Staging, parts: Iterable[bytes]) -> None:
        self._gate.wait()
        super()._write_staged(staging, parts)

    def append(self, record: bytes) -> bool:
        if self.staging is not None:
            if self._left <= 0:
                self._gate.set()
                self.staging.done.wait()
            self._left -= 1
        done = super().append(record)
        if done:
            self.on_write()
        return done

    def switch(self) -> bool:
        self._gate.set()
        done = super().switch()
        if done:
            self.on_write()
        return done

    def drop_staging(self) -> None:
        self._gate.set()
        super().drop_staging()

    def rewrite(self, records: bytes) -> None:
        super().rewrite(records)
        self.on_write()


def tag(key: bytes) -> int:
    """What a chunk's bytes are, per page, in the page model."""
    return int.from_bytes(key[:7], "little") + 1


class Workload:
    def __init__(self, seed: int, policy: str) -> None:
        self.rng = random.Random(seed)
        metrics = Metrics()
        self.clock = FakeClock()
        self.store = L1Store(PagePool(PAGES, PAGE), make_policy(policy), metrics, min_block_bytes=MIN_BLOCK_BYTES)
        self.holds = Holds(self.store, metrics, lease_ttl_s=5.0, reservation_ttl_s=5.0, client_timeout_s=12.0,
                           clock=self.clock)
        half = half_bytes(PAGES, PAGE, MIN_BLOCK_BYTES)
        self.journal = RecordingJournal.create(anonymous_segment(journal_bytes(half)), VERSION, GEOMETRY)
        self.writer = L1Journal(self.journal, metrics, slack=600)  # a compaction every few dozen records
        self.store.attach_journal(self.writer)
        self.model = np.zeros(PAGES, dtype=np.int64)  # per page: the tag of the chunk whose bytes it holds
        self.written: set[int] = set()  # reservations whose client has copied its bytes in
        self.leases: list[tuple[bytes, int]] = []
        self.promoting: dict[bytes, Entry] = {}
        self.points: list[tuple[bytes, np.ndarray, np.ndarray]] = []
        self.idents = [b"a", b"b"]
        for ident in self.idents:
            self.hello(ident)
        self.fp = NS.fingerprint()
        self.journal.on_write = self.capture
        let = random.Random(-seed)  # its own: the workload's operations stay those of the seed
        self.journal.let_through = lambda: let.randrange(12)

    def capture(self) -> None:
        writers = [r.extents for r in self.holds.reservations.values()] + [e.extents for e in self.promoting.values()]
        pages = np.concatenate([from_extents(e) for e in writers]) if writers else np.empty(0, dtype=np.int32)
        self.points.append((self.journal.committed(), self.model.copy(), pages))

    def hello(self, ident: bytes) -> None:
        self.holds.hello(ident, ident.decode(), 1)
        self.holds.register(NS, self.holds.client(ident))

    def owner(self):  # noqa: ANN201 - a ClientState
        ident = self.rng.choice(self.idents)
        if ident not in self.holds.clients:  # retired by the timeout: it says hello again
            self.hello(ident)
        return self.holds.client(ident)

    # -- operations ------------------------------------------------------------------------------

    def reserve(self) -> None:
        items = []
        for _ in range(self.rng.randint(1, 3)):
            blocks = self.rng.choice([BPC, BPC, BPC, 1, 2])
            pages = self.rng.randint(1, 3)
            items.append(item(self.rng.randrange(12), blocks, max(pages * PAGE - self.rng.randrange(PAGE), blocks * MIN_BLOCK_BYTES)))
        self.holds.reserve(self.owner(), self.fp, items)

    def write(self) -> None:
        open_ = [r for r in self.holds.reservations.values() if r.rid not in self.written]
        if open_:
            res = self.rng.choice(open_)
            self.model[from_extents(res.extents)] = tag(res.item.key)
            self.written.add(res.rid)

    def settle(self) -> None:
        ready = [r for r in self.holds.reservations.values() if r.rid in self.written]
        if ready:
            res = self.rng.choice(ready)
            owner = self.holds.caller(res.owner.ident)
            (self.holds.commit if self.rng.random() < 0.85 else self.holds.abort)(owner, [res.rid])

    def abort_unwritten(self) -> None:
        open_ = [r for r in self.holds.reservations.values() if r.rid not in self.written]
        if open_:
            res = self.rng.choice(open_)
            self.holds.abort(self.holds.caller(res.owner.ident), [res.rid])

    def acquire(self) -> None:
        keys = self.rng.sample(list(self.store.entries), min(2, len(self.store.entries)))
        ident = self.rng.choice(self.idents)
        if keys and ident in self.holds.clients:
            lid, _ = self.holds.acquire(self.holds.client(ident), self.fp, keys)
            if lid:
                self.leases.append((ident, lid))

    def release(self) -> None:
        if self.leases:
            ident, lid = self.leases.pop(self.rng.randrange(len(self.leases)))
            self.holds.release(self.holds.caller(ident), lid)

    def promote(self) -> None:
        """A lower tier's chunk read into L1 pages (tiers/promotion.py's calls): begin, read, then commit or
        give the pages back."""
        if self.promoting and self.rng.random() < 0.6:
            key = self.rng.choice(list(self.promoting))
            entry = self.promoting.pop(key)
            self.store.end_busy(key, entry)
            self.model[from_extents(entry.extents)] = tag(key)
            if self.rng.random() < 0.7 and key not in self.store.entries:
                self.store.insert(entry)
            else:
                self.store.pool.release(entry.extents)
            return
        it = item(self.rng.randrange(30, 40), BPC, PAGE)
        if it.key in self.store.entries or it.key in self.store.busy:
            return
        entry = Entry(it.key, self.fp, it.size, it.blocks, (), it.aliases)
        extents = self.store.begin_insert(it.key, it.size, entry, admit=False)
        if not isinstance(extents, str):
            entry.extents = extents
            self.promoting[it.key] = entry

    def pin(self) -> None:
        if self.store.entries:
            key = self.rng.choice(list(self.store.entries))
            self.store.pin_keys([key], self.rng.choice([1, 1, -1]))

    def time_passes(self) -> None:
        self.clock.now += self.rng.choice([1.0, 6.0])
        self.holds.sweep()

    def clear(self) -> None:
        self.store.clear(self.fp if self.rng.random() < 0.5 else None)

    def resize(self) -> None:
        self.store.resize(self.rng.randint(PAGES // 2, PAGES) if self.rng.random() < 0.5 else PAGES)

    def step(self) -> None:
        ops = [(self.reserve, 4), (self.write, 6), (self.settle, 7), (self.abort_unwritten, 1), (self.acquire, 2),
               (self.release, 2), (self.promote, 2), (self.pin, 0.5), (self.time_passes, 1), (self.clear, 0.2), (self.resize, 0.3)]
        fn = self.rng.choices([op for op, _ in ops], [w for _, w in ops])[0]
        try:
            fn()
        except Exception as exc:  # a shrink below what is held is refused; nothing else may fail
            assert type(exc).__name__ == "ResizeRefused", exc

    # -- checks ----------------------------------------------------------------------------------

    def check_exact(self) -> None:
        """Between operations the journal is the store: same entries in the same order, same unheld pages."""
        got = replay(self.journal.records(), PAGES, PAGE)
        assert got.dropped == 0
        assert [e.key for e in got.entries] == list(self.store.entries)
        for e in got.entries:
            mine = self.store.entries[e.key]
            assert (e.ns, e.size, e.blocks, e.aliases, e.extents, e.pins) == (
                mine.ns, mine.size, mine.blocks, mine.aliases, mine.extents, mine.pins)
        used = np.ones(PAGES, dtype=bool)
        used[from_extents(self.store.pool.free_extents())] = False
        for entry in self.store.entries.values():
            used[from_extents(entry.extents)] = False
        assert sorted(from_extents(got.unheld).tolist()) == np.flatnonzero(used).tolist()
        groups = {(g.client, g.rid): set(from_extents(g.extents).tolist()) for g in got.groups}
        for res in self.holds.reservations.values():  # each reservation's pages name their writer
            assert set(from_extents(res.extents).tolist()) <= groups[res.owner.lock[-32:], res.rid]
        assert set(got.namespaces) == {e.ns for e in self.store.entries.values()}


def check_point(log: bytes, model: np.ndarray, writers: np.ndarray) -> int:
    """The journal a kill would have left: adopted entries hold their bytes, no writer's page is reused."""
    got = replay(parse(log), PAGES, PAGE)
    held = np.zeros(PAGES, dtype=np.int64)
    for e in got.entries:
        pages = from_extents(e.extents)
        assert (model[pages] == tag(e.key)).all(), f"entry {e.key.hex()} adopted over bytes that are not its own"
        assert not held[pages].any(), "two adopted entries share a page"
        held[pages] = 1
    unheld = from_extents(got.unheld)
    assert not held[unheld].any(), "a quarantined page is an adopted entry's"
    assert set(writers.tolist()) <= set(unheld.tolist()), "a page a writer may still fill would be reused"
    return len(got.entries)


@pytest.mark.parametrize("seed", range(6))
def test_journal_replays_to_a_safe_l1_at_every_instant(seed):
    work = Workload(seed, "lru" if seed % 2 else "reuse")
    for _ in range(800):
        work.step()
        work.check_exact()
    adopted = [check_point(*point) for point in work.points]
    # the workload made a busy journal: compactions, evictions, and many points with chunks to adopt
    assert work.writer.compactions > 10 and len(work.points) > 400 and max(adopted) >= 5
    assert work.store.metrics.evictions.labels("l1", "capacity")._value.get() > 10


def test_a_clean_stop_snapshot_carries_the_policys_order():
    work = Workload(99, "lru")
    for _ in range(300):
        work.step()
    order = drain_policy(work.store)
    work.writer.compact(order)
    assert [e.key for e in replay(work.journal.records(), PAGES, PAGE).entries] == order


def test_a_journal_that_cannot_keep_up_makes_itself_unadoptable():
    """A half too small for the live state (a sizing bug): the file stops being a journal, never goes stale."""
    store = L1Store(PagePool(PAGES, PAGE), make_policy("lru"), Metrics(), min_block_bytes=MIN_BLOCK_BYTES)
    journal = Journal.create(anonymous_segment(journal_bytes(2048)), VERSION, GEOMETRY)
    store.attach_journal(L1Journal(journal, store.metrics, slack=100))
    holds = Holds(store, store.metrics, clock=FakeClock())
    holds.hello(b"c", "c", 1)
    client = holds.client(b"c")
    fp = holds.register(NS, client)
    for family in range(20):
        [res] = holds.reserve(client, fp, [item(family, BPC, PAGE)])
        holds.commit(client, [res[1]])
    assert store.journal.failed and len(store.entries) == 20  # serving goes on
    with pytest.raises(JournalMismatch, match="no magic"):
        Journal.open(journal.segment, VERSION, GEOMETRY)


def test_worst_case_records_stay_within_the_bounds_the_halves_are_sized_by():
    """half_bytes promises that any snapshot fits: each record type's largest encoding must be within it."""
    from kvtier.server.keys import MAX_NS_STR, Namespace
    from kvtier.server.l1 import journal_records as j
    from kvtier.server.l1 import store

    assert j.MAX_NAMESPACES == store.MAX_NAMESPACES
    wide = "\U0001F600" * MAX_NS_STR  # 4 UTF-8 bytes a character
    ns = Namespace(model=wide, dtype=wide, num_layers=1 << 20, kv_heads=1 << 20, head_size=1 << 20, block_size=1,
                   layout=wide, chunk_size=4096, tp_size=1 << 20, tp_rank=(1 << 20) - 1, revision=wide,
                   cache_salt=wide)
    assert len(frame(NAMESPACE, j._pack((ns.fingerprint(), ns.to_dict())))) <= j._NAMESPACE_MAX
    pairs = 70_000  # past 65,535: the largest array header
    extents = tuple(x for i in range(pairs) for x in ((1 << 32) - 2 * pairs + 2 * i, 1))
    aliases = tuple(bytes([i % 256, i // 256]) * 8 for i in range(4095))
    commit = frame(COMMIT, j._pack((b"k" * 16, b"n" * 16, (1 << 64) - 1, 4096, aliases, extents)))
    assert len(commit) <= j._ENTRY_MAX + pairs * j._EXTENT_MAX + len(aliases) * j._ALIAS_MAX
    record = j.Unheld(extents, "f" * 32, (1 << 64) - 1).record()
    assert len(record) <= j._ENTRY_MAX + pairs * j._EXTENT_MAX + j._WRITER_MAX
    assert len(j.pin_record(b"k" * 16, (1 << 64) - 1)) <= j._PIN_MAX


# -- replay of hand-written journals -------------------------------------------------------------


def records(*pairs: tuple[int, object]) -> bytes:
    return b"".join(frame(t, msgpack.packb(v, use_bin_type=True)) for t, v in pairs)


def alloc(extents: tuple[int, ...], client: str = "", rid: int = 0) -> tuple[int, object]:
    return ALLOC, (extents, client, rid)


def commit(family: int, extents: tuple[int, ...], size: int = PAGE) -> tuple[int, object]:
    return COMMIT, (block_key(family, 1), NS.fingerprint(), size, 1, (), extents)


NAMESPACE_RECORD = (NAMESPACE, (NS.fingerprint(), NS.to_dict()))


def test_pages_claimed_twice_drop_every_claimant():
    log = records(NAMESPACE_RECORD, alloc((0, 2)), commit(1, (0, 1)), commit(2, (0, 1)),
                  alloc((5, 1)), commit(3, (5, 1)), alloc((2, 1)), commit(4, (2, 1)), alloc((2, 1)))
    got = replay(parse(log), PAGES, PAGE)
    # 1 and 2 share page 0; 4's page was allocated again while it lived; 3 is untouched
    assert [e.key for e in got.entries] == [block_key(3, 1)] and got.dropped == 3
    assert sorted(from_extents(got.unheld).tolist()) == [0, 1, 2]


def test_a_snapshots_commit_stands_for_the_allocation_of_its_pages():
    got = replay(parse(records(NAMESPACE_RECORD, commit(1, (3, 1)), alloc((4, 1)))), PAGES, PAGE)
    assert [e.extents for e in got.entries] == [(3, 1)] and got.dropped == 0 and got.unheld == (4, 1)


def test_an_entry_without_its_namespace_is_not_adopted():
    got = replay(parse(records(alloc((0, 1)), commit(1, (0, 1)))), PAGES, PAGE)
    assert got.entries == [] and got.dropped == 1 and extent_pages(got.unheld) == 1


@pytest.mark.parametrize("bad", [
    alloc((PAGES - 1, 2)),  # past the segment
    alloc((-1, 1)),
    alloc(()),
    (ALLOC, (0, 1)),  # version 1's ALLOC: no writer
    alloc((3, 1), "x" * 32),  # a client lock id is 32 hex digits
    alloc((3, 1), "a" * 33),
    alloc((3, 1), "", -1),
    (COMMIT, (b"short", NS.fingerprint(), PAGE, 1, (), (0, 1))),
    (COMMIT, (block_key(1, 1), NS.fingerprint(), 2 * PAGE, 1, (), (0, 1))),  # more bytes than its pages
    (NAMESPACE, (b"\0" * 16, NS.to_dict())),  # a fingerprint its fields do not give
    (9, 0),  # an unknown record type
])
def test_a_record_that_verifies_but_does_not_decode_is_damage(bad):
    with pytest.raises(JournalDamaged):
        replay(parse(records(NAMESPACE_RECORD, alloc((0, 1)), bad)), PAGES, PAGE)


def test_unheld_pages_are_grouped_by_the_client_that_may_still_write_them():
    a, b = "a" * 32, "b" * 32
    log = records(NAMESPACE_RECORD, alloc((0, 2), a, 7), alloc((2, 1), b, 9), alloc((3, 2)), alloc((5, 1), a, 8),
                  commit(1, (3, 1)), (FREE, (4, 1)), alloc((4, 1), b, 9), (REMOVE, block_key(1, 1)))
    got = replay(parse(log), PAGES, PAGE)
    assert sorted((g.client, g.rid, g.extents) for g in got.groups) == [
        ("", 0, (3, 1)), (a, 7, (0, 2)), (a, 8, (5, 1)), (b, 9, (2, 1, 4, 1))]
    assert sorted(from_extents(got.unheld).tolist()) == [0, 1, 2, 3, 4, 5]
