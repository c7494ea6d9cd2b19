"""L2 file format, filesystem tier, write-behind queue and the L1 <-> L2 glue (no server process)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from kvtier.server import l2_format as fmt
from kvtier.server import protocol as p
from kvtier.server.chunk_store import ChunkStore
from kvtier.server.config import ServerConfig, add_arguments, from_args
from kvtier.server.eviction import make_policy
from kvtier.server.keys import Namespace, chunk_keys, digest
from kvtier.server.l1_pool import PagePool
from kvtier.server.l2_format import ChunkMeta, CorruptChunk
from kvtier.server.l2_service import L2Service
from kvtier.server.l2_tier import FsTier
from kvtier.server.l2_writer import L2Writer, WriteJob
from kvtier.server.metrics import Metrics

pytestmark = pytest.mark.unit

NS = Namespace(model="m", dtype="bf16", num_layers=2, kv_heads=2, head_size=8, block_size=64,
               layout="NHD", chunk_size=256)
PAGE = 1024
MIN_BLOCK_BYTES = 256  # a test page stands for a 64 KiB one: at most 4 blocks per page


def meta(i: int, size: int = 3000) -> ChunkMeta:
    return ChunkMeta(digest(b"k%d" % i), digest(b"ns"), 4, (digest(b"a%d/1" % i), digest(b"a%d/2" % i)), size)


def payload(i: int, size: int = 3000) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def read_back(tier: FsTier, m: ChunkMeta) -> bytes | None:
    buf = bytearray(m.size)
    return bytes(buf) if tier.get(m, [memoryview(buf)]) else None


def test_format_round_trip_and_split_buffers(tmp_path):
    m = meta(1)
    path = fmt.write_file(str(tmp_path), m, payload(1))
    assert os.path.basename(path) == fmt.file_name(m.key)
    assert fmt.read_meta(path) == m
    a, b = bytearray(1000), bytearray(2000)
    fmt.read_payload(path, m, [memoryview(a), memoryview(b)])
    assert bytes(a + b) == payload(1)
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    assert fmt.TEMP_RE.match(fmt.temp_name(m.key)) and not fmt.NAME_RE.match(fmt.temp_name(m.key))


@pytest.mark.parametrize("where", ["payload", "header", "checksum"])
def test_flipped_bytes_are_detected(tmp_path, where):
    m = meta(2)
    path = fmt.write_file(str(tmp_path), m, payload(2))
    offset = {"payload": m.data_offset + 17, "header": 21, "checksum": m.header_len - 3}[where]
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(CorruptChunk):
        fmt.read_meta(path)  # header fields are crc-guarded
        fmt.read_payload(path, m, [memoryview(bytearray(m.size))])


def test_tier_put_find_get_and_lru_capacity(tmp_path):
    per_file = meta(0).file_bytes
    evicted = []
    tier = FsTier(str(tmp_path), 3 * per_file, on_evict=evicted.append)
    for i in range(3):
        assert tier.put(meta(i), payload(i))
    assert not tier.put(meta(0), payload(0))  # exists; touches it
    assert tier.find([meta(1).aliases[0], b"x" * 16]) == (meta(1), 1)
    assert tier.find([b"y" * 16, meta(2).aliases[1], meta(2).key]) == (meta(2), 4)
    assert tier.put(meta(3), payload(3))  # evicts the LRU: chunk 1
    assert evicted == ["capacity"] and not tier.contains(meta(1).key) and tier.find([meta(1).key]) is None
    assert tier.used_bytes == 3 * per_file <= tier.capacity_bytes
    assert read_back(tier, meta(3)) == payload(3)
    tier.sync()
    assert tier.written == 4
    assert sorted(os.listdir(tmp_path)) == sorted(fmt.file_name(meta(i).key) for i in (0, 2, 3))


def test_scan_rebuilds_and_drops_corrupt_temp_ignores_foreign(tmp_path):
    corrupt = []
    tier = FsTier(str(tmp_path), 1 << 30)
    for i in range(5):
        tier.put(meta(i), payload(i))
    d = tmp_path
    os.truncate(d / fmt.file_name(meta(0).key), 10)
    (d / fmt.file_name(meta(1).key)).write_bytes(b"")
    (d / f".{meta(2).key.hex()}.tmp-123").write_bytes(b"partial")
    (d / "foreign.bin").write_bytes(b"hello")
    (d / "sub").mkdir()
    os.symlink(d / fmt.file_name(meta(3).key), d / fmt.file_name(meta(9).key))
    again = FsTier(str(tmp_path), 1 << 30, on_corrupt=lambda: corrupt.append(1), progress_every=2)
    assert again.scan() == 3
    assert len(corrupt) == 2 and again.temp_removed == 1
    assert {k for k in (meta(i).key for i in range(10)) if again.contains(k)} == {meta(i).key for i in (2, 3, 4)}
    assert again.used_bytes == 3 * meta(0).file_bytes
    assert (d / "foreign.bin").exists() and (d / "sub").is_dir() and (d / fmt.file_name(meta(9).key)).is_symlink()
    assert read_back(again, meta(4)) == payload(4)
    # A payload flip is caught on load: counted, removed, a miss.
    path = d / fmt.file_name(meta(4).key)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    assert read_back(again, meta(4)) is None
    assert len(corrupt) == 3 and not path.exists() and not again.contains(meta(4).key)


def test_scan_shrinks_to_a_smaller_budget(tmp_path):
    tier = FsTier(str(tmp_path), 1 << 30)
    for i in range(4):
        tier.put(meta(i), payload(i))
    small = FsTier(str(tmp_path), 2 * meta(0).file_bytes)
    assert small.scan() == 2 and small.used_bytes <= small.capacity_bytes
    assert len(os.listdir(tmp_path)) == 2


def test_writer_drops_when_full_and_always_releases(tmp_path):
    tier = FsTier(str(tmp_path), 1 << 30)
    drops, released = [], []
    writer = L2Writer(tier, 2, on_drop=lambda: drops.append(1))
    jobs = [WriteJob(meta(i), (lambda i=i: [payload(i)]), (lambda i=i: released.append(i))) for i in range(3)]
    assert writer.submit(jobs[0]) and writer.submit(jobs[1])
    assert not writer.submit(jobs[2])
    assert drops == [1] and writer.dropped == 1 and writer.inflight == 2

    def boom():
        raise RuntimeError("copy failed")

    assert writer.run_pending() == 2 and released == [0, 1] and tier.written == 2
    writer.submit(WriteJob(meta(5), boom, lambda: released.append(5)))
    writer.run_pending()
    assert released == [0, 1, 5] and writer.failed == 1 and writer.inflight == 0


def make_store(num_pages: int = 64) -> tuple[ChunkStore, np.ndarray, Metrics]:
    metrics = Metrics()
    store = ChunkStore(PagePool(num_pages, PAGE), make_policy("lru"), metrics, min_block_bytes=MIN_BLOCK_BYTES)
    return store, np.zeros(num_pages * PAGE, dtype=np.uint8), metrics


def put_chunks(store: ChunkStore, segment: np.ndarray, fp: bytes, chunks, size: int) -> None:
    store.hello(b"c", "t", 1)
    owner = store.client(b"c")
    items = [p.StoreItem(c.key, size, len(c.block_keys), c.aliases) for c in chunks]
    res = store.reserve(owner, fp, items)
    for c, r in zip(chunks, res, strict=True):
        assert r[0] == p.RESERVED
        ext = r[2]
        data = np.frombuffer(payload(c.index, size), dtype=np.uint8)
        off = 0
        for i in range(0, len(ext), 2):
            n = min(ext[i + 1] * PAGE, size - off)
            segment[ext[i] * PAGE: ext[i] * PAGE + n] = data[off: off + n]
            off += n
    store.commit(owner, [r[1] for r in res])


def test_commit_hook_holds_reader_until_written_then_promotes_after_restart(tmp_path):
    store, segment, metrics = make_store()
    l2 = L2Service.filesystem(store, segment, str(tmp_path), 1 << 30, 16, metrics)
    l2.open()
    l2.writer.stop()  # no worker thread: jobs run in this thread via run_pending
    l2.writer._stopping = False
    fp = store.register(NS)
    chunks = chunk_keys(NS, list(range(3 * 256)))
    size = 2500  # three pages
    put_chunks(store, segment, fp, chunks, size)
    assert all(store.entries[c.key].readers == 1 for c in chunks)
    assert store.evictable_pages == 0  # held by the pending L2 copies
    l2.writer.run_pending()
    assert all(store.entries[c.key].readers == 0 for c in chunks) and store.evictable_pages == 9
    assert l2.stats()["l2_written"] == 3

    # "Restart": a fresh store and segment over the same directory.
    store2, segment2, metrics2 = make_store()
    l2b = L2Service.filesystem(store2, segment2, str(tmp_path), 1 << 30, 16, metrics2)
    l2b.open()
    try:
        fp2 = store2.register(NS)
        block_lists = [list(c.block_keys) for c in chunks]
        hits = store2.lookup(fp2, block_lists)
        assert hits == []
        hits, tiers = l2b.extend_lookup(fp2, block_lists, hits)
        assert tiers == ["l2"] * 3 and [m for _, m in hits] == [4, 4, 4]
        for c, (entry, _) in zip(chunks, hits, strict=True):
            got = np.concatenate([segment2[entry.extents[i] * PAGE:(entry.extents[i] + entry.extents[i + 1]) * PAGE]
                                  for i in range(0, len(entry.extents), 2)])[:size]
            assert got.tobytes() == payload(c.index, size)
            assert store2.index[c.key][0] is entry and entry.readers == 0
        assert store2.evictable_pages == 9
        assert metrics2.hit_tokens.labels("l2")._value.get() == 3 * 4 * NS.block_size
        # Promoted entries are L1 entries now, and not queued back to L2.
        assert [m for _, m in store2.lookup(fp2, block_lists)] == [4, 4, 4]
        assert l2b.writer.inflight == 0
    finally:
        l2b.close()


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
    store, segment, metrics = make_store()
    l2 = L2Service.filesystem(store, segment, str(tmp_path), 1 << 30, 16, metrics)
    l2.open()
    try:
        store.register(NS)
        hits, tiers = l2.extend_lookup(fp, [list(c.block_keys) for c in chunks], [])
        assert tiers == ["l2"] and len(store.entries) == 1
        assert store.pool.used_pages == 2  # the corrupt chunk's pages went back
        assert l2.stats()["l2_corrupt_chunks"] == 1 and not path.exists()
        assert metrics.registry.get_sample_value("kvtier_l2_corrupt_chunks_total") == 1
        assert metrics.registry.get_sample_value("kvtier_l2_used_bytes") == l2.tier.used_bytes > 0
    finally:
        l2.close()


def test_l2_config_flags():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = from_args(parser.parse_args(["--l2-path", "/tmp/x", "--l2-size-gb", "2", "--l2-odirect",
                                       "--l2-queue-depth", "7"]), environ={})
    assert (cfg.l2_path, cfg.l2_bytes, cfg.l2_odirect, cfg.l2_queue_depth) == ("/tmp/x", 2 << 30, True, 7)
    assert from_args(parser.parse_args([]), environ={"KVTIER_L2_ODIRECT": "1"}).l2_odirect is True
    assert from_args(parser.parse_args(["--no-l2-odirect"]), environ={"KVTIER_L2_ODIRECT": "1"}).l2_odirect is False
    assert from_args(parser.parse_args([]), environ={"KVTIER_L2_ODIRECT": "0"}).l2_odirect is False
    with pytest.raises(ValueError):
        from_args(parser.parse_args([]), environ={"KVTIER_L2_ODIRECT": "maybe"})
    assert ServerConfig().l2_path == ""


def test_l2_metrics_are_exported(tmp_path):
    from prometheus_client import generate_latest

    store, segment, metrics = make_store()
    l2 = L2Service.filesystem(store, segment, str(tmp_path), 10 * meta(0).file_bytes, 1, metrics)
    l2.open()
    l2.writer.stop()
    l2.writer._stopping = False
    fp = store.register(NS)
    put_chunks(store, segment, fp, chunk_keys(NS, list(range(2 * 256))), 2000)  # queue of 1: one dropped
    assert l2.stats()["l2_dropped_writes"] == 1 and store.evictable_pages == 2  # the dropped one is free
    l2.writer.run_pending()
    text = generate_latest(metrics.registry).decode()
    for name in ("kvtier_l2_used_bytes", "kvtier_l2_capacity_bytes", "kvtier_l2_queue_depth",
                 "kvtier_l2_dropped_writes_total 1.0", "kvtier_l2_corrupt_chunks_total 0.0",
                 'kvtier_hit_tokens_total{tier="l2"}', 'kvtier_evictions_total{reason="capacity",tier="l2"}',
                 'kvtier_entries{tier="l2"} 1.0'):
        assert name in text, name
    assert metrics.registry.get_sample_value("kvtier_l2_capacity_bytes") == 10 * meta(0).file_bytes
