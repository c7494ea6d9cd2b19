"""Lower-tier adapters: the `TierAdapter` interface (a remote Redis tier implements it later) and the
filesystem L2 tier: one file per chunk (see l2_format), an in-memory index rebuilt by a start-up scan of
names and headers, its own byte budget and LRU eviction.

Thread safety: the write-behind threads call `prepare`/`put`/`sync`; the serving loop calls `find`/`remove`
and the promotion threads `get`. Every index mutation holds `self._lock`; file I/O runs outside it.
"""

from __future__ import annotations

import logging
import os
import threading
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.server import l2_format as fmt
from kvtier.server.keys import KEY_BYTES
from kvtier.server.l2_format import ChunkMeta, CorruptChunk

log = logging.getLogger("kvtier.server.l2")

SCAN_PROGRESS_EVERY = 10_000
SCAN_LOG_CORRUPT = 10  # corrupt files named one by one in a scan's log; the rest are counted by reason
SYNC_BATCH = 64


@dataclass(frozen=True)
class Cleared:
    """What a clear did: the chunks and file bytes it removed, and `failed`, the files it could not remove
    (a directory in a chunk file's place). The index forgot those too, and a start-up scan never indexes
    what is not a regular file, so none of them is served again."""

    entries: int
    nbytes: int
    failed: int = 0


class TierAdapter(ABC):
    """A chunk store below L1, keyed by chunk key; values are (metadata, payload bytes)."""

    name: str

    def prepare(self, meta: ChunkMeta, sources: Sequence):  # noqa: ANN201 - whatever `put` takes
        """Do the CPU work of a put of a chunk held in `sources` (its buffers, in order; they stay valid until
        the put returns) that can overlap earlier puts' I/O; the result is passed to `put`. Default: the
        bytes joined."""
        del meta
        return b"".join(sources)

    @abstractmethod
    def put(self, meta: ChunkMeta, payload, keep: Callable[[], bool] | None = None) -> bool:
        """Store a chunk (False when it exists or cannot fit). May evict older chunks. `keep`, when given, is
        asked once the chunk is stored and before any lookup can find it: False drops it again."""

    @abstractmethod
    def get(self, meta: ChunkMeta, bufs: Sequence[memoryview]) -> bool:
        """Read a chunk's verified payload into `bufs`; False (and the chunk dropped) if missing or corrupt."""

    @abstractmethod
    def contains(self, key: bytes) -> bool: ...

    @abstractmethod
    def find(self, block_keys: Sequence[bytes]) -> tuple[ChunkMeta, int] | None:
        """The stored chunk holding the longest leading run of `block_keys`, and that run's length."""

    @abstractmethod
    def remove(self, key: bytes, reason: str = "removed") -> bool: ...

    @abstractmethod
    def clear(self, ns: bytes | None = None) -> Cleared:
        """Remove every chunk, or those of namespace fingerprint `ns`, going on past what cannot be removed;
        none of them is found again, removed or not."""

    @abstractmethod
    def scan(self) -> int:
        """Rebuild the index from what the tier holds; returns the chunks found."""

    def sync(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Make completed puts durable (no-op where puts are durable already)."""

    def health(self) -> tuple[bool, str]:
        """(ok, why not): whether the tier can take writes now. Default: always."""
        return True, ""

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...

    @property
    @abstractmethod
    def entries(self) -> int: ...


class FsTier(TierAdapter):
    """`odirect` asks for O_DIRECT file I/O; `odirect_active` says whether the directory accepted it (a
    filesystem that refuses it, tmpfs for one, gets one warning and buffered I/O)."""

    name = "l2"

    def __init__(
        self, path: str, capacity_bytes: int, odirect: bool = False,
        on_evict: Callable[[str], None] | None = None, on_corrupt: Callable[[], None] | None = None,
        progress_every: int = SCAN_PROGRESS_EVERY,
    ) -> None:
        self.path = os.path.abspath(path)
        os.makedirs(self.path, mode=0o700, exist_ok=True)  # an existing directory keeps its mode
        self._capacity = int(capacity_bytes)
        self.odirect = odirect  # as configured
        self.odirect_active = odirect and fmt.probe_odirect(self.path)  # what the file I/O uses
        if odirect and not self.odirect_active:
            log.warning("L2 directory %s does not support O_DIRECT (EINVAL): using buffered I/O", self.path)
        self._on_evict = on_evict or (lambda _r: None)
        self._on_corrupt = on_corrupt or (lambda: None)
        self.progress_every = progress_every
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()  # one directory fsync at a time: each counts its own puts
        self._writing: set[bytes] = set()  # keys whose file is being written (puts run on several threads)
        self._index: OrderedDict[bytes, ChunkMeta] = OrderedDict()  # LRU order: oldest first
        self._keys: dict[bytes, tuple[bytes, int]] = {}  # chunk key or alias -> (chunk key, leading blocks)
        self._used = 0  # bytes of indexed files plus the file being written
        self._unsynced = 0
        self.written = 0  # chunks whose file and rename are durable (directory fsynced)
        self.corrupt = 0
        self.evicted = 0
        self.temp_removed = 0

    # -- accounting ------------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def entries(self) -> int:
        return len(self._index)

    def _file(self, key: bytes) -> str:
        return os.path.join(self.path, fmt.file_name(key))

    def _index_add(self, meta: ChunkMeta) -> None:
        self._index[meta.key] = meta
        self._keys[meta.key] = (meta.key, meta.blocks)
        for j, alias in enumerate(meta.aliases, start=1):
            self._keys.setdefault(alias, (meta.key, j))

    def _index_drop(self, key: bytes) -> ChunkMeta | None:
        meta = self._index.pop(key, None)
        if meta is None:
            return None
        for k in (meta.key, *meta.aliases):
            found = self._keys.get(k)
            if found is not None and found[0] == key:
                del self._keys[k]
        self._used -= meta.file_bytes
        return meta

    def _evict_one_locked(self, reason: str) -> bool:
        if not self._index:
            return False
        key = next(iter(self._index))
        self._index_drop(key)
        fmt.unlink_quiet(self._file(key))
        self.evicted += 1
        self._on_evict(reason)
        return True

    # -- adapter ---------------------------------------------------------------------------------

    def prepare(self, meta: ChunkMeta, sources: Sequence) -> fmt.Encoded:
        return fmt.encode(meta, sources, self.odirect_active)

    def put(self, meta: ChunkMeta, payload, keep: Callable[[], bool] | None = None) -> bool:
        """Write a chunk (its bytes, or `prepare`'s result) unless it exists or exceeds the budget. `keep` is
        asked under the index lock once the file is written: False (a cache clear came meanwhile) removes
        the file before it was ever indexed."""
        need = meta.file_bytes
        with self._lock:
            if meta.key in self._index:
                self._index.move_to_end(meta.key)
                return False
            if need > self._capacity or meta.key in self._writing:
                return False
            while self._used + need > self._capacity and self._evict_one_locked("capacity"):
                pass
            self._used += need  # reserved before the write, so disk use never exceeds the budget
            self._writing.add(meta.key)
        try:
            fmt.write_file(self.path, meta, payload, self.odirect_active)
        except BaseException as exc:
            with self._lock:
                self._used -= need
                self._writing.discard(meta.key)
            if not isinstance(exc, OSError):
                raise
            log.exception("L2 write of %s failed", meta.key.hex())
            return False
        with self._lock:
            kept = keep is None or keep()
            if kept:
                self._writing.discard(meta.key)
                self._index_add(meta)
                self._unsynced += 1
        if not kept:
            fmt.unlink_quiet(self._file(meta.key))
            with self._lock:
                self._used -= need
                self._writing.discard(meta.key)
            return False
        if self._unsynced >= SYNC_BATCH:
            self.sync()
        return True

    def sync(self) -> None:
        with self._sync_lock:
            n = self._unsynced
            if not n:
                return
            fmt.fsync_dir(self.path)
            with self._lock:
                self._unsynced -= n
                self.written += n

    def contains(self, key: bytes) -> bool:
        return key in self._index

    def find(self, block_keys: Sequence[bytes]) -> tuple[ChunkMeta, int] | None:
        with self._lock:
            for j in range(len(block_keys), 0, -1):
                found = self._keys.get(block_keys[j - 1])
                if found is not None:
                    meta = self._index.get(found[0])
                    if meta is not None:
                        return meta, found[1]
        return None

    def get(self, meta: ChunkMeta, bufs: Sequence[memoryview]) -> bool:
        with self._lock:
            if self._index.get(meta.key) != meta:
                return False
            self._index.move_to_end(meta.key)
        try:
            fmt.read_payload(self._file(meta.key), meta, list(bufs), self.odirect_active)
        except FileNotFoundError:
            self.remove(meta.key, "missing")
            return False
        except (CorruptChunk, OSError) as exc:
            log.warning("L2 chunk %s is corrupt (%s): removed", meta.key.hex(), exc)
            self._drop_corrupt(meta.key)
            return False
        return True

    def _drop_corrupt(self, key: bytes) -> None:
        with self._lock:
            self._index_drop(key)
        fmt.unlink_quiet(self._file(key))
        self.corrupt += 1
        self._on_corrupt()

    def remove(self, key: bytes, reason: str = "removed") -> bool:
        with self._lock:
            meta = self._index_drop(key)
        if meta is None:
            return False
        fmt.unlink_quiet(self._file(key))
        self._on_evict(reason)
        return True

    def clear(self, ns: bytes | None = None) -> Cleared:
        with self._lock:
            gone = [self._index_drop(key) for key, m in list(self._index.items()) if ns is None or m.ns == ns]
        removed = [meta for meta in gone if fmt.unlink_quiet(self._file(meta.key))]
        for _ in gone:
            self._on_evict("clear")
        failed = len(gone) - len(removed)
        if failed:
            log.warning("L2 clear of %s: %d of %d files could not be removed (forgotten: never served)",
                        self.path, failed, len(gone))
        return Cleared(len(removed), sum(m.file_bytes for m in removed), failed)

    def health(self) -> tuple[bool, str]:
        """Whether a file can be created in the directory now: a probe under a temp name (removed again; a
        start-up scan removes one a crash left), so a missing, replaced or read-only directory shows."""
        probe = os.path.join(self.path, fmt.temp_name(bytes(KEY_BYTES)))
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600))
            os.unlink(probe)
        except OSError as exc:
            return False, f"L2 directory {self.path} is not writable: {exc.strerror or exc}"
        return True, ""

    # -- start-up scan ---------------------------------------------------------------------------

    def scan(self) -> int:
        """Index every well-formed chunk file by name and header (no payload reads).

        kvtier's own temp files are removed; kvtier-named regular files whose header does not verify
        are counted corrupt and removed; anything else (foreign names, directories, symlinks) is left
        alone and never counted.
        """
        found: list[tuple[float, ChunkMeta]] = []
        reasons: Counter[str] = Counter()  # why kvtier-named files were corrupt (a version change: all of them)
        seen = 0
        with os.scandir(self.path) as it:
            for dent in it:
                seen += 1
                if seen % self.progress_every == 0:
                    log.info("L2 scan of %s: %d files seen, %d chunks indexed", self.path, seen, len(found))
                name = dent.name
                try:
                    if not dent.is_file(follow_symlinks=False):
                        continue  # directories, symlinks, sockets: not ours
                except OSError:
                    continue
                if fmt.TEMP_RE.match(name):
                    fmt.unlink_quiet(dent.path)
                    self.temp_removed += 1
                    continue
                if not fmt.NAME_RE.match(name):
                    continue
                try:
                    meta = fmt.read_meta(dent.path)
                    mtime = dent.stat(follow_symlinks=False).st_mtime
                except (CorruptChunk, OSError) as exc:
                    if reasons.total() < SCAN_LOG_CORRUPT:
                        log.warning("L2 file %s is corrupt (%s): removed", name, exc)
                    # the reason without the file's name or sizes, so that the summary groups files
                    reasons[str(exc) if isinstance(exc, CorruptChunk) else exc.strerror or type(exc).__name__] += 1
                    fmt.unlink_quiet(dent.path)
                    self.corrupt += 1
                    self._on_corrupt()
                    continue
                found.append((mtime, meta))
        found.sort(key=lambda t: t[0])
        with self._lock:
            self._index.clear()
            self._keys.clear()
            self._used = 0
            for _, meta in found:
                self._index_add(meta)
                self._used += meta.file_bytes
            while self._used > self._capacity and self._evict_one_locked("capacity"):
                pass
        log.info(
            "L2 scan of %s done: %d files seen, %d chunks (%d bytes) indexed, %d corrupt, %d temp files removed",
            self.path, seen, len(self._index), self._used, self.corrupt, self.temp_removed,
        )
        if reasons.total() > SCAN_LOG_CORRUPT:
            log.warning("L2 scan of %s removed %d corrupt files: %s", self.path, reasons.total(),
                        ", ".join(f"{n} {why}" for why, n in reasons.most_common()))
        return len(self._index)
