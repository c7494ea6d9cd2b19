"""Counts a connector keeps for the server's metrics (the `report` op): requests skipped for want of an
identity, promised tokens not delivered, sampled verifications, request hints ignored, lookups answered
locally as misses by the presence filter (so the server's lookup metrics count them). A daemon thread, started by the first count,
sends what was counted once per `every_s` (never on the engine's own calls, and an engine that goes idle still
reports its last counts); counts a send could not deliver are kept for the next one."""

from __future__ import annotations

import threading
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
        self._hints_ignored: Counter[str] = Counter()
        self._verified: dict[Namespace, list[int]] = {}  # namespace -> [checks, mismatches]
        self._local_misses: dict[Namespace, list[int]] = {}  # namespace -> [lookups, requested blocks]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def skipped(self, reason: str) -> None:
        with self._lock:
            self._skipped[reason] += 1
            self._started()

    def undelivered(self, reason: str, tokens: int) -> None:
        if tokens > 0:
            with self._lock:
                self._undelivered[reason] += tokens
                self._started()

    def hint_ignored(self, reason: str) -> None:
        """A request hint ignored (protocol.HINT_IGNORED_REASONS)."""
        with self._lock:
            self._hints_ignored[reason] += 1
            self._started()

    def verified(self, ns: Namespace, mismatched: bool) -> None:
        with self._lock:
            counts = self._verified.setdefault(ns, [0, 0])
            counts[0] += 1
            counts[1] += int(mismatched)
            self._started()

    def local_miss(self, ns: Namespace, blocks: int) -> None:
        """A lookup of `blocks` engine blocks the presence filter answered as a miss without asking the server."""
        with self._lock:
            counts = self._local_misses.setdefault(ns, [0, 0])
            counts[0] += 1
            counts[1] += blocks
            self._started()

    def _started(self) -> None:
        """Start the sender (the caller holds the lock)."""
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name="kvtier-tally", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.flush()

    def flush(self) -> None:
        """Send what was counted now."""
        with self._lock:
            skipped, undelivered, hints = self._skipped, self._undelivered, self._hints_ignored
            verified, local = self._verified, self._local_misses
            self._skipped, self._undelivered, self._hints_ignored, self._verified = Counter(), Counter(), Counter(), {}
            self._local_misses = {}
        counts = {"skipped": dict(skipped), "undelivered": dict(undelivered), "hints_ignored": dict(hints)}
        if (skipped or undelivered or hints) and not self._send(counts, None):
            self._keep(skipped, undelivered, {}, hints)
        for ns in verified.keys() | local.keys():
            checks, mismatches = verified.get(ns, (0, 0))
            lookups, blocks = local.get(ns, (0, 0))
            if not self._send({"verified": checks, "mismatched": mismatches, "local_lookups": lookups,
                               "local_blocks": blocks}, ns):
                self._keep(Counter(), Counter(), {ns: [checks, mismatches]} if checks else {}, None,
                           {ns: [lookups, blocks]} if lookups else {})

    def close(self) -> None:
        """Stop the sender and send what is left (once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.flush()

    def _keep(self, skipped: Counter[str], undelivered: Counter[str], verified: dict[Namespace, list[int]],
              hints: Counter[str] | None = None, local: dict[Namespace, list[int]] | None = None) -> None:
        """Counts a send could not deliver, added back for the next one."""
        with self._lock:
            self._skipped.update(skipped)
            self._undelivered.update(undelivered)
            self._hints_ignored.update(hints or {})
            for kept, into in ((verified, self._verified), (local or {}, self._local_misses)):
                for ns, (a, b) in kept.items():
                    counts = into.setdefault(ns, [0, 0])
                    counts[0] += a
                    counts[1] += b
