"""What the filesystem tier reports through the event seam (server/events.py): a put it indexed is a Stored, an
eviction, a removal and a corrupt file found by a read are Removed with their reason, a clear is one Cleared;
`held` lists the index (the feed's snapshot)."""

from __future__ import annotations

import numpy as np
import pytest
from kvtier.server.events import Bus, Cleared, Removed, Stored
from kvtier.server.keys import digest
from kvtier.server.tiers import fs_io
from kvtier.server.tiers.fs import FsTier
from kvtier.server.tiers.record import ChunkMeta

pytestmark = pytest.mark.unit

NS = digest(b"ns")


def meta(i: int, size: int = 3000) -> ChunkMeta:
    return ChunkMeta(digest(b"k%d" % i), NS, 4, (digest(b"a%d/1" % i),), size)


def payload(i: int, size: int = 3000) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def stored(m: ChunkMeta) -> Stored:
    return Stored("l2", m.ns, m.key, m.blocks, m.aliases, m.size)


def test_fs_tier_reports_puts_evictions_removals_corruption_and_clears(tmp_path) -> None:
    ms = [meta(i) for i in range(4)]
    tier = FsTier(str(tmp_path), capacity_bytes=2 * ms[0].file_bytes)  # room for two chunks
    bus = Bus()
    sub = bus.subscribe(depth=100)
    tier.report = bus.post  # type: ignore[method-assign]  # as the cache does
    assert tier.put(ms[0], payload(0)) and tier.put(ms[1], payload(1))
    assert not tier.put(ms[1], payload(1))  # there already: nothing new
    assert tier.put(ms[2], payload(2))  # evicts ms[0] (LRU)
    assert sub.take(100, 0) == [stored(ms[0]), stored(ms[1]), Removed("l2", NS, ms[0].key, "capacity"),
                                stored(ms[2])]
    assert sorted(e.key for e in tier.held()) == sorted([ms[1].key, ms[2].key])
    assert tier.remove(ms[1].key) and not tier.remove(ms[1].key)
    with open(tmp_path / fs_io.file_name(ms[2].key), "r+b") as fh:  # damage the payload
        fh.seek(ms[2].data_offset + 5)
        fh.write(b"\xff\xff\xff")
    assert not tier.get(ms[2], [memoryview(bytearray(ms[2].size))])
    assert sub.take(100, 0) == [Removed("l2", NS, ms[1].key, "removed"), Removed("l2", NS, ms[2].key, "corrupt")]
    assert tier.put(ms[3], payload(3))
    tier.clear(NS)
    assert sub.take(100, 0) == [stored(ms[3]), Cleared("l2", NS)]
    assert tier.held() == []
