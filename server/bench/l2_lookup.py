"""The lookup part of `kvtier bench l2` (the lookup item of l2.py's docstring, which says what is measured and
how): a real server with --l2-path, filled and restarted on the same directory, and the lookup + acquire +
release of each prompt's chunk while it is only in L2 (a promotion) against the same as an L1 hit."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from kvtier.server.bench import common as bc
from kvtier.server.bench.l2_io import drop_page_cache

if TYPE_CHECKING:
    from kvtier.connector.client import KVTierClient

TOKENS = 256  # tokens per chunk in the lookup part


def _connect(url: str) -> KVTierClient:
    from kvtier.connector.client import ClientConfig, KVTierClient

    c = KVTierClient(ClientConfig(url=url, strict=True, request_timeout_s=60.0))
    c.connect()
    return c


def _fill(l1_gb: float, extra: list[str], ns: Any, prompts: list[np.ndarray], size: int, payload: np.ndarray,
          n: int) -> None:
    """Store each prompt's chunk through a first server and wait until its L2 queue has drained."""
    server = bc.start_server(l1_gb, extra)
    try:
        c = _connect(server.url)
        for tokens in prompts:
            res = c.store(ns, tokens, lambda _c: size, lambda _ch, span: span.write(0, payload))
            if res.stored != 1:
                raise RuntimeError(f"store failed: {res}")
        deadline = time.monotonic() + 120
        while (c.stats() or {}).get("l2_inflight", 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        s = c.stats() or {}
        if s.get("l2_inflight") or s.get("l2_written", 0) < n:
            raise RuntimeError(f"L2 writes did not drain: {s}")
        c.close()
    finally:
        server.stop()


def _time_fetches(url: str, ns: Any, prompts: list[np.ndarray]) -> tuple[list[float], list[float], list[float],
                                                                       list[float], int]:
    """For each prompt, its chunk fetched while only in L2, then again as an L1 hit. Returns the seconds of
    (promotions, L1 hits, L2 lookup replies, L1 lookup replies) and the server's l2_promoted count."""
    promote, hit, reply, l1_reply = [], [], [], []

    def fetch(tokens: np.ndarray, tier: str) -> float:
        """lookup + acquire (+ release) of the prompt's chunk, as the connector does; the acquire waits for
        a promotion in flight. Returns the time of the lookup reply alone."""
        t0 = time.perf_counter()
        found = c.lookup(ns, tokens)
        t1 = time.perf_counter()
        if [h.tier for h in found.hits] != [tier]:
            raise RuntimeError(f"expected one {tier} hit, got {found.hits}")
        if c.retrieve_chunks(ns, found.hits, lambda _chunk: None) != len(found.hits[0].chunk.block_keys):
            raise RuntimeError(f"acquire after a {tier} hit failed")
        return t1 - t0

    c = _connect(url)
    for tokens in prompts:
        t0 = time.perf_counter()
        reply.append(fetch(tokens, "l2"))
        t1 = time.perf_counter()
        l1_reply.append(fetch(tokens, "l1"))
        t2 = time.perf_counter()
        promote.append(t1 - t0)
        hit.append(t2 - t1)
    promoted = (c.stats() or {}).get("l2_promoted", 0)
    c.close()
    return promote, hit, reply, l1_reply, promoted


def bench_lookup(root: str, n: int, size: int, rng: np.random.Generator) -> dict[str, Any]:
    """n chunks (one per prompt) stored, the server restarted with the page cache dropped, each fetched twice."""
    from kvtier.server.keys import Namespace

    ns = Namespace(model="kvtier-bench-l2", dtype="bfloat16", num_layers=32, kv_heads=8, head_size=128,
                   block_size=16, layout=f"bench-l2-{size}", chunk_size=TOKENS)
    l2dir = os.path.join(root, "server-l2")
    l1_gb = max(0.25, 2.5 * n * size / (1 << 30))
    extra = ["--l2-path", l2dir, "--l2-size-gb", repr(max(1.0, 2 * n * size / (1 << 30))),
             "--l2-queue-depth", str(max(64, 2 * n)), "--eviction-policy", "lru"]
    payload = rng.integers(0, 256, size, dtype=np.uint8)
    prompts = [rng.integers(0, 1 << 31, TOKENS, dtype=np.int64) for _ in range(n)]
    _fill(l1_gb, extra, ns, prompts, size, payload, n)
    files = [e.path for e in os.scandir(l2dir) if e.name.endswith(".kv")]
    drop = drop_page_cache(files)
    server = bc.start_server(l1_gb, extra)
    try:
        promote, hit, reply, l1_reply, promoted = _time_fetches(server.url, ns, prompts)
    finally:
        server.stop()
    p, h = bc.percentiles(promote), bc.percentiles(hit)
    return {"chunks": n, "chunk_bytes": size, "cache_drop": drop, "promoted": promoted,
            "promote_lookup": p, "l1_hit_lookup": h, "l2_lookup_reply": bc.percentiles(reply),
            "l1_lookup_reply": bc.percentiles(l1_reply),
            "promotion_cost_us_p50": p["p50_us"] - h["p50_us"],
            "promotion_gbps_p50": size / ((p["p50_us"] - h["p50_us"]) * 1e3) if p["p50_us"] > h["p50_us"] else 0.0}
