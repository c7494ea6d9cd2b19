"""A crash-safe record log in a shared-memory file: its writer may be killed at any instant.

The file (a `Segment`, owner-locked like the L1 segment) is a 4096-byte header and two halves of `half`
bytes. The header:

    magic "KVTJ" | framing version u16 | version u16 | reserved u32 | half u64 | geometry 4 x u64 |
    crc32 of the bytes before it u32 | zeros | state word u64 at offset 64

`version` is the owner's record format and `geometry` the facts its records depend on (for L1: segment size,
page size, page count, segment inode); `open` refuses a journal whose framing, version or geometry differ.
The state word names the active half (bit 63) and how many of its bytes are committed (the rest).

A record is `length u32 | type u8 | payload | XXH3-64 of the length, type and payload (u64)`. `append`
writes it after the committed bytes, then advances the state word with one aligned 8-byte store: a writer
killed inside a record leaves bytes past the committed length, which no reader looks at. `rewrite`
(compaction) writes the live records into the other half and then flips the word, again one store; killed
before the flip, the active half is untouched. The old half's memory is then given back (MADV_REMOVE).

`stage` and `switch` compact without holding the writer up: `stage` hands a snapshot (its records, captured
by the caller) to a worker thread that writes it into the other half, while `append` goes on committing to
the active half and keeps a copy of each record it appends; the worker, the snapshot written, copies most of
those after it too; `switch`, once the worker is done, copies the rest and flips the word: the commit point,
as in `rewrite`. Killed at any instant before the flip, the active half holds every record; after it, the new
half holds the snapshot and every record appended since it was captured. The worker also gives the old
half's memory back, after the flip.

The file is sparse, so a store into a page the tmpfs has no room for would be SIGBUS. No byte is stored
before its pages are reserved (`posix_fallocate`, RESERVE_STEP at a time): a reservation refused (ENOSPC, the
tmpfs filled by something else) invalidates the journal instead (see `invalidate`; `append` is then False
and `rewrite` writes nothing), and the writer stops journaling: the next start is cold, never a crash.

Inside the committed bytes every record must verify: one that does not is damage (memory corruption, a
foreign writer, a bug), not a torn write, and `records` raises JournalDamaged. A caller must then trust no
part of the journal, not even the records before the damage: a later record may undo an earlier one.

One writer (the file's owner, on one thread); its worker touches only the inactive half's bytes (and its
memory), and what it found is read once it is done.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import zlib
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice

import numpy as np
import xxhash
from kvtier.shm.segment import NoSpace, Segment

log = logging.getLogger("kvtier.shm")

MAGIC = b"KVTJ"
FRAMING = 1  # this module's layout: header, state word, record framing
HEADER_BYTES = 4096
STATE_OFFSET = 64
_HEADER = struct.Struct("<4sHHIQ4Q")
_CRC = struct.Struct("<I")
_HEAD = struct.Struct("<IB")  # record length, type
_SUM = struct.Struct("<Q")
RECORD_OVERHEAD = _HEAD.size + _SUM.size
_ACTIVE = 1 << 63
RESERVE_STEP = 1 << 20  # bytes of a half reserved at a time ahead of the writes
JOIN_STEP = 4096  # records the worker joins and copies at once: the GIL is held for each join and copy
CATCH_UP_LEFT = 256  # the worker copies the records appended since the snapshot while more are left
STAGE_RESERVE_STEP = 16 << 20  # bytes of the staging half the worker reserves at a time
GIVE_BACK_STEP = 4 << 20  # bytes of a half the worker gives back at once (the GIL is held for each)


class JournalMismatch(Exception):
    """The file is not a journal this code may continue: not one at all, or another framing, version or
    geometry. The message says which."""


class _NoFit(Exception):
    """What the worker was to write does not fit the half."""


class JournalDamaged(Exception):
    """A committed record does not verify (or does not decode): the journal as a whole is not to be trusted."""


def journal_bytes(half: int) -> int:
    """The file size of a journal with halves of `half` bytes."""
    return HEADER_BYTES + 2 * half


def frame(rtype: int, payload: bytes) -> bytes:
    """One record, ready to append (and to keep: a record's bytes do not depend on where it is written)."""
    body = _HEAD.pack(len(payload), rtype) + payload
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def parse(data: bytes) -> Iterator[tuple[int, memoryview, memoryview]]:
    """(type, payload, whole record) of each record of a committed log, lazily: JournalDamaged at the first
    record that does not verify, and a caller then discards what it took before."""
    view = memoryview(data)
    pos, end = 0, len(data)
    while pos < end:
        if end - pos < RECORD_OVERHEAD:
            raise JournalDamaged(f"record at byte {pos} is cut short")
        length, rtype = _HEAD.unpack_from(view, pos)
        stop = pos + _HEAD.size + length
        if stop + _SUM.size > end:
            raise JournalDamaged(f"record at byte {pos} claims {length} bytes past the committed end")
        if xxhash.xxh3_64_intdigest(view[pos:stop]) != _SUM.unpack_from(view, stop)[0]:
            raise JournalDamaged(f"record at byte {pos} fails its checksum")
        yield rtype, view[pos + _HEAD.size : stop], view[pos : stop + _SUM.size]
        pos = stop + _SUM.size


def write_header(buf: mmap.mmap, version: int, half: int, geometry: tuple[int, int, int, int],
                 framing: int = FRAMING) -> None:
    """Write the header fields and their crc32, magic last: a file cut short before that is no journal.
    Used by `Journal.create`, and by tests to stamp an existing journal with another version."""
    fields = _HEADER.pack(b"\0\0\0\0", framing, version, 0, half, *geometry)
    buf[4 : _HEADER.size] = fields[4:]
    buf[_HEADER.size : _HEADER.size + _CRC.size] = _CRC.pack(zlib.crc32(MAGIC + fields[4:]))
    buf[0:4] = MAGIC


@dataclass
class Staging:
    """A snapshot being written into the inactive half by the worker, and the records appended since."""

    half: int
    since: list[bytes] = field(default_factory=list)  # appended to the active half after the snapshot
    length: int = 0  # the snapshot's bytes (set by the worker)
    written: int = 0  # bytes the worker wrote: the snapshot, then the first `copied` records of `since`
    copied: int = 0
    reserved: int = 0  # bytes of the half the worker backed (set by the worker)
    error: str = ""  # set by the worker: "" or why the snapshot is not written
    lost: bool = False  # the error is the tmpfs out of room
    done: threading.Event = field(default_factory=threading.Event)


def _back(segment: Segment, offset: int, length: int) -> None:
    """Reserve memory for bytes of a file's mapping (an anonymous one, fd -1, cannot run out of it)."""
    if segment.fd >= 0:
        os.posix_fallocate(segment.fd, offset, length)


class Journal:
    def __init__(self, segment: Segment, half: int) -> None:
        self.segment = segment
        self.half = half
        buf = segment.buf
        self._buf = buf
        # the state word as one aligned uint64: an assignment to it is one 8-byte store
        self._word = np.ndarray((1,), dtype="<u8", buffer=buf, offset=STATE_OFFSET)
        state = int(self._word[0])
        self.active = state >> 63
        self.length = state & (_ACTIVE - 1)
        if self.length > half:
            raise JournalDamaged(f"the state word claims {self.length} committed bytes in a half of {half}")
        self.reserved = [0, 0]  # bytes from each half's start known backed (written, or reserved)
        self.reserved[self.active] = self.length
        self.lost = ""  # why the journal was invalidated for want of space ("" while it is not)
        self.staging: Staging | None = None
        self._worker: ThreadPoolExecutor | None = None  # made at the first `stage`
        self._jobs: list[Future] = []  # the worker's, not yet known finished

    @classmethod
    def create(cls, segment: Segment, version: int, geometry: tuple[int, int, int, int]) -> Journal:
        """A new, empty journal in a freshly created segment of `journal_bytes(half)` bytes."""
        half = (segment.size - HEADER_BYTES) // 2
        if half <= 0 or segment.size != journal_bytes(half):
            raise ValueError(f"a journal segment is {HEADER_BYTES} bytes plus two halves")
        try:
            _back(segment, 0, HEADER_BYTES)
        except OSError as exc:
            raise NoSpace(f"no room for the journal {segment.name} in {segment.directory}: {exc.strerror}") from None
        segment.buf[STATE_OFFSET : STATE_OFFSET + 8] = bytes(8)
        write_header(segment.buf, version, half, geometry)
        return cls(segment, half)

    @classmethod
    def open(cls, segment: Segment, version: int, geometry: tuple[int, int, int, int]) -> Journal:
        """The journal in an adopted segment; JournalMismatch unless it is one of this framing, `version`
        and `geometry`."""
        buf = segment.buf
        if segment.size < HEADER_BYTES or buf[0:4] != MAGIC:
            raise JournalMismatch("not a kvtier journal (no magic)")
        magic, framing, found, _, half, *geo = _HEADER.unpack_from(buf, 0)
        if _CRC.unpack_from(buf, _HEADER.size)[0] != zlib.crc32(buf[0 : _HEADER.size]):
            raise JournalMismatch("the journal header fails its checksum")
        if framing != FRAMING or found != version:
            raise JournalMismatch(f"journal format {framing}.{found}; this kvtier reads {FRAMING}.{version}")
        if tuple(geo) != tuple(geometry):
            raise JournalMismatch(f"journal written for geometry {tuple(geo)}, not {tuple(geometry)}")
        if segment.size != journal_bytes(half):
            raise JournalMismatch(f"journal file of {segment.size} bytes does not hold two halves of {half}")
        return cls(segment, half)

    def close(self, keep: bool = True) -> None:
        """Unmap and unlock (the worker finished first); the file stays for the next owner unless not `keep`."""
        self.drop_staging()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        del self._word  # the view's export would keep the mapping open
        self.segment.close(keep)

    def _base(self, half: int) -> int:
        return HEADER_BYTES + half * self.half

    def committed(self) -> bytes:
        """A copy of the committed bytes of the active half (the log to `parse`)."""
        base = self._base(self.active)
        return self._buf[base : base + self.length]

    def records(self) -> Iterator[tuple[int, memoryview, memoryview]]:
        return parse(self.committed())

    def append(self, record: bytes) -> bool:
        """Append one framed record; False (nothing written) when the active half has no room for it."""
        end = self.length + len(record)
        if end > self.half or not self._reserve(self.active, end, RESERVE_STEP):
            return False
        start = self._base(self.active) + self.length
        self._buf[start : start + len(record)] = record
        self.length = end
        self._word[0] = (self.active << 63) | end
        if self.staging is not None:
            self.staging.since.append(record)
        return True

    def rewrite(self, records: bytes) -> None:
        """Replace the log by `records` (framed, concatenated): written to the other half, then made active."""
        if len(records) > self.half:
            raise ValueError(f"{len(records)} bytes of records do not fit a half of {self.half}")
        self.drop_staging()
        self._settle()  # the worker may still be giving the other half's memory back
        old, new = self.active, 1 - self.active
        if not self._reserve(new, len(records), 0):
            return
        start = self._base(new)
        self._buf[start : start + len(records)] = records
        self._word[0] = (new << 63) | len(records)
        self.active, self.length = new, len(records)
        self.segment.give_back([(self._base(old), self._base(old) + self.half)])  # the old half's memory
        self.reserved[old] = 0

    def stage(self, parts: Iterable[bytes]) -> Staging:
        """Start writing the snapshot `parts` (framed records, in order; iterated on the worker) into the other
        half; `switch` makes it the log once `done`. The caller must not change what `parts` iterates until
        then."""
        if self.staging is not None:
            raise RuntimeError("a snapshot is already being staged")
        staging = Staging(1 - self.active)
        self.staging = staging
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvtier-journal")
        self._submit(self._write_staged, staging, parts)
        return staging

    def switch(self) -> bool:
        """Make the staged snapshot, followed by the records appended since it was captured, the log (waiting
        for the worker if it is not done). False, the log unchanged, when it cannot be: the snapshot and
        those records do not fit the half, or the tmpfs had no room (`lost` then says why)."""
        staging, self.staging = self.staging, None
        if staging is None:
            raise RuntimeError("no snapshot is staged")
        staging.done.wait()
        if staging.lost:
            self._lose(staging.error)
        tail = b"".join(staging.since[staging.copied :])
        end = staging.written + len(tail)
        if staging.error or end > self.half:
            return False
        old, new = self.active, staging.half
        self.reserved[new] = staging.reserved
        if not self._reserve(new, end, RESERVE_STEP):
            return False
        start = self._base(new) + staging.written
        self._buf[start : start + len(tail)] = tail
        self._word[0] = (new << 63) | end  # the commit point
        self.active, self.length = new, end
        self.reserved[old] = 0
        base = self._base(old)
        self._submit(self._give_back, [(at, min(at + GIVE_BACK_STEP, base + self.half))
                                       for at in range(base, base + self.half, GIVE_BACK_STEP)])
        return True

    def drop_staging(self) -> None:
        """Forget a staged snapshot (its half stays inactive); waits for the worker to be done with it."""
        staging, self.staging = self.staging, None
        if staging is not None:
            staging.done.wait()

    def _submit(self, job: object, *args: object) -> None:
        assert self._worker is not None
        self._jobs = [f for f in self._jobs if not f.done()]
        self._jobs.append(self._worker.submit(job, *args))  # type: ignore[arg-type]

    def _settle(self) -> None:
        """Wait for the worker's jobs (their errors are theirs: a give-back that failed leaves memory used)."""
        for job in self._jobs:
            job.exception()
        self._jobs = []

    def _write_staged(self, staging: Staging, parts: Iterable[bytes]) -> None:
        """On the worker: the snapshot into `staging.half`, JOIN_STEP records at a time; then, while more than
        CATCH_UP_LEFT have come, the records appended since, so that the switch has few left to copy (should
        the loop outpace this, the half fills and the loop waits for it in `switch`)."""
        try:
            at = self._write_pieces(staging, 0, parts)
            staging.length = at
            while len(staging.since) - staging.copied > CATCH_UP_LEFT:
                since = staging.since[staging.copied :]  # (the loop appends to the list meanwhile)
                at = self._write_pieces(staging, at, since)
                staging.copied += len(since)
            staging.written = at
        except OSError as exc:
            staging.error, staging.lost = exc.strerror or str(exc), True
        except _NoFit as exc:
            staging.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - reported to the writer, which falls back to `rewrite`
            staging.error = f"staging failed: {exc!r}"
        finally:
            staging.done.set()

    def _write_pieces(self, staging: Staging, at: int, records: Iterable[bytes]) -> int:
        """Write `records` from byte `at` of the staging half, their memory reserved first; returns where they
        end. (Each join and copy holds the GIL briefly; a large join and a reservation let it go.)"""
        base = self._base(staging.half)
        records = iter(records)
        while batch := list(islice(records, JOIN_STEP)):
            data = b"".join(batch)
            end = at + len(data)
            if end > self.half:
                raise _NoFit(f"a snapshot of over {end} bytes does not fit a half of {self.half}")
            if end > staging.reserved:  # reserved ahead in large steps: fewer calls, each lets the GIL go
                stop = min(self.half, max(end, staging.reserved + STAGE_RESERVE_STEP))
                _back(self.segment, base + staging.reserved, stop - staging.reserved)
                staging.reserved = stop
            self._buf[base + at : base + end] = data
            at = end
        return at

    def _give_back(self, ranges: list[tuple[int, int]]) -> None:
        for piece in ranges:
            self.segment.give_back([piece])

    def invalidate(self) -> None:
        """Make this file no journal at all (its magic zeroed): for a writer that cannot keep it current."""
        self._buf[0:4] = bytes(4)

    def _reserve(self, half: int, end: int, ahead: int) -> bool:
        """Back the first `end` bytes of `half` with memory (and up to `ahead` more, for the writes to come)
        before they are stored to; False (the journal invalidated, once) when the tmpfs has no room."""
        if self.lost:
            return False
        if end <= self.reserved[half]:
            return True
        stop = min(self.half, max(end, self.reserved[half] + ahead))
        try:
            _back(self.segment, self._base(half) + self.reserved[half], stop - self.reserved[half])
        except OSError as exc:
            self._lose(exc.strerror or str(exc))
            return False
        self.reserved[half] = stop
        return True

    def _lose(self, why: str) -> None:
        """The tmpfs refused memory: invalidate, once."""
        if not self.lost:
            self.lost = why
            self.invalidate()
            log.error("L1 journal %s invalidated: no room to grow it in %s (%s); the next start is cold "
                      "(docs/operations.md, \"Sizing the shared-memory directory\")", self.segment.name,
                      self.segment.directory, self.lost)
