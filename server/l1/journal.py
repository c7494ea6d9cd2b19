"""L1's journal writer: every fact the index needs, kept beside the segment so that a restarted daemon adopts
the old L1 (docs/warm-restart.md). The records and their order are journal_records.py's, reading them back is
replay.py's; this appends them and keeps the log compact.

Compaction: when the active half holds twice the last snapshot plus `SLACK`, a snapshot of the live state
(the namespaces in use, the live COMMIT records, cached as written, a PIN per pinned entry, and an ALLOC per
group of allocated pages no entry holds) replaces the log. The serving loop only starts it (`stage`): the
journal's worker reads the live COMMIT records in place (commits and removals wait beside them meanwhile)
and writes the snapshot into the other half (shm/journal.py `stage`) while records go on being appended; the
next append after the worker is done switches to it (those records follow the snapshot there). Should the
active half fill before that, the append waits for the worker; should the switch not fit, a compaction on
the loop (`compact`) does the work.
A half holds the largest snapshot the geometry allows (`half_bytes`) twice over, so a snapshot always fits.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import chain

from kvtier.server.keys import Namespace
from kvtier.server.l1.entry import Entry
from kvtier.server.l1.journal_records import (
    NO_WRITER,
    SLACK,
    Unheld,
    commit_record,
    free_record,
    namespace_record,
    pin_record,
    remove_record,
)
from kvtier.server.l1.pool import Extents
from kvtier.server.l1.replay import AdoptedEntry
from kvtier.server.metrics import Metrics
from kvtier.shm.journal import Journal, Staging

log = logging.getLogger("kvtier.server")

GIVE_WAY_EVERY, GIVE_WAY_S = 64, 0.001  # see L1Journal._give_way


class L1Journal:
    """The writer: the pool's PageLog and the store's commit/remove hooks, called on the serving loop (as every
    L1 call is); compacts itself. Should it ever be unable to (a snapshot larger than a half: a sizing bug),
    it invalidates the file and stops: the next start is cold, never adopts a journal gone stale."""

    def __init__(self, journal: Journal, metrics: Metrics, slack: int = SLACK) -> None:
        self.journal = journal
        self.metrics = metrics
        self.slack = slack
        self.live: dict[bytes, bytes] = {}  # key -> its COMMIT record, in commit order
        # While the worker reads `live` (a staged snapshot) it is not changed: commits and removals go here, and
        # are merged into it when the staging ends.
        self._added: dict[bytes, bytes] | None = None
        self._gone: set[bytes] = set()
        self._appends_staged = 0
        self.pins: dict[bytes, bytes] = {}  # key of a pinned live entry -> its last PIN record
        self.ns_records: dict[bytes, bytes] = {}  # fingerprint -> its NAMESPACE record, once written
        self.ns_refs: dict[bytes, int] = {}  # fingerprint -> live entries
        self.unheld: dict[int, Unheld] = {}  # first page -> allocated extents no live entry holds
        self.writer = NO_WRITER  # who writes the pages allocated next (see `writing`)
        self.compactions = 0
        self.failed = False
        self._limit = min(journal.half, 2 * journal.length + slack)

    # -- hooks -----------------------------------------------------------------------------------

    @contextmanager
    def writing(self, client: str, rid: int) -> Iterator[None]:
        """Pages allocated inside are written by the client whose lock id is `client`, for its reservation
        `rid`."""
        self.writer = Unheld((), client, rid)
        try:
            yield
        finally:
            self.writer = NO_WRITER

    def allocated(self, extents: Extents) -> None:
        unheld = Unheld(extents, self.writer.client, self.writer.rid)
        self._append(unheld.record())
        self.unheld[extents[0]] = unheld

    def released(self, extents: Extents) -> None:
        self._append(free_record(extents))
        self.unheld.pop(extents[0], None)

    def committed(self, entry: Entry, namespace: Namespace | None) -> None:
        # counted first: a compaction the appends below start must keep the namespace's record
        self.ns_refs[entry.ns] = self.ns_refs.get(entry.ns, 0) + 1
        if namespace is not None and entry.ns not in self.ns_records:
            record = namespace_record(entry.ns, namespace)
            self._append(record)
            self.ns_records[entry.ns] = record
        record = commit_record(entry.key, entry.ns, entry.size, entry.blocks, entry.aliases, entry.extents)
        self._append(record)
        if self._added is None:
            self.live[entry.key] = record
        else:
            self._added[entry.key] = record
        self.pins.pop(entry.key, None)
        self.unheld.pop(entry.extents[0], None)

    def pinned(self, key: bytes, pins: int) -> None:
        """The live entry `key` is about to hold `pins` pins (0: none; a snapshot then has no PIN for it)."""
        record = pin_record(key, pins)
        self._append(record)
        if pins:
            self.pins[key] = record
        else:
            self.pins.pop(key, None)

    def removed(self, entry: Entry, reason: str) -> None:
        del reason  # not journaled: a restart needs only that the entry is gone
        self._append(remove_record(entry.key))
        self.pins.pop(entry.key, None)
        if self._added is None:
            was_live = self.live.pop(entry.key, None) is not None
        else:
            was_live = self._added.pop(entry.key, None) is not None
            if entry.key in self.live and entry.key not in self._gone:
                self._gone.add(entry.key)
                was_live = True
        if was_live:
            self.ns_refs[entry.ns] -= 1
            if not self.ns_refs[entry.ns]:
                del self.ns_refs[entry.ns]
        self.unheld[entry.extents[0]] = Unheld(entry.extents, "", 0)  # until released (now, or by its last reader)

    def carry(self, entries: list[AdoptedEntry], namespaces: dict[bytes, Namespace], unheld: list[Unheld]) -> None:
        """Take over what an adoption kept of a replay (entries in commit order, their namespaces, the
        quarantined pages), then compact: the log becomes a snapshot of exactly that."""
        for entry in entries:
            self.live[entry.key] = entry.record
            if entry.pins:
                self.pins[entry.key] = pin_record(entry.key, entry.pins)
            self.ns_refs[entry.ns] = self.ns_refs.get(entry.ns, 0) + 1
        self.ns_records = {fp: namespace_record(fp, namespaces[fp]) for fp in self.ns_refs}
        for group in unheld:
            self.unheld[group.extents[0]] = group
        self.compact()

    # -- log and snapshot ------------------------------------------------------------------------

    def _append(self, record: bytes) -> None:
        """Append, first switching to a snapshot the worker has written, or starting one when the log has
        grown past its limit: the snapshot is of the state before this record, which follows it."""
        journal = self.journal
        if self.failed:
            return
        if journal.staging is not None:
            self._give_way(journal.staging)
            if journal.staging.done.is_set():
                self._switch()
        elif journal.length + len(record) > self._limit:
            self.stage()
        if self.failed or journal.append(record):
            return
        if journal.staging is not None and not journal.lost:  # the half filled before the worker was done
            self._switch()
            if self.failed or journal.append(record):
                return
        if journal.lost:  # invalidated for want of room (shm/journal.py logged why): no compaction helps
            self._fail(f"the journal ran out of room ({journal.lost})")
            return
        self.compact()
        if not self.failed and not journal.append(record):
            self._fail(f"a record of {len(record)} bytes does not fit after a compaction")

    def stage(self) -> None:
        """Start a compaction off the loop: the live state captured now (`live` as it is: the worker reads it
        while commits and removals wait beside it; the rest copied), written into the other half by the
        journal's worker, switched to at the first append after it is done."""
        if not self.failed and self.journal.staging is None:
            self._added, self._gone = {}, set()
            self.journal.stage(self._records())

    def _merge(self) -> None:
        """The staging is over: what waited beside `live` goes into it."""
        if self._added is not None:
            for key in self._gone:
                del self.live[key]
            self.live.update(self._added)
            self._added, self._gone = None, set()

    def _give_way(self, staging: Staging) -> None:
        """Every GIVE_WAY_EVERY appends while the worker writes, let it run for up to GIVE_WAY_S (the loop
        waits on it, the GIL free): a loop that never waits (stores back to back) would otherwise leave it the
        GIL only at the interpreter's switch interval, and the staging, and what the switch must merge, grow."""
        self._appends_staged += 1
        if self._appends_staged % GIVE_WAY_EVERY == 0:
            staging.done.wait(GIVE_WAY_S)

    def _switch(self) -> None:
        """Make the staged snapshot the log; if it cannot be (it and the records since do not fit), compact on
        the loop instead."""
        journal = self.journal
        staging = journal.staging
        assert staging is not None
        switched = journal.switch()
        self._merge()
        if switched:
            self._compacted(staging.length)  # (the records since count as the log's growth)
        elif journal.lost:
            self._fail(f"the journal ran out of room ({journal.lost})")
        else:
            self.compact()

    def _records(self) -> Iterator[bytes]:
        """The live state as records: namespaces in use, entries in commit order, their pins, unheld pages
        (`live` iterated in place, the rest copied now)."""
        self.ns_records = {fp: r for fp, r in self.ns_records.items() if fp in self.ns_refs}
        return chain(list(self.ns_records.values()), self.live.values(), list(self.pins.values()),
                     [u.record() for u in self.unheld.values()])

    def snapshot(self) -> bytes:
        return b"".join(self._records())

    def compact(self, order: list[bytes] | None = None) -> None:
        """Replace the log by a snapshot, here and now (a staged one is dropped); `order` (keys, coldest first:
        the policy's eviction order at a clean stop) puts the entries in the order the next start re-inserts
        them."""
        if self.failed:
            return
        self.journal.drop_staging()
        self._merge()
        if order is not None:
            ranked = {key: self.live[key] for key in order if key in self.live}
            self.live = ranked | self.live  # keys the order missed keep their place after it
        snapshot = self.snapshot()
        if len(snapshot) > self.journal.half:
            self._fail(f"a snapshot of {len(snapshot)} bytes does not fit a half of {self.journal.half}")
            return
        self.journal.rewrite(snapshot)
        self._compacted(len(snapshot))

    def _compacted(self, length: int) -> None:
        self._limit = min(self.journal.half, 2 * length + self.slack)
        self.compactions += 1
        self.metrics.l1_journal_compactions.inc()

    def _fail(self, why: str) -> None:
        self.journal.invalidate()
        self.failed = True
        log.error("L1 journal stopped (%s): the next start will not adopt this L1", why)
