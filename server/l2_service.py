"""Glue between L1 (ChunkStore, the shared-memory segment) and the filesystem L2 tier.

* Write-behind: `on_commit` (ChunkStore's commit hook) holds a reader on the new entry and queues it;
  the writer thread copies the bytes out of the L1 pages, then the reader is released on the serving
  loop (`call_soon_threadsafe`), then the file is written. A full queue drops the L2 copy (counted).
* Lookup: `extend_lookup` (RequestHandler's hook) continues a lookup past the L1 prefix. Each chunk
  found in L2 is promoted to L1 *synchronously, during the lookup*: pages are made room for through the
  store's own eviction path, the file is read straight into them and its checksum verified, then the
  chunk is committed as an ordinary L1 entry and reported with tier "l2". Only chunks whose promotion
  finished are reported, so a following `acquire` always finds them in L1 (the vLLM lookup -> acquire
  flow works after a restart). The read blocks the loop for the lookup's L2 bytes: asynchronous
  promotion that overlaps the engine's queueing is left for later.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from kvtier.server.chunk_store import L1, ChunkStore, Entry
from kvtier.server.l2_format import ChunkMeta
from kvtier.server.l2_tier import FsTier, TierAdapter
from kvtier.server.l2_writer import L2Writer, WriteJob
from kvtier.server.metrics import Metrics
from prometheus_client import Counter, Gauge

log = logging.getLogger("kvtier.server.l2")

L2 = "l2"


class L2Metrics:
    def __init__(self, metrics: Metrics) -> None:
        r = metrics.registry
        self.used = Gauge("kvtier_l2_used_bytes", "L2 bytes in use (chunk files, headers included)", registry=r)
        self.capacity = Gauge("kvtier_l2_capacity_bytes", "L2 capacity", registry=r)
        self.queue_depth = Gauge("kvtier_l2_queue_depth", "Chunks waiting in the L2 write-behind queue", registry=r)
        self.dropped = Counter("kvtier_l2_dropped_writes", "L2 copies dropped because the queue was full", registry=r)
        self.corrupt = Counter("kvtier_l2_corrupt_chunks", "L2 chunk files found corrupt and removed", registry=r)
        self.written = Gauge(
            "kvtier_l2_written_chunks", "Chunks whose L2 file is durable, since the server started", registry=r
        )
        self.promoted = Counter("kvtier_l2_promotions", "L2 chunks promoted to L1 by lookups", registry=r)


class L2Service:
    def __init__(
        self, store: ChunkStore, segment: np.ndarray, tier: TierAdapter, queue_depth: int, metrics: Metrics,
    ) -> None:
        self.store = store
        self.segment = segment
        self.page_size = store.pool.page_size
        self.tier = tier
        self.metrics = metrics
        self.m = L2Metrics(metrics)
        self.writer = L2Writer(tier, queue_depth, on_drop=self.m.dropped.inc)
        self.promoted = 0
        self._call_soon: Callable[..., Any] = lambda fn, *a: fn(*a)
        self.m.used.set_function(lambda: self.tier.used_bytes)
        self.m.capacity.set_function(lambda: self.tier.capacity_bytes)
        self.m.queue_depth.set_function(lambda: self.writer.queue_depth)
        self.m.written.set_function(lambda: getattr(self.tier, "written", 0))
        metrics.entries.labels(L2).set_function(lambda: self.tier.entries)
        metrics.hit_tokens.labels(L2)
        metrics.evictions.labels(L2, "capacity")

    @classmethod
    def filesystem(cls, store: ChunkStore, segment: np.ndarray, path: str, capacity_bytes: int,
                   queue_depth: int, metrics: Metrics, odirect: bool = False) -> L2Service:
        holder: list[L2Service] = []
        tier = FsTier(
            path, capacity_bytes, odirect,
            on_evict=lambda reason: metrics.evictions.labels(L2, reason).inc(),
            on_corrupt=lambda: holder[0].m.corrupt.inc(),
        )
        service = cls(store, segment, tier, queue_depth, metrics)
        holder.append(service)
        return service

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self) -> None:
        """Scan the tier (blocking; before serving) and start the writer."""
        self.tier.scan()
        self.store.on_commit = self.on_commit
        self.writer.start()

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._call_soon = loop.call_soon_threadsafe

    def close(self, timeout: float = 5.0) -> None:
        self.store.on_commit = None
        self.writer.stop(timeout)

    # -- write-behind ----------------------------------------------------------------------------

    def on_commit(self, entry: Entry) -> None:
        if self.tier.contains(entry.key):
            return
        meta = ChunkMeta(entry.key, entry.ns, entry.blocks, entry.aliases, entry.size)
        self.store._add_readers(entry, 1)
        job = WriteJob(meta, lambda: self._copy_out(entry), lambda: self._call_soon(self._release, entry))
        if not self.writer.submit(job):
            self.store._add_readers(entry, -1)

    def _copy_out(self, entry: Entry) -> bytes:
        return b"".join(bytes(v) for v in self._views(entry.extents, entry.size))

    def _views(self, extents, size: int) -> list[memoryview]:
        ps, out, left = self.page_size, [], size
        for i in range(0, len(extents), 2):
            n = min(extents[i + 1] * ps, left)
            if n <= 0:
                break
            start = extents[i] * ps
            out.append(memoryview(self.segment[start : start + n]))
            left -= n
        return out

    def _release(self, entry: Entry) -> None:
        self.store._add_readers(entry, -1)
        self.store._update_gauges()

    # -- lookup and promotion --------------------------------------------------------------------

    def extend_lookup(self, fp: bytes, chunks: list[list[bytes]], hits: list[tuple[Entry, int]]
                      ) -> tuple[list[tuple[Entry, int]], list[str]]:
        """Continue an L1 lookup prefix with chunks promoted from L2; returns (hits, tier per hit)."""
        tiers = [L1] * len(hits)
        if len(hits) >= len(chunks):
            return hits, tiers
        ns = self.store.namespaces.get(fp)
        if ns is None:
            return hits, tiers
        bpc = ns.blocks_per_chunk
        if hits:
            last = hits[-1][1]
            if last < bpc or last < len(chunks[len(hits) - 1]):
                return hits, tiers  # the L1 prefix ended inside a chunk
        hits = list(hits)
        held = [entry for entry, _ in hits]
        for entry in held:  # promotions below must not evict the prefix found so far
            self.store._add_readers(entry, 1)
        l2_blocks = 0
        try:
            for block_keys in chunks[len(hits):]:
                found = self.tier.find(block_keys)
                if found is None:
                    break
                meta, match = found
                if meta.ns != fp or meta.key in self.store.pending or meta.key in self.store.entries:
                    break
                entry = self.promote(meta)
                if entry is None:
                    break
                self.store._add_readers(entry, 1)
                held.append(entry)
                hits.append((entry, match))
                tiers.append(L2)
                l2_blocks += match
                if match < bpc or match < len(block_keys):
                    break
        finally:
            for entry in held:
                self.store._add_readers(entry, -1)
            self.store._update_gauges()
        if l2_blocks:
            self.metrics.hit_tokens.labels(L2).inc(l2_blocks * ns.block_size)
        return hits, tiers

    def promote(self, meta: ChunkMeta) -> Entry | None:
        """Copy one L2 chunk into freshly made L1 pages and commit it as an L1 entry (None on failure)."""
        store, pool = self.store, self.store.pool
        npages = pool.pages_for(meta.size)
        if store._make_room(npages):
            return None
        extents = pool.allocate(npages)
        if extents is None:
            return None
        try:
            ok = self.tier.get(meta, self._views(extents, meta.size))
        except Exception:
            log.exception("L2 promotion of %s failed", meta.key.hex())
            ok = False
        if not ok:
            pool.release(extents)
            return None
        entry = store.insert(Entry(meta.key, meta.ns, meta.size, meta.blocks, extents, meta.aliases))
        self.promoted += 1
        self.m.promoted.inc()
        return entry

    # -- reporting -------------------------------------------------------------------------------

    def stats(self) -> dict:
        t = self.tier
        return {
            "l2_enabled": True,
            "l2_entries": t.entries,
            "l2_used_bytes": t.used_bytes,
            "l2_capacity_bytes": t.capacity_bytes,
            "l2_queue_depth": self.writer.queue_depth,
            "l2_inflight": self.writer.inflight,
            "l2_written": getattr(t, "written", self.writer.done),
            "l2_dropped_writes": self.writer.dropped,
            "l2_corrupt_chunks": getattr(t, "corrupt", 0),
            "l2_evictions": getattr(t, "evicted", 0),
            "l2_promoted": self.promoted,
        }
