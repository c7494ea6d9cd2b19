"""A lower tier as the cache runs it: write-behind from L1, promotions into L1, clears, meters, health.

Write-behind: `write_behind` (called for each chunk L1 commits) holds a reader on the new entry and queues
it; the writer checksums the bytes in the L1 pages and writes them straight from there, then the reader is
released on the serving loop (`call_soon_threadsafe`). A full queue drops the lower-tier copy (counted).
Bandwidth: promotions' reads and the writer's puts feed a `BandwidthMeter` each, reported in the status, as
gauges and in lookup replies with lower-tier hits, so a client can skip a tier slower than recomputing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from kvtier.server.l1.store import Entry, L1Store
from kvtier.server.metrics import Metrics, TierMetrics
from kvtier.server.tiers.bandwidth import BandwidthMeter
from kvtier.server.tiers.base import Cleared, LowerTier
from kvtier.server.tiers.promotion import PROMOTE_THREADS, Promotions
from kvtier.server.tiers.record import ChunkMeta
from kvtier.server.tiers.writer import L2Writer, WriteJob
from kvtier.shm.pages import extent_views

log = logging.getLogger("kvtier.server.tiers")

REWRITE_POLL_S = 0.05  # how often the write-behind after an adoption looks for room in a full queue
REWRITE_BATCH = 256  # adopted chunks it looks at between yields to the serving loop


class _TimedPuts:
    """The tier as the writer sees it: each successful put is timed into the write meter."""

    def __init__(self, tier: LowerTier, meter: BandwidthMeter) -> None:
        self._tier = tier
        self._meter = meter

    def put(self, meta: ChunkMeta, payload: Any, keep: Callable[[], bool] | None = None) -> bool:
        start = time.perf_counter()
        ok = self._tier.put(meta, payload, keep)
        if ok:
            self._meter.add(meta.size, start, time.perf_counter())
        return ok

    def __getattr__(self, name: str) -> Any:  # prepare(), sync() and anything else the writer uses
        return getattr(self._tier, name)


class AttachedTier:
    def __init__(self, store: L1Store, segment: np.ndarray, tier: LowerTier, queue_depth: int, metrics: Metrics,
                 m: TierMetrics, max_promoting_bytes: int | None = None) -> None:
        self.store = store
        self.segment = segment
        self.tier = tier
        self.name = tier.name
        self.m = m
        self.read_bw = BandwidthMeter()
        self.write_bw = BandwidthMeter()
        self.writer = L2Writer(_TimedPuts(tier, self.write_bw), queue_depth,  # type: ignore[arg-type]
                               on_drop=m.dropped.inc)
        self.promotions = Promotions(store, segment, tier, m, self.read_bw, max_promoting_bytes)
        self.clear_failures = 0
        self._call_soon: Callable[..., Any] = lambda fn, *a: fn(*a)
        m.used.set_function(lambda: tier.used_bytes)
        m.capacity.set_function(lambda: tier.capacity_bytes)
        m.queue_depth.set_function(lambda: self.writer.queue_depth)
        m.written.set_function(self.written)
        m.promoting_bytes.set_function(lambda: self.promotions.promoting_pages * store.pool.page_size)
        metrics.tier_read_bw.labels(self.name).set_function(lambda: self.read_bw.bytes_per_s)
        metrics.tier_write_bw.labels(self.name).set_function(lambda: self.write_bw.bytes_per_s)
        metrics.entries.labels(self.name).set_function(lambda: tier.entries)
        metrics.hit_tokens.labels(self.name)
        metrics.evictions.labels(self.name, "capacity")

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self) -> None:
        """Scan the tier (blocking; before serving) and start the writer."""
        self.tier.scan()
        self.writer.start()
        log.info("%s tier at %s: %d chunks, %.2f of %.2f GiB", self.name, getattr(self.tier, "path", "?"),
                 self.tier.entries, self.tier.used_bytes / (1 << 30), self.tier.capacity_bytes / (1 << 30))

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve from `loop`: writer callbacks and promotion completions run on it, reads on threads."""
        self._call_soon = loop.call_soon_threadsafe
        self.promotions.attach_loop(loop)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the promotion threads and the writer; promotions not committed give their pages back."""
        self.promotions.close(timeout)
        self.writer.stop(timeout)
        self.tier.close()

    # -- write-behind ----------------------------------------------------------------------------

    def write_behind(self, entry: Entry) -> None:
        if self.tier.contains(entry.key):
            return
        meta = ChunkMeta(entry.key, entry.ns, entry.blocks, entry.aliases, entry.size)
        self.store.hold(entry)
        page_size = self.store.pool.page_size
        job = WriteJob(meta, lambda: extent_views(self.segment, entry.extents, page_size, entry.size),
                       lambda: self._call_soon(self._written, entry))
        if not self.writer.submit(job):
            self.store.unhold(entry)

    async def write_behind_again(self, entries: Sequence[Entry], epochs: dict[bytes, tuple[int, int]],
                                 entries_now: Mapping[bytes, Entry]) -> None:
        """Warm restart (Cache.write_behind_again): queue adopted `entries` again, in the order given, unless
        the tier has one, it left L1 (`entries_now`) or a clear of its namespace came since `epochs`; never
        more than half the queue at once."""
        writer = self.writer
        started = time.monotonic()
        queued = there = gone = 0
        for n, entry in enumerate(entries, 1):
            if n % REWRITE_BATCH == 0:
                await asyncio.sleep(0)  # let requests in
            if entries_now.get(entry.key) is entry and not self.tier.contains(entry.key):
                while writer.room <= writer.depth // 2:
                    await asyncio.sleep(REWRITE_POLL_S)
            if entries_now.get(entry.key) is not entry or writer.epochs(entry.ns) != epochs[entry.ns]:
                gone += 1
            elif self.tier.contains(entry.key):
                there += 1
            else:
                self.write_behind(entry)
                queued += 1
        log.info("%s write-behind after adoption: %d of %d adopted chunks queued again (%d there already, %d gone "
                 "from L1 or cleared) in %.2f s", self.name, queued, len(entries), there, gone,
                 time.monotonic() - started)

    def _written(self, entry: Entry) -> None:
        self.store.unhold(entry)

    # -- clear, health, reporting ----------------------------------------------------------------

    async def clear(self, ns: bytes | None = None) -> Cleared:
        """Admin cache clear of the tier (every chunk, or namespace `ns`'s): (chunks, bytes) removed, and
        `failed`, those that could not be (forgotten all the same: never served again).

        On the loop, first: writes still queued (of that namespace) are dropped and promotions in flight
        will give their pages back instead of entering L1; until the chunks are gone (on a thread), lookups
        of that namespace start no promotions. Nothing stored before the clear is found after it, whatever
        the caller clears in L1 in the same loop step.
        """
        self.writer.invalidate(ns)
        with self.promotions.clearing(ns):
            cleared = await asyncio.to_thread(self.tier.clear, ns)
        if cleared.failed:
            self.clear_failures += cleared.failed
            self.m.clear_failures.inc(cleared.failed)
        return cleared

    def written(self) -> int:
        """Chunks written to the tier: its own count where it keeps one (`written`: durable ones, or this
        node's in a shared store), else the writer's successful puts."""
        return getattr(self.tier, "written", self.writer.done)

    def health(self) -> tuple[bool, str]:
        """(ok, why not) for /healthz: the writer's threads run, the tier takes writes, and not every
        promotion thread is stuck in a hung read."""
        if not self.writer.alive:
            return False, f"the {self.name} writer's threads stopped"
        if self.promotions.stuck >= PROMOTE_THREADS:
            return False, f"all {PROMOTE_THREADS} {self.name} promotion threads are stuck in reads past their deadline"
        return self.tier.health()

    def stats(self) -> dict:
        """The tier's part of the `stats` op, keys prefixed with its name (`l2_...`, `remote_...`), plus what
        the tier itself reports (`LowerTier.stats`)."""
        t, promos, p = self.tier, self.promotions, self.name
        out = {
            f"{p}_enabled": True,
            f"{p}_entries": t.entries,
            f"{p}_used_bytes": t.used_bytes,
            f"{p}_capacity_bytes": t.capacity_bytes,
            f"{p}_queue_depth": self.writer.queue_depth,
            f"{p}_inflight": self.writer.inflight,
            f"{p}_written": self.written(),
            f"{p}_dropped_writes": self.writer.dropped,
            f"{p}_cleared_writes": self.writer.stale,
            f"{p}_corrupt_chunks": getattr(t, "corrupt", 0),
            f"{p}_evictions": getattr(t, "evicted", 0),
            f"{p}_promoted": promos.promoted,
            f"{p}_promoting": promos.in_flight,
            f"{p}_promoting_bytes": promos.promoting_pages * self.store.pool.page_size,
            f"{p}_promotion_failures": promos.failures,
            f"{p}_promotions_expired": promos.expired,
            f"{p}_promotions_stuck": promos.stuck,
            f"{p}_clear_failures": self.clear_failures,
            f"{p}_read_bytes_per_s": self.read_bw.bytes_per_s,
            f"{p}_write_bytes_per_s": self.write_bw.bytes_per_s,
        }
        out.update(t.stats())
        return out
