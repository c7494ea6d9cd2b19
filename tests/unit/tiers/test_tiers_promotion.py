"""Asynchronous L2 -> L1 promotion through RequestHandler, the Cache and an attached filesystem tier on a
real asyncio loop (no server process): lookups answer while reads are in flight, acquires wait for them,
failures are misses, the in-flight cap holds, nothing leaks on shutdown or client loss, and the tier
bandwidth is measured."""

from __future__ import annotations

import asyncio
import threading

import msgpack
import numpy as np
import pytest
from kvtier.connector.results import LookupResult
from kvtier.server import protocol as p
from kvtier.server.cache import Cache
from kvtier.server.eviction import make_policy
from kvtier.server.keys import Namespace, chunk_keys
from kvtier.server.l1.holds import Holds
from kvtier.server.l1.pool import PagePool
from kvtier.server.l1.store import L1Store
from kvtier.server.metrics import Metrics, TierMetrics
from kvtier.server.rpc import RequestHandler
from kvtier.server.tiers import fs_io as fmt
from kvtier.server.tiers.attached import AttachedTier
from kvtier.server.tiers.bandwidth import BandwidthMeter
from kvtier.server.tiers.fs import FsTier
from kvtier.server.tiers.record import ChunkMeta

pytestmark = pytest.mark.unit

NS = Namespace(model="m", dtype="bf16", num_layers=2, kv_heads=2, head_size=8, block_size=64,
               layout="NHD", chunk_size=256)
PAGE = 1024
MIN_BLOCK_BYTES = 256  # a test page stands for a 64 KiB one: at most 4 blocks per page
SIZE = 2500  # three pages per chunk
IDENT = b"client-1"


class GatedTier(FsTier):
    """An FsTier whose reads wait for `gate`: a promotion stays observably in flight until the test opens it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.reads = 0

    def get(self, meta, bufs) -> bool:
        self.reads += 1
        assert self.gate.wait(10), "gate never opened"
        return super().get(meta, bufs)


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8).tobytes()


class Rig:
    def __init__(self, tmp_path, n_chunks: int = 3, num_pages: int = 64, max_promoting_bytes: int | None = None):
        self.metrics = Metrics()
        self.store = L1Store(PagePool(num_pages, PAGE), make_policy("lru"), self.metrics,
                             min_block_bytes=MIN_BLOCK_BYTES)
        self.holds = Holds(self.store, self.metrics)
        self.segment = np.zeros(num_pages * PAGE, dtype=np.uint8)
        m = TierMetrics(self.metrics, "l2")
        self.tier = GatedTier(str(tmp_path), 1 << 30, on_corrupt=m.corrupt.inc)
        self.chunks = chunk_keys(NS, list(range(n_chunks * NS.chunk_size)))
        fp = NS.fingerprint()
        for c in self.chunks:
            self.tier.put(ChunkMeta(c.key, fp, len(c.block_keys), c.aliases, SIZE), payload(c.index))
        self.l2 = AttachedTier(self.store, self.segment, self.tier, 16, self.metrics, m, max_promoting_bytes)
        self.cache = Cache(self.store, self.holds, self.metrics, [self.l2])
        self.cache.open()
        self.h = RequestHandler(self.cache, {"shm_name": "x", "shm_size": self.segment.size, "page_size": PAGE},
                                NS.chunk_size, 5.0)
        self.ids = iter(range(1, 1 << 30))
        self.cache.attach_loop(asyncio.get_running_loop())
        assert self.call({"op": "hello", "version": p.PROTOCOL_VERSION})["ok"]
        self.fp = self.call({"op": "register", "namespace": NS.to_dict()})["ns"]

    def send(self, message: dict, ident: bytes = IDENT):
        """The reply map, or an awaitable of it when the handler deferred the reply."""
        out = self.h.handle(ident, msgpack.packb({"id": next(self.ids), **message}, use_bin_type=True))
        if isinstance(out, bytes):
            return msgpack.unpackb(out, raw=False)

        async def later() -> dict:
            return msgpack.unpackb(await out, raw=False)

        return asyncio.ensure_future(later())

    def call(self, message: dict) -> dict:
        reply = self.send(message)
        assert isinstance(reply, dict), f"{message['op']} was deferred"
        return reply

    def lookup(self, acquire: bool = False):
        return self.send({"op": "lookup", "ns": self.fp, "chunks": [list(c.block_keys) for c in self.chunks],
                          "acquire": acquire})

    def acquire_keys(self) -> list[bytes]:
        return [c.key for c in self.chunks]

    def read(self, item) -> bytes:
        _blocks, _match, size, ext = item
        data = b"".join(self.segment[ext[i] * PAGE:(ext[i] + ext[i + 1]) * PAGE].tobytes()
                        for i in range(0, len(ext), 2))
        return data[:size]

    def accounting(self) -> dict:
        s, h = self.store, self.holds
        return {"used": s.pool.used_pages, "free": s.pool.free_pages, "evictable": s.evictable_pages,
                "leases": len(h.leases), "reservations": len(h.reservations), "pending": len(s.busy),
                "promoting": self.l2.stats()["l2_promoting"]}

    def sample(self, name: str, **labels) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels or None)


def run(coro_fn, tmp_path, **kwargs) -> None:
    async def main() -> None:
        rig = Rig(tmp_path, **kwargs)
        try:
            await coro_fn(rig)
        finally:
            rig.tier.gate.set()
            rig.cache.close()

    asyncio.run(main())


async def settle(rig: Rig) -> None:
    for _ in range(200):
        if not rig.l2.stats()["l2_promoting"]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("promotions did not finish")


def test_lookup_answers_while_promoting_and_acquire_waits_for_bit_exact_bytes(tmp_path):
    async def body(rig: Rig) -> None:
        empty = rig.accounting()
        reply = rig.lookup()
        assert isinstance(reply, dict), "the lookup must not wait for the reads"
        assert reply["tiers"] == ["l2"] * 3 and reply["hits"] == [4, 4, 4]
        assert reply["bw"] == {"l2": 0.0}  # nothing measured yet
        s = rig.h._stats(IDENT, {"id": 0})
        assert s["l2_promoting"] == 3 and s["l2_promoting_bytes"] == 9 * PAGE and s["entries"] == 0
        assert rig.store.pool.used_pages == 9 and rig.store.evictable_pages == 0  # in-flight pages never evictable
        # A second lookup reports the same chunks without a second promotion; a store of one is "busy".
        assert rig.lookup()["tiers"] == ["l2"] * 3 and rig.l2.promotions.in_flight == 3
        c0 = rig.chunks[0]
        res = rig.call({"op": "reserve", "ns": rig.fp, "items": [[c0.key, SIZE, 4, list(c0.aliases)]]})
        assert res["results"] == [[p.BUSY]]
        waiting = rig.send({"op": "acquire", "ns": rig.fp, "keys": rig.acquire_keys()})
        assert isinstance(waiting, asyncio.Future), "an acquire of a promoting chunk must wait"
        assert rig.call({"op": "heartbeat"})["ok"]  # other requests are served meanwhile
        await asyncio.sleep(0.05)
        assert not waiting.done()
        rig.tier.gate.set()
        got = await asyncio.wait_for(waiting, 10)
        assert got["ok"] and got["lease"] > 0
        assert [rig.read(item) for item in got["items"]] == [payload(c.index) for c in rig.chunks]
        assert rig.tier.reads == 3
        assert rig.call({"op": "release", "leases": [got["lease"]]})["released"] == 1
        s = rig.h._stats(IDENT, {"id": 0})
        assert s["l2_promoted"] == 3 and s["l2_promoting"] == 0 and s["entries"] == 3
        assert s["l2_read_bytes_per_s"] > 0
        assert rig.sample("kvtier_tier_read_bandwidth_bytes_per_second", tier="l2") > 0
        assert rig.sample("kvtier_l2_promotion_waits_total") == 1
        assert rig.accounting() == {**empty, "used": 9, "free": empty["free"] - 9, "evictable": 9}
        again = rig.lookup()
        assert again["tiers"] == ["l1"] * 3 and "bw" not in again
        assert rig.lookup()["hits"] == [4, 4, 4]

    run(body, tmp_path)


def test_lookup_with_acquire_waits_and_a_corrupt_file_is_a_counted_miss(tmp_path):
    async def body(rig: Rig) -> None:
        path = tmp_path / fmt.file_name(rig.chunks[1].key)
        raw = bytearray(path.read_bytes())
        raw[-5] ^= 0xFF
        path.write_bytes(bytes(raw))
        before = rig.accounting()
        waiting = rig.lookup(acquire=True)
        assert isinstance(waiting, asyncio.Future)
        rig.tier.gate.set()
        got = await asyncio.wait_for(waiting, 10)
        assert got["tiers"] == ["l2"] * 3  # reported before the read found the damage
        items = got["items"]
        assert rig.read(items[0]) == payload(0) and items[1] is None  # a miss, never wrong bytes
        await settle(rig)
        s = rig.h._stats(IDENT, {"id": 0})
        assert s["l2_promotion_failures"] == 1 and s["l2_corrupt_chunks"] == 1 and not path.exists()
        assert rig.sample("kvtier_l2_promotion_failures_total") == 1
        assert rig.sample("kvtier_l2_corrupt_chunks_total") == 1
        assert rig.call({"op": "release", "leases": [got["lease"]]})["released"] == 1
        # Chunks 0 and 2 are L1 entries; the corrupt one's pages went back.
        assert rig.accounting() == {**before, "used": 6, "free": before["free"] - 6, "evictable": 6}
        assert rig.lookup()["tiers"] == ["l1"]

    run(body, tmp_path)


def test_in_flight_cap_limits_reported_hits(tmp_path):
    async def body(rig: Rig) -> None:
        reply = rig.lookup()
        assert reply["tiers"] == ["l2"] and rig.store.pool.used_pages == 3
        assert rig.sample("kvtier_l2_promotions_capped_total") == 1
        rig.tier.gate.set()
        await settle(rig)
        assert rig.lookup()["tiers"] == ["l1", "l2"]  # room again: the next chunk is promoted

    run(body, tmp_path, max_promoting_bytes=4 * PAGE)


def test_close_gives_in_flight_pages_back(tmp_path):
    async def body(rig: Rig) -> None:
        before = rig.accounting()
        assert rig.lookup()["tiers"] == ["l2"] * 4  # two reads run, two wait in the executor's queue
        threading.Timer(0.2, rig.tier.gate.set).start()
        rig.cache.close()  # waits for the running reads, drops their results and the queued ones
        assert rig.accounting() == before and rig.store.pool.used_pages == 0 and not rig.store.entries
        await asyncio.sleep(0.05)  # completions queued to the loop by the finished reads are no-ops now
        assert rig.accounting() == before and not rig.store.entries

    run(body, tmp_path, n_chunks=4)


def test_client_dropped_while_waiting_leaves_no_lease(tmp_path):
    async def body(rig: Rig) -> None:
        waiting = rig.lookup(acquire=True)
        assert isinstance(waiting, asyncio.Future)
        rig.holds.drop_client(IDENT)  # what the sweep does to a client that went silent
        rig.tier.gate.set()
        got = await asyncio.wait_for(waiting, 10)
        assert not got["ok"] and got["code"] == p.NOT_REGISTERED
        await settle(rig)
        assert not rig.holds.leases and rig.store.evictable_pages == rig.store.pool.used_pages == 9

    run(body, tmp_path)


def test_write_bandwidth_is_measured_from_the_writer(tmp_path):
    async def body(rig: Rig) -> None:
        rig.l2.writer.stop()  # no worker thread: run the queued write here
        rig.l2.writer._stopping = False
        c = chunk_keys(NS, list(range(100, 100 + NS.chunk_size)))[0]
        res = rig.call({"op": "reserve", "ns": rig.fp, "items": [[c.key, SIZE, 4, list(c.aliases)]]})
        assert rig.call({"op": "commit", "res": [res["results"][0][1]]})["committed"] == 1
        assert rig.l2.stats()["l2_write_bytes_per_s"] == 0.0
        assert rig.l2.writer.run_pending() == 1
        await asyncio.sleep(0)  # the reader hold is released on the loop
        assert rig.l2.stats()["l2_write_bytes_per_s"] > 0
        assert rig.sample("kvtier_tier_write_bandwidth_bytes_per_second", tier="l2") > 0

    run(body, tmp_path)


def test_bandwidth_meter_measures_aggregate_throughput():
    m = BandwidthMeter()
    assert m.bytes_per_s == 0.0
    for i in range(5):
        m.add(100, i, i + 1.0)  # back to back: 100 B/s
    assert m.bytes_per_s == pytest.approx(100.0)
    overlapped = BandwidthMeter()
    overlapped.add(100, 0.0, 1.0)
    overlapped.add(100, 0.0, 1.0)  # two transfers in the same second: the tier moved 200 B/s
    assert overlapped.bytes_per_s > 150


def test_lookup_result_skips_lower_tiers_slower_than_recompute():
    r = LookupResult([], [4, 4, 2], ["l1", "l2", "l2"], 16, {"l2": 1e9})
    assert r.tokens_faster_than(0) == r.tokens == 160
    assert r.tokens_faster_than(5e8) == 160  # L2 is faster than recomputing
    assert r.tokens_faster_than(2e9) == 64  # L2 is slower: only the L1 prefix
    unknown = LookupResult([], [4, 4], ["l1", "l2"], 16, {"l2": 0.0})
    assert unknown.tokens_faster_than(2e9) == 128  # not measured yet: load


def test_lookup_result_drops_a_remote_run_prefill_beats_by_its_round_trip():
    # 6 remote blocks of 16 tokens = 96 tokens; at 10,000 prefill tokens/s they compute in 9.6 ms
    r = LookupResult([], [4, 4, 2], ["l1", "remote", "remote"], 16, {"remote": 1e9}, {"remote": 0.02})
    assert r.tokens_faster_than(5e8, 10_000) == 64  # a 20 ms round trip is slower: only the L1 prefix
    assert r.tokens_faster_than(5e8, 1_000) == 160  # 96 ms of prefill: the round trip pays
    assert r.tokens_faster_than(5e8) == 160  # no prefill rate given: the round trip is not weighed
    fast = LookupResult([], [4, 6], ["l1", "remote"], 16, {"remote": 1e9}, {"remote": 0.001})
    assert fast.tokens_faster_than(5e8, 10_000) == 160
