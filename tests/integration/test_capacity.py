"""A 64 MiB L1 takes 256 MiB of stores by evicting; with every entry leased, a store is refused (no_space)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from _support import prompt
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server.keys import Namespace, chunk_keys

pytestmark = pytest.mark.integration

NS = Namespace(model="org/tiny", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64, block_size=16,
               layout="NHD", chunk_size=256)
CHUNK_BYTES = 64 * 1024
BATCH = 64  # chunks per store call: 4 MiB
L1_BYTES = 64 << 20
TOTAL_BYTES = 256 << 20


@pytest.mark.parametrize("policy", ["lru", "lirs", "reuse"])
def test_stores_evict_within_budget_then_refuse_when_all_leased(kvtier_server, policy):
    srv = kvtier_server(l1_gb=L1_BYTES / (1 << 30), extra=["--eviction-policy", policy])
    c = KVTierClient(ClientConfig(url=srv.url, strict=True))
    assert c.connect()
    payload = np.random.default_rng(0).integers(0, 256, CHUNK_BYTES, dtype=np.uint8)
    capacity = c.stats()["l1_capacity_bytes"]
    assert capacity == L1_BYTES
    # A second client polls the server's accounting while the stores run (also mid-batch).
    peak = {"used": 0, "polls": 0}
    done = threading.Event()

    def poll() -> None:
        watcher = KVTierClient(ClientConfig(url=srv.url, strict=True))
        while not done.is_set():
            s = watcher.stats()
            peak["used"] = max(peak["used"], s["l1_used_bytes"])
            peak["polls"] += 1
            done.wait(0.005)
        watcher.close()

    def polled_since(count: int) -> None:
        """Wait until the poller has polled again (its thread competes for the GIL with the stores)."""
        for _ in range(1000):
            if peak["polls"] > count:
                return
            done.wait(0.005)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    stored = 0
    batches = TOTAL_BYTES // (BATCH * CHUNK_BYTES)
    for b in range(batches):
        polled_since(b)  # at least one poll per batch, so the peak covers the whole run
        tokens = prompt(1000 + b, BATCH * NS.chunk_size)
        r = c.store(NS, tokens, lambda _c: CHUNK_BYTES, lambda _c, span: span.write(0, payload))
        assert r.refused == {} and r.busy == 0 and r.existing == 0
        assert r.stored == BATCH
        stored += r.stored
        s = c.stats()
        assert s["l1_used_bytes"] <= capacity
        assert s["reservations"] == 0
        # The batch just stored is all there: room was made by evicting older chunks, not by dropping.
        assert c.lookup(NS, tokens).tokens == BATCH * NS.chunk_size
    polled_since(batches)
    done.set()
    poller.join(timeout=10)
    assert peak["polls"] > batches and 0 < peak["used"] <= capacity
    assert stored * CHUNK_BYTES == TOTAL_BYTES
    s = c.stats()
    resident = s["entries"]
    assert resident * CHUNK_BYTES <= capacity
    assert s["evictions"] == stored - resident
    assert s["evictions"] >= (TOTAL_BYTES - L1_BYTES) // CHUNK_BYTES

    # Lease everything that is still resident, so nothing is evictable.
    keys = [k.key for b in range(batches) for k in chunk_keys(NS, prompt(1000 + b, BATCH * NS.chunk_size))]
    reply = c._request({"op": "acquire", "keys": keys}, NS)
    assert sum(i is not None for i in reply["items"]) == resident
    s = c.stats()
    assert s["evictable_bytes"] == 0 and s["leases"] == 1
    free = capacity - s["l1_used_bytes"]
    n_new = free // CHUNK_BYTES + 1  # one more chunk than the free pages hold
    tokens = prompt(5000, n_new * NS.chunk_size)
    r = c.store(NS, tokens, lambda _c: CHUNK_BYTES, lambda _c, span: span.write(0, payload))
    assert r.refused.get("no_space", 0) >= 1
    assert r.stored + r.refused["no_space"] == n_new
    assert r.stored == free // CHUNK_BYTES
    assert c.stats()["l1_used_bytes"] <= capacity

    # Releasing the lease makes the store possible again.
    assert c._request({"op": "release", "leases": [reply["lease"]]})["released"] == 1
    r = c.store(NS, tokens, lambda _c: CHUNK_BYTES, lambda _c, span: span.write(0, payload))
    assert r.refused == {} and r.stored + r.existing == n_new and r.stored >= 1
    c.close()


def test_a_store_batch_at_the_item_limit_is_stored_whole(kvtier_server):
    """65,536 one-page chunks in one store call (the protocol's item limit) all commit within a short
    reservation TTL: client-side bookkeeping stays linear, and nothing is lost silently."""
    from kvtier.server import protocol as p
    from kvtier.server.keys import ChunkKeys

    srv = kvtier_server(l1_gb=0.1, extra=["--page-size-kb", "1", "--reservation-ttl-s", "10"])
    c = KVTierClient(ClientConfig(url=srv.url, strict=True, request_timeout_s=60))
    c.connect()
    raw = np.random.default_rng(0).bytes(16 * p.MAX_ITEMS)
    batch = [ChunkKeys(0, 0, 1, (raw[i : i + 16],)) for i in range(0, len(raw), 16)]
    result = c.store_chunks(NS, batch, lambda _c: 1, lambda _c, span: span.write(0, np.ones(1, np.uint8)))
    assert result.stored == p.MAX_ITEMS and not result.refused, result
    assert c.stats()["entries"] == p.MAX_ITEMS
    c.close()
