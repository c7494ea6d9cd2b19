"""L1 at start: adopt the segment and journal a previous daemon left (a warm restart), or start empty and say why.

A segment of the configured name whose owner lock is free, of the configured size, beside a journal of this
version whose geometry (segment size, page size, page count, the segment's inode) matches and whose records
all verify, is adopted: its namespaces, entries (in commit order, or the policy's order at a clean stop) with
their pins, and free pages come back; pages allocated to no entry (reservations and promotions in flight when the old daemon
died, removed entries still being read) stay quarantined: those a client of the old daemon was writing until
that client settles them or its lock file shows it gone (holds.py), the others until `quarantine_s` has passed.
Anything else starts empty, and the old files are removed journal first: a journal never outlives the segment
it describes (a fresh segment under an old journal would serve zeros as chunks). docs/warm-restart.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

from kvtier.server import protocol as p
from kvtier.server.eviction.base import EvictionPolicy
from kvtier.server.index import IndexObserver
from kvtier.server.l1.entry import Entry
from kvtier.server.l1.journal import L1Journal
from kvtier.server.l1.journal_records import VERSION, half_bytes
from kvtier.server.l1.pool import PagePool, extent_pages
from kvtier.server.l1.reconfig import drain_policy
from kvtier.server.l1.replay import replay
from kvtier.server.l1.store import L1Store
from kvtier.server.metrics import Metrics
from kvtier.shm.journal import Journal, JournalDamaged, JournalMismatch, journal_bytes
from kvtier.shm.pages import extent_byte_ranges
from kvtier.shm.segment import Segment, SegmentMismatch, remove_stale

log = logging.getLogger("kvtier.server")

JOURNAL_SUFFIX = ".journal"


class _StartEmpty(Exception):
    """Why the old L1 is not adopted."""


@dataclass
class L1Files:
    name: str  # the segment's; the journal is `<name>.journal` beside it
    directory: str
    mode: int  # the segment's permission bits (the journal is always 0600: only the server reads it)


@dataclass
class OpenedL1:
    segment: Segment
    store: L1Store
    journal: L1Journal | None  # None: --no-l1-adopt (no journal, the segment is removed at stop)
    adopted: int  # chunks adopted
    outcome: str  # the log line: adopted what, or why it starts empty

    def close(self) -> str:
        """Clean stop; returns what became of L1, for the log. Journaled and holding chunks: a last snapshot
        with the entries in the policy's eviction order (so the next start keeps their recency), the free
        pages' memory given back (the next start backs them again), both files left for the next start.
        Otherwise (nothing to adopt, or --no-l1-adopt) the files are removed, the journal first."""
        if self.journal is None or self.journal.failed or not self.store.entries:
            if self.journal is not None:
                self.journal.journal.close(keep=False)
            self.segment.close()
            return "shared-memory segment removed"
        pool = self.store.pool
        self.journal.compact(drain_policy(self.store))
        with contextlib.suppress(OSError):  # not fatal: only the memory of free pages stays committed
            self.segment.give_back(extent_byte_ranges(pool.free_extents(), pool.page_size))
        chunks, nbytes = len(self.store.entries), pool.used_pages * pool.page_size
        self.journal.journal.close(keep=True)
        self.segment.close(keep=True)
        return f"L1 kept for the next start: {chunks} chunks in {nbytes / (1 << 30):.2f} GiB (free pages given back)"

    def abandon(self) -> None:
        """Close after a failed start: files kept as they are when journaled (the journal is current)."""
        if self.journal is not None:
            self.journal.journal.close(keep=True)
        self.segment.close(keep=self.journal is not None)


def open_l1(files: L1Files, num_pages: int, page_size: int, policy: EvictionPolicy, metrics: Metrics, *,
            adopt: bool = True, discard: bool = False, quarantine_s: float = 30.0,
            clock: Callable[[], float] = time.monotonic, min_block_bytes: int = p.MIN_BLOCK_BYTES,
            index_observer: IndexObserver | None = None) -> OpenedL1:
    """The segment and L1Store to serve: adopted when `adopt` and possible (not `discard`), else empty; the
    store's index tells `index_observer` (the presence filter's L1 region) of every key, adopted ones included.
    SegmentInUse when a live server owns the segment."""
    journal_name = files.name + JOURNAL_SUFFIX
    if not adopt:
        remove_stale(journal_name, files.directory)  # an earlier run's: it would describe a segment now gone
        segment = Segment.create(files.name, num_pages * page_size, files.mode, files.directory)
        store = L1Store(PagePool(num_pages, page_size), policy, metrics, min_block_bytes, index_observer)
        return OpenedL1(segment, store, None, 0, "L1 starts empty (--no-l1-adopt); its segment is removed at stop")
    half = half_bytes(num_pages, page_size, min_block_bytes)
    reason = "--l1-discard"
    if not discard:
        try:
            return _adopt(files, num_pages, page_size, half, policy, metrics, clock() + quarantine_s,
                          quarantine_s, min_block_bytes, index_observer)
        except _StartEmpty as exc:
            reason = str(exc)
    remove_stale(journal_name, files.directory)  # first: see the module doc
    segment = Segment.create(files.name, num_pages * page_size, files.mode, files.directory)
    try:
        journal_segment = Segment.create(journal_name, journal_bytes(half), 0o600, files.directory)
    except BaseException:
        segment.close()
        raise
    journal = Journal.create(journal_segment, VERSION, _geometry(segment, page_size, num_pages))
    store = L1Store(PagePool(num_pages, page_size), policy, metrics, min_block_bytes, index_observer)
    writer = L1Journal(journal, metrics)
    store.attach_journal(writer)
    metrics.l1_journal_bytes.set_function(lambda: journal.length)
    return OpenedL1(segment, store, writer, 0, f"L1 starts empty: {reason}")


def _geometry(segment: Segment, page_size: int, num_pages: int) -> tuple[int, int, int, int]:
    return segment.size, page_size, num_pages, segment.inode


def _adopt(files: L1Files, num_pages: int, page_size: int, half: int, policy: EvictionPolicy, metrics: Metrics,
           quarantine_until: float, quarantine_s: float, min_block_bytes: int,
           index_observer: IndexObserver | None) -> OpenedL1:
    started = time.perf_counter()
    path = os.path.join(files.directory, files.name)
    try:
        segment = Segment.adopt(files.name, num_pages * page_size, files.mode, files.directory)
    except FileNotFoundError:
        raise _StartEmpty(f"no segment {path} to adopt") from None
    except SegmentMismatch as exc:
        hint = " (--l1-size-gb changed?)" if "bytes, not" in str(exc) else ""
        raise _StartEmpty(f"the segment left in {files.directory} cannot be adopted: {exc}{hint}") from None
    journal_segment: Segment | None = None
    try:
        journal_segment = Segment.adopt(files.name + JOURNAL_SUFFIX, journal_bytes(half), 0o600, files.directory)
        journal = Journal.open(journal_segment, VERSION, _geometry(segment, page_size, num_pages))
        replayed = replay(journal.records(), num_pages, page_size)
    except (FileNotFoundError, SegmentMismatch, JournalMismatch, JournalDamaged) as exc:
        if journal_segment is not None:
            journal_segment.close(keep=True)
        segment.close(keep=True)
        what = "no journal beside it" if isinstance(exc, FileNotFoundError) else f"its journal: {exc}"
        if isinstance(exc, SegmentMismatch):
            what += " (--page-size-kb changed?)"
        raise _StartEmpty(f"the segment {path} is not adopted, {what}") from None
    except BaseException:
        if journal_segment is not None:
            journal_segment.close(keep=True)
        segment.close(keep=True)
        raise
    unheld = replayed.unheld
    in_use = unheld + tuple(chain.from_iterable(e.extents for e in replayed.entries))
    store = L1Store(PagePool(num_pages, page_size, in_use), policy, metrics, min_block_bytes, index_observer)
    for namespace in replayed.namespaces.values():
        store.register_namespace(namespace)
    for e in replayed.entries:  # commit order: the policy sees the oldest first
        entry = store.insert(Entry(e.key, e.ns, e.size, e.blocks, e.extents, e.aliases))
        if e.pins:  # before the next insert: a pinned partial is not superseded
            store.hold(entry, 0, pins=e.pins)
    kept = [e for e in replayed.entries if store.entries.get(e.key) is not None]  # less superseded partials
    if unheld:
        store.keep_quarantined(replayed.groups, quarantine_until)
    writer = L1Journal(journal, metrics)
    writer.carry(kept, replayed.namespaces, replayed.groups)  # the log becomes a snapshot of what is adopted
    store.attach_journal(writer)
    metrics.l1_adopted.set(len(kept))
    metrics.l1_journal_bytes.set_function(lambda: journal.length)
    if replayed.dropped:
        log.warning("L1 adoption dropped %d chunks: the journal contradicts their hold on their pages (or has no "
                    "namespace for them); their pages are quarantined", replayed.dropped)
    nbytes = sum(e.size for e in kept)
    written = sum(extent_pages(group.extents) for group in replayed.groups if group.client)
    outcome = (f"L1 adopted from {path}: {len(kept)} chunks ({nbytes / (1 << 30):.2f} GiB) of "
               f"{len(replayed.namespaces)} namespaces, {extent_pages(unheld)} pages quarantined ({written} until "
               f"the old clients writing them settle or exit, the rest for {quarantine_s:g} s); "
               f"{replayed.records} journal records replayed in {time.perf_counter() - started:.2f} s")
    return OpenedL1(segment, store, writer, len(kept), outcome)
