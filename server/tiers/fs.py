"""The filesystem tier: one file per chunk (fs_io.py; the record inside it: record.py), an in-memory index
(server/index.py's PrefixIndex, as L1's) rebuilt by a start-up scan of names and headers, its own byte
budget, and victims from an `EvictionPolicy` (LRU by default; admission included: a put the policy refuses
is not written).

Thread safety (which thread calls what: base.py): the write-behind threads call `prepare`/`put`/`sync`; the
serving loop calls `find_prefix`/`contains`/`remove` and the promotion threads `get`; `clear` runs on a
worker thread. Every index mutation, and every lookup of the prefix index, holds `self._lock`; file I/O runs
outside it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.server.events import Cleared as ClearedEvent
from kvtier.server.events import Removed, Stored
from kvtier.server.eviction import EvictionPolicy, LRUPolicy, make_policy
from kvtier.server.index import IndexObserver, PrefixIndex
from kvtier.server.keys import KEY_BYTES, Namespace
from kvtier.server.metrics import Metrics, TierMetrics
from kvtier.server.tenants import QuotaTable
from kvtier.server.tiers import fs_io
from kvtier.server.tiers.base import Cleared, LowerTier
from kvtier.server.tiers.fs_tenants import FsTenants, TenantCollector
from kvtier.server.tiers.record import ChunkMeta, CorruptChunk

log = logging.getLogger("kvtier.server.l2")

SCAN_PROGRESS_EVERY = 10_000
SCAN_LOG_CORRUPT = 10  # corrupt files named one by one in a scan's log; the rest are counted by reason
SYNC_BATCH = 64
METRIC_HELP = {"used": "L2 bytes in use (chunk files, headers included)", "capacity": "L2 capacity",
               "written": "Chunks whose L2 file is durable, since the server started",
               "corrupt": "L2 chunk files found corrupt and removed"}


@dataclass(frozen=True)
class FsOptions:
    """What the filesystem tier is made with (server/config.py fills it from the --l2-* flags)."""

    path: str
    capacity_bytes: int
    odirect: bool = False
    eviction_policy: str = "lru"
    queue_depth: int = 1024
    tenant_quotas: QuotaTable | None = None  # shares of `capacity_bytes` per tenant (fs_tenants.py)


def make_tier(options: FsOptions, metrics: Metrics) -> FsTier:
    """The registry's factory: the tier `options` describe, counting into `metrics` (kvtier_l2_*)."""
    m = TierMetrics(metrics, FsTier.name, "L2", METRIC_HELP)
    tier = FsTier(options.path, options.capacity_bytes, options.odirect,
                  on_evict=lambda reason: metrics.evictions.labels(FsTier.name, reason).inc(),
                  on_corrupt=m.corrupt.inc, policy=make_policy(options.eviction_policy),
                  tenant_quotas=options.tenant_quotas)
    tier.m = m
    metrics.registry.register(TenantCollector(FsTier.name, tier.tenant_rows))
    return tier


class FsTier(LowerTier):
    """`odirect` asks for O_DIRECT file I/O; `odirect_active` says whether the directory accepted it (a
    filesystem that refuses it, tmpfs for one, gets one warning and buffered I/O)."""

    name = "l2"

    def __init__(
        self, path: str, capacity_bytes: int, odirect: bool = False,
        on_evict: Callable[[str], None] | None = None, on_corrupt: Callable[[], None] | None = None,
        progress_every: int = SCAN_PROGRESS_EVERY, policy: EvictionPolicy | None = None,
        tenant_quotas: QuotaTable | None = None,
    ) -> None:
        self.path = os.path.abspath(path)
        os.makedirs(self.path, mode=0o700, exist_ok=True)  # an existing directory keeps its mode
        self._capacity = int(capacity_bytes)
        self.odirect = odirect  # as configured
        self.odirect_active = odirect and fs_io.probe_odirect(self.path)  # what the file I/O uses
        if odirect and not self.odirect_active:
            log.warning("L2 directory %s does not support O_DIRECT (EINVAL): using buffered I/O", self.path)
        self._on_evict = on_evict or (lambda _r: None)
        self._on_corrupt = on_corrupt or (lambda: None)
        self.progress_every = progress_every
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()  # one directory fsync at a time: each counts its own puts
        self._writing: set[bytes] = set()  # keys whose file is being written (puts run on several threads)
        self._index: dict[bytes, ChunkMeta] = {}  # chunk key -> its record
        self._prefix: PrefixIndex[ChunkMeta] = PrefixIndex()  # chunk key or alias -> (record, leading blocks)
        self.policy = policy if policy is not None else LRUPolicy()  # victims, in file bytes; told of every put, read and removal
        self._used = 0  # bytes of indexed files plus the file being written
        self.tenants = FsTenants(self._capacity, tenant_quotas)  # each tenant's share (ValueError: too big)
        self._unsynced = 0
        self.written = 0  # chunks whose file and rename are durable (directory fsynced)
        self.corrupt = 0
        self.evicted = 0
        self.temp_removed = 0

    # -- accounting ------------------------------------------------------------------------------

    @property
    def entries(self) -> int:
        return len(self._index)

    def stats(self) -> dict:
        """Whether O_DIRECT, asked for, was taken by the directory, and the tenants' rows (AttachedTier adds
        the common facts)."""
        table = self.tenants.table
        return {f"{self.name}_odirect": self.odirect_active, f"{self.name}_tenants": self.tenant_rows(),
                f"{self.name}_tenant_quotas": table.text() if table is not None else ""}

    def tenant_rows(self) -> list[dict]:
        """Per tenant: bytes, files, limits, evictions and refusals by reason (any thread)."""
        with self._lock:
            self.tenants.refresh()
            return self.tenants.rows()

    def know_namespaces(self, lookup: Callable[[bytes], Namespace | None]) -> None:
        self.tenants.lookup = lookup

    def observe_index(self, observer: IndexObserver | None) -> bool:
        """The presence filter's L2 region follows the prefix index (written under `_lock`: its one writer)."""
        with self._lock:
            self._prefix.observe(observer)
        return True

    def set_quotas(self, table: QuotaTable | None) -> dict:
        """Apply a tenant quota table (None: none) at once: a tenant now over its maximum sheds its own chunks
        in the policy's order (reason "quota"). ValueError, nothing changed, if the guarantees exceed the
        tier."""
        with self._lock:
            self.tenants.set_table(table)
            entries, nbytes = self._shed_locked()
        return {"table": table.text() if table is not None else "", "evicted_entries": entries,
                "evicted_bytes": nbytes}

    def _file(self, key: bytes) -> str:
        return os.path.join(self.path, fs_io.file_name(key))

    def _index_add(self, meta: ChunkMeta, reserved: bool = False) -> None:
        """Index a file (its bytes in `_used` and its tenant's already when `reserved`, as a put's are)."""
        self._index[meta.key] = meta
        self._prefix.add(meta, meta.key, meta.blocks, meta.aliases)
        self.policy.insert(meta.key, meta.file_bytes)
        self.tenants.add(meta, reserved)

    def _index_drop(self, key: bytes, reason: str | None = None) -> ChunkMeta | None:
        """Forget a file; `reason` counts it as its tenant's eviction."""
        meta = self._index.pop(key, None)
        if meta is None:
            return None
        self.tenants.drop(meta, reason)
        self._prefix.remove(meta, meta.key, meta.aliases)
        self.policy.remove(key)
        self._used -= meta.file_bytes
        return meta

    def _evict_one_locked(self, reason: str, allowed: Callable[[ChunkMeta], bool] | None = None) -> bool:
        """Evict the policy's next victim (among the chunks `allowed` names: fs_tenants.py); False if none."""
        key = self.policy.pick_victim(self._index.__contains__) if allowed is None \
            else self.tenants.victim(self.policy, self._index, allowed)
        if key is None:
            return False
        meta = self._index_drop(key, reason)
        fs_io.unlink_quiet(self._file(key))
        self.evicted += 1
        self._on_evict(reason)
        self._removed(meta, reason)
        return True

    def _removed(self, meta: ChunkMeta | None, reason: str) -> None:
        if meta is not None:
            self.report(Removed(self.name, meta.ns, meta.key, reason))

    # -- LowerTier ---------------------------------------------------------------------------------

    def prepare(self, meta: ChunkMeta, sources: Sequence) -> fs_io.Encoded:
        return fs_io.encode(meta, sources, self.odirect_active)

    def put(self, meta: ChunkMeta, payload, keep: Callable[[], bool] | None = None) -> bool:
        """Write a chunk (its bytes, or `prepare`'s result) unless it exists or exceeds the budget. `keep` is
        asked under the index lock once the file is written: False (a cache clear came meanwhile) removes
        the file before it was ever indexed."""
        need = meta.file_bytes
        with self._lock:
            if meta.key in self._index:
                self.policy.touch(meta.key)
                return False
            if need > self._capacity or meta.key in self._writing:
                return False
            if self._used + need > self._capacity and not self.tenants.within_guarantee(meta.ns, need) \
                    and not self.policy.admit(meta.key, need, self._index.__contains__):
                return False
            refused = self._make_room_locked(meta, need)
            if refused:
                self.tenants.refuse(self.tenants.tenant(meta.ns), refused)
                return False
            self._used += need  # reserved before the write, so disk use never exceeds the budget
            self.tenants.reserve(meta.ns, need)
            self._writing.add(meta.key)
        try:
            fs_io.write_file(self.path, meta, payload, self.odirect_active)
        except BaseException as exc:
            with self._lock:
                self._unreserve_locked(meta, need)
            if not isinstance(exc, OSError):
                raise
            log.exception("L2 write of %s failed", meta.key.hex())
            return False
        with self._lock:
            kept = keep is None or keep()
            if kept:
                self._writing.discard(meta.key)
                self._index_add(meta, reserved=True)
                self._unsynced += 1
                self.report(Stored(self.name, meta.ns, meta.key, meta.blocks, meta.aliases, meta.size))
        if not kept:
            fs_io.unlink_quiet(self._file(meta.key))
            with self._lock:
                self._unreserve_locked(meta, need)
            return False
        if self._unsynced >= SYNC_BATCH:
            self.sync()
        return True

    def _unreserve_locked(self, meta: ChunkMeta, need: int) -> None:
        self._used -= need
        self.tenants.reserve(meta.ns, -need)
        self._writing.discard(meta.key)

    def _make_room_locked(self, meta: ChunkMeta, need: int) -> str | None:
        """Evict for a put of `need` bytes: None when it may go ahead, else why it is refused. Without a
        quota table, the policy's victims until it fits; with one, the rules of fs_tenants.py."""
        if self.tenants.active:
            return self.tenants.make_room(meta, need, self._evict_one_locked,
                                          lambda: self._used + need > self._capacity)
        while self._used + need > self._capacity and self._evict_one_locked("capacity"):
            pass
        return None

    def _shed_locked(self) -> tuple[int, int]:
        """Evict tenants' chunks over their maximum (fs_tenants.py): (chunks, bytes) removed."""
        before = self._used
        return self.tenants.shed(self._evict_one_locked), before - self._used

    def sync(self) -> None:
        with self._sync_lock:
            n = self._unsynced
            if not n:
                return
            fs_io.fsync_dir(self.path)
            with self._lock:
                self._unsynced -= n
                self.written += n

    def contains(self, key: bytes) -> bool:
        return key in self._index

    def find_prefix(self, chunks: Sequence[Sequence[bytes]], ns: bytes | None = None) -> list[tuple[ChunkMeta, int]]:
        """From memory (the prefix index, under the lock): per chunk, the record holding the longest leading
        run of its keys, up to the first chunk not held and through the first partial match."""
        with self._lock:
            return self._prefix.run(chunks)

    def get(self, meta: ChunkMeta, bufs: Sequence[memoryview]) -> bool:
        with self._lock:
            if self._index.get(meta.key) != meta:
                return False
            self.policy.touch(meta.key)
        try:
            fs_io.read_payload(self._file(meta.key), meta, list(bufs), self.odirect_active)
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
            meta = self._index_drop(key, "corrupt")
        fs_io.unlink_quiet(self._file(key))
        self.corrupt += 1
        self._on_corrupt()
        self._removed(meta, "corrupt")

    def remove(self, key: bytes, reason: str = "removed") -> bool:
        with self._lock:
            meta = self._index_drop(key, reason)
        if meta is None:
            return False
        fs_io.unlink_quiet(self._file(key))
        self._on_evict(reason)
        self._removed(meta, reason)
        return True

    def clear(self, ns: bytes | None = None) -> Cleared:
        with self._lock:
            gone = [self._index_drop(key, "clear") for key, m in list(self._index.items()) if ns is None or m.ns == ns]
        removed = [meta for meta in gone if fs_io.unlink_quiet(self._file(meta.key))]
        for _ in gone:
            self._on_evict("clear")
        self.report(ClearedEvent(self.name, ns))
        failed = len(gone) - len(removed)
        if failed:
            log.warning("L2 clear of %s: %d of %d files could not be removed (forgotten: never served)",
                        self.path, failed, len(gone))
        return Cleared(len(removed), sum(m.file_bytes for m in removed), failed)

    def held(self) -> list[Stored]:
        with self._lock:
            return [Stored(self.name, m.ns, m.key, m.blocks, m.aliases, m.size) for m in self._index.values()]

    def health(self) -> tuple[bool, str]:
        """Whether a file can be created in the directory now: a probe under a temp name (removed again; a
        start-up scan removes one a crash left), so a missing, replaced or read-only directory shows."""
        probe = os.path.join(self.path, fs_io.temp_name(bytes(KEY_BYTES)))
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
        reasons: Counter[str] = Counter()  # why kvtier-named files were corrupt (a version change: all of them)
        seen, found = self._scan_files(reasons)
        self._reindex(found)
        log.info(
            "L2 scan of %s done: %d files seen, %d chunks (%d bytes) indexed, %d corrupt, %d temp files removed",
            self.path, seen, len(self._index), self._used, self.corrupt, self.temp_removed,
        )
        if reasons.total() > SCAN_LOG_CORRUPT:
            log.warning("L2 scan of %s removed %d corrupt files: %s", self.path, reasons.total(),
                        ", ".join(f"{n} {why}" for why, n in reasons.most_common()))
        return len(self._index)

    def _scan_files(self, reasons: Counter[str]) -> tuple[int, list[tuple[float, ChunkMeta]]]:
        """(directory entries seen, (mtime, record) of every well-formed chunk file), logging progress."""
        found: list[tuple[float, ChunkMeta]] = []
        seen = 0
        with os.scandir(self.path) as it:
            for dent in it:
                seen += 1
                if seen % self.progress_every == 0:
                    log.info("L2 scan of %s: %d files seen, %d chunks indexed", self.path, seen, len(found))
                item = self._scan_entry(dent, reasons)
                if item is not None:
                    found.append(item)
        return seen, found

    def _scan_entry(self, dent: os.DirEntry, reasons: Counter[str]) -> tuple[float, ChunkMeta] | None:
        """One directory entry: (mtime, record) of a well-formed chunk file; None for anything else, after
        removing it if it is kvtier's temp file or a corrupt chunk file (counted in `reasons`)."""
        name = dent.name
        try:
            if not dent.is_file(follow_symlinks=False):
                return None  # directories, symlinks, sockets: not ours
        except OSError:
            return None
        if fs_io.TEMP_RE.match(name):
            fs_io.unlink_quiet(dent.path)
            self.temp_removed += 1
            return None
        if not fs_io.NAME_RE.match(name):
            return None
        try:
            meta = fs_io.read_meta(dent.path)
            mtime = dent.stat(follow_symlinks=False).st_mtime
        except (CorruptChunk, OSError) as exc:
            if reasons.total() < SCAN_LOG_CORRUPT:
                log.warning("L2 file %s is corrupt (%s): removed", name, exc)
            # the reason without the file's name or sizes, so that the summary groups files
            reasons[str(exc) if isinstance(exc, CorruptChunk) else exc.strerror or type(exc).__name__] += 1
            fs_io.unlink_quiet(dent.path)
            self.corrupt += 1
            self._on_corrupt()
            return None
        return mtime, meta

    def _reindex(self, found: list[tuple[float, ChunkMeta]]) -> None:
        """Replace the index with `found`, oldest first (the policy's order), then shrink to the budget."""
        found.sort(key=lambda t: t[0])
        with self._lock:
            for key in list(self._index):
                self._index_drop(key)
            self._used = 0
            for _, meta in found:
                self._index_add(meta)
                self._used += meta.file_bytes
            while self._used > self._capacity and self._evict_one_locked("capacity"):
                pass
            self._shed_locked()
