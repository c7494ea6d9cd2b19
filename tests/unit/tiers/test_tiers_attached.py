"""A lower tier attached to L1 (tiers/attached.py through cache.py, no serving loop, no server process):
write-behind holds a reader until the copy is written, promotion after a restart, a corrupt chunk ends the
promoted run, the tier's "not known yet" answer and another namespace's chunk, and its metrics."""

from __future__ import annotations

import numpy as np
import pytest
from kvtier.server import protocol as p
from kvtier.server.cache import Cache
from kvtier.server.config import ServerConfig
from kvtier.server.eviction import make_policy
from kvtier.server.keys import Namespace, chunk_keys, digest
from kvtier.server.l1.holds import Holds
from kvtier.server.l1.pool import PagePool
from kvtier.server.l1.store import L1Store
from kvtier.server.metrics import Metrics, TierMetrics
from kvtier.server.tier_setup import make_tiers
from kvtier.server.tiers import fs_io as fmt
from kvtier.server.tiers.attached import AttachedTier
from kvtier.server.tiers.fs import FsTier
from kvtier.server.tiers.record import ChunkMeta

pytestmark = pytest.mark.unit

NS = Namespace(model="m", dtype="bf16", num_layers=2, kv_heads=2, head_size=8, block_size=64,
               layout="NHD", chunk_size=256)
PAGE = 1024
MIN_BLOCK_BYTES = 256  # a test page stands for a 64 KiB one: at most 4 blocks per page


def meta(i: int, size: int = 3000) -> ChunkMeta:
    return ChunkMeta(digest(b"k%d" % i), digest(b"ns"), 4, (digest(b"a%d/1" % i), digest(b"a%d/2" % i)), size)


def payload(i: int, size: int = 3000) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


class L1:
    """An L1 store, its holds and segment, and the cache over them with the tiers given to `attach`."""

    def __init__(self, num_pages: int = 64) -> None:
        self.metrics = Metrics()
        self.store = L1Store(PagePool(num_pages, PAGE), make_policy("lru"), self.metrics,
                             min_block_bytes=MIN_BLOCK_BYTES)
        self.holds = Holds(self.store, self.metrics)
        self.segment = np.zeros(num_pages * PAGE, dtype=np.uint8)
        self.cache = Cache(self.store, self.holds, self.metrics)

    def attach(self, tier: AttachedTier) -> AttachedTier:
        self.cache.tiers.append(tier)
        tier.open()
        return tier

    def filesystem(self, path, capacity_bytes: int, queue_depth: int) -> AttachedTier:
        """The filesystem tier as the daemon configures it (make_tiers), opened."""
        config = ServerConfig(l2_path=str(path), l2_size_gb=capacity_bytes / (1 << 30), l2_queue_depth=queue_depth)
        [tier] = make_tiers(config, self.store, self.segment, self.metrics)
        assert tier.tier.capacity_bytes == capacity_bytes
        return self.attach(tier)

    def close(self) -> None:
        self.cache.close()


def put_chunks(l1: L1, fp: bytes, chunks, size: int) -> None:
    l1.holds.hello(b"c", "t", 1)
    owner = l1.holds.client(b"c")
    items = [p.StoreItem(c.key, size, len(c.block_keys), c.aliases) for c in chunks]
    res = l1.holds.reserve(owner, fp, items)
    for c, r in zip(chunks, res, strict=True):
        assert r[0] == p.RESERVED
        ext = r[2]
        data = np.frombuffer(payload(c.index, size), dtype=np.uint8)
        off = 0
        for i in range(0, len(ext), 2):
            n = min(ext[i + 1] * PAGE, size - off)
            l1.segment[ext[i] * PAGE: ext[i] * PAGE + n] = data[off: off + n]
            off += n
    l1.cache.commit(owner, [r[1] for r in res])


def test_commit_hook_holds_reader_until_written_then_promotes_after_restart(tmp_path):
    l1 = L1()
    store = l1.store
    l2 = l1.filesystem(tmp_path, 1 << 30, 16)
    l2.writer.stop()  # no worker thread: jobs run in this thread via run_pending
    l2.writer._stopping = False
    fp = l1.holds.register(NS)
    chunks = chunk_keys(NS, list(range(3 * 256)))
    size = 2500  # three pages
    put_chunks(l1, fp, chunks, size)
    assert all(store.entries[c.key].readers == 1 for c in chunks)
    assert store.evictable_pages == 0  # held by the pending L2 copies
    l2.writer.run_pending()
    assert all(store.entries[c.key].readers == 0 for c in chunks) and store.evictable_pages == 9
    assert l2.stats()["l2_written"] == 3 and l1.cache.status()["l2_written"] == 3

    # "Restart": a fresh store and segment over the same directory.
    again = L1()
    store2, segment2, metrics2 = again.store, again.segment, again.metrics
    l2b = again.filesystem(tmp_path, 1 << 30, 16)
    try:
        fp2 = again.holds.register(NS)
        block_lists = [list(c.block_keys) for c in chunks]
        assert store2.lookup(fp2, block_lists) == []  # nothing in L1
        found = again.cache.lookup(fp2, block_lists)
        hits = found.hits
        assert found.tiers == ["l2"] * 3 and [m for _, m in hits] == [4, 4, 4]
        for c, (entry, _) in zip(chunks, hits, strict=True):
            got = np.concatenate([segment2[entry.extents[i] * PAGE:(entry.extents[i] + entry.extents[i + 1]) * PAGE]
                                  for i in range(0, len(entry.extents), 2)])[:size]
            assert got.tobytes() == payload(c.index, size)
            assert store2.index.get(c.key)[0] is entry and entry.readers == 0
        assert store2.evictable_pages == 9
        assert metrics2.hit_tokens.labels("l2")._value.get() == 3 * 4 * NS.block_size
        # Promoted entries are L1 entries now, and not queued back to L2.
        assert [m for _, m in store2.lookup(fp2, block_lists)] == [4, 4, 4]
        assert l2b.writer.inflight == 0
    finally:
        again.close()
        l1.close()


def test_promotion_stops_at_a_corrupt_chunk(tmp_path):
    tier = FsTier(str(tmp_path), 1 << 30)
    fp = NS.fingerprint()
    chunks = chunk_keys(NS, list(range(2 * 256)))
    for c in chunks:
        tier.put(ChunkMeta(c.key, fp, len(c.block_keys), c.aliases, 2000), payload(c.index, 2000))
    path = tmp_path / fmt.file_name(chunks[1].key)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    l1 = L1()
    store, metrics = l1.store, l1.metrics
    l2 = l1.filesystem(tmp_path, 1 << 30, 16)
    try:
        l1.holds.register(NS)
        found = l1.cache.lookup(fp, [list(c.block_keys) for c in chunks])
        assert found.tiers == ["l2"] and len(store.entries) == 1
        assert store.pool.used_pages == 2  # the corrupt chunk's pages went back
        assert l2.stats()["l2_corrupt_chunks"] == 1 and not path.exists()
        assert metrics.registry.get_sample_value("kvtier_l2_corrupt_chunks_total") == 1
        assert metrics.registry.get_sample_value("kvtier_l2_used_bytes") == l2.tier.used_bytes > 0
    finally:
        l1.close()


def test_lookup_treats_an_unknown_answer_as_no_hit_and_stops_at_another_namespace(tmp_path):
    """The cache asks the tier once per lookup: None ("not known yet") is no hit now; a chunk of another
    namespace in the run ends the hits there."""

    class NotYet(FsTier):
        def find_prefix(self, chunks, ns=None):
            return None

    fp = NS.fingerprint()
    chunks = chunk_keys(NS, list(range(3 * 256)))
    lists = [list(c.block_keys) for c in chunks]
    tier = FsTier(str(tmp_path / "l2"), 1 << 30)
    for c in chunks:
        ns = fp if c.index != 1 else digest(b"another namespace")
        assert tier.put(ChunkMeta(c.key, ns, len(c.block_keys), c.aliases, 2000), payload(c.index, 2000))
    for cls, expected in ((NotYet, []), (FsTier, ["l2"])):
        l1 = L1()
        l1.attach(AttachedTier(l1.store, l1.segment, cls(str(tmp_path / "l2"), 1 << 30), 16, l1.metrics,
                               TierMetrics(l1.metrics, "l2")))
        try:
            l1.holds.register(NS)
            found = l1.cache.lookup(fp, lists)
            assert found.tiers == expected and len(found.hits) == len(expected)
        finally:
            l1.close()


def test_l2_metrics_are_exported(tmp_path):
    from prometheus_client import generate_latest

    l1 = L1()
    store, metrics = l1.store, l1.metrics
    l2 = l1.filesystem(tmp_path, 10 * meta(0).file_bytes, 1)
    l2.writer.stop()
    l2.writer._stopping = False
    fp = l1.holds.register(NS)
    put_chunks(l1, fp, chunk_keys(NS, list(range(2 * 256))), 2000)  # queue of 1: one dropped
    assert l2.stats()["l2_dropped_writes"] == 1 and store.evictable_pages == 2  # the dropped one is free
    l2.writer.run_pending()
    text = generate_latest(metrics.registry).decode()
    for name in ("kvtier_l2_used_bytes", "kvtier_l2_capacity_bytes", "kvtier_l2_queue_depth",
                 "kvtier_l2_dropped_writes_total 1.0", "kvtier_l2_corrupt_chunks_total 0.0",
                 'kvtier_hit_tokens_total{tier="l2"}', 'kvtier_evictions_total{reason="capacity",tier="l2"}',
                 'kvtier_entries{tier="l2"} 1.0'):
        assert name in text, name
    assert metrics.registry.get_sample_value("kvtier_l2_capacity_bytes") == 10 * meta(0).file_bytes
    l1.close()


def test_a_lookup_goes_on_from_one_lower_tier_into_the_next(tmp_path):
    """Tiers are asked in order: the prefix continues in the second tier where the first one's run ends,
    each hit reports its tier, and every promoted chunk is read bit-exact into L1."""

    class Third(FsTier):
        name = "l3"

    fp = NS.fingerprint()
    chunks = chunk_keys(NS, list(range(3 * 256)))
    first, second = FsTier(str(tmp_path / "a"), 1 << 30), Third(str(tmp_path / "b"), 1 << 30)
    for c in chunks:
        tier = first if c.index == 0 else second
        assert tier.put(ChunkMeta(c.key, fp, len(c.block_keys), c.aliases, 2000), payload(c.index, 2000))
    l1 = L1()
    for tier, metrics in ((first, l1.metrics), (second, Metrics())):  # kvtier_l2_* gauges: one set per registry
        l1.attach(AttachedTier(l1.store, l1.segment, type(tier)(tier.path, 1 << 30), 16, l1.metrics,
                               TierMetrics(metrics, "l2")))
    try:
        l1.holds.register(NS)
        found = l1.cache.lookup(fp, [list(c.block_keys) for c in chunks])
        assert found.tiers == ["l2", "l3", "l3"] and [m for _, m in found.hits] == [4, 4, 4]
        for c, (entry, _) in zip(chunks, found.hits, strict=True):
            got = np.concatenate([l1.segment[entry.extents[i] * PAGE:(entry.extents[i] + entry.extents[i + 1]) * PAGE]
                                  for i in range(0, len(entry.extents), 2)])[:2000]
            assert got.tobytes() == payload(c.index, 2000)
        assert l1.metrics.hit_tokens.labels("l3")._value.get() == 2 * 4 * NS.block_size
        assert l1.metrics.hit_tokens.labels("l2")._value.get() == 4 * NS.block_size
    finally:
        l1.close()
