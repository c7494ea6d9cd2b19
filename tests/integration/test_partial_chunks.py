"""Block-granular matching end to end: a lookup that ends inside a stored chunk loads its leading blocks."""

from __future__ import annotations

import numpy as np
import pytest
from _support import prompt
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.connector.results import ReadChunk
from kvtier.server.keys import Namespace

pytestmark = pytest.mark.integration

CPU_NS = Namespace(model="org/tiny", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64, block_size=128,
                   layout="cpu", chunk_size=256)
BLOCK_BYTES = 8192  # bytes of one engine block in this fake layout


def chunk_bytes(chunk) -> np.ndarray:
    """Fake KV: each block's bytes are a function of its prefix key, as real KV is of the prefix tokens."""
    return np.concatenate([
        np.random.default_rng(int.from_bytes(k, "little")).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)
        for k in chunk.block_keys
    ])


def test_document_then_different_questions(kvtier_server):
    srv = kvtier_server(l1_gb=0.0625)
    c = KVTierClient(ClientConfig(url=srv.url, strict=True))
    doc = prompt(9, 1020)
    def write(chunk, span) -> None:
        span.write(0, chunk_bytes(chunk))

    r = c.store(CPU_NS, doc, lambda ch: len(ch.block_keys) * BLOCK_BYTES, write)
    assert r.stored == 4  # three full chunks and the partial one (1 block)
    assert c.lookup(CPU_NS, doc).tokens == 896  # 7 blocks of 128; LMCache would reload 768

    # The same document followed by a question: the 4th chunk of this prompt is full and differs from the
    # stored partial one after its first block, yet that first block is shared.
    asked = np.concatenate([doc[:896], prompt(10, 500)])
    reads: list[ReadChunk] = []

    def read(rc: ReadChunk) -> None:
        n = rc.match * BLOCK_BYTES
        buf = np.empty(n, dtype=np.uint8)
        rc.span.read(0, buf)
        assert np.array_equal(buf, chunk_bytes(rc.chunk)[:n])
        reads.append(rc)

    assert c.retrieve(CPU_NS, asked, read) == 896
    assert [(rc.blocks, rc.match) for rc in reads] == [(2, 2), (2, 2), (2, 2), (1, 1)]

    # Now store the longer prompt: its chunk 4 (2 blocks) is stored; a third question that shares only the
    # document finds chunk 4's first block through either entry.
    r = c.store(CPU_NS, asked, lambda ch: len(ch.block_keys) * BLOCK_BYTES, write)
    assert (r.existing, r.stored) == (3, 2), r  # full chunk 4 and a partial chunk 5
    third = np.concatenate([doc[:896], prompt(11, 300)])
    reads.clear()
    assert c.retrieve(CPU_NS, third, read) == 896
    assert reads[-1].match == 1

    # A prompt ending on a block boundary inside a stored full chunk loads only the leading blocks.
    short = asked[: 768 + 128 + 100]
    reads.clear()
    assert c.retrieve(CPU_NS, short, read) == 896
    assert reads[-1].match == 1
    c.close()
