"""L2 against a hostile or broken directory, with real files, FIFOs and directories (no server process):
a FIFO in place of a chunk file is a counted miss and never blocks a thread, a promotion that outlives its
deadline is abandoned without leaking pages, shutdown is bounded while a read hangs, a clear gets past
what it cannot remove and nothing it cleared comes back, a clear fences the promotions around it, and the
health check sees a missing or replaced directory."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import stat
import threading
from collections.abc import Callable

import numpy as np
import pytest
from kvtier.server.cache import Cache
from kvtier.server.eviction import make_policy
from kvtier.server.keys import Namespace, chunk_keys, digest
from kvtier.server.l1.holds import Holds
from kvtier.server.l1.pool import PagePool
from kvtier.server.l1.store import L1Store
from kvtier.server.metrics import Metrics, TierMetrics
from kvtier.server.tiers import fs_io as fmt
from kvtier.server.tiers.attached import AttachedTier
from kvtier.server.tiers.base import Cleared
from kvtier.server.tiers.fs import FsTier
from kvtier.server.tiers.promotion import PROMOTE_THREADS
from kvtier.server.tiers.record import ChunkMeta, CorruptChunk

pytestmark = pytest.mark.unit

NS = Namespace(model="m", dtype="bf16", num_layers=2, kv_heads=2, head_size=8, block_size=64,
               layout="NHD", chunk_size=256)
PAGE = 1024
SIZE = 2500  # three pages per chunk
HANG_S = 15.0  # only to tell a hang from an answer: every step here takes milliseconds


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8).tobytes()


def meta(i: int) -> ChunkMeta:
    return ChunkMeta(digest(b"k%d" % i), digest(b"ns"), 4, (), SIZE)


def to_fifo(path: os.PathLike) -> None:
    os.unlink(path)
    os.mkfifo(path)


def unblock(path: os.PathLike) -> None:
    """Open a FIFO's write end, so that a reader blocked in open() returns (nothing to do if none is)."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def disarm(paths: list[str]) -> None:
    """Free any thread blocked opening one of the FIFOs among `paths`, and remove them so that no later open
    blocks (what a test leaves behind must not hang the shutdown that follows it)."""
    fifos = [p for p in paths if os.path.exists(p) and stat.S_ISFIFO(os.stat(p).st_mode)]
    ends = []
    for path in fifos:
        with contextlib.suppress(OSError):
            ends.append(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    for path in fifos:
        with contextlib.suppress(FileNotFoundError):  # a freed reader may have removed it
            os.unlink(path)
    for fd in ends:
        os.close(fd)


def in_thread(fn: Callable[[], object], fifos: list) -> object:
    """fn()'s result, run on a thread; fails if it has not returned within HANG_S."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(HANG_S)
    hung = t.is_alive()
    for path in fifos:
        unblock(path)
    t.join(HANG_S)
    assert not hung, "blocked on a FIFO"
    return out[0] if out else None


class GatedTier(FsTier):
    """An FsTier whose reads wait for `gate` (a hung disk, seen from the promotion threads), and whose
    clear waits for `clear_gate` once `clearing` is set (a clear still removing files)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.clear_gate = threading.Event()
        self.clear_gate.set()
        self.clearing = threading.Event()
        self.entered = 0  # reads that reached the gate

    def get(self, meta, bufs) -> bool:
        self.entered += 1
        self.gate.wait(2 * HANG_S)
        return super().get(meta, bufs)

    def clear(self, ns=None):
        self.clearing.set()
        self.clear_gate.wait(2 * HANG_S)
        return super().clear(ns)


class Rig:
    """A cache with a filesystem tier over real chunk files, serving from the running loop."""

    def __init__(self, path, n_chunks: int, num_pages: int = 128, seed: int = 0) -> None:
        self.metrics = Metrics()
        self.store = L1Store(PagePool(num_pages, PAGE), make_policy("lru"), self.metrics, min_block_bytes=256)
        self.holds = Holds(self.store, self.metrics)
        self.segment = np.zeros(num_pages * PAGE, dtype=np.uint8)
        m = TierMetrics(self.metrics, "l2")
        self.tier = GatedTier(str(path), 1 << 30, on_corrupt=m.corrupt.inc)
        self.fp = self.holds.register(NS)
        self.chunks = chunk_keys(NS, list(range(seed, seed + n_chunks * NS.chunk_size)))
        for c in self.chunks:
            self.tier.put(ChunkMeta(c.key, self.fp, len(c.block_keys), c.aliases, SIZE), payload(c.index))
        self.l2 = AttachedTier(self.store, self.segment, self.tier, 16, self.metrics, m)
        self.cache = Cache(self.store, self.holds, self.metrics, [self.l2])
        self.cache.open()
        self.cache.attach_loop(asyncio.get_running_loop())

    def path(self, i: int) -> str:
        return os.path.join(self.tier.path, fmt.file_name(self.chunks[i].key))

    def lookup(self, chunks=None) -> list[str]:
        """Tiers of the hits of a lookup (promotions start, as in the server)."""
        chunks = self.chunks if chunks is None else chunks
        block_lists = [list(c.block_keys) for c in chunks]
        return self.cache.lookup(self.fp, block_lists).tiers

    async def promoted(self, chunks=None) -> None:
        """Wait (at most HANG_S) for the promotions of `chunks` to finish, whatever their outcome."""
        chunks = self.chunks if chunks is None else chunks
        waiting = self.l2.promotions.waits([c.key for c in chunks])
        if waiting is not None:
            await asyncio.wait_for(asyncio.shield(waiting), HANG_S)

    def bytes_of(self, key: bytes) -> bytes:
        ext = self.store.entries[key].extents
        return b"".join(self.segment[ext[i] * PAGE:(ext[i] + ext[i + 1]) * PAGE].tobytes()
                        for i in range(0, len(ext), 2))[:SIZE]

    def sample(self, name: str) -> float | None:
        return self.metrics.registry.get_sample_value(name)


async def until(predicate: Callable[[], bool]) -> None:
    """Wait (at most HANG_S) for `predicate` to hold."""
    for _ in range(int(HANG_S / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def run(tmp_path, body, **kwargs) -> None:
    async def main() -> None:
        rig = Rig(tmp_path, **kwargs)
        try:
            await body(rig)
        finally:
            rig.tier.gate.set()
            rig.tier.clear_gate.set()
            disarm([rig.path(i) for i in range(len(rig.chunks))])
            rig.cache.close(timeout=HANG_S)

    asyncio.run(main())


# -- 4: FIFOs, promotion deadline, bounded shutdown --------------------------------------------------


@pytest.mark.parametrize("odirect", [False, True])
def test_fifo_in_place_of_a_chunk_file_is_a_counted_miss(tmp_path, odirect):
    corrupt: list[int] = []
    tier = FsTier(str(tmp_path), 1 << 30, odirect, on_corrupt=lambda: corrupt.append(1))
    m = meta(1)
    assert tier.put(m, payload(1))
    path = tmp_path / fmt.file_name(m.key)
    to_fifo(path)
    buf = bytearray(SIZE)
    assert in_thread(lambda: tier.get(m, [memoryview(buf)]), [path]) is False
    assert corrupt == [1] and tier.corrupt == 1 and not tier.contains(m.key) and tier.used_bytes == 0
    assert not path.exists()  # at kvtier's name, removed like any corrupt record


def test_header_read_of_a_fifo_or_directory_raises_corrupt(tmp_path):
    fifo, folder = tmp_path / fmt.file_name(meta(1).key), tmp_path / fmt.file_name(meta(2).key)
    os.mkfifo(fifo)
    folder.mkdir()

    def attempt(path) -> str:
        try:
            fmt.read_meta(str(path))
        except CorruptChunk as exc:
            return str(exc)
        return "read"

    assert in_thread(lambda: attempt(fifo), [fifo]) == "not a regular file"
    assert attempt(folder) == "not a regular file"


def test_fifo_promotion_is_a_quick_counted_miss_and_other_chunks_promote(tmp_path):
    async def body(rig: Rig) -> None:
        fifos = [0, 2, 3, 4, 5]  # more FIFOs than promotion threads
        assert len(fifos) > PROMOTE_THREADS
        for i in fifos:
            to_fifo(rig.path(i))
        for i in range(len(rig.chunks)):  # one chunk per lookup: a miss does not end the next one's prefix
            assert rig.lookup(rig.chunks[i:i + 1]) == ["l2"]
        await rig.promoted()
        assert set(rig.store.entries) == {rig.chunks[i].key for i in (1, 6)}
        assert rig.bytes_of(rig.chunks[1].key) == payload(1) and rig.bytes_of(rig.chunks[6].key) == payload(6)
        s = rig.l2.stats()
        assert s["l2_promotion_failures"] == len(fifos) and s["l2_corrupt_chunks"] == len(fifos)
        assert rig.sample("kvtier_l2_corrupt_chunks_total") == len(fifos)
        assert s["l2_promoting"] == 0 and rig.store.pool.used_pages == 6  # the two promoted chunks only

    run(tmp_path, body, n_chunks=7)


def test_promotion_past_its_deadline_is_abandoned_and_its_pages_come_back(tmp_path):
    async def body(rig: Rig) -> None:
        rig.l2.promotions.deadline_s = 1.0
        rig.tier.gate.clear()  # every read hangs
        n = PROMOTE_THREADS + 2  # two of them never start: they wait for a thread
        assert rig.lookup(rig.chunks[:n]) == ["l2"] * n
        await rig.promoted(rig.chunks[:n])  # answered (a miss) instead of waiting for the hung reads
        assert rig.tier.entered == PROMOTE_THREADS
        assert not rig.store.entries and rig.l2.stats()["l2_promoting"] == 0
        assert rig.l2.stats()["l2_promotions_expired"] == n
        assert rig.sample("kvtier_l2_promotions_expired_total") == n
        # The reads not started were cancelled, their pages are free; the running ones may still write
        # into theirs, which stay held until they return.
        assert rig.store.pool.used_pages == 3 * PROMOTE_THREADS
        assert rig.l2.stats()["l2_promoting_bytes"] == 3 * PROMOTE_THREADS * PAGE
        # Every promotion thread is stuck: further L2 hits are not reported (nor their pages taken).
        assert rig.lookup(rig.chunks[n:]) == []
        # A store of an abandoned chunk's key is no longer "busy".
        assert rig.chunks[0].key not in rig.store.busy
        rig.tier.gate.set()
        await until(lambda: rig.store.pool.used_pages == 0)
        assert not rig.store.entries  # never committed, nothing leaked
        assert rig.l2.stats()["l2_promoting_bytes"] == 0
        assert rig.lookup(rig.chunks[n:]) == ["l2"]
        await rig.promoted(rig.chunks[n:])
        assert rig.bytes_of(rig.chunks[n].key) == payload(rig.chunks[n].index)

    run(tmp_path, body, n_chunks=PROMOTE_THREADS + 3)


def test_close_is_bounded_while_reads_hang(tmp_path, caplog):
    async def body(rig: Rig) -> None:
        rig.tier.gate.clear()
        assert rig.lookup() == ["l2"] * len(rig.chunks)
        await until(lambda: rig.tier.entered == PROMOTE_THREADS)  # every read started, and hangs
        opener = threading.Timer(HANG_S, rig.tier.gate.set)  # only ends the hang if close() waits for it
        opener.start()
        try:
            with caplog.at_level(logging.WARNING, logger="kvtier.server.tiers"):
                rig.cache.close(timeout=0.2)
            assert not rig.tier.gate.is_set(), "close() waited for the hung reads"
        finally:
            opener.cancel()
        assert "promotion reads still running" in caplog.text
        assert rig.store.pool.used_pages == 0 and not rig.store.entries

    run(tmp_path, body, n_chunks=PROMOTE_THREADS)


# -- 5: what a clear cannot remove ------------------------------------------------------------------


def test_clear_gets_past_a_directory_and_nothing_it_cleared_comes_back(tmp_path):
    tier = FsTier(str(tmp_path), 1 << 30)
    metas = [meta(i) for i in range(6)]
    for i, m in enumerate(metas):
        assert tier.put(m, payload(i))
    blocked = tmp_path / fmt.file_name(metas[0].key)  # the oldest: the first the clear reaches
    blocked.unlink()
    blocked.mkdir()
    (blocked / "inside").write_bytes(b"x")
    cleared = tier.clear()
    assert cleared == Cleared(5, 5 * metas[0].file_bytes, failed=1)
    assert tier.entries == 0 and tier.used_bytes == 0
    assert os.listdir(tmp_path) == [blocked.name] and blocked.is_dir()  # everything else is gone
    again = FsTier(str(tmp_path), 1 << 30)
    assert again.scan() == 0 and again.find_prefix([list(metas[0].aliases) + [metas[0].key]]) == []
    assert blocked.is_dir()  # not ours to delete


# -- 6: a clear fences promotions -------------------------------------------------------------------


def test_clear_fences_promotions_in_flight_and_started_during_it(tmp_path):
    async def body(rig: Rig) -> None:
        first, during = rig.chunks[:1], rig.chunks[1:]
        rig.tier.gate.clear()
        assert rig.lookup(first) == ["l2"]  # reading when the clear comes
        rig.tier.clear_gate.clear()
        clearing = asyncio.ensure_future(rig.l2.clear())
        while not rig.tier.clearing.is_set():  # the clear's thread is removing files
            await asyncio.sleep(0.01)
        tiers = rig.lookup(during)  # a lookup served while the files are being removed
        rig.tier.gate.set()
        await rig.promoted()
        rig.tier.clear_gate.set()
        cleared = await asyncio.wait_for(clearing, HANG_S)
        await rig.promoted()
        assert tiers == [] and cleared == Cleared(len(rig.chunks), len(rig.chunks) * 4096 * 2)
        assert not rig.store.entries and rig.store.pool.used_pages == 0  # nothing from before entered L1
        assert rig.lookup() == [] and rig.l2.stats()["l2_promoting"] == 0

    run(tmp_path, body, n_chunks=3)


def test_clear_of_another_namespace_does_not_fence(tmp_path):
    async def body(rig: Rig) -> None:
        rig.tier.gate.clear()
        assert rig.lookup() == ["l2"] * len(rig.chunks)
        await rig.l2.clear(digest(b"another namespace"))
        rig.tier.gate.set()
        await rig.promoted()
        assert len(rig.store.entries) == len(rig.chunks)

    run(tmp_path, body, n_chunks=2)


# -- health ------------------------------------------------------------------------------------------


def test_health_sees_a_missing_or_replaced_directory(tmp_path):
    async def body(rig: Rig) -> None:
        assert rig.l2.health() == (True, "")
        path = rig.tier.path
        os.rename(path, path + ".away")
        ok, reason = rig.l2.health()
        assert not ok and os.strerror(errno.ENOENT) in reason, reason
        with open(path, "wb"):
            pass
        ok, reason = rig.l2.health()
        assert not ok and os.strerror(errno.ENOTDIR) in reason, reason
        os.unlink(path)
        os.rename(path + ".away", path)
        assert rig.l2.health() == (True, "")
        assert not [n for n in os.listdir(path) if fmt.TEMP_RE.match(n)]  # the probe leaves nothing

    run(tmp_path / "l2", body, n_chunks=1)
