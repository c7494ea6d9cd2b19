"""What converting the server feed's `Stored` events into the engine's own KV events costs the vLLM scheduler
process (connector/vllm/engine_events.py, on the connector's thread): microseconds per 256-token chunk, per
hash algorithm and engine block size.

Not a pytest module (no ``test_`` prefix). Run with the vLLM venv's python (it needs vLLM's hash functions)::

    $(bash scripts/vllm_env.sh) tests/e2e/bench_engine_events.py
"""

from __future__ import annotations

import time

import numpy as np
from kvtier.connector.vllm.engine_events import Converter, engine_hasher
from kvtier.server.events import Stored
from kvtier.server.feed import encode
from kvtier.server.keys import Namespace, chunk_keys
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import init_none_hash

PROMPTS, PROMPT_TOKENS, CHUNK = 200, 1024, 256


def main() -> None:
    for algo in ("sha256", "sha256_cbor", "xxhash"):
        init_none_hash(get_hash_fn_by_name(algo))
        for block in (16, 128):
            ns = Namespace(model="m", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64, block_size=block,
                           layout="bench", chunk_size=CHUNK)
            rng = np.random.default_rng(0)
            events = [encode(Stored("l1", ns.fingerprint(), c.key, len(c.block_keys), c.aliases, 1, c.tokens,
                                    c.parent))
                      for _ in range(PROMPTS) for c in chunk_keys(ns, rng.integers(10, 30_000, PROMPT_TOKENS))]
            conv = Converter(ns.fingerprint(), block, engine_hasher(algo))
            start = time.perf_counter()
            out = conv.batch({"epoch": "bench", "events": events})
            spent = time.perf_counter() - start
            assert len(out) == len(events) and not conv.skipped
            print(f"{algo:12s} block {block:4d}: {spent / len(events) * 1e6:7.1f} us per {CHUNK}-token chunk "
                  f"({len(events)} chunks)")


if __name__ == "__main__":
    main()
