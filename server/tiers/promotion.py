"""Promotion: a lower tier's chunk read into L1 pages and committed there, using only L1's public calls.

A chunk a lookup found below L1 gets L1 pages at once (`L1Store.begin_insert`, without admission: it is
being read now) and its read and checksum verification run on a promotion thread; the lookup replies
without waiting, so the read overlaps the request's wait in the engine's queue. When the read verifies, the
chunk is inserted as an ordinary L1 entry (on the loop); a corrupt or missing chunk gives its pages back.
While a chunk is being promoted its key is busy in L1 (a store of it answers "busy"), another lookup reports
it without reading it twice, and an acquire of it waits (`waits`). In-flight promotions are capped (bytes):
chunks beyond the cap are not reported as hits. A promotion unfinished after `deadline_s` is abandoned (a
miss; a read hung in the kernel keeps its pages until it returns), and while every read thread is stuck so,
the tier is not looked at. A cache clear bumps an epoch: a promotion commits only if the epoch it started in
is still current, and none starts while the clear removes files.

Without a serving loop (`attach_loop` never called: tools, unit tests) a promotion runs inside `start`.
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
from kvtier.server import protocol as p
from kvtier.server.l1.store import Entry, L1Store
from kvtier.server.metrics import TierMetrics
from kvtier.server.tiers.bandwidth import BandwidthMeter
from kvtier.server.tiers.base import LowerTier
from kvtier.server.tiers.record import ChunkMeta
from kvtier.shm.pages import extent_views

log = logging.getLogger("kvtier.server.tiers")

PROMOTE_THREADS = 4  # chunk reads in flight: measured faster than 2 or 1 even on two cores (they wait on the disk)
PROMOTE_MAX_BYTES = 1 << 30  # in-flight promotion cap: at most this, and at most a quarter of L1
PROMOTE_DEADLINE_S = 5.0  # a promotion unfinished after this is abandoned: a miss (1 GiB in flight reads in ~1-3 s)


class ReadPool:
    """Reads on `n` daemon threads. Not a ThreadPoolExecutor: its threads are joined at interpreter exit, so
    a read hung in the kernel would keep a stopping server alive; these are left behind instead."""

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


@dataclass(eq=False, slots=True)
class Promotion:
    """One chunk being read into its L1 pages; `entry` (pages allocated, not yet indexed) is inserted into
    L1 when the read verifies."""

    meta: ChunkMeta
    entry: Entry
    done: asyncio.Future[bool] | None  # set on the loop when finished (None without a loop)
    epoch: tuple[int, int]  # the clear epochs at the start, all and the chunk's namespace
    ok: bool | None = None
    read: Future | None = None  # the read on a promotion thread
    expiry: asyncio.TimerHandle | None = None  # the deadline


class Promotions:
    def __init__(self, store: L1Store, segment: np.ndarray, tier: LowerTier, m: TierMetrics,
                 read_bw: BandwidthMeter, max_promoting_bytes: int | None = None) -> None:
        self.store = store
        self.segment = segment
        self.tier = tier
        self.m = m
        self.read_bw = read_bw
        self.max_promoting_bytes = max_promoting_bytes
        self.deadline_s = PROMOTE_DEADLINE_S
        self.promoted = self.failures = self.expired = 0
        self._call_soon: Callable[..., Any] = lambda fn, *a: fn(*a)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._readers: ReadPool | None = None
        self._promoting: dict[bytes, Promotion] = {}  # chunk key -> its promotion
        self._by_key: dict[bytes, Promotion] = {}  # chunk and alias keys -> promotion (acquire waits)
        self.promoting_pages = 0  # pages of in-flight and stuck promotions
        self._stuck: set[Promotion] = set()  # abandoned at the deadline, their read still running
        self._epoch = 0  # bumped by a clear of everything
        self._ns_epochs: dict[bytes, int] = {}  # bumped by a clear of one namespace
        self._clearing: dict[bytes | None, int] = {}  # clears removing files now, by namespace (None: all)

    # -- lifecycle -------------------------------------------------------------------------------

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Complete promotions on `loop`, read on worker threads."""
        self._call_soon = loop.call_soon_threadsafe
        self._loop = loop
        self._readers = ReadPool(PROMOTE_THREADS, "kvtier-promote")

    def close(self, timeout: float) -> None:
        """Stop the read threads (waiting at most `timeout` for running reads: they write into the segment,
        which is unmapped after this); promotions not committed give their pages back."""
        if self._readers is not None:
            left = self._readers.stop(timeout)
            if left:
                log.warning("%d promotion reads still running %.1f s into shutdown: left behind", left, timeout)
        for promo in list(self._promoting.values()):
            self._settle(promo, False)
        for promo in self._stuck:
            self._release_pages(promo)
        self._stuck.clear()

    @property
    def stuck(self) -> int:
        return len(self._stuck)

    @property
    def in_flight(self) -> int:
        return len(self._promoting)

    # -- clears ----------------------------------------------------------------------------------

    def fenced(self, fp: bytes) -> bool:
        """No promotion starts while a clear of `fp` (or of all) removes files, nor while every read thread
        is stuck in a read abandoned at its deadline (a hung disk: the hit would only wait and miss)."""
        return bool(self._clearing.get(None) or self._clearing.get(fp)) or len(self._stuck) >= PROMOTE_THREADS

    @contextlib.contextmanager
    def clearing(self, ns: bytes | None):  # noqa: ANN201 - a context manager
        """Around a clear's file removal: promotions in flight of `ns` (None: all) will not commit, and none
        starts until the removal is done."""
        if ns is None:
            self._epoch += 1
        else:
            self._ns_epochs[ns] = self._ns_epochs.get(ns, 0) + 1
        self._clearing[ns] = self._clearing.get(ns, 0) + 1
        try:
            yield
        finally:
            self._clearing[ns] -= 1
            if not self._clearing[ns]:
                del self._clearing[ns]

    def _epochs(self, ns: bytes) -> tuple[int, int]:
        return self._epoch, self._ns_epochs.get(ns, 0)

    # -- promotion -------------------------------------------------------------------------------

    def get(self, key: bytes) -> Promotion | None:
        """The promotion in flight of chunk `key`."""
        return self._promoting.get(key)

    def _cap_pages(self) -> int:
        pool = self.store.pool
        cap = self.max_promoting_bytes
        if cap is None:
            cap = min(PROMOTE_MAX_BYTES, pool.num_pages * pool.page_size // 4)
        return cap // pool.page_size

    def start(self, meta: ChunkMeta) -> Promotion | None:
        """Allocate L1 pages for `meta` and start reading it into them (None: over the cap or no room, or a
        record a client's reserve would refuse: then a counted failure, and removed from the tier)."""
        store = self.store
        unfit = self._unfit(meta)
        if unfit is not None:
            self.failures += 1
            self.m.promotion_failures.inc()
            log.warning("%s chunk %s refused: %s; removed", self.tier.name, meta.key.hex(), unfit)
            self.tier.remove(meta.key, "corrupt")
            return None
        npages = store.pool.pages_for(meta.size)
        if self.promoting_pages + npages > self._cap_pages():
            self.m.promotions_capped.inc()
            return None
        loop = self._loop
        promo = Promotion(meta, Entry(meta.key, meta.ns, meta.size, meta.blocks, (), meta.aliases),
                          loop.create_future() if loop is not None else None, self._epochs(meta.ns))
        extents = store.begin_insert(meta.key, meta.size, promo, admit=False, fp=meta.ns)  # "busy" now
        if isinstance(extents, str):
            return None
        promo.entry.extents = extents
        self._promoting[meta.key] = promo
        for key in (meta.key, *meta.aliases):
            self._by_key.setdefault(key, promo)
        self.promoting_pages += npages
        if self._readers is None or loop is None:
            self._finish(promo, self._read(promo))
        else:  # after the lookup's reply is sent: a read thread starting now would hold it up (the GIL)
            loop.call_soon(self._submit, promo)
            promo.expiry = loop.call_later(self.deadline_s, self._expire, promo)
        return promo

    def _unfit(self, meta: ChunkMeta) -> str | None:
        """Why a client's reserve of `meta` would be refused (holds.reserve's checks: StoreItem.from_wire and
        check_fits against its namespace), or None: a record from below L1 gets no more trust than a client."""
        pool = self.store.pool
        try:
            item = p.StoreItem.from_wire([meta.key, meta.size, meta.blocks, list(meta.aliases)])
            item.check_fits(self.store.namespace(meta.ns).blocks_per_chunk, pool.pages_for(meta.size) * pool.page_size,
                            self.store.min_block_bytes)
        except p.ProtocolError as exc:
            return exc.message
        return None

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
        """Worker thread: read and verify the chunk into the promotion's pages; (ok, start, end)."""
        start = time.perf_counter()
        try:
            views = extent_views(self.segment, promo.entry.extents, self.store.pool.page_size, promo.meta.size)
            ok = self.tier.get(promo.meta, views)
        except Exception:
            log.exception("promotion of %s from %s failed", promo.meta.key.hex(), self.tier.name)
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
            return
        if self._promoting.get(promo.meta.key) is not promo:
            return  # settled by close()
        ok, start, end = result
        if ok:
            self.read_bw.add(promo.meta.size, start, end)
        else:
            self.failures += 1
            self.m.promotion_failures.inc()
        self._settle(promo, ok and promo.epoch == self._epochs(promo.meta.ns))  # not if a clear came since

    def _expire(self, promo: Promotion) -> None:
        """On the loop, at a promotion's deadline: abandon it (a miss). A read not started yet is cancelled
        and its pages go back now; a running one may still write into them: they go back when it returns."""
        if self._promoting.get(promo.meta.key) is not promo:
            return
        running = promo.read is not None and not promo.read.cancel()
        self.expired += 1
        self.m.promotions_expired.inc()
        log.warning("promotion of %s unfinished after %.1f s: abandoned (%s)", promo.meta.key.hex(),
                    self.deadline_s, "its read still runs" if running else "its read never started")
        if running:
            self._stuck.add(promo)
        self._settle(promo, False, release=not running)

    def _settle(self, promo: Promotion, ok: bool, release: bool = True) -> None:
        """End a promotion: its entry into L1 (`ok`), or its pages back to the pool (unless not `release`:
        a read may still write into them)."""
        meta = promo.meta
        del self._promoting[meta.key]
        for key in (meta.key, *meta.aliases):
            if self._by_key.get(key) is promo:
                del self._by_key[key]
        self.store.end_busy(meta.key, promo)
        if promo.expiry is not None:
            promo.expiry.cancel()
        if ok:
            self.promoting_pages -= promo.entry.pages
            self.store.insert(promo.entry)
            self.promoted += 1
            self.m.promoted.inc()
        elif release:
            self._release_pages(promo)
        promo.ok = ok
        if promo.done is not None and not promo.done.done():
            promo.done.set_result(ok)

    def _release_pages(self, promo: Promotion) -> None:
        self.promoting_pages -= promo.entry.pages
        self.store.pool.release(promo.entry.extents)

    def waits(self, keys: Iterable[bytes]) -> Awaitable[Any] | None:
        """Something to await before acquiring `keys` while any of them is being promoted, else None."""
        if not self._by_key:
            return None
        waits = {id(promo): promo.done for key in keys if (promo := self._by_key.get(key)) is not None}
        futures = [f for f in waits.values() if f is not None]
        if not futures or self._loop is None:
            return None
        self.m.promotion_waits.inc()
        # A task, so that a cancelled waiter (client gone, shutdown) never cancels the promotions' futures.
        return self._loop.create_task(asyncio.wait(futures))
