"""Measured transfer bandwidth of a lower tier, one `BandwidthMeter` per direction (promotions' reads, the
writer's puts): reported in stats, as gauges and in lookup replies with lower-tier hits, so a client can skip
a tier that is slower than recomputing."""

from __future__ import annotations

import threading

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
