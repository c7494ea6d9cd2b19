"""Compaction off the serving loop (issue 29 item 8): shm/journal.py `stage`/`switch` and L1Journal's use of it.

A staged snapshot is written into the inactive half by the journal's worker while records go on being
appended to the active half; the switch writes those records after the snapshot and flips the state word.
Every instant is checked as a kill would leave it: a copy of the file taken there is reopened and replayed.
The worker is held at a gate (a subclass's `_write_staged` waits for it) to put appends inside the staging.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import uuid
from collections.abc import Iterable, Iterator

import numpy as np
import pytest
from kvtier.server.eviction import make_policy
from kvtier.server.l1.holds import Holds
from kvtier.server.l1.journal import L1Journal
from kvtier.server.l1.journal_records import VERSION, half_bytes
from kvtier.server.l1.pool import PagePool, from_extents
from kvtier.server.l1.reconfig import drain_policy
from kvtier.server.l1.replay import replay
from kvtier.server.l1.store import L1Store
from kvtier.server.metrics import Metrics
from kvtier.shm.journal import Journal, Staging, frame, journal_bytes
from kvtier.shm.segment import SHM_DIR, Segment
from l1_helpers import BPC, MIN_BLOCK_BYTES, NS, PAGE, FakeClock, hello, item

pytestmark = pytest.mark.unit

GEOMETRY = (1 << 20, 4096, 256, 7)
SNAPSHOT, STEP = 1, 2


class GatedJournal(Journal):
    """The worker waits at `gate` before it writes a staged snapshot."""

    gate: threading.Event

    def _write_staged(self, staging: Staging, parts: Iterable[bytes]) -> None:
        self.gate.wait()
        super()._write_staged(staging, parts)


@pytest.fixture
def name() -> Iterator[str]:
    name = f"kvtier-unit-staging-{uuid.uuid4().hex[:12]}"
    yield name
    for leftover in (name, name + ".crash"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, leftover))


def gated(name: str, half: int, version: int = 1, geometry: tuple = GEOMETRY) -> GatedJournal:
    journal = GatedJournal.create(Segment.create(name, journal_bytes(half)), version, geometry)
    journal.gate = threading.Event()
    return journal


def reopen(name: str, half: int, version: int = 1, geometry: tuple = GEOMETRY) -> Journal:
    return Journal.open(Segment.adopt(name, journal_bytes(half)), version, geometry)


def after_a_kill(name: str, half: int, version: int = 1, geometry: tuple = GEOMETRY) -> list[tuple[int, bytes]]:
    """The records a daemon killed right now would leave: the file as it is, copied, reopened and read."""
    shutil.copyfile(os.path.join(SHM_DIR, name), os.path.join(SHM_DIR, name + ".crash"))
    journal = reopen(name + ".crash", half, version, geometry)
    try:
        return [(rtype, bytes(payload)) for rtype, payload, _ in journal.records()]
    finally:
        journal.close(keep=False)


def test_a_staged_snapshot_counts_only_after_the_switch_and_records_appended_meanwhile_follow_it(name):
    half = 1 << 20
    j = gated(name, half)
    old = [frame(STEP, b"old %d" % i) for i in range(50)]
    for record in old:
        assert j.append(record)
    before = after_a_kill(name, half)
    staging = j.stage([frame(SNAPSHOT, b"snap")])
    assert j.append(frame(STEP, b"while gated"))
    # killed while the worker has not written yet: the old log, and the record appended since
    assert after_a_kill(name, half) == [*before, (STEP, b"while gated")]
    j.gate.set()
    staging.done.wait()
    assert j.append(frame(STEP, b"after written"))
    # killed with the snapshot written but not switched to: the old half is still the log, whole
    assert after_a_kill(name, half) == [*before, (STEP, b"while gated"), (STEP, b"after written")]
    assert j.active == 0 and j.switch()
    expected = [(SNAPSHOT, b"snap"), (STEP, b"while gated"), (STEP, b"after written")]
    assert j.active == 1 and after_a_kill(name, half) == expected
    assert j.append(frame(STEP, b"after the switch"))  # appends go to the new half, not into the buffer
    assert j.staging is None
    j.close()
    j = reopen(name, half)
    assert [(t, bytes(p)) for t, p, _ in j.records()] == [*expected, (STEP, b"after the switch")]
    j.close(keep=False)


def test_the_switch_gives_the_old_half_back_and_a_rewrite_afterwards_waits_for_it(name):
    half = 4 << 20
    j = gated(name, half)
    j.gate.set()
    record = frame(STEP, os.urandom(4000))
    while j.append(record):
        pass
    path = os.path.join(SHM_DIR, name)
    full = os.stat(path).st_blocks * 512
    j.stage([frame(SNAPSHOT, b"small")])
    assert j.switch()
    j.rewrite(frame(SNAPSHOT, b"again"))  # into the half the worker was giving back: after it, never under it
    assert full > half and os.stat(path).st_blocks * 512 < full - half + (1 << 20)
    assert [bytes(p) for _, p, _ in j.records()] == [b"again"]
    j.close(keep=False)


def test_a_switch_that_does_not_fit_changes_nothing(name):
    half = 16384
    j = gated(name, half)
    j.gate.set()
    j.stage([frame(SNAPSHOT, bytes(9000))])
    while j.append(frame(STEP, bytes(1000))):
        pass  # the active half fills: the snapshot and these records exceed a half
    length = j.length
    assert not j.switch() and not j.lost and j.active == 0 and j.length == length
    j.stage([frame(SNAPSHOT, bytes(half + 1))])
    assert not j.switch() and not j.lost and j.length == length  # the worker refused it
    j.close(keep=False)


# -- L1Journal: the serving loop stages, appends on, switches --------------------------------------


PAGES = 64


def l1_with(journal: Journal, slack: int) -> tuple[L1Store, Holds, L1Journal]:
    metrics = Metrics()
    store = L1Store(PagePool(PAGES, PAGE), make_policy("lru"), metrics, min_block_bytes=MIN_BLOCK_BYTES)
    writer = L1Journal(journal, metrics, slack=slack)
    store.attach_journal(writer)
    return store, Holds(store, metrics, clock=FakeClock()), writer


def same(store: L1Store, records: list[tuple[int, bytes]] | Journal) -> None:
    """The replay of `records` is the store: entries in order, their pages and pins, the pages no entry holds."""
    if isinstance(records, Journal):
        records = [(t, bytes(p)) for t, p, _ in records.records()]
    got = replay(((t, p, frame(t, p)) for t, p in records), PAGES, PAGE)
    assert [(e.key, e.extents, e.pins) for e in got.entries] == [
        (e.key, e.extents, e.pins) for e in store.entries.values()]
    used = np.ones(PAGES, dtype=bool)
    used[from_extents(store.pool.free_extents())] = False
    for entry in store.entries.values():
        used[from_extents(entry.extents)] = False
    assert sorted(from_extents(got.unheld).tolist()) == np.flatnonzero(used).tolist()


def store_family(holds: Holds, family: int) -> None:
    client = hello(holds, b"w")
    fp = holds.register(NS, client)
    [res] = holds.reserve(client, fp, [item(family, BPC, PAGE)])
    holds.commit(client, [res[1]])


def test_what_the_loop_logs_while_the_worker_stages_survives_the_switch_and_a_kill_at_each_step(name):
    half = half_bytes(PAGES, PAGE, MIN_BLOCK_BYTES)
    geometry = (PAGES * PAGE, PAGE, PAGES, 1)
    journal = gated(name, half, VERSION, geometry)
    store, holds, writer = l1_with(journal, slack=2000)
    family = 0
    while journal.staging is None:  # until the log passes its limit and a snapshot is staged
        store_family(holds, family)
        family += 1
    staged_at = family
    for later in range(staged_at, staged_at + 120):  # evicting (64 pages): commits, removals, frees, pins
        store_family(holds, later)
        if later % 7 == 0:
            store.pin_keys([next(iter(store.entries))])
        same(store, after_a_kill(name, half, VERSION, geometry))
    assert journal.staging is not None and len(journal.staging.since) > 300 and writer.compactions == 0
    assert store.pinned_pages and store.metrics.evictions.labels("l1", "capacity")._value.get() > 10
    journal.gate.set()
    journal.staging.done.wait()
    assert journal.staging.copied > 256  # the worker copied the records since, too
    same(store, after_a_kill(name, half, VERSION, geometry))  # written, not switched to
    active = journal.active
    store_family(holds, staged_at + 300)  # the first append after the worker is done switches
    assert writer.compactions == 1 and journal.active != active  # (the records since may start another)
    same(store, after_a_kill(name, half, VERSION, geometry))
    same(store, journal)
    journal.close()


def test_an_append_that_finds_the_half_full_waits_for_the_worker(name):
    half = 16384
    geometry = (PAGES * PAGE, PAGE, PAGES, 1)
    journal = gated(name, half, VERSION, geometry)
    store, holds, writer = l1_with(journal, slack=100)
    threading.Timer(0.2, journal.gate.set).start()
    family = 0
    while not writer.compactions:  # the half fills while the worker is held: an append waits for it
        store_family(holds, family)
        family += 1
    assert journal.gate.is_set() and not writer.failed
    same(store, after_a_kill(name, half, VERSION, geometry))
    journal.close()


def test_a_compaction_on_the_loop_while_a_snapshot_is_staged_drops_it_and_keeps_everything(name):
    """A clean stop's compaction (in the policy's order) finds a snapshot staged: what the loop logged meanwhile
    (kept beside the live records the worker was reading) is in the log it writes."""
    half = half_bytes(PAGES, PAGE, MIN_BLOCK_BYTES)
    geometry = (PAGES * PAGE, PAGE, PAGES, 1)
    journal = gated(name, half, VERSION, geometry)
    store, holds, writer = l1_with(journal, slack=2000)
    family = 0
    while journal.staging is None:
        store_family(holds, family)
        family += 1
    for later in range(family, family + 100):
        store_family(holds, later)
    journal.gate.set()
    order = drain_policy(store)
    writer.compact(order)
    assert journal.staging is None and writer.compactions == 1
    assert [e.key for e in replay(journal.records(), PAGES, PAGE).entries] == order
    for key in order:  # the policy back, as set_policy does
        store.policy.insert(key, store.entries[key].size)
    evicted = store.metrics.evictions.labels("l1", "capacity")._value.get()
    for later in range(family + 100, family + 120):  # and the writer goes on from the merged state
        store_family(holds, later)
    assert store.metrics.evictions.labels("l1", "capacity")._value.get() >= evicted + 20
    same(store, after_a_kill(name, half, VERSION, geometry))
    journal.close()
