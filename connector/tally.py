"""Counts a connector keeps for the server's metrics (the `report` op): requests skipped for want of an
identity, promised tokens not delivered, sampled verifications. Sent at most once per `every_s` from the
engine's own calls (no thread of its own); kept while the server cannot be reached."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvtier.server.keys import Namespace

Send = Callable[[dict[str, Any], Namespace | None], bool]


class Tally:
    def __init__(self, send: Send, every_s: float = 1.0) -> None:
        self._send = send
        self.every_s = every_s
        self._lock = threading.Lock()
        self._skipped: Counter[str] = Counter()
        self._undelivered: Counter[str] = Counter()
        self._verified: dict[Namespace, list[int]] = {}  # namespace -> [checks, mismatches]
        self._last = time.monotonic()

    def skipped(self, reason: str) -> None:
        with self._lock:
            self._skipped[reason] += 1

    def undelivered(self, reason: str, tokens: int) -> None:
        if tokens > 0:
            with self._lock:
                self._undelivered[reason] += tokens

    def verified(self, ns: Namespace, mismatched: bool) -> None:
        with self._lock:
            counts = self._verified.setdefault(ns, [0, 0])
            counts[0] += 1
            counts[1] += int(mismatched)

    def flush(self, force: bool = False) -> None:
        """Send what was counted, if `every_s` passed since the last send (or `force`)."""
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        with self._lock:
            skipped, undelivered, verified = self._skipped, self._undelivered, self._verified
            self._skipped, self._undelivered, self._verified = Counter(), Counter(), {}
        sent = not (skipped or undelivered) or self._send({"skipped": dict(skipped),
                                                            "undelivered": dict(undelivered)}, None)
        if not sent:
            self._keep(skipped, undelivered, {})
        for ns, (checks, mismatches) in verified.items():
            if not self._send({"verified": checks, "mismatched": mismatches}, ns):
                self._keep(Counter(), Counter(), {ns: [checks, mismatches]})

    def _keep(self, skipped: Counter[str], undelivered: Counter[str], verified: dict[Namespace, list[int]]) -> None:
        """Counts a send could not deliver, added back for the next one."""
        with self._lock:
            self._skipped.update(skipped)
            self._undelivered.update(undelivered)
            for ns, (checks, mismatches) in verified.items():
                counts = self._verified.setdefault(ns, [0, 0])
                counts[0] += checks
                counts[1] += mismatches
