"""A document followed by different questions, on disk: after a restart, one question's chunk file is gone,
and the document's leading block is still found in L2 through the other question's chunk (the disk tier
shares L1's prefix index rules: server/index.py)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from _support import prompt, wait_for
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server.keys import Namespace, chunk_keys
from kvtier.server.tiers.fs_io import file_name

pytestmark = pytest.mark.integration

NS = Namespace(model="org/tiny-shared-alias", dtype="bfloat16", num_layers=1, kv_heads=2, head_size=64,
               block_size=128, layout="cpu", chunk_size=256)
BLOCK_BYTES = 8192


def block_bytes(key: bytes) -> np.ndarray:
    """Fake KV of one block: a function of its prefix key, as real KV is of the prefix tokens."""
    return np.random.default_rng(int.from_bytes(key, "little")).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


def write(chunk, span) -> None:  # type: ignore[no-untyped-def]
    span.write(0, np.concatenate([block_bytes(k) for k in chunk.block_keys]))


def found_blocks(c: KVTierClient, tokens: np.ndarray) -> int:
    """Blocks a lookup finds and an acquire then reads, every byte checked against the block model."""
    def read(rc) -> None:  # type: ignore[no-untyped-def]
        buf = np.empty(rc.match * BLOCK_BYTES, dtype=np.uint8)
        rc.span.read(0, buf)
        want = np.concatenate([block_bytes(k) for k in rc.chunk.block_keys[: rc.match]])
        assert np.array_equal(buf, want), "bytes of another chunk were served"

    return c.retrieve_chunks(NS, c.lookup(NS, tokens).hits, read)


def test_shared_leading_block_survives_the_loss_of_one_holder_after_restart(kvtier_server, tmp_path):
    l2 = tmp_path / "l2"
    srv = kvtier_server(l1_gb=0.0625, extra=["--l2-path", str(l2), "--l2-size-gb", "0.0625", "--no-l1-adopt"])
    doc = prompt(1, 3 * NS.block_size)  # chunk 0 (2 blocks) + the first block of chunk 1
    asks = [np.concatenate([doc, prompt(10 + q, NS.block_size)]) for q in range(3)]  # doc + question q
    c = KVTierClient(ClientConfig(url=srv.url, strict=True))
    for n, tokens in enumerate(asks[:2], start=2):  # one after the other: the first question's file is older
        c.store(NS, tokens, lambda ch: len(ch.block_keys) * BLOCK_BYTES, write)
        wait_for(lambda n=n: (s := c.stats()) and s["l2_inflight"] == 0 and s["l2_written"] >= n, timeout=60,
                 what="the chunks durable in L2")
        time.sleep(0.05)
    c.close()
    srv.signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=30) == 0
    srv.start()  # L1 empty; the L2 index rebuilt by the scan, oldest first: the shared block's key -> question 0
    os.unlink(l2 / file_name(chunk_keys(NS, asks[0])[1].key))  # question 0's chunk 1 is gone from the disk
    c = KVTierClient(ClientConfig(url=srv.url, strict=True))
    third = asks[2]
    # The first lookup picks the lost file (the index has it until a read finds it missing): 2 blocks...
    assert found_blocks(c, third) == 2
    # ...then the shared block is found through question 1's chunk, promoted into L1 and read bit-exact.
    wait_for(lambda: found_blocks(c, third) == 3, timeout=30, what="the shared block found again")
    st = c.stats()
    assert st["l2_entries"] == 2 and st["l2_promotion_failures"] == 1  # chunk 0 and question 1's chunk 1
    c.close()
