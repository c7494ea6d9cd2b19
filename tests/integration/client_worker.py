"""Client code the integration tests run in separate processes: `python client_worker.py FN JSON_KWARGS`.

Each function prints one JSON object as its last stdout line (hold_and_wait prints it, then sleeps).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np
from _support import prompt
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.connector.results import ReadChunk
from kvtier.server import protocol as p
from kvtier.server.keys import Namespace, chunk_keys


def client(url: str) -> KVTierClient:
    c = KVTierClient(ClientConfig(url=url, connect_timeout_s=5.0, request_timeout_s=10.0, strict=True))
    assert c.connect()
    return c


def store_prompt(url: str, ns: dict, seed: int, n_chunks: int, chunk_bytes: int) -> dict:
    """Store every chunk of one long prompt with fresh random bytes; report each chunk's digest."""
    namespace = Namespace(**ns)
    tokens = prompt(seed, n_chunks * namespace.chunk_size)
    digests: dict[int, str] = {}

    def write(chunk, span) -> None:
        data = np.frombuffer(os.urandom(chunk_bytes), dtype=np.uint8)
        span.write(0, data)
        digests[chunk.index] = hashlib.sha256(data.tobytes()).hexdigest()

    c = client(url)
    result = c.store(namespace, tokens, lambda _c: chunk_bytes, write)
    c.close()
    return {"stored": result.stored, "existing": result.existing, "busy": result.busy,
            "refused": result.refused, "digests": [digests.get(i) for i in range(n_chunks)]}


def retrieve_prompt(url: str, ns: dict, seed: int, n_chunks: int) -> dict:
    """Look the prompt up, then copy every stored chunk out; report hits and each chunk's digest."""
    namespace = Namespace(**ns)
    tokens = prompt(seed, n_chunks * namespace.chunk_size)
    c = client(url)
    looked = c.lookup(namespace, tokens)
    digests: dict[int, str] = {}

    def read(rc: ReadChunk) -> None:
        buf = np.empty(rc.span.size, dtype=np.uint8)
        rc.span.read(0, buf)
        digests[rc.chunk.index] = hashlib.sha256(buf.tobytes()).hexdigest()

    retrieved = c.retrieve(namespace, tokens, read)
    c.close()
    return {"lookup_tokens": looked.tokens, "retrieved_tokens": retrieved,
            "digests": [digests.get(i) for i in range(n_chunks)]}


def hold_and_wait(url: str, ns: dict, seed: int, n_chunks: int, reserve_seed: int, n_reserve: int,
                  chunk_bytes: int) -> None:
    """Lease every chunk of prompt `seed` and reserve (never commit) the chunks of prompt `reserve_seed`,
    announce it, then sleep until killed."""
    namespace = Namespace(**ns)
    c = client(url)
    keys = [k.key for k in chunk_keys(namespace, prompt(seed, n_chunks * namespace.chunk_size))]
    acquired = c._request({"op": "acquire", "keys": keys}, namespace)
    chunks = chunk_keys(namespace, prompt(reserve_seed, n_reserve * namespace.chunk_size))
    items = [p.StoreItem(k.key, chunk_bytes, len(k.block_keys), k.aliases).to_wire() for k in chunks]
    reserved = c._request({"op": "reserve", "items": items}, namespace)
    print(json.dumps({
        "lease": acquired["lease"],
        "acquired": sum(i is not None for i in acquired["items"]),
        "reserved": sum(r[0] == p.RESERVED for r in reserved["results"]),
    }), flush=True)
    time.sleep(120)


def chunk_bytes_of(seed: int, index: int, size: int) -> np.ndarray:
    """The bytes a test stores for chunk `index` of prompt `seed`: distinct for every chunk."""
    block = hashlib.blake2b(f"{seed}/{index}".encode()).digest()
    return np.frombuffer((block * (size // len(block) + 1))[:size], dtype=np.uint8)


def slow_store(url: str, ns: dict, seed: int, n_chunks: int, chunk_bytes: int, delay_s: float) -> dict:
    """Reserve every chunk of prompt `seed`, announce it, stall `delay_s` inside the first copy (a slow,
    swapped or stopped engine), then write this writer's bytes and commit."""
    namespace = Namespace(**ns)
    tokens = prompt(seed, n_chunks * namespace.chunk_size)
    stalled = False

    def write(chunk, span) -> None:
        nonlocal stalled
        if not stalled:
            stalled = True
            print(json.dumps({"reserved": True}), flush=True)
            time.sleep(delay_s)
        span.write(0, chunk_bytes_of(seed, chunk.index, chunk_bytes))

    c = client(url)
    result = c.store(namespace, tokens, lambda _c: chunk_bytes, write)
    c.close()
    return {"stored": result.stored, "refused": result.refused}


def slow_read(url: str, ns: dict, seed: int, n_chunks: int, delay_s: float) -> dict:
    """Retrieve prompt `seed`, stalling `delay_s` inside the first copy; report the tokens the client said
    it read and which chunks' bytes were not the ones stored (chunk_bytes_of)."""
    namespace = Namespace(**ns)
    tokens = prompt(seed, n_chunks * namespace.chunk_size)
    stalled = False
    wrong: list[int] = []

    def read(rc: ReadChunk) -> None:
        nonlocal stalled
        if not stalled:
            stalled = True
            print(json.dumps({"leased": True}), flush=True)
            time.sleep(delay_s)
        buf = np.empty(rc.span.size, dtype=np.uint8)
        rc.span.read(0, buf)
        if not np.array_equal(buf, chunk_bytes_of(seed, rc.chunk.index, rc.span.size)):
            wrong.append(rc.chunk.index)

    c = client(url)
    retrieved = c.retrieve(namespace, tokens, read)
    c.close()
    return {"retrieved_tokens": retrieved, "wrong_chunks": wrong}


def gpu_store_and_hang(url: str, name: str, tokens: int) -> None:
    """A GPU worker (the fake device named `name`) whose stream never reaches the event of its store: it
    reports the store sent, then waits to be killed."""
    from _gpu_rig import FakeGpuWorker, namespace

    worker = FakeGpuWorker("LBNHC", name)
    _, transfers = worker.transfers(url)
    worker.events.hold = True
    blocks = -(-tokens // 16)
    submitted = transfers.store("hang", namespace("LBNHC"), prompt(1, tokens).tolist(), list(range(blocks)))
    print(json.dumps({"submitted": submitted is not None}), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    fn, kwargs = sys.argv[1], json.loads(sys.argv[2])
    out = globals()[fn](**kwargs)
    if out is not None:
        print(json.dumps(out), flush=True)
