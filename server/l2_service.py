"""Glue between L1 (ChunkStore, the shared-memory segment) and the filesystem L2 tier.

* Write-behind: `on_commit` (ChunkStore's commit hook) holds a reader on the new entry and queues it;
  the writer checksums the bytes in the L1 pages and writes the file straight from them, then the reader
  is released on the serving loop (`call_soon_threadsafe`). A full queue drops the L2 copy (counted).
* Lookup: `extend_lookup` (RequestHandler's hook) continues a lookup past the L1 prefix. Each chunk
  found in L2 gets L1 pages at once (through the store's own eviction path) and its file read and
  checksum verification run on a worker thread; the lookup replies without waiting, reporting the chunk
  with tier "l2", so the read overlaps the request's wait in the engine's queue. When the read finishes
  the chunk is committed as an ordinary L1 entry (on the loop); a corrupt or missing file releases the
  pages instead. While a chunk is being promoted its pages are not evictable, a store of its key answers
  "busy" and another lookup reports it without reading it twice; an `acquire` of it waits (`promotions`
  gives the RequestHandler something to await; the serving loop goes on meanwhile) and gets a miss if the
  promotion failed. In-flight promotions are capped (`max_promoting_bytes`): chunks beyond the cap are
  not reported as hits. A promotion unfinished after `promote_deadline_s` is abandoned (a miss; a hung
  read keeps its pages until it returns), and while every read thread is stuck so, L2 is not looked at.
* Cache clear: bumps an epoch (a promotion commits only if the epoch it started in is still current) and,
  until its files are gone, no lookup of the cleared namespace starts a promotion.
* Bandwidth: promotions' reads and the writer's puts feed a `BandwidthMeter` each, reported in `stats`,
  as gauges and (`bandwidths`) in lookup replies with lower-tier hits, so a client can skip a tier that
  is slower than recomputing.

Without a serving loop (`attach_loop` never called: tools, unit tests) promotion runs synchronously
inside the lookup.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
from kvtier.server.chunk_store import L1, ChunkStore, Entry
from kvtier.server.l2_format import ChunkMeta
from kvtier.server.l2_tier import Cleared, FsTier, TierAdapter
from kvtier.server.l2_writer import L2Writer, WriteJob
from kvtier.server.metrics import Metrics
from prometheus_client import Counter, Gauge

log = logging.getLogger("kvtier.server.l2")

L2 = "l2"
PROMOTE_THREADS = 4  # chunk reads in flight: measured faster than 2 or 1 even on two cores (they wait on the disk)
PROMOTE_MAX_BYTES = 1 << 30  # in-flight promotion cap: at most this, and at most a quarter of L1
PROMOTE_DEADLINE_S = 5.0  # a promotion unfinished after this is abandoned: a miss (1 GiB in flight reads in ~1-3 s)
PROMOTING = 0  # ChunkStore.pending value of a key being promoted (reservation ids start at 1)
BANDWIDTH_DECAY = 0.9  # per transfer: the measured rate follows roughly the last ten transfers


class BandwidthMeter:
    """Decayed bytes over decayed busy seconds of one tier direction's transfers (thread-safe).

    Busy time, not the sum of transfer times: each transfer adds only the time since the previous one
    ended, so overlapping transfers (several promotion threads) measure the tier's aggregate rate.
    """

    def __init__(self, decay: float = BANDWIDTH_DECAY) -> None:
        self.decay = decay
        self._lock = threading.Lock()
        self._bytes = 0.0
        self._seconds = 0.0
        self._last_end = float("-inf")

    def add(self, nbytes: int, start: float, end: float) -> None:
        """One finished transfer of `nbytes` that ran from `start` to `end` (time.perf_counter)."""
        with self._lock:
            busy = max(0.0, end - max(start, self._last_end))
            self._last_end = max(self._last_end, end)
            self._bytes = self._bytes * self.decay + nbytes
            self._seconds = self._seconds * self.decay + busy

    @property
    def bytes_per_s(self) -> float:
        """0.0 until a transfer was measured."""
        return self._bytes / self._seconds if self._seconds > 0 else 0.0


class _ReadPool:
    """Promotion reads on `n` daemon threads. Not a ThreadPoolExecutor: its threads are joined at interpreter
    exit, so a read hung in the kernel would keep a stopping server alive; these are left behind instead."""

    def __init__(self, n: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except Exception as exc:
                    future.set_exception(exc)

    def stop(self, timeout: float) -> int:
        """Cancel the jobs not started and stop the threads, waiting at most `timeout` seconds for running
        ones; returns how many threads are still running a job."""
        with contextlib.suppress(queue.Empty):
            while True:
                job = self._jobs.get_nowait()
                if job is not None:
                    job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return sum(t.is_alive() for t in self._threads)


class _TimedPuts:
    """The tier as the writer sees it: each successful put is timed into the write meter."""

    def __init__(self, tier: TierAdapter, meter: BandwidthMeter) -> None:
        self._tier = tier
        self._meter = meter

    def put(self, meta: ChunkMeta, payload, keep: Callable[[], bool] | None = None) -> bool:
        start = time.perf_counter()
        ok = self._tier.put(meta, payload, keep)
        if ok:
            self._meter.add(meta.size, start, time.perf_counter())
        return ok

    def __getattr__(self, name: str) -> Any:  # sync() and anything else the writer uses
        return getattr(self._tier, name)


@dataclass(eq=False, slots=True)
class Promotion:
    """One chunk being read from L2 into its L1 pages; `entry` (pages allocated, not yet indexed) is
    inserted into the store when the read verifies."""

    meta: ChunkMeta
    entry: Entry
    done: asyncio.Future[bool] | None  # set on the loop when finished (None without a loop)
    epoch: tuple[int, int]  # the service's clear epochs at the start, all and the chunk's namespace
    ok: bool | None = None
    read: Future | None = None  # the read on a promotion thread
    expiry: asyncio.TimerHandle | None = None  # the deadline


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
        self.promotion_failures = Counter(
            "kvtier_l2_promotion_failures", "L2 promotions whose file was missing or corrupt (served as misses)",
            registry=r,
        )
        self.promoting_bytes = Gauge(
            "kvtier_l2_promoting_bytes", "L1 bytes held by promotions from L2 still in flight", registry=r
        )
        self.promotions_capped = Counter(
            "kvtier_l2_promotions_capped", "L2 hits not promoted (nor reported) because of the in-flight cap",
            registry=r,
        )
        self.promotion_waits = Counter(
            "kvtier_l2_promotion_waits", "Acquires that had to wait for an in-flight promotion", registry=r
        )
        self.promotions_expired = Counter(
            "kvtier_l2_promotions_expired", "L2 promotions abandoned at their deadline (served as misses)",
            registry=r,
        )
        self.clear_failures = Counter(
            "kvtier_l2_clear_failures", "L2 files a cache clear could not remove (forgotten, never served)",
            registry=r,
        )


class L2Service:
    def __init__(
        self, store: ChunkStore, segment: np.ndarray, tier: TierAdapter, queue_depth: int, metrics: Metrics,
        max_promoting_bytes: int | None = None,
    ) -> None:
        self.store = store
        self.segment = segment
        self.page_size = store.pool.page_size
        self.tier = tier
        self.metrics = metrics
        self.m = L2Metrics(metrics)
        self.read_bw = BandwidthMeter()
        self.write_bw = BandwidthMeter()
        self.writer = L2Writer(_TimedPuts(tier, self.write_bw), queue_depth,  # type: ignore[arg-type]
                               on_drop=self.m.dropped.inc)
        self.max_promoting_bytes = max_promoting_bytes
        self.promote_deadline_s = PROMOTE_DEADLINE_S
        self.promoted = 0
        self.promotion_failures = 0
        self.promotions_expired = 0
        self.clear_failures = 0
        self._call_soon: Callable[..., Any] = lambda fn, *a: fn(*a)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._readers: _ReadPool | None = None
        self._promoting: dict[bytes, Promotion] = {}  # chunk key -> its promotion
        self._promoting_keys: dict[bytes, Promotion] = {}  # chunk and alias keys -> promotion (acquire waits)
        self._promoting_pages = 0  # pages of `_promoting` and `_stuck`
        self._stuck: set[Promotion] = set()  # abandoned at the deadline, their read still running
        self._epoch = 0  # bumped by a clear of everything
        self._ns_epochs: dict[bytes, int] = {}  # bumped by a clear of one namespace
        self._clearing: dict[bytes | None, int] = {}  # clears removing files now, by namespace (None: all)
        self.m.used.set_function(lambda: self.tier.used_bytes)
        self.m.capacity.set_function(lambda: self.tier.capacity_bytes)
        self.m.queue_depth.set_function(lambda: self.writer.queue_depth)
        self.m.written.set_function(lambda: getattr(self.tier, "written", 0))
        self.m.promoting_bytes.set_function(lambda: self._promoting_pages * self.page_size)
        metrics.tier_read_bw.labels(L2).set_function(lambda: self.read_bw.bytes_per_s)
        metrics.tier_write_bw.labels(L2).set_function(lambda: self.write_bw.bytes_per_s)
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
        """Serve from `loop`: writer callbacks and promotion completions run on it, promotion reads on
        worker threads."""
        self._call_soon = loop.call_soon_threadsafe
        self._loop = loop
        self._readers = _ReadPool(PROMOTE_THREADS, "kvtier-l2-promote")

    def close(self, timeout: float = 5.0) -> None:
        """Stop the writer and the promotion threads; promotions not committed yet give their pages back.

        Waits at most `timeout` seconds for reads already running (they write into the segment, which is
        unmapped after this); a read still running then (a hung disk) is left to its daemon thread, logged."""
        self.store.on_commit = None
        if self._readers is not None:
            left = self._readers.stop(timeout)
            if left:
                log.warning("L2: %d promotion reads still running %.1f s into shutdown: left behind", left, timeout)
        for promo in list(self._promoting.values()):
            self._settle(promo, False)
        for promo in self._stuck:
            self._release_pages(promo)
        self._stuck.clear()
        self.store._update_gauges()
        self.writer.stop(timeout)

    # -- write-behind ----------------------------------------------------------------------------

    def on_commit(self, entry: Entry) -> None:
        if self.tier.contains(entry.key):
            return
        meta = ChunkMeta(entry.key, entry.ns, entry.blocks, entry.aliases, entry.size)
        self.store._add_readers(entry, 1)
        job = WriteJob(meta, lambda: self._views(entry.extents, entry.size),
                       lambda: self._call_soon(self._release, entry))
        if not self.writer.submit(job):
            self.store._add_readers(entry, -1)

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
        """Continue an L1 lookup prefix with chunks from L2, starting their promotion; returns (hits, tier
        per hit). An "l2" hit's entry may still be in flight (not indexed until its read verifies)."""
        tiers = [L1] * len(hits)
        if len(hits) >= len(chunks) or self._fenced(fp):
            return hits, tiers
        store = self.store
        ns = store.namespaces.get(fp)
        if ns is None:
            return hits, tiers
        bpc = ns.blocks_per_chunk
        if hits:
            last = hits[-1][1]
            if last < bpc or last < len(chunks[len(hits) - 1]):
                return hits, tiers  # the L1 prefix ended inside a chunk
        hits = list(hits)
        held = [entry for entry, _ in hits]
        for entry in held:  # room made for promotions below must not evict the prefix found so far
            store._add_readers(entry, 1)
        blocks = {L1: 0, L2: 0}
        try:
            for block_keys in chunks[len(hits):]:
                found = self.tier.find(block_keys)
                if found is None:
                    break
                meta, match = found
                if meta.ns != fp:
                    break
                tier = L2
                promo = self._promoting.get(meta.key)
                if promo is not None:
                    entry = promo.entry
                elif meta.key in store.entries:  # promoted meanwhile (reads finish in any order)
                    entry, tier = store.entries[meta.key], L1
                elif meta.key in store.pending:  # a client is storing it
                    break
                else:
                    promo = self._start(meta)
                    if promo is None or promo.ok is False:
                        break
                    entry = promo.entry
                if store.entries.get(entry.key) is entry:  # indexed: hold it like the L1 prefix
                    store._add_readers(entry, 1)
                    held.append(entry)
                hits.append((entry, match))
                tiers.append(tier)
                blocks[tier] += match
                if match < bpc or match < len(block_keys):
                    break
        finally:
            for entry in held:
                store._add_readers(entry, -1)
            store._update_gauges()
        for tier, n in blocks.items():
            if n:
                self.metrics.hit_tokens.labels(tier).inc(n * ns.block_size)
        return hits, tiers

    def _fenced(self, fp: bytes) -> bool:
        """No promotion starts while a clear of `fp` (or of all) removes files, nor while every read thread
        is stuck in a read abandoned at its deadline (a hung disk: the hit would only wait and miss)."""
        return bool(self._clearing.get(None) or self._clearing.get(fp)) or len(self._stuck) >= PROMOTE_THREADS

    def _epochs(self, ns: bytes) -> tuple[int, int]:
        return self._epoch, self._ns_epochs.get(ns, 0)

    def _promotion_cap_pages(self) -> int:
        pool = self.store.pool
        cap = self.max_promoting_bytes
        if cap is None:
            cap = min(PROMOTE_MAX_BYTES, pool.num_pages * pool.page_size // 4)
        return cap // pool.page_size

    def _start(self, meta: ChunkMeta) -> Promotion | None:
        """Allocate L1 pages for `meta` and start reading it into them (None: over the cap or no room)."""
        store, pool = self.store, self.store.pool
        npages = pool.pages_for(meta.size)
        if self._promoting_pages + npages > self._promotion_cap_pages():
            self.m.promotions_capped.inc()
            return None
        if store._make_room(npages):
            return None
        extents = pool.allocate(npages)
        if extents is None:
            return None
        entry = Entry(meta.key, meta.ns, meta.size, meta.blocks, extents, meta.aliases)
        loop = self._loop
        promo = Promotion(meta, entry, loop.create_future() if loop is not None else None, self._epochs(meta.ns))
        self._promoting[meta.key] = promo
        for key in (meta.key, *meta.aliases):
            self._promoting_keys.setdefault(key, promo)
        store.pending[meta.key] = PROMOTING  # a store of this key answers "busy" meanwhile
        self._promoting_pages += npages
        if self._readers is None or loop is None:
            self._finish(promo, self._read(promo))
        else:  # after the lookup's reply is sent: a read thread starting now would hold it up (the GIL)
            loop.call_soon(self._submit, promo)
            promo.expiry = loop.call_later(self.promote_deadline_s, self._expire, promo)
        return promo

    def _submit(self, promo: Promotion) -> None:
        if self._promoting.get(promo.meta.key) is not promo or self._readers is None:
            return  # settled by close() or its deadline
        promo.read = self._readers.submit(self._read, promo)
        promo.read.add_done_callback(lambda f: self._read_done(promo, f))

    def _read_done(self, promo: Promotion, read: Future) -> None:
        """On the read's thread (or close()'s, for a cancelled one): hand the result to the loop."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: a read left running at shutdown
            self._call_soon(self._finish_future, promo, read)

    def _read(self, promo: Promotion) -> tuple[bool, float, float]:
        """Worker thread: read and verify the file into the promotion's pages; (ok, start, end)."""
        start = time.perf_counter()
        try:
            ok = self.tier.get(promo.meta, self._views(promo.entry.extents, promo.meta.size))
        except Exception:
            log.exception("L2 promotion of %s failed", promo.meta.key.hex())
            ok = False
        return ok, start, time.perf_counter()

    def _finish_future(self, promo: Promotion, read: Future) -> None:
        if not read.cancelled():  # cancelled only by close() or the deadline, which settle it themselves
            self._finish(promo, read.result())

    def _finish(self, promo: Promotion, result: tuple[bool, float, float]) -> None:
        """On the loop: commit a verified promotion as an L1 entry, or give its pages back."""
        if promo in self._stuck:  # abandoned at its deadline: now that the read returned, its pages go back
            self._stuck.discard(promo)
            self._release_pages(promo)
            self.store._update_gauges()
            return
        if self._promoting.get(promo.meta.key) is not promo:
            return  # settled by close()
        ok, start, end = result
        if ok:
            self.read_bw.add(promo.meta.size, start, end)
        else:
            self.promotion_failures += 1
            self.m.promotion_failures.inc()
        self._settle(promo, ok and promo.epoch == self._epochs(promo.meta.ns))  # not if a clear came since
        self.store._update_gauges()

    def _expire(self, promo: Promotion) -> None:
        """On the loop, at a promotion's deadline: abandon it (a miss). A read not started yet is cancelled
        and its pages go back now; a running one may still write into them: they go back when it returns."""
        if self._promoting.get(promo.meta.key) is not promo:
            return
        running = promo.read is not None and not promo.read.cancel()
        self.promotions_expired += 1
        self.m.promotions_expired.inc()
        log.warning("L2 promotion of %s unfinished after %.1f s: abandoned (%s)", promo.meta.key.hex(),
                    self.promote_deadline_s, "its read still runs" if running else "its read never started")
        if running:
            self._stuck.add(promo)
        self._settle(promo, False, release=not running)
        self.store._update_gauges()

    def _settle(self, promo: Promotion, ok: bool, release: bool = True) -> None:
        """End a promotion: its entry into L1 (`ok`), or its pages back to the pool (unless not `release`:
        a read may still write into them)."""
        meta, store = promo.meta, self.store
        del self._promoting[meta.key]
        for key in (meta.key, *meta.aliases):
            if self._promoting_keys.get(key) is promo:
                del self._promoting_keys[key]
        if store.pending.get(meta.key) == PROMOTING:
            del store.pending[meta.key]
        if promo.expiry is not None:
            promo.expiry.cancel()
        if ok:
            self._promoting_pages -= promo.entry.pages
            store.insert(promo.entry)
            self.promoted += 1
            self.m.promoted.inc()
        elif release:
            self._release_pages(promo)
        promo.ok = ok
        if promo.done is not None and not promo.done.done():
            promo.done.set_result(ok)

    def _release_pages(self, promo: Promotion) -> None:
        self._promoting_pages -= promo.entry.pages
        self.store.pool.release(promo.entry.extents)

    async def clear(self, ns: bytes | None = None) -> Cleared:
        """Admin cache clear of L2 (every chunk, or namespace `ns`'s): (chunks, file bytes) removed, and
        `failed`, the files that could not be (forgotten all the same: never served again).

        On the loop, first: L2 writes still queued (of that namespace) are dropped, and the epoch moves on,
        so promotions in flight give their pages back instead of entering L1; until the files are gone (on
        a thread), lookups of that namespace start no promotions. Nothing stored before the clear is found
        after it, whatever the caller clears in L1 in the same loop step.
        """
        self.writer.invalidate(ns)
        if ns is None:
            self._epoch += 1
        else:
            self._ns_epochs[ns] = self._ns_epochs.get(ns, 0) + 1
        self._clearing[ns] = self._clearing.get(ns, 0) + 1
        try:
            cleared = await asyncio.to_thread(self.tier.clear, ns)
        finally:
            self._clearing[ns] -= 1
            if not self._clearing[ns]:
                del self._clearing[ns]
        if cleared.failed:
            self.clear_failures += cleared.failed
            self.m.clear_failures.inc(cleared.failed)
        return cleared

    def health(self) -> tuple[bool, str]:
        """(ok, why not) for /healthz: the writer's threads run, the tier takes writes (FsTier: a file can be
        created in its directory now), and not every promotion thread is stuck in a hung read."""
        if not self.writer.alive:
            return False, "the L2 writer's threads stopped"
        if len(self._stuck) >= PROMOTE_THREADS:
            return False, f"all {PROMOTE_THREADS} L2 promotion threads are stuck in reads past their deadline"
        return self.tier.health()

    def promotions(self, keys: Iterable[bytes]) -> Awaitable[Any] | None:
        """Something to await before acquiring `keys` while any of them is being promoted, else None."""
        if not self._promoting_keys:
            return None
        waits = {id(promo): promo.done for key in keys if (promo := self._promoting_keys.get(key)) is not None}
        futures = [f for f in waits.values() if f is not None]
        if not futures or self._loop is None:
            return None
        self.m.promotion_waits.inc()
        # A task, so that a cancelled waiter (client gone, shutdown) never cancels the promotions' futures.
        return self._loop.create_task(asyncio.wait(futures))

    # -- reporting -------------------------------------------------------------------------------

    def bandwidths(self) -> dict[str, float]:
        """Measured read bandwidth per lower tier, bytes/s (0.0: not measured yet), for lookup replies."""
        return {L2: self.read_bw.bytes_per_s}

    def stats(self) -> dict:
        t = self.tier
        return {
            "l2_enabled": True,
            "l2_entries": t.entries,
            "l2_used_bytes": t.used_bytes,
            "l2_capacity_bytes": t.capacity_bytes,
            "l2_odirect": getattr(t, "odirect_active", False),  # O_DIRECT asked for and taken by the directory
            "l2_queue_depth": self.writer.queue_depth,
            "l2_inflight": self.writer.inflight,
            "l2_written": getattr(t, "written", self.writer.done),
            "l2_dropped_writes": self.writer.dropped,
            "l2_cleared_writes": self.writer.stale,
            "l2_corrupt_chunks": getattr(t, "corrupt", 0),
            "l2_evictions": getattr(t, "evicted", 0),
            "l2_promoted": self.promoted,
            "l2_promoting": len(self._promoting),
            "l2_promoting_bytes": self._promoting_pages * self.page_size,
            "l2_promotion_failures": self.promotion_failures,
            "l2_promotions_expired": self.promotions_expired,
            "l2_promotions_stuck": len(self._stuck),
            "l2_clear_failures": self.clear_failures,
            "l2_read_bytes_per_s": self.read_bw.bytes_per_s,
            "l2_write_bytes_per_s": self.write_bw.bytes_per_s,
        }
