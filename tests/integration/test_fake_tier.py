"""A tier has one room: a third lower tier kvtier does not ship (fake_tier.py, registered by import path with
--extra-tiers, no change to kvtier's code) shows up in /status, the Prometheus metrics, the `stats` op and the
daemon feed, and serves lookups (its chunks promoted back into L1 after L1 is cleared)."""

from __future__ import annotations

import itertools
from pathlib import Path

import httpx
import pytest
import zmq
from _support import free_port, prompt, wait_for
from kvtier.connector.client import ClientConfig, KVTierClient
from test_event_feed import L1_GB, NS, Consumer, joined, store

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent


def test_a_plug_in_tier_shows_in_status_metrics_stats_and_feed(kvtier_server, tmp_path):
    pub, http = f"ipc://{tmp_path}/feed.sock", free_port()
    srv = kvtier_server(l1_gb=L1_GB, extra=["--events-endpoint", pub, "--http-port", str(http),
                                            "--extra-tiers", "fake_tier:make"],
                        env={"PYTHONPATH": str(HERE)})
    ctx = zmq.Context()
    feed = Consumer(ctx, pub)
    c = KVTierClient(ClientConfig(url=srv.url, strict=True))
    base = f"http://127.0.0.1:{http}"
    try:
        joined(c, feed, itertools.count(1))
        tokens = prompt(10_000, 2 * NS.chunk_size)
        keys = store(c, tokens)
        for key in keys:
            feed.wait("the chunk written to the fake tier", type="Stored", tier="fake", key=key)
        wait_for(lambda: c.stats()["fake_written"] >= len(keys), timeout=20, what="the fake tier's writes")

        stats = c.stats()  # the `stats` op: the common facts of every tier, and the tier's own
        assert stats["fake_enabled"] is True and stats["fake_entries"] >= len(keys)
        assert stats["fake_puts"] == stats["fake_written"] and stats["fake_used_bytes"] > 0

        status = httpx.get(f"{base}/status", timeout=10).json()
        [fake] = [t for t in status["tiers"] if t["name"] == "fake"]
        assert fake["fake_entries"] == stats["fake_entries"] and fake["fake_puts"] == stats["fake_puts"]

        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        assert f'kvtier_entries{{tier="fake"}} {float(stats["fake_entries"])}' in metrics
        assert f"kvtier_fake_written_chunks {float(stats['fake_written'])}" in metrics
        assert f"kvtier_fake_used_bytes {float(stats['fake_used_bytes'])}" in metrics
        assert 'kvtier_tier_read_bandwidth_bytes_per_second{tier="fake"}' in metrics

        # only the fake tier holds the prompt now: a lookup finds it there and promotes it into L1
        r = httpx.post(f"{base}/cache/clear", json={"scope": "tier", "tier": "l1"}, timeout=10)
        assert r.status_code == 200, r.text
        found = c.lookup(NS, tokens)
        assert found.tiers == ["fake"] * len(keys) and found.matches == [NS.chunk_size // NS.block_size] * len(keys)
        wait_for(lambda: c.stats()["fake_promoted"] == len(keys), timeout=20, what="the promotions")
        assert c.lookup(NS, tokens).tiers == ["l1"] * len(keys)
        assert c.stats()["fake_reads"] == len(keys)
        assert 'kvtier_hit_tokens_total{tier="fake"} ' + f"{float(len(tokens))}" in httpx.get(
            f"{base}/metrics", timeout=10).text
    finally:
        c.close()
        ctx.destroy(linger=0)
