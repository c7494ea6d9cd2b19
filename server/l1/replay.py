"""Replay of L1's journal (the records of journal_records.py, framed by shm/journal.py): what a previous daemon's
L1 held, for adopt.py to take over.

Replaying gives the entries still committed (in commit order: the policy hint), their namespaces, and the
pages allocated to no entry (reservations and promotions in flight, removed entries still being read when the
daemon died): those are quarantined, in groups by the client that may still write them. A record that
contradicts a live entry's hold on its pages (a page allocated, freed or committed again while the entry lives)
drops that entry: never wrong bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import msgpack
import numpy as np
from kvtier.server.keys import KEY_BYTES, Namespace
from kvtier.server.l1.journal_records import ALLOC, COMMIT, FREE, NAMESPACE, PIN, REMOVE, Unheld
from kvtier.server.l1.pool import Extents, from_extents, to_extents
from kvtier.shm.journal import JournalDamaged

_CLIENT_RE = re.compile(r"^([0-9a-f]{32})?$")


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
