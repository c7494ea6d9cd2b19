"""The client's side of request hints against a real server (docs/hints.md): `store(..., hint=...)` carries the
hint in its reserve, so a retained prompt and a live session's survive a flood that evicts a plain one;
`end_session` ends a session once (its chunks then go like any other), and never raises, not even with the
server gone."""

from __future__ import annotations

import numpy as np
import pytest
from _support import prompt
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server import protocol as p
from kvtier.server.keys import Namespace

pytestmark = pytest.mark.integration

NS = Namespace(model="org/tiny", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64, block_size=128,
               layout="cpu", chunk_size=256)
BLOCK_BYTES = 256 << 10
L1_GB = 0.0625  # 256 blocks
TOKENS = 2048  # 16 blocks, 8 chunks


def store(c: KVTierClient, seed: int, hint: p.Hint = p.NO_HINT) -> int:
    fill = np.full(2 * BLOCK_BYTES, seed % 251, dtype=np.uint8)
    result = c.store(NS, prompt(seed, TOKENS), lambda ch: len(ch.block_keys) * BLOCK_BYTES,
                     lambda ch, span: span.write(0, fill[: len(ch.block_keys) * BLOCK_BYTES]), hint=hint)
    return result.stored


def flood(c: KVTierClient, first_seed: int) -> None:
    """Unrelated prompts twice L1's size."""
    for seed in range(first_seed, first_seed + 2 * 256 // 16 + 1):
        store(c, seed)


def held(c: KVTierClient, seed: int) -> int:
    return c.lookup(NS, prompt(seed, TOKENS)).tokens


def test_hinted_stores_survive_a_flood_until_their_session_ends(kvtier_server):
    srv = kvtier_server(l1_gb=L1_GB, extra=["--eviction-policy", "lru"])
    c = KVTierClient(ClientConfig(url=srv.url, strict=True))
    assert store(c, 1) == 8
    assert store(c, 2, p.Hint(retain_s=600)) == 8
    assert store(c, 3, p.Hint(session="conv-1")) == 8
    flood(c, 100)
    assert (held(c, 1), held(c, 2), held(c, 3)) == (0, TOKENS, TOKENS)
    assert c.end_session("conv-1") is True
    assert c.end_session("conv-1") is False  # ended already
    assert c.end_session("never-started") is False
    flood(c, 200)
    assert (held(c, 2), held(c, 3)) == (TOKENS, 0)


def test_end_session_never_raises(kvtier_server):
    srv = kvtier_server(l1_gb=L1_GB)
    c = KVTierClient(ClientConfig(url=srv.url, request_timeout_s=0.5, retry_backoff_s=0.1))
    assert store(c, 1, p.Hint(session="s")) == 8
    assert c.end_session("x" * (p.MAX_SESSION_ID + 1)) is False  # refused by the server (bad_request): logged
    srv.kill()
    assert c.end_session("s") is False  # no server: logged, not raised
