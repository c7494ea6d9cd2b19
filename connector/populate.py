"""Map all of the server's L1 into this process's page tables in the background (the connector's CPU copies).

A process's first write or read of each 4 KiB page of the L1 segment takes a page fault, even when the server
has backed the whole segment with memory (its prefault): measured on a 2-core VM, a 64 KiB copy into pages
not yet mapped by this process costs about 25 us, into mapped ones 2.5 us, so a fresh vLLM worker pays about
0.2 ms of its core for each 512 KiB chunk it stores or loads until it has touched all of L1 once
(docs/performance.md). A `Populator` maps the whole segment once, after each hello, off the engine's threads.
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
