"""The presence filter: a counting Bloom filter of the block keys a server's local tiers hold, in a shared-memory
file beside its L1 segment (`<segment>.presence`), so that a client answers "certainly not held" without a round
trip (docs/architecture.md, "Presence filter").

Layout: a header page, then `regions` regions of `counters` uint8 counters, one region per locally indexed
tier (L1, then L2). Each region has exactly one writer (L1's on the serving loop, L2's under its tier's lock), so
plain read-modify-write of a counter is enough. A key sets two counters per region, at its first and its last
8 bytes (little-endian) modulo `counters` (a power of two). A counter saturates at 255 and is never decremented
again (a false "maybe", never a false "no"). A reader says "maybe held" when in any region both counters are
non-zero, and when the file is closed (its server stopped, or a newer one replaced it).

The file is made anew at every start (`create`: a stale one is marked closed first, so that its readers stop
trusting it) and removed at stop (`close`: marked closed, then unlinked).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct

from kvtier.shm.segment import SHM_DIR, _path, create_mapped

MAGIC = b"KVTPRES1"
VERSION = 1
HEADER_BYTES = 4096  # the regions start page-aligned
COUNTERS = 4 << 20  # per region: 4 MiB each (docs/architecture.md has the false-positive rates)
SATURATED = 255
_HEADER = struct.Struct("<8sIIQQI")  # magic, version, regions, counters per region, epoch, open (1) / closed (0)
_OPEN_OFFSET = 8 + 4 + 4 + 8 + 8
_KEY = struct.Struct("<QQ")


def file_bytes(regions: int, counters: int = COUNTERS) -> int:
    return HEADER_BYTES + regions * counters


class PresenceMismatch(ValueError):
    """A file that is not a presence filter this code reads."""


class RegionWriter:
    """The one writer of one region (its tier's index observer: server/index.py's IndexObserver)."""

    def __init__(self, view: memoryview, start: int, counters: int) -> None:
        self._view, self._start, self._mask = view, start, counters - 1
        self._counters = counters

    def add(self, key: bytes) -> None:
        a, b = _KEY.unpack_from(key)
        view, start, mask = self._view, self._start, self._mask
        try:
            i = start + (a & mask)
            v = view[i]
            if v < SATURATED:
                view[i] = v + 1
            i = start + (b & mask)
            v = view[i]
            if v < SATURATED:
                view[i] = v + 1
        except ValueError:  # the file is closed (the server is stopping): nobody reads it any more
            pass

    def discard(self, key: bytes) -> None:
        a, b = _KEY.unpack_from(key)
        view, start, mask = self._view, self._start, self._mask
        try:
            i = start + (a & mask)
            v = view[i]
            if 0 < v < SATURATED:
                view[i] = v - 1
            i = start + (b & mask)
            v = view[i]
            if 0 < v < SATURATED:
                view[i] = v - 1
        except ValueError:  # closed, as in `add`
            pass

    def clear(self) -> None:
        with contextlib.suppress(ValueError):  # closed, as in `add`
            self._view[self._start:self._start + self._counters] = bytes(self._counters)

    def count(self, key: bytes) -> tuple[int, int]:
        """The key's two counters (tests, diagnostics)."""
        a, b = _KEY.unpack_from(key)
        return self._view[self._start + (a & self._mask)], self._view[self._start + (b & self._mask)]


class PresenceFile:
    """The server's side: creates the file, hands out one writer per region, closes (and removes) it."""

    def __init__(self, name: str, directory: str, buf: mmap.mmap, regions: int, counters: int, epoch: int) -> None:
        self.name, self.directory, self.regions, self.counters, self.epoch = name, directory, regions, counters, epoch
        self._buf = buf
        self._view = memoryview(buf)
        self._writers = [RegionWriter(self._view, HEADER_BYTES + r * counters, counters) for r in range(regions)]

    @classmethod
    def create(cls, name: str, regions: int, directory: str = SHM_DIR, mode: int = 0o600,
               counters: int = COUNTERS, epoch: int = 0) -> PresenceFile:
        """A new, empty filter of `regions` regions (a file of that name left by an earlier server is marked
        closed, so its readers stop trusting it, and removed)."""
        if regions < 1 or counters < 2 or counters & (counters - 1):
            raise ValueError("a presence filter needs regions >= 1 and a power-of-two counter count")
        path = _path(name, directory)
        mark_closed(name, directory)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        # readable by the clients the segment's mode admits
        fd, buf = create_mapped(path, file_bytes(regions, counters), mode)
        os.close(fd)
        buf[:_HEADER.size] = _HEADER.pack(MAGIC, VERSION, regions, counters, epoch, 1)
        return cls(name, directory, buf, regions, counters, epoch)

    def writer(self, region: int) -> RegionWriter:
        return self._writers[region]

    def close(self) -> None:
        """Mark the filter closed (readers answer "maybe" from now on) and remove its file."""
        if self._buf.closed:
            return
        self._view[_OPEN_OFFSET] = 0
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_path(self.name, self.directory))
        self._view.release()
        with contextlib.suppress(BufferError):
            self._buf.close()


def mark_closed(name: str, directory: str = SHM_DIR) -> bool:
    """Mark a presence file (one a dead server left) closed, so that a client still mapping it stops trusting
    it; False when there is none (or it is not one)."""
    try:
        fd = os.open(_path(name, directory), os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_size < HEADER_BYTES or os.pread(fd, 8, 0) != MAGIC:
            return False
        os.pwrite(fd, b"\0", _OPEN_OFFSET)
        return True
    finally:
        os.close(fd)


class PresenceReader:
    """A client's read-only mapping. Thread-safe enough: `may_hold` after `close` answers True."""

    def __init__(self, name: str, directory: str = SHM_DIR) -> None:
        fd = os.open(_path(name, directory), os.O_RDONLY | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise PresenceMismatch(f"{name} is too small for a presence filter")
            buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, version, regions, counters, epoch, _ = _HEADER.unpack_from(buf)
        if magic != MAGIC or version != VERSION or size != file_bytes(regions, counters) or counters & (counters - 1):
            buf.close()
            raise PresenceMismatch(f"{name} is not a version-{VERSION} presence filter")
        self.name, self.regions, self.counters, self.epoch = name, regions, counters, epoch
        self._buf = buf
        self._view = memoryview(buf)
        self._starts = tuple(HEADER_BYTES + r * counters for r in range(regions))
        self._mask = counters - 1

    @property
    def open(self) -> bool:
        try:
            return bool(self._view[_OPEN_OFFSET])
        except ValueError:  # released by close()
            return False

    def may_hold(self, key: bytes) -> bool:
        """False only when no region holds `key` (both its counters non-zero) while the filter is open."""
        a, b = _KEY.unpack_from(key)
        try:
            view = self._view
            if not view[_OPEN_OFFSET]:
                return True
            a &= self._mask
            b &= self._mask
            for start in self._starts:  # noqa: SIM110 - a generator in any() costs twice as much
                if view[start + a] and view[start + b]:
                    return True
            return False
        except ValueError:  # closed meanwhile by another thread
            return True

    def close(self) -> None:
        self._view.release()
        with contextlib.suppress(BufferError):
            self._buf.close()
