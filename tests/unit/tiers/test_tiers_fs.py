"""The filesystem tier (tiers/fs.py, tiers/fs_io.py): the file format, put/find/get, the start-up scan, its
budget and policy, and the write-behind queue over it (no L1, no server process). The L1 <-> tier glue is in
test_tiers_attached.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
from kvtier.server.config import ServerConfig, add_arguments, from_args
from kvtier.server.eviction import make_policy
from kvtier.server.keys import digest
from kvtier.server.tiers import fs_io as fmt
from kvtier.server.tiers.fs import FsTier
from kvtier.server.tiers.record import ChunkMeta, CorruptChunk
from kvtier.server.tiers.writer import L2Writer, WriteJob

pytestmark = pytest.mark.unit


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


def test_tier_put_find_prefix_get_and_lru_capacity(tmp_path):
    per_file = meta(0).file_bytes
    evicted = []
    tier = FsTier(str(tmp_path), 3 * per_file, on_evict=evicted.append)
    for i in range(3):
        assert tier.put(meta(i), payload(i))
    assert not tier.put(meta(0), payload(0))  # exists; touches it
    assert tier.find_prefix([[meta(1).aliases[0], b"x" * 16]]) == [(meta(1), 1)]
    assert tier.find_prefix([[b"y" * 16, meta(2).aliases[1], meta(2).key]]) == [(meta(2), 4)]
    assert tier.put(meta(3), payload(3))  # evicts the LRU: chunk 1
    assert evicted == ["capacity"] and not tier.contains(meta(1).key) and tier.find_prefix([[meta(1).key]]) == []
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


def run_of(i: int, ns: bytes = b"ns", blocks: int = 3) -> tuple[ChunkMeta, list[bytes]]:
    """A chunk of `blocks` blocks and its block-prefix keys (the last is the chunk's own key)."""
    keys = [digest(b"run%d/%d" % (i, j)) for j in range(1, blocks + 1)]
    return ChunkMeta(keys[-1], digest(ns), blocks, tuple(keys[:-1]), 3000), keys


def test_find_prefix_returns_the_run_of_held_chunks(tmp_path):
    """From the first chunk: every held chunk with its matched blocks, up to the first chunk not held, and
    through the first partial match; another namespace's chunk is returned too (the caller checks `ns`)."""
    tier = FsTier(str(tmp_path), 1 << 20)
    (m0, k0), (m1, k1), (_, k2), (m3, k3) = (run_of(i) for i in range(4))
    other, k_other = run_of(9, ns=b"other")
    for i, m in enumerate((m0, m1, m3, other)):
        assert tier.put(m, payload(i))
    assert tier.find_prefix([k0, k1]) == [(m0, 3), (m1, 3)]  # several chunks
    assert tier.find_prefix([k0, k1, k2, k3]) == [(m0, 3), (m1, 3)]  # stops at the missing chunk 2
    partial = [k1[0], k1[1], digest(b"another question")]
    assert tier.find_prefix([k0, partial, k3]) == [(m0, 3), (m1, 2)]  # stops after the partial match
    assert tier.find_prefix([k0, k_other, k3]) == [(m0, 3), (other, 3), (m3, 3)]  # not filtered by namespace
    assert tier.find_prefix([k2, k0]) == [] and tier.find_prefix([]) == []


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


def shared_lead(question: int) -> ChunkMeta:
    """A 2-block chunk: a document's first block (shared), then a question's block."""
    return ChunkMeta(digest(b"q%d" % question), digest(b"ns"), 2, (digest(b"doc/1"),), 3000)


@pytest.mark.parametrize("restart", [False, True])
def test_shared_leading_blocks_stay_findable_after_one_holder_goes(tmp_path, restart):
    """Two chunks in L2 share a document's leading block; removing the one the alias points at leaves the
    block findable through the other (as in L1), also when the index was rebuilt by a restart's scan."""
    tier = FsTier(str(tmp_path), 1 << 20)
    a, b = shared_lead(1), shared_lead(2)
    assert tier.put(a, payload(1)) and tier.put(b, payload(2))
    if restart:
        tier = FsTier(str(tmp_path), 1 << 20)
        assert tier.scan() == 2
    other_question = [digest(b"doc/1"), digest(b"q9")]
    [(first, _)] = tier.find_prefix([other_question])
    assert tier.remove(first.key)
    [found] = tier.find_prefix([other_question])
    assert found[1] == 1 and found[0].key != first.key
    assert read_back(tier, found[0]) == payload(2 if found[0].key == b.key else 1)
    assert tier.remove(found[0].key) and tier.find_prefix([other_question]) == []


def test_disk_tier_victims_and_admission_come_from_its_policy(tmp_path):
    class KeepFirst(type(make_policy("lru"))):  # type: ignore[misc]
        name = "keep-first"

        def admit(self, key, size, evictable):  # type: ignore[no-untyped-def]
            return False

    m1, m2 = meta(11), meta(12)
    tier = FsTier(str(tmp_path), m1.file_bytes + 100, policy=KeepFirst())
    assert tier.put(m1, payload(11))
    assert not tier.put(m2, payload(12))  # the policy keeps what the full tier holds
    assert tier.contains(m1.key) and not tier.contains(m2.key)
    lru = FsTier(str(tmp_path / "lru"), m1.file_bytes + 100, policy=make_policy("lru"))
    assert lru.put(m1, payload(11)) and lru.put(m2, payload(12))  # LRU evicts m1 for m2
    assert not lru.contains(m1.key) and lru.contains(m2.key)
