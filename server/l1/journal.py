"""L1's journal: every fact the index needs, kept beside the segment so that a restarted daemon adopts the old
L1 (docs/warm-restart.md). The framing and its crash safety are shm/journal.py's; this is what the records say.

Records (msgpack payloads):

    NAMESPACE  fingerprint, Namespace fields          before the first COMMIT of that namespace
    COMMIT     key, ns, size, blocks, aliases, extents  before the entry is indexed (a commit or a promotion)
    REMOVE     key                                      before any page of the removed entry can be reused
    ALLOC      extents, client, rid                     before the pages leave the pool (to a reservation, a
                                                        promotion): nobody can write a page unlogged; `client`
                                                        names the lock file (shm/client_lock.py) of the client
                                                        that writes them (its 32 hex digits) and `rid` its
                                                        reservation ("", 0: no client writes them: a promotion,
                                                        a GPU copy)
    FREE       extents                                  before the pages rejoin the pool
    PIN        key, pins                                before an entry's pin count changes (to `pins`); a
                                                        REMOVE or a new COMMIT of the key ends its pins

Every record is appended before its effect, so a daemon killed between the two leaves a journal that is
behind on nothing that matters: a page it names as allocated may be free (it stays quarantined a while),
never the reverse. Pages are logged at the pool (PagePool.log), so every path that takes or returns pages
(reservations, promotions, removed entries still being read, the quarantine) is covered by two hooks.

Replaying gives the entries still committed (in commit order: the policy hint), their namespaces, and the
pages allocated to no entry (reservations and promotions in flight, removed entries still being read when the
daemon died): those are quarantined, in groups by the client that may still write them. A record that
contradicts a live entry's hold on its pages (a page allocated, freed or committed again while the entry lives)
drops that entry: never wrong bytes.

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
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

import msgpack
import numpy as np
from kvtier.server.keys import KEY_BYTES, MAX_NS_STR, Namespace
from kvtier.server.l1.pool import Extents, from_extents, to_extents
from kvtier.server.metrics import Metrics
from kvtier.shm.journal import RECORD_OVERHEAD, Journal, JournalDamaged, Staging, frame

if TYPE_CHECKING:
    from kvtier.server.l1.store import Entry

log = logging.getLogger("kvtier.server")

VERSION = 3  # the records' format; a journal of another version is never adopted (1: ALLOC without its writer,
# 2: without PIN)
NAMESPACE, COMMIT, REMOVE, ALLOC, FREE, PIN = 1, 2, 3, 4, 5, 6
SLACK = 1 << 20
GIVE_WAY_EVERY, GIVE_WAY_S = 64, 0.001  # see L1Journal._give_way
MAX_NAMESPACES = 4096  # store.MAX_NAMESPACES (not imported: store imports this module)
# Upper bounds of encoded sizes, for half_bytes: a record's fixed part, each extent pair, each alias, and a
# namespace (five strings of MAX_NS_STR characters of up to 4 UTF-8 bytes, seven integers, twelve names).
_ENTRY_MAX = RECORD_OVERHEAD + 96
_PIN_MAX = RECORD_OVERHEAD + KEY_BYTES + 2 + 9 + 1
_EXTENT_MAX = 10
_WRITER_MAX = 2 + 34 + 9  # an ALLOC's writer: its client's lock id (32 hex digits) and its reservation id
_CLIENT_RE = re.compile(r"^([0-9a-f]{32})?$")
_ALIAS_MAX = KEY_BYTES + 2
_NAMESPACE_MAX = RECORD_OVERHEAD + 64 + 5 * (4 * MAX_NS_STR + 3) + 7 * 9 + 12 * 16

_pack = msgpack.Packer(use_bin_type=True).pack


def half_bytes(num_pages: int, page_size: int, min_block_bytes: int) -> int:
    """Bytes of each journal half: twice the largest snapshot `num_pages` pages can need, plus SLACK.

    Every page belongs to at most one snapshot record (a COMMIT or an ALLOC), every extent pair holds a page,
    every alias a block of at least `min_block_bytes`, every entry has at most one PIN, and only namespaces
    with an entry are written. The
    file is sparse: memory is used by what is written, about twice the live records at most.
    """
    aliases = num_pages * page_size // min_block_bytes
    snapshot = (num_pages * (_ENTRY_MAX + _EXTENT_MAX + _WRITER_MAX + _PIN_MAX) + aliases * _ALIAS_MAX
                + min(num_pages, MAX_NAMESPACES) * _NAMESPACE_MAX)
    return -(-(2 * snapshot + SLACK) // 4096) * 4096


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
        self._append(frame(FREE, _pack(extents)))
        self.unheld.pop(extents[0], None)

    def committed(self, entry: Entry, namespace: Namespace | None) -> None:
        # counted first: a compaction the appends below start must keep the namespace's record
        self.ns_refs[entry.ns] = self.ns_refs.get(entry.ns, 0) + 1
        if namespace is not None and entry.ns not in self.ns_records:
            record = frame(NAMESPACE, _pack((entry.ns, namespace.to_dict())))
            self._append(record)
            self.ns_records[entry.ns] = record
        record = frame(COMMIT, _pack((entry.key, entry.ns, entry.size, entry.blocks, entry.aliases, entry.extents)))
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
        self._append(frame(REMOVE, _pack(entry.key)))
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
        self.ns_records = {fp: frame(NAMESPACE, _pack((fp, namespaces[fp].to_dict()))) for fp in self.ns_refs}
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


# -- replay --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Unheld:
    """Allocated pages no entry holds, and who may still write them: the client whose lock file's id (the 32
    hex digits that end its name, shm/client_lock.py) is `client`, for its reservation `rid` ("", 0: no client:
    a promotion, a GPU copy, a removed entry still being read)."""

    extents: Extents
    client: str
    rid: int

    def record(self) -> bytes:
        return frame(ALLOC, _pack((self.extents, self.client, self.rid)))


NO_WRITER = Unheld((), "", 0)


def pin_record(key: bytes, pins: int) -> bytes:
    return frame(PIN, _pack((key, pins)))


@dataclass
class AdoptedEntry:
    key: bytes
    ns: bytes
    size: int
    blocks: int
    aliases: tuple[bytes, ...]
    extents: Extents
    record: bytes  # its COMMIT record, to carry into the new journal as it is
    pins: int = 0


@dataclass
class Replayed:
    """What a journal says L1 holds: entries in commit order, their namespaces, pages no entry holds (all of
    them, and in groups by who may still write them)."""

    namespaces: dict[bytes, Namespace] = field(default_factory=dict)
    entries: list[AdoptedEntry] = field(default_factory=list)
    unheld: Extents = ()
    groups: list[Unheld] = field(default_factory=list)
    records: int = 0
    dropped: int = 0  # entries whose pages a later record contradicted, or of an unknown namespace


def replay(records: object, num_pages: int, page_size: int) -> Replayed:
    """Replay `records` ((type, payload, record) as shm.journal.parse yields them) of a segment of
    `num_pages` pages. JournalDamaged for a record that does not decode into what its type requires."""
    owner = np.zeros(num_pages, dtype=np.int64)  # per page: 0 free, -1 allocated to no entry, i > 0 entry i
    writer = np.zeros(num_pages, dtype=np.int64)  # per page allocated to no entry: its writer in `writers`
    writers: dict[tuple[str, int], int] = {("", 0): 0}
    live: dict[int, AdoptedEntry] = {}
    by_key: dict[bytes, int] = {}
    out = Replayed()

    def drop(ids: object) -> None:
        for i in set(np.asarray(ids).tolist()):
            entry = live.pop(i)
            del by_key[entry.key]
            pages = from_extents(entry.extents)
            owner[pages], writer[pages] = -1, 0
            out.dropped += 1

    for rtype, payload, record in records:  # type: ignore[attr-defined]
        out.records += 1
        try:
            value = msgpack.unpackb(payload, use_list=False)
            if rtype in (ALLOC, FREE):
                extents, client, rid = value if rtype == ALLOC else (value, "", 0)
                pages = _pages(extents, num_pages)
                held = owner[pages]
                drop(held[held > 0])
                owner[pages] = -1 if rtype == ALLOC else 0
                writer[pages] = writers.setdefault(_writer(client, rid), len(writers))
            elif rtype == COMMIT:
                entry = _entry(value, bytes(record), num_pages, page_size)
                if entry.key in by_key:
                    drop([by_key[entry.key]])
                pages = from_extents(entry.extents)
                held = owner[pages]
                if (held > 0).any():  # another entry's pages (free ones are a snapshot's: no ALLOC there)
                    drop(held[held > 0])
                    owner[pages], writer[pages] = -1, 0
                    out.dropped += 1
                    continue
                i = out.records
                live[i] = entry
                by_key[entry.key] = i
                owner[pages], writer[pages] = i, 0
            elif rtype == REMOVE:
                i = by_key.pop(_key(value), 0)
                if i:
                    pages = from_extents(live.pop(i).extents)
                    owner[pages], writer[pages] = -1, 0  # until a FREE: still being read, perhaps
            elif rtype == PIN:
                key, pins = value
                if not (type(pins) is int and pins >= 0):
                    raise ValueError("a pin count is a non-negative integer")
                i = by_key.get(_key(key), 0)
                if i:  # (a key no entry is live under: nothing to pin)
                    live[i].pins = pins
            elif rtype == NAMESPACE:
                fp, fields = value
                namespace = Namespace.from_dict(dict(fields))
                if namespace.fingerprint() != fp:
                    raise ValueError("the namespace's fields do not give its fingerprint")
                out.namespaces[fp] = namespace
            else:
                raise ValueError(f"unknown record type {rtype}")
        except Exception as exc:  # msgpack raises several unrelated types for bytes it cannot decode
            raise JournalDamaged(f"record {out.records} (type {rtype}) does not decode: {exc}") from None
    drop([i for i, entry in live.items() if entry.ns not in out.namespaces])
    out.entries = list(live.values())
    used = {entry.ns for entry in out.entries}
    out.namespaces = {fp: ns for fp, ns in out.namespaces.items() if fp in used}
    unheld = np.flatnonzero(owner == -1)
    out.unheld = to_extents(unheld)
    by_writer = writer[unheld]
    for (client, rid), w in writers.items():
        extents = to_extents(unheld[by_writer == w])
        if extents:
            out.groups.append(Unheld(extents, client, rid))
    return out


def _writer(client: object, rid: object) -> tuple[str, int]:
    if not (isinstance(client, str) and _CLIENT_RE.match(client) and type(rid) is int and rid >= 0):
        raise ValueError("an ALLOC's writer is a client lock id (32 hex digits, or none) and a reservation id")
    return client, rid


def _key(value: object) -> bytes:
    if not isinstance(value, bytes) or len(value) != KEY_BYTES:
        raise ValueError("a key is 16 bytes")
    return value


def _pages(extents: object, num_pages: int) -> np.ndarray:
    """The pages of extents read from a record, every run checked to lie inside the segment."""
    if not isinstance(extents, tuple) or not extents or len(extents) % 2:
        raise ValueError("extents are (first page, page count) pairs")
    for i in range(0, len(extents), 2):
        first, count = extents[i], extents[i + 1]
        if not (type(first) is int and type(count) is int and first >= 0 and count > 0
                and first + count <= num_pages):
            raise ValueError(f"page run ({first}, {count}) outside a segment of {num_pages} pages")
    return from_extents(extents)


def _entry(value: object, record: bytes, num_pages: int, page_size: int) -> AdoptedEntry:
    key, ns, size, blocks, aliases, extents = value  # type: ignore[misc]
    pages = _pages(extents, num_pages)
    if not (type(size) is int and type(blocks) is int and 0 < size <= len(pages) * page_size
            and len(pages) == -(-size // page_size) and blocks >= 1 and len(aliases) < blocks):
        raise ValueError("size, blocks or aliases do not fit the entry's pages")
    return AdoptedEntry(_key(key), _key(ns), size, blocks, tuple(map(_key, aliases)), extents, record)
