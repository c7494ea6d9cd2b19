"""Map all of the server's L1 into this process's page tables in the background (the connector's CPU copies).

A process's first write or read of each 4 KiB page of the L1 segment takes a page fault, even when the server
has backed the whole segment with memory (its prefault): a copy into pages this process has not mapped yet
runs about 5x slower than into mapped ones (docs/performance.md, "Copy path vs raw memcpy"), which a fresh vLLM
worker would pay on its engine's core for every chunk it stores or loads until it had touched all of L1 once.
A `Populator` maps the whole segment once, after each hello, off the engine's threads.
"""

from __future__ import annotations

import logging
import threading
import time

from kvtier.shm.segment import Segment

log = logging.getLogger("kvtier.client")


class Populator:
    """One background pass of `Segment.populate` over a segment; `stop` ends it (and joins) before the
    segment is closed."""

    def __init__(self, segment: Segment) -> None:
        self._segment = segment
        self._stop = threading.Event()
        self.done = False
        self._thread = threading.Thread(target=self._run, name="kvtier-populate", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            self.done = self._segment.populate(self._stop)
        except OSError as exc:  # e.g. a kernel before 5.14: copies take their page faults as before
            log.warning("kvtier: L1 not mapped ahead (%s): copies fault its pages in on first touch", exc)
            return
        if self.done:
            log.info("kvtier: L1 mapped into this process: %.2f GiB in %.2f s", self._segment.size / (1 << 30),
                     time.monotonic() - started)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
