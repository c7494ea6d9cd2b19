"""Bounded write-behind queue from L1 to a lower tier, drained by a two-stage pipeline.

`submit` never blocks: when the queue is full the lower-tier copy is dropped and counted (the L1 store
has already succeeded). Stage one (thread "kvtier-l2-writer") does the tier's CPU work on each job's
bytes where they are (`tier.prepare(meta, job.sources())`: the filesystem tier checksums them). Stage two
(IO_THREADS threads "kvtier-l2-io-N") does the tier's I/O (`tier.put`: write straight from the sources,
fsync, rename), two files at once, then tells the job it is done with its sources (`job.release()`, which
lets L1 free the pages). A hand-off of one job between them lets the next chunk's checksum run while
earlier ones are written and fsynced; the checksum and the syscalls release the GIL, so the stages
overlap. Queued jobs hold their L1 pages already; the pipeline holds at most IO_THREADS + HANDOFF + 1 more.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.server.tiers.base import LowerTier
from kvtier.server.tiers.record import ChunkMeta

log = logging.getLogger("kvtier.server.l2")

HANDOFF = 1  # prepared jobs waiting for the I/O stage
IO_THREADS = 2  # files written at once: a second stream lifts a disk that waits per request (measured +10-50%)


@dataclass(slots=True)
class WriteJob:
    meta: ChunkMeta
    sources: Callable[[], Sequence]  # the chunk's buffers in order (L1 pages), valid until `release`
    release: Callable[[], None]  # called once the sources may be freed: written, failed or skipped
    epoch: tuple[int, int] = (0, 0)  # the writer's epochs at submit, all and the job's namespace (`invalidate`)


_FAILED = object()  # stage one's result for a job whose sources or prepare raised
_STALE = object()  # stage one's result for a job submitted before the last `invalidate`


class L2Writer:
    def __init__(self, tier: LowerTier, depth: int, on_drop: Callable[[], None] | None = None) -> None:
        self.tier = tier
        self.depth = max(1, depth)
        self._queue: queue.Queue[WriteJob | None] = queue.Queue(maxsize=self.depth)
        self._handoff: queue.Queue[tuple[WriteJob, Any] | None] = queue.Queue(maxsize=HANDOFF)
        self._on_drop = on_drop or (lambda: None)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when `_pending` drops to 0
        self._pending = 0  # jobs accepted and not yet written and synced
        self._closing = 0  # of those, written and waiting on the directory sync that ends their burst
        self._stopping = False
        self.dropped = 0
        self.done = 0
        self.failed = 0
        self.stale = 0  # accepted jobs not kept because a clear came first
        self.epoch = 0  # bumped by `invalidate()`
        self._ns_epochs: dict[bytes, int] = {}  # bumped by `invalidate(ns)`, per namespace fingerprint

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def room(self) -> int:
        """Jobs `submit` would take now before dropping one."""
        return self.depth - self._queue.qsize()

    @property
    def alive(self) -> bool:
        """False when a worker thread died (not when stopped, or never started)."""
        return self._stopping or all(t.is_alive() for t in self._threads)

    @property
    def inflight(self) -> int:
        """Jobs queued or being written (0 means every accepted write has finished and been synced)."""
        return self._pending

    def wait_idle(self, timeout: float) -> bool:
        """Block until every accepted write has finished and been synced (`inflight == 0`), at most
        `timeout` seconds; returns whether it did."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def invalidate(self, ns: bytes | None = None) -> None:
        """Cache clear: jobs already accepted (all, or those of namespace fingerprint `ns`) are not written,
        and one being written now is removed before it is indexed (no lookup can find it)."""
        if ns is None:
            self.epoch += 1
        else:
            self._ns_epochs[ns] = self._ns_epochs.get(ns, 0) + 1

    def epochs(self, ns: bytes) -> tuple[int, int]:
        """The clear epochs a job of namespace `ns` submitted now gets: (all, the namespace's)."""
        return self.epoch, self._ns_epochs.get(ns, 0)

    def _epochs(self, job: WriteJob) -> tuple[int, int]:
        return self.epochs(job.meta.ns)

    def submit(self, job: WriteJob) -> bool:
        job.epoch = self._epochs(job)
        if self._stopping:
            self._drop()
            return False
        with self._lock:
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                full = True
            else:
                full = False
                self._pending += 1
        if full:
            self._drop()
            return False
        return True

    def _drop(self) -> None:
        self.dropped += 1
        self._on_drop()

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._run_prepare, name="kvtier-l2-writer", daemon=True)]
        self._threads += [threading.Thread(target=self._run_io, name=f"kvtier-l2-io-{i}", daemon=True)
                          for i in range(IO_THREADS)]
        for t in self._threads:
            t.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Finish queued writes (up to `timeout` seconds), then stop the worker threads."""
        self._stopping = True
        if not self._threads:
            self.run_pending()
            return
        deadline = time.monotonic() + timeout
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.warning("L2 writer still busy at shutdown: %d queued writes abandoned", self.queue_depth)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def run_pending(self) -> int:
        """Process every queued job in the calling thread (tests, or shutdown without workers)."""
        n = 0
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                break
            self._write(job, self._prepare(job))
            n += 1
        self._sync()
        self._finished(n)
        return n

    # -- stages ----------------------------------------------------------------------------------

    def _run_prepare(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                for _ in range(IO_THREADS):
                    self._handoff.put(None)
                return
            self._handoff.put((job, self._prepare(job)))

    def _run_io(self) -> None:
        while True:
            try:
                item = self._handoff.get(timeout=0.2)
            except queue.Empty:
                self._sync()
                continue
            if item is None:
                self._sync()
                return
            self._write(*item)
            with self._lock:
                # the last accepted job not already waiting on a sync makes the burst durable before it
                # stops counting (a sync already running may have missed this job's rename)
                last = self._pending - self._closing == 1
                if last:
                    self._closing += 1
                else:
                    self._pending -= 1
            if last:
                self._sync()
                with self._lock:
                    self._closing -= 1
                self._finished(1)

    def _finished(self, n: int) -> None:
        with self._lock:
            self._pending -= n
            if self._pending == 0:
                self._idle.notify_all()

    def _prepare(self, job: WriteJob) -> Any:
        if job.epoch != self._epochs(job):
            return _STALE
        try:
            return self.tier.prepare(job.meta, job.sources())
        except Exception:  # the workers must survive any one bad write
            log.exception("L2 write of %s failed", job.meta.key.hex())
            return _FAILED

    def _write(self, job: WriteJob, prepared: Any) -> None:
        """Stage two for one job (whatever stage one made of it), then release its sources."""
        try:
            if prepared is _FAILED:
                self.failed += 1
            elif prepared is _STALE:
                self.stale += 1
            elif self.tier.put(job.meta, prepared, lambda: job.epoch == self._epochs(job)):
                self.done += 1
            elif job.epoch != self._epochs(job):  # cleared while it was being written: never indexed
                self.stale += 1
        except Exception:
            self.failed += 1
            log.exception("L2 write of %s failed", job.meta.key.hex())
        finally:
            job.release()

    def _sync(self) -> None:
        try:
            self.tier.sync()
        except OSError:
            log.exception("L2 directory fsync failed")
