"""The background thread of a networked tier: it runs the probes that answer a lookup's "pending" (a
lookup never waits for the network: it queues a probe for what it did not know and answers None) and other
jobs off the serving path (a removal's delete). A bounded queue: a job that finds it full is not queued
(a probe's lookup stays pending; the next lookup queues it again)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Hashable

PROBE_QUEUE = 64  # jobs waiting; a lookup that finds the queue full stays pending
TICK_S = 0.25  # how often the thread looks whether it is stopped

log = logging.getLogger("kvtier.server.tiers")


class Prober:
    def __init__(self, name: str, depth: int = PROBE_QUEUE) -> None:
        self._lock = threading.Lock()
        self._probing: set[Hashable] = set()  # the probes queued or running, by the caller's id
        self._stop = threading.Event()
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue(depth)
        self.thread = threading.Thread(target=self._run, name=f"kvtier-{name}-probe", daemon=True)
        self._name = name
        self.thread.start()

    def probe(self, ident: Hashable, job: Callable[[], None]) -> None:
        """Queue `job` unless a probe with the same `ident` is queued or running, or the queue is full."""
        with self._lock:
            if ident in self._probing:
                return
            self._probing.add(ident)

        def run() -> None:
            try:
                job()
            finally:
                with self._lock:
                    self._probing.discard(ident)

        if not self.submit(run):
            with self._lock:
                self._probing.discard(ident)

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue a job; False (not queued) when the queue is full."""
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            return False
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=TICK_S)
            except queue.Empty:
                continue
            if job is None:
                return
            try:
                job()
            except Exception:  # the thread must survive any one job
                log.exception("%s probe failed", self._name)

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Full):
            self._jobs.put_nowait(None)
        self.thread.join(timeout)
