"""What a networked tier knows of its store: block key -> (chunk record, leading blocks), or None (known
missing), each with an expiry (the store may evict a chunk, or another node write one, meanwhile), bounded
(the oldest entries go first). Lookups answer from it without waiting for the network.

Shared block-prefix aliases follow PrefixIndex (server/index.py): an alias a live chunk already holds keeps
pointing there and the newcomer is remembered as a shadowed holder, so when the holder goes (`drop`), the
shared leading blocks (a document followed by different questions) stay findable through the next one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from kvtier.server.tiers.record import ChunkMeta

PRESENT_TTL_S = 30.0  # how long a chunk seen is trusted (the store may evict it meanwhile)
MISSING_TTL_S = 2.0  # ... and a miss (another node may write the chunk): a new chunk is seen this late at most
PRESENCE_MAX = 200_000  # entries (block keys); the oldest go first
SHADOWED_MAX = 8  # shadowed holders remembered per alias (the newest)

UNKNOWN = object()  # `get`'s answer for a key with no live entry
Found = tuple[ChunkMeta, int]  # a chunk and the leading blocks a key matches


class Presence:
    """Thread-safe; `chunks` counts live entries under a chunk's own key."""

    def __init__(self, max_entries: int = PRESENCE_MAX) -> None:
        self._lock = threading.Lock()
        self._map: OrderedDict[bytes, tuple[float, Found | None]] = OrderedDict()
        self._shadowed: dict[bytes, list[tuple[float, Found]]] = {}  # alias -> other holders, the newest last
        self._max = max_entries
        self.chunks = 0

    def get(self, key: bytes, now: float) -> Found | None | object:
        with self._lock:
            item = self._map.get(key)
            if item is None:
                return UNKNOWN
            if item[0] < now:
                self._pop(key)
                return UNKNOWN
            return item[1]

    def add(self, meta: ChunkMeta, now: float) -> None:
        """`meta` is in the store: found under its key and each alias (a live hit of another chunk under an
        alias stays, `meta` shadowed behind it)."""
        expiry = now + PRESENT_TTL_S
        with self._lock:
            self._set(meta.key, (expiry, (meta, meta.blocks)))
            for j, alias in enumerate(meta.aliases, start=1):
                item = self._map.get(alias)
                if item is None or item[1] is None or item[0] < now or item[1][0] == meta:
                    self._set(alias, (expiry, (meta, j)))
                else:
                    others = [o for o in self._shadowed.get(alias, []) if o[1][0] != meta]
                    self._shadowed[alias] = [*others, (expiry, (meta, j))][-SHADOWED_MAX:]

    def found(self, key: bytes, hit: Found, now: float) -> None:
        with self._lock:
            self._set(key, (now + PRESENT_TTL_S, hit))

    def missing(self, keys: Iterable[bytes], now: float) -> None:
        expiry = now + MISSING_TTL_S
        with self._lock:
            for key in keys:
                self._set(key, (expiry, None))

    def drop(self, meta: ChunkMeta, now: float) -> None:
        """`meta` is gone from the store: a miss under its key; an alias it held falls back to the newest live
        shadowed holder, else is forgotten (a probe asks the store again)."""
        with self._lock:
            for alias in meta.aliases:
                others = [o for o in self._shadowed.pop(alias, []) if o[1][0] != meta and o[0] >= now]
                item = self._map.get(alias)
                if item is not None and item[1] is not None and item[1][0] == meta:
                    self._pop(alias)
                    if others:
                        self._set(alias, others.pop())
                if others:
                    self._shadowed[alias] = others
            self._set(meta.key, (now + MISSING_TTL_S, None))

    def forget(self, ns: bytes | None) -> None:
        """Forget every chunk (of namespace `ns`), and every miss (a clear makes them stale too)."""
        with self._lock:
            for key in [k for k, (_, hit) in self._map.items() if ns is None or hit is None or hit[0].ns == ns]:
                self._pop(key)
            for alias in list(self._shadowed):
                kept = [o for o in self._shadowed[alias] if ns is not None and o[1][0].ns != ns]
                if kept:
                    self._shadowed[alias] = kept
                else:
                    del self._shadowed[alias]

    def _set(self, key: bytes, item: tuple[float, Found | None]) -> None:
        self._pop(key)
        self._map[key] = item
        if item[1] is not None and item[1][0].key == key:
            self.chunks += 1
        while len(self._map) > self._max:
            oldest = next(iter(self._map))
            self._pop(oldest)
            self._shadowed.pop(oldest, None)

    def _pop(self, key: bytes) -> None:
        item = self._map.pop(key, None)
        if item is not None and item[1] is not None and item[1][0].key == key:
            self.chunks -= 1
