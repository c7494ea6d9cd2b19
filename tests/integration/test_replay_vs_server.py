"""The trace replay against a real server: the same connector steps, through KVTierClient over ZeroMQ to a
`kvtier server` process, find exactly the blocks the in-process replay finds, read by read."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.connector.results import ReadChunk
from kvtier.server.bench.trace_replay import drive, replay
from kvtier.server.bench.trace_workloads import Geometry, Trace, chat_trace, cyclic_trace, zipf_trace
from kvtier.server.eviction import DEFAULT_POLICY
from kvtier.server.keys import ChunkKeys, Namespace

pytestmark = pytest.mark.integration

CAPACITY = 256  # pages of 64 KiB: a 16 MiB L1
GEOMETRY = Geometry(block_bytes=64 << 10)  # one page per block keeps the server small
NS = Namespace(model="replay/check", dtype="bfloat16", num_layers=1, kv_heads=1, head_size=64,
               block_size=GEOMETRY.block_tokens, layout="cpu",
               chunk_size=GEOMETRY.block_tokens * GEOMETRY.chunk_blocks)


class RealServer:
    """The connector's calls, one KVTierClient per engine: lookup, then the load (acquire + release) of what
    it found, and reserve/write/commit for the store."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.clients: dict[int, KVTierClient] = {}
        self.loaded_blocks = 0

    def _client(self, engine: int) -> KVTierClient:
        if engine not in self.clients:
            self.clients[engine] = KVTierClient(ClientConfig(url=self.url, strict=True))
        return self.clients[engine]

    def lookup(self, engine: int, chunks: Sequence[ChunkKeys]) -> list[int]:
        client = self._client(engine)
        found = client.lookup_chunks(NS, list(chunks))
        if found.hits:
            self.loaded_blocks += client.retrieve_chunks(NS, found.hits, _ignore)
        return list(found.matches)

    def store(self, engine: int, chunks: Sequence[ChunkKeys], sizes: Sequence[int]) -> None:
        size_of = dict(zip((c.key for c in chunks), sizes, strict=True))
        self._client(engine).store_chunks(NS, list(chunks), lambda c: size_of[c.key], _write)

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


def _ignore(_chunk: ReadChunk) -> None:
    return None


def _write(_chunk: ChunkKeys, span) -> None:  # type: ignore[no-untyped-def]
    span.write(0, ONE_BYTE)


ONE_BYTE = np.ones(1, dtype=np.uint8)
TRACES: dict[str, Trace] = {
    "cyclic-1.6x": cyclic_trace(CAPACITY, GEOMETRY, 1.6, seed=3),
    "zipf": zipf_trace(CAPACITY, GEOMETRY, seed=3, requests=250),
    "chat": chat_trace(CAPACITY, GEOMETRY, seed=3, sessions=40),
}


@pytest.mark.parametrize("policy", [DEFAULT_POLICY, "lru"])
@pytest.mark.parametrize("workload", sorted(TRACES))
def test_server_finds_what_the_replay_finds(kvtier_server, policy: str, workload: str) -> None:
    trace = TRACES[workload]
    expected = replay(policy, trace, CAPACITY, GEOMETRY)
    srv = kvtier_server(l1_gb=CAPACITY * GEOMETRY.page_bytes / (1 << 30), extra=["--eviction-policy", policy])
    server = RealServer(srv.url)
    try:
        got = drive(server, trace, GEOMETRY)
    finally:
        server.close()
    assert got.requested == expected.requested
    assert got.hits == expected.hits
    assert server.loaded_blocks == expected.hit_blocks
    if workload == "cyclic-1.6x":  # the check is about something: the loop is larger than L1
        assert expected.hit_blocks > 0 if policy == DEFAULT_POLICY else expected.hit_blocks == 0
