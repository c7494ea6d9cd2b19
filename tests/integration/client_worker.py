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
from kvtier.connector.client import ClientConfig, KVTierClient, ReadChunk
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


if __name__ == "__main__":
    fn, kwargs = sys.argv[1], json.loads(sys.argv[2])
    out = globals()[fn](**kwargs)
    if out is not None:
        print(json.dumps(out), flush=True)
