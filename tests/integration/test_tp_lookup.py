"""A tensor-parallel engine's lookup against a real server: each TP rank stores its own KV of a prompt under its
own namespace, and each rank's chunks are evicted on their own; the scheduler's lookup names every rank
(`ranks`) and is answered with the prefix every rank holds, leased in every rank."""

from __future__ import annotations

import dataclasses

import httpx
import numpy as np
import pytest
from _support import free_port, payload_of, prompt
from kvtier.connector.client import ClientConfig, KVTierClient, KVTierError
from kvtier.server.keys import Namespace, chunk_keys

pytestmark = pytest.mark.integration

RANK0 = Namespace(model="org/tp-test", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64, block_size=16,
                  layout="test", chunk_size=64, tp_size=2, tp_rank=0)
RANK1 = dataclasses.replace(RANK0, tp_rank=1)
FILLER = dataclasses.replace(RANK0, model="org/other")
BLOCK_BYTES = 16 << 10  # 4 blocks per chunk: one 64 KiB L1 page per chunk
TOKENS = 256  # 4 chunks, 16 blocks


def store(client: KVTierClient, ns: Namespace, tokens: np.ndarray) -> int:
    def write(chunk, span) -> None:
        span.write(0, payload_of(chunk.key, len(chunk.block_keys) * BLOCK_BYTES))

    return client.store(ns, tokens, lambda chunk: len(chunk.block_keys) * BLOCK_BYTES, write).stored


def fill(client: KVTierClient, seed: int) -> None:
    """Store more than L1 holds in another namespace: everything not leased is evicted (lru)."""
    store(client, FILLER, prompt(seed, 1100 * RANK0.chunk_size))


def test_lookup_promises_only_what_every_rank_holds(kvtier_server):
    http_port = free_port()
    srv = kvtier_server(l1_gb=0.0625, extra=["--http-port", str(http_port), "--eviction-policy", "lru"])
    admin = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=10)
    worker0, worker1, scheduler = (KVTierClient(ClientConfig(url=srv.url, strict=True)) for _ in range(3))
    tokens = prompt(5, TOKENS)
    assert store(worker0, RANK0, tokens) == 4 and store(worker1, RANK1, tokens) == 4
    assert scheduler.lookup(RANK0, tokens, ranks=[RANK1]).tokens == TOKENS

    # Rank 1's chunks cleared: rank 0 alone still holds the whole prompt, the engine holds none of it.
    r = admin.post("/cache/clear", json={"scope": "namespace", "namespace": RANK1.fingerprint().hex()})
    assert r.status_code == 200 and r.json()["cleared_entries"] == 4
    assert scheduler.lookup(RANK0, tokens).tokens == TOKENS
    found = scheduler.lookup(RANK0, tokens, lease=True, ranks=[RANK1])
    assert (found.tokens, found.lease) == (0, 0)

    # Rank 1 holds 2 chunks and 2 blocks of the prompt: that is all the engine can load, and its lease
    # holds both ranks' chunks through an eviction of everything else.
    assert store(worker1, RANK1, tokens[:160]) == 3
    found = scheduler.lookup(RANK0, tokens, lease=True, ranks=[RANK1])
    assert found.tokens == 160 and found.matches == [4, 4, 2] and found.lease
    fill(scheduler, 6)
    assert worker0.lookup(RANK0, tokens).tokens == 192  # rank 0's leased chunks (3 of 4)
    assert worker1.lookup(RANK1, tokens).tokens == 160
    assert scheduler.release([found.lease]) == 1
    fill(scheduler, 7)
    assert worker0.lookup(RANK0, tokens).tokens == worker1.lookup(RANK1, tokens).tokens == 0

    # Rank 0 evicted while rank 1 is stored again: the minimum is rank 0's.
    assert store(worker1, RANK1, tokens) == 4 and store(worker0, RANK0, tokens[:64]) == 1
    assert scheduler.lookup(RANK0, tokens, lease=True, ranks=[RANK1]).tokens == 64


def test_ranks_must_match_the_chunks(kvtier_server):
    """Each rank's chunk keys must cut the prompt at the same tokens: anything else is a bad request."""
    srv = kvtier_server(l1_gb=0.0625)
    client = KVTierClient(ClientConfig(url=srv.url, strict=True))
    tokens = prompt(8, TOKENS)
    with pytest.raises(KVTierError, match="as many blocks"):
        client.lookup_chunks(RANK0, chunk_keys(RANK0, tokens), ranks=[(RANK1, chunk_keys(RANK1, tokens[:200]))])
    assert client.lookup_chunks(RANK0, chunk_keys(RANK0, tokens), ranks=[(RANK1, chunk_keys(RANK1, tokens))]).tokens == 0
