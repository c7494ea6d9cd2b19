"""What the cache holds, as events: `Stored`, `Removed` (with its reason), `Cleared`, and the `Bus` they go through.

L1 posts from the serving loop, lower tiers from their own threads (write-behind, promotions, probes, clears);
listeners (the daemon feed, server/feed.py) each read their own bounded queue on their own thread. Posting never
blocks: a full queue drops the event for that subscriber and counts it (a consumer that needs an exact view
then asks for a snapshot, docs/events.md). Events of one poster keep their order; events of several posters
are ordered by when they were posted.

Imports nothing of kvtier (a layering rule): events are plain values any part may post or read.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

# The `reason` of a Removed is the `reason` label of kvtier_evictions_total where the tier counts one there:
# "capacity" (evicted to make room), "resize", "superseded" (a longer chunk serves the same blocks), "removed",
# "corrupt", "missing" (found gone), "expired".


@dataclass(frozen=True, slots=True)
class Stored:
    """A chunk the tier holds from now on: `blocks` leading engine blocks, named by `key` (all of them) and by
    `aliases` (the keys of its shorter leading runs), `size` payload bytes. `tokens` (its token ids, uint32
    little-endian) and `parent` (the key of the chunk before it; b"" for the first) when its client sent
    them: what an engine needs to name the chunk's blocks with its own hashes (docs/events.md)."""

    tier: str
    ns: bytes
    key: bytes
    blocks: int
    aliases: tuple[bytes, ...]
    size: int
    tokens: bytes = b""
    parent: bytes = b""


@dataclass(frozen=True, slots=True)
class Removed:
    """A chunk the tier no longer holds (nor any of its aliases), and why."""

    tier: str
    ns: bytes
    key: bytes
    reason: str


@dataclass(frozen=True, slots=True)
class Cleared:
    """Every chunk of the tier (of namespace `ns`; None: of every namespace) is gone: an admin clear."""

    tier: str
    ns: bytes | None


Event = Stored | Removed | Cleared


class Subscription:
    """One listener's bounded queue, read with `take` on the listener's thread; what a full queue refuses is
    counted in `dropped` (and passed to `on_drop`)."""

    def __init__(self, depth: int, on_drop: Callable[[], None] | None = None) -> None:
        self.depth = depth
        self._items: deque[object] = deque()
        self._ready = threading.Condition(threading.Lock())
        self._on_drop = on_drop
        self.dropped = 0

    def offer(self, item: object, force: bool = False) -> None:
        """Queue `item` unless the queue is full (`force`: even then: a listener's own control item)."""
        with self._ready:
            if len(self._items) >= self.depth and not force:
                self.dropped += 1
                if self._on_drop is not None:
                    self._on_drop()
                return
            self._items.append(item)
            self._ready.notify()

    def take(self, most: int, timeout: float) -> list[object]:
        """Up to `most` items in order, waiting up to `timeout` seconds for the first; [] if none came."""
        with self._ready:
            if not self._items:
                self._ready.wait(timeout)
            return [self._items.popleft() for _ in range(min(most, len(self._items)))]


class Bus:
    """Fan-out of events to subscriptions; thread-safe and never blocking the poster."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # serialises posts, so that every subscriber sees one order
        self._subs: tuple[Subscription, ...] = ()

    def subscribe(self, depth: int, on_drop: Callable[[], None] | None = None) -> Subscription:
        sub = Subscription(depth, on_drop)
        with self._lock:
            self._subs = (*self._subs, sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subs = tuple(s for s in self._subs if s is not sub)

    @property
    def active(self) -> bool:
        """Whether anyone listens (posters may skip building events otherwise)."""
        return bool(self._subs)

    def post(self, event: object) -> None:
        """Hand `event` (an Event, or a listener's own marker) to every subscriber."""
        if not self._subs:
            return
        with self._lock:
            for sub in self._subs:
                sub.offer(event)
