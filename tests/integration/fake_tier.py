"""A third lower tier that kvtier does not ship: chunks in this process's memory, registered by import path
(`--extra-tiers fake_tier:make`, this folder on PYTHONPATH), with no change to kvtier's code. What
test_fake_tier.py proves a tier gets from the one room it lives in (status, metrics, the stats op, the feed,
lookups and promotions)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from kvtier.server.events import Cleared as ClearedEvent
from kvtier.server.events import Removed, Stored
from kvtier.server.index import PrefixIndex
from kvtier.server.metrics import Metrics, TierMetrics
from kvtier.server.tiers.base import Cleared, LowerTier
from kvtier.server.tiers.record import ChunkMeta


class FakeTier(LowerTier):
    name = "fake"

    def __init__(self, capacity_bytes: int) -> None:
        self._capacity = capacity_bytes
        self._lock = threading.Lock()
        self._chunks: dict[bytes, tuple[ChunkMeta, bytes]] = {}
        self._index: PrefixIndex[ChunkMeta] = PrefixIndex()
        self.puts = self.reads = 0

    @property
    def entries(self) -> int:
        return len(self._chunks)

    def put(self, meta: ChunkMeta, payload, keep: Callable[[], bool] | None = None) -> bool:
        with self._lock:
            if meta.key in self._chunks or self._used + meta.size > self._capacity:
                return False
            self._chunks[meta.key] = (meta, bytes(payload))
            self._index.add(meta, meta.key, meta.blocks, meta.aliases)
            self._used += meta.size
            self.puts += 1
        self.report(Stored(self.name, meta.ns, meta.key, meta.blocks, meta.aliases, meta.size))
        return True

    def get(self, meta: ChunkMeta, bufs: Sequence[memoryview]) -> bool:
        with self._lock:
            held = self._chunks.get(meta.key)
        if held is None or held[0] != meta:
            return False
        off = 0
        for buf in bufs:
            n = min(len(buf), meta.size - off)
            buf[:n] = held[1][off : off + n]
            off += n
        self.reads += 1
        return True

    def contains(self, key: bytes) -> bool:
        return key in self._chunks

    def find_prefix(self, chunks: Sequence[Sequence[bytes]], ns: bytes | None = None) -> list[tuple[ChunkMeta, int]]:
        with self._lock:
            return self._index.run(chunks)

    def remove(self, key: bytes, reason: str = "removed") -> bool:
        with self._lock:
            held = self._chunks.pop(key, None)
            if held is None:
                return False
            self._index.remove(held[0], key, held[0].aliases)
            self._used -= held[0].size
        self.report(Removed(self.name, held[0].ns, key, reason))
        return True

    def clear(self, ns: bytes | None = None) -> Cleared:
        with self._lock:
            gone = [meta for meta, _ in self._chunks.values() if ns is None or meta.ns == ns]
            for meta in gone:
                del self._chunks[meta.key]
                self._index.remove(meta, meta.key, meta.aliases)
                self._used -= meta.size
        self.report(ClearedEvent(self.name, ns))
        return Cleared(len(gone), sum(m.size for m in gone))

    def scan(self) -> int:
        return 0

    def held(self) -> list[Stored]:
        with self._lock:
            return [Stored(self.name, m.ns, m.key, m.blocks, m.aliases, m.size) for m, _ in self._chunks.values()]

    def stats(self) -> dict:
        return {"fake_puts": self.puts, "fake_reads": self.reads}


def make(arg: str, metrics: Metrics) -> FakeTier:
    """The factory --extra-tiers names: `arg` is the capacity in bytes (default 64 MiB)."""
    tier = FakeTier(int(arg) if arg else 64 << 20)
    tier.m = TierMetrics(metrics, tier.name, "Fake")
    return tier
