"""Bounded write-behind queue from L1 to a lower tier, drained by one worker thread.

`submit` never blocks: when the queue is full the lower-tier copy is dropped and counted (the L1 store
has already succeeded). The worker takes each job's bytes (`job.copy()`), tells the job it is done with
the source (`job.copied()`, which lets L1 free the pages), then writes them to the tier.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.server.l2_format import ChunkMeta
from kvtier.server.l2_tier import TierAdapter

log = logging.getLogger("kvtier.server.l2")


@dataclass(slots=True)
class WriteJob:
    meta: ChunkMeta
    copy: Callable[[], Any]  # returns the payload (a bytes-like copy of the chunk)
    copied: Callable[[], None]  # called once the source may be released (always, even on failure)


class L2Writer:
    def __init__(self, tier: TierAdapter, depth: int, on_drop: Callable[[], None] | None = None) -> None:
        self.tier = tier
        self.depth = max(1, depth)
        self._queue: queue.Queue[WriteJob | None] = queue.Queue(maxsize=self.depth)
        self._on_drop = on_drop or (lambda: None)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending = 0  # jobs accepted and not yet written and synced
        self._stopping = False
        self.dropped = 0
        self.done = 0
        self.failed = 0

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def inflight(self) -> int:
        """Jobs queued or being written (0 means every accepted write has finished and been synced)."""
        return self._pending

    def submit(self, job: WriteJob) -> bool:
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
        self._thread = threading.Thread(target=self._run, name="kvtier-l2-writer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Finish queued writes (up to `timeout` seconds), then stop the worker."""
        self._stopping = True
        if self._thread is None:
            self.run_pending()
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.warning("L2 writer still busy at shutdown: %d queued writes abandoned", self.queue_depth)
        self._thread.join(timeout)

    def run_pending(self) -> int:
        """Process every queued job in the calling thread (tests, or shutdown without a worker)."""
        n = 0
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                break
            self._process(job)
            n += 1
        self._sync()
        with self._lock:
            self._pending -= n
        return n

    def _run(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=0.2)
            except queue.Empty:
                self._sync()
                continue
            if job is None:
                self._sync()
                return
            self._process(job)
            if self._queue.empty():
                self._sync()
            with self._lock:
                self._pending -= 1

    def _sync(self) -> None:
        try:
            self.tier.sync()
        except OSError:
            log.exception("L2 directory fsync failed")

    def _process(self, job: WriteJob) -> None:
        try:
            try:
                payload = job.copy()
            finally:
                job.copied()
            if self.tier.put(job.meta, payload):
                self.done += 1
        except Exception:  # the worker must survive any one bad write
            self.failed += 1
            log.exception("L2 write of %s failed", job.meta.key.hex())
