"""Chunks stored by one client process are found, byte for byte, by another; other namespaces miss."""

from __future__ import annotations

import dataclasses

import pytest
from _support import run_client
from kvtier.server.keys import Namespace

pytestmark = pytest.mark.integration

NS = Namespace(model="org/tiny", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64, block_size=16,
               layout="NHD", chunk_size=256, tp_size=2, tp_rank=0)
N_CHUNKS = 1000
CHUNK_BYTES = 64 * 1024


def test_cross_process_store_and_retrieve_exact_bytes(kvtier_server):
    srv = kvtier_server(l1_gb=0.125)  # 128 MiB for 62.5 MiB of chunks: nothing is evicted
    ns = NS.to_dict()
    stored = run_client("store_prompt", url=srv.url, ns=ns, seed=11, n_chunks=N_CHUNKS, chunk_bytes=CHUNK_BYTES)
    assert stored["stored"] == N_CHUNKS and not stored["refused"]
    assert None not in stored["digests"] and len(set(stored["digests"])) == N_CHUNKS

    got = run_client("retrieve_prompt", url=srv.url, ns=ns, seed=11, n_chunks=N_CHUNKS)
    assert got["lookup_tokens"] == N_CHUNKS * NS.chunk_size
    assert got["retrieved_tokens"] == N_CHUNKS * NS.chunk_size
    assert got["digests"] == stored["digests"]

    # Storing the same prompt again is deduplicated.
    again = run_client("store_prompt", url=srv.url, ns=ns, seed=11, n_chunks=N_CHUNKS, chunk_bytes=CHUNK_BYTES)
    assert again["stored"] == 0 and again["existing"] == N_CHUNKS

    # Same tokens, different namespace: no hits and no bytes.
    for other in (dataclasses.replace(NS, dtype="float16"), dataclasses.replace(NS, tp_rank=1)):
        miss = run_client("retrieve_prompt", url=srv.url, ns=other.to_dict(), seed=11, n_chunks=N_CHUNKS)
        assert miss["lookup_tokens"] == 0 and miss["retrieved_tokens"] == 0
        assert miss["digests"] == [None] * N_CHUNKS
    # A different prompt in the same namespace misses too.
    miss = run_client("retrieve_prompt", url=srv.url, ns=ns, seed=12, n_chunks=10)
    assert miss["lookup_tokens"] == 0
