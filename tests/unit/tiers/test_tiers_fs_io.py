"""L2 file I/O: the aligned layout, O_DIRECT and its fallback, cross-mode readability, corruption in the
padding, writes straight from the sources, and the two-stage write pipeline."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import struct
import threading
import time

import numpy as np
import pytest
from kvtier.server.keys import digest
from kvtier.server.tiers import fs_io as fmt
from kvtier.server.tiers.base import Cleared
from kvtier.server.tiers.fs import FsTier
from kvtier.server.tiers.record import ALIGN, ChunkMeta, CorruptChunk
from kvtier.server.tiers.writer import L2Writer, WriteJob

pytestmark = pytest.mark.unit

SIZES = [3000, 2 * ALIGN, 3 * ALIGN + 1]


def meta(i: int, size: int, aliases: int = 2) -> ChunkMeta:
    return ChunkMeta(digest(b"k%d" % i), digest(b"ns"), aliases + 2,
                     tuple(digest(b"a%d/%d" % (i, j)) for j in range(aliases)), size)


def payload(i: int, size: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def aligned_bufs(size: int) -> list[memoryview]:
    """Two L1-like extents: page-aligned, the first a whole number of blocks."""
    first = (size // 2) // ALIGN * ALIGN
    return [memoryview(mmap.mmap(-1, n))[:n] for n in (first, size - first) if n]


def odirect_tier(path, capacity: int = 1 << 30) -> FsTier:
    tier = FsTier(str(path), capacity, odirect=True)
    if not tier.odirect_active:
        pytest.skip(f"{path} does not take O_DIRECT")
    return tier


def read_back(tier: FsTier, m: ChunkMeta, bufs: list[memoryview] | None = None) -> bytes | None:
    bufs = bufs if bufs is not None else [memoryview(bytearray(m.size))]
    return b"".join(bytes(b) for b in bufs) if tier.get(m, bufs) else None


@pytest.mark.parametrize("size", SIZES)
def test_layout_is_aligned(tmp_path, size):
    m = meta(1, size)
    path = fmt.write_file(str(tmp_path), m, payload(1, size))
    with open(path, "rb") as fh:
        raw = fh.read()
    assert len(raw) == m.file_bytes and m.file_bytes % ALIGN == 0 and m.data_offset % ALIGN == 0
    assert raw[m.data_offset : m.data_offset + size] == payload(1, size)
    assert not raw[m.header_len : m.data_offset].strip(b"\0") and not raw[m.data_offset + size :].strip(b"\0")
    assert fmt.read_meta(path) == m


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("aligned", [True, False])
def test_odirect_round_trip(tmp_path, size, aligned):
    tier = odirect_tier(tmp_path)
    m = meta(2, size)
    assert tier.put(m, payload(2, size))
    bufs = aligned_bufs(size) if aligned else [memoryview(bytearray(5)), memoryview(bytearray(size - 5))]
    assert read_back(tier, m, bufs) == payload(2, size)
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_large_header_spans_blocks(tmp_path):
    m = meta(3, 5000, aliases=300)
    assert m.header_len > ALIGN and m.data_offset == 2 * ALIGN
    tier = odirect_tier(tmp_path)
    assert tier.put(m, payload(3, 5000))
    again = FsTier(str(tmp_path), 1 << 30, odirect=True)
    assert again.scan() == 1 and read_back(again, m, aligned_bufs(5000)) == payload(3, 5000)


def test_fallback_when_odirect_is_refused(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *a):  # noqa: ANN001, ANN202 - os.open's signature
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(fmt.os, "open", no_direct)
    with caplog.at_level(logging.WARNING, logger="kvtier.server.l2"):
        tier = FsTier(str(tmp_path), 1 << 30, odirect=True)
    assert tier.odirect and not tier.odirect_active
    assert sum("O_DIRECT" in r.getMessage() for r in caplog.records) == 1
    m = meta(4, 3000)
    assert tier.put(m, payload(4, 3000)) and read_back(tier, m, aligned_bufs(3000)) == payload(4, 3000)
    assert os.listdir(tmp_path) == [fmt.file_name(m.key)]  # the probe left nothing behind


def test_tmpfs_probe_is_consistent():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    tier = FsTier(f"/dev/shm/kvtier-test-{os.getpid()}", 1 << 20, odirect=True)
    try:  # tmpfs refuses O_DIRECT on older kernels and takes it on newer ones: either way it works
        m = meta(5, 3000)
        assert tier.put(m, payload(5, 3000)) and read_back(tier, m) == payload(5, 3000)
    finally:
        for name in os.listdir(tier.path):
            os.unlink(os.path.join(tier.path, name))
        os.rmdir(tier.path)


@pytest.mark.parametrize(("write_direct", "read_direct"), [(False, True), (True, False)])
def test_files_are_readable_in_both_modes(tmp_path, write_direct, read_direct):
    writer = odirect_tier(tmp_path) if write_direct else FsTier(str(tmp_path), 1 << 30)
    for i, size in enumerate(SIZES):
        assert writer.put(meta(i, size), payload(i, size))
    writer.sync()
    reader = odirect_tier(tmp_path) if read_direct else FsTier(str(tmp_path), 1 << 30)
    assert reader.scan() == len(SIZES)
    for i, size in enumerate(SIZES):
        assert read_back(reader, meta(i, size), aligned_bufs(size)) == payload(i, size)


def test_both_modes_write_the_same_bytes(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    m = meta(6, 3 * ALIGN + 1)
    a.mkdir()
    fmt.write_file(str(a), m, payload(6, m.size), odirect=False)
    odirect_tier(b)  # creates b; skips where O_DIRECT is refused
    fmt.write_file(str(b), m, payload(6, m.size), odirect=True)
    assert (a / fmt.file_name(m.key)).read_bytes() == (b / fmt.file_name(m.key)).read_bytes()


@pytest.mark.parametrize("odirect", [False, True])
@pytest.mark.parametrize("where", ["payload", "last payload byte", "header padding", "tail padding", "checksum"])
def test_corruption_in_the_aligned_layout(tmp_path, odirect, where):
    corrupt = []
    tier = odirect_tier(tmp_path) if odirect else FsTier(str(tmp_path), 1 << 30)
    tier._on_corrupt = lambda: corrupt.append(1)
    m = meta(7, 3 * ALIGN + 1)
    assert tier.put(m, payload(7, m.size))
    offset = {"payload": m.data_offset + 100, "last payload byte": m.data_offset + m.size - 1,
              "header padding": m.header_len + 5, "tail padding": m.file_bytes - 1,
              "checksum": m.header_len - 1}[where]
    path = tmp_path / fmt.file_name(m.key)
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x10
    path.write_bytes(bytes(raw))
    assert fmt.read_meta(str(path)) == m  # the header fields still verify: found only when loaded
    assert read_back(tier, m, aligned_bufs(m.size)) is None
    assert corrupt == [1] and tier.corrupt == 1 and not path.exists() and not tier.contains(m.key)


@pytest.mark.parametrize("version", [1, 2])
def test_older_format_versions_are_corrupt_at_scan(tmp_path, version):
    m = meta(8, 3000)
    path = tmp_path / fmt.file_name(m.key)
    fmt.write_file(str(tmp_path), m, payload(8, 3000))
    raw = bytearray(path.read_bytes())
    struct.pack_into("<H", raw, 4, version)  # 1: no padding, 2: a BLAKE3 checksum
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptChunk, match="version"):
        fmt.read_meta(str(path))
    tier = FsTier(str(tmp_path), 1 << 30)
    assert tier.scan() == 0 and tier.corrupt == 1 and not path.exists()


def test_a_scan_of_many_old_files_logs_a_few_lines_not_one_per_file(tmp_path, caplog):
    """An upgrade over a directory of an older format: every file is corrupt; the log names the first
    SCAN_LOG_CORRUPT and sums up the rest by reason."""
    from kvtier.server.tiers.fs import SCAN_LOG_CORRUPT

    n = SCAN_LOG_CORRUPT + 15
    for i in range(n):
        path = fmt.write_file(str(tmp_path), meta(i, 3000), payload(i, 3000))
        with open(path, "r+b") as fh:
            fh.seek(4)
            fh.write(struct.pack("<H", 2))
    tier = FsTier(str(tmp_path), 1 << 30)
    with caplog.at_level(logging.INFO, logger="kvtier.server.l2"):
        assert tier.scan() == 0
    lines = [r.getMessage() for r in caplog.records]
    assert tier.corrupt == n and not os.listdir(tmp_path)
    assert sum("is corrupt" in line for line in lines) == SCAN_LOG_CORRUPT
    assert any(f"removed {n} corrupt files: {n} unknown format version 2" in line for line in lines)
    assert len(lines) <= SCAN_LOG_CORRUPT + 2


def test_pipeline_writes_everything_and_syncs_before_idle(tmp_path):
    tier = FsTier(str(tmp_path), 1 << 30)
    released, drops = [], []
    writer = L2Writer(tier, 64, on_drop=lambda: drops.append(1))
    writer.start()
    n = 20

    def boom() -> list[bytes]:
        raise RuntimeError("copy failed")

    try:
        for i in range(n):
            sources = boom if i == 7 else (lambda i=i: [payload(i, 3000)])
            assert writer.submit(WriteJob(meta(i, 3000), sources, lambda i=i: released.append(i)))
        assert writer.wait_idle(30)
        assert writer.inflight == 0 and writer.done == n - 1 and writer.failed == 1
        assert tier.written == n - 1  # inflight 0: every write and its rename are durable
        assert sorted(released) == list(range(n)) and not drops
    finally:
        writer.stop()
    assert not any(t.is_alive() for t in writer._threads)
    for i in range(n):
        assert (read_back(tier, meta(i, 3000)) == payload(i, 3000)) == (i != 7)


def test_pipeline_full_queue_drops_without_blocking(tmp_path):
    tier = FsTier(str(tmp_path), 1 << 30)
    writer = L2Writer(tier, 2)
    gate = []

    def slow() -> list[bytes]:
        while not gate:
            time.sleep(0.005)
        return [payload(0, 3000)]

    writer.start()
    try:
        jobs = [WriteJob(meta(i, 3000), slow, lambda: None) for i in range(10)]
        t = time.monotonic()
        accepted = [writer.submit(j) for j in jobs]
        assert time.monotonic() - t < 1.0
        # stage one holds one job, the queue two: everything else is dropped and counted
        assert sum(accepted) <= 3 and writer.dropped == 10 - sum(accepted)
        assert not writer.wait_idle(0.05)  # stage one is held by the gate
        gate.append(1)
        assert writer.wait_idle(30)
        assert writer.done == sum(accepted) and tier.written == sum(accepted)
    finally:
        gate.append(1)
        writer.stop()


@pytest.mark.parametrize("odirect", [False, True])
def test_read_into_more_pages_than_one_preadv_takes_and_corruption_near_the_end(tmp_path, odirect):
    """A chunk loaded into 4 KiB L1-like pages, more than IOV_MAX (1024) of them plus a partial last one:
    bit-exact in both modes; a byte flipped near the payload's end is caught."""
    tier = odirect_tier(tmp_path) if odirect else FsTier(str(tmp_path), 1 << 30)
    size = (4 << 20) + 5000
    m, data = meta(9, size), payload(9, size)
    assert tier.put(m, data)
    page = 4096
    bufs = [memoryview(mmap.mmap(-1, page))[: min(page, size - off)] for off in range(0, size, page)]
    assert read_back(tier, m, bufs) == data
    path = tmp_path / fmt.file_name(m.key)
    with open(path, "r+b") as fh:
        fh.seek(m.data_offset + size - 10)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0x01]))
    assert read_back(tier, m, bufs) is None and tier.corrupt == 1
    assert not path.exists()


def test_clear_by_namespace_removes_only_its_files_and_leaves_foreign_ones(tmp_path):
    tier = FsTier(str(tmp_path), 1 << 30)
    other = ChunkMeta(digest(b"other"), digest(b"ns-2"), 2, (), 5000)
    mine = [meta(i, 3000) for i in range(3)]
    for m in mine:
        assert tier.put(m, payload(1, 3000))
    assert tier.put(other, payload(2, 5000))
    (tmp_path / "notes.txt").write_text("operator's")
    assert tier.clear(digest(b"ns")) == Cleared(3, 3 * mine[0].file_bytes)
    assert tier.entries == 1 and tier.used_bytes == other.file_bytes and tier.contains(other.key)
    assert sorted(os.listdir(tmp_path)) == sorted([fmt.file_name(other.key), "notes.txt"])
    assert tier.clear() == Cleared(1, other.file_bytes) and os.listdir(tmp_path) == ["notes.txt"]


def test_invalidate_drops_jobs_accepted_before_it(tmp_path):
    """A cache clear while writes are queued: none of them lands in L2, every source is released."""
    tier = FsTier(str(tmp_path), 1 << 30)
    writer = L2Writer(tier, 16)
    released = []
    jobs = [WriteJob(meta(i, 3000), lambda i=i: [payload(i, 3000)], lambda i=i: released.append(i)) for i in range(4)]
    assert all(writer.submit(j) for j in jobs)
    writer.invalidate()
    late = WriteJob(meta(9, 3000), lambda: [payload(9, 3000)], lambda: released.append(9))
    assert writer.submit(late)
    assert writer.run_pending() == 5
    assert writer.stale == 4 and writer.done == 1 and sorted(released) == [0, 1, 2, 3, 9]
    assert os.listdir(tmp_path) == [fmt.file_name(late.meta.key)]


def test_invalidate_of_a_namespace_drops_only_its_jobs(tmp_path):
    tier = FsTier(str(tmp_path), 1 << 30)
    writer = L2Writer(tier, 16)
    other = ChunkMeta(digest(b"other-key"), digest(b"ns-2"), 2, (), 3000)
    mine = [meta(i, 3000) for i in range(3)]
    for m in [*mine, other]:
        assert writer.submit(WriteJob(m, lambda: [payload(1, 3000)], lambda: None))
    writer.invalidate(digest(b"ns"))
    assert writer.run_pending() == 4
    assert writer.stale == 3 and writer.done == 1
    assert os.listdir(tmp_path) == [fmt.file_name(other.key)]


def test_encode_writes_from_aligned_sources_in_place_and_unaligned_ones_buffered(tmp_path):
    size = 3 * ALIGN + 1
    m, data = meta(10, size), payload(10, size)
    bufs = aligned_bufs(size)
    off = 0
    for b in bufs:
        b[:] = data[off : off + len(b)]
        off += len(b)
    enc = fmt.encode(m, bufs, odirect=True)
    assert enc.odirect
    # the payload parts are the sources' own memory (no copy), but the last partial block
    first = np.frombuffer(bufs[0], dtype=np.uint8)
    assert any(np.shares_memory(first, np.frombuffer(p, dtype=np.uint8)) for p in enc.parts if len(p))
    assert sum(len(p) for p in enc.parts) == m.file_bytes
    odirect_tier(tmp_path)  # skips where O_DIRECT is refused
    path = fmt.write_file(str(tmp_path), m, enc)
    with open(path, "rb") as fh:
        assert fh.read()[m.data_offset : m.data_offset + size] == data
    unaligned = memoryview(mmap.mmap(-1, size + 1))[1 : size + 1]  # one byte past a page start
    unaligned[:] = data
    assert not fmt.encode(m, [unaligned], odirect=True).odirect  # not page-aligned: buffered


def test_writer_releases_sources_only_once_the_file_is_written(tmp_path):
    tier = FsTier(str(tmp_path), 1 << 30)
    writer = L2Writer(tier, 8)
    seen = []
    writer.start()
    try:
        for i in range(4):
            m = meta(i, 3000)
            path = tmp_path / fmt.file_name(m.key)
            assert writer.submit(WriteJob(m, lambda i=i: [payload(i, 3000)], lambda p=path: seen.append(p.exists())))
        assert writer.wait_idle(30)
    finally:
        writer.stop()
    assert seen == [True] * 4


def test_io_stage_writes_two_files_at_once_and_a_key_once(tmp_path, monkeypatch):
    """Two puts overlap (IO_THREADS); a put of a key whose file is being written is refused, not written
    twice over the same temp name."""
    tier = FsTier(str(tmp_path), 1 << 30)
    both = threading.Barrier(2, timeout=10)
    real_write = fmt.write_file
    refused = []

    def write_file(directory, m, enc, odirect=False):  # noqa: ANN001, ANN202 - write_file's signature
        both.wait()  # only returns once two writes are in flight together
        if m.key == meta(0, 3000).key:
            refused.append(tier.put(m, payload(0, 3000)))
        return real_write(directory, m, enc, odirect)

    monkeypatch.setattr(fmt, "write_file", write_file)
    writer = L2Writer(tier, 8)
    writer.start()
    try:
        for i in range(2):
            assert writer.submit(WriteJob(meta(i, 3000), lambda i=i: [payload(i, 3000)], lambda: None))
        assert writer.wait_idle(30)
    finally:
        writer.stop()
    assert refused == [False] and writer.done == 2 and tier.written == 2
    for i in range(2):
        assert read_back(tier, meta(i, 3000)) == payload(i, 3000)
