"""Asynchronous L2 -> L1 promotion against a real server process and real chunk files: lookups after a
restart answer before the reads finish, other clients are served during them, acquires get bit-exact bytes,
corrupt files are counted misses, shutdown and a SIGKILLed client leak nothing, and the measured tier
bandwidth shows up in stats, /metrics and lookup replies."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from _support import HERE, REPO, free_port, payload_of, prompt, read_checked, wait_for
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server.keys import Namespace, chunk_keys

pytestmark = pytest.mark.integration

NS = Namespace(model="org/tiny-l2-promo", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64,
               block_size=16, layout="NHD", chunk_size=256)
BIG = 1 << 20  # bytes per chunk of the large promotion (16 pages of 64 KiB)
HELD = ("leases", "reservations", "pinned_bytes", "l2_promoting", "l2_promoting_bytes")



def client(url: str) -> KVTierClient:
    c = KVTierClient(ClientConfig(url=url, connect_timeout_s=5.0, request_timeout_s=20.0, strict=True))
    assert c.connect()
    return c


def store_all(c: KVTierClient, prompts, size: int) -> None:
    for tokens in prompts:
        n = len(chunk_keys(NS, tokens))
        assert c.store(NS, tokens, lambda _c: size, lambda ch, span: span.write(0, payload_of(ch.key, size))).stored == n
    wait_for(lambda: (s := c.stats()) and s["l2_inflight"] == 0 and s["l2_written"] >= sum(
        len(chunk_keys(NS, t)) for t in prompts), timeout=120, what="L2 writes durable")



def restart(srv, sig: int = signal.SIGTERM) -> None:
    srv.signal(sig)
    assert srv.proc.wait(timeout=30) == (0 if sig == signal.SIGTERM else -sig), srv.log_text()
    srv.start()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def test_promotion_overlaps_and_is_bit_exact_with_bandwidth_reported(kvtier_server, tmp_path):
    http = free_port()
    srv = kvtier_server(l1_gb=0.5, extra=["--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "1",
                                          "--l2-queue-depth", "512", "--http-port", str(http), "--no-l1-adopt"])
    n_big = 112  # 112 MiB: under the in-flight cap (a quarter of L1)
    big = prompt(1, n_big * NS.chunk_size)
    small = [prompt(10 + i, 4 * NS.chunk_size) for i in range(3)]
    c = client(srv.url)
    store_all(c, [big], BIG)
    store_all(c, small, 64 * 1024)
    s = c.stats()
    assert s["l2_write_bytes_per_s"] > 0 and s["l2_read_bytes_per_s"] == 0.0
    c.close()
    restart(srv)

    a, b = client(srv.url), client(srv.url)
    looked = a.lookup(NS, big)
    # The reply did not wait for the reads: it reports every chunk from L2, and no read had finished
    # when it was built (the bandwidth of the first promotions after a restart is still unmeasured).
    assert [h.tier for h in looked.hits] == ["l2"] * n_big and looked.tokens == len(big)
    assert looked.bandwidth == {"l2": 0.0}
    during = b.stats()  # another client, answered while the promotion runs
    assert during["l2_promoted"] < n_big, during
    assert read_checked(a, NS, looked.hits) == n_big * NS.chunk_size // NS.block_size  # waits, then bit-exact
    s = b.stats()
    assert s["l2_promoted"] == n_big and s["l2_promoting"] == 0 and s["l2_promotion_failures"] == 0
    assert s["l2_read_bytes_per_s"] > 0 and s["leases"] == 0
    again = a.lookup(NS, big)
    assert [h.tier for h in again.hits] == ["l1"] * n_big and again.bandwidth == {}
    other = a.lookup(NS, small[0])
    assert [h.tier for h in other.hits] == ["l2"] * 4 and other.bandwidth["l2"] > 0
    assert read_checked(a, NS, other.hits) == 4 * NS.chunk_size // NS.block_size
    text = scrape(http)
    bw = [line for line in text.splitlines()
          if line.startswith('kvtier_tier_read_bandwidth_bytes_per_second{tier="l2"}')]
    assert bw and float(bw[0].split()[-1]) > 0, bw
    assert "kvtier_l2_promotion_waits_total" in text and 'kvtier_tier_write_bandwidth_bytes_per_second{tier="l2"}' in text
    a.close()
    b.close()

    # Shutdown while a large promotion is in flight: a clean exit (the reads finish before the segment
    # is unmapped), and the files are intact afterwards.
    restart(srv)
    a = client(srv.url)
    assert [h.tier for h in a.lookup(NS, big).hits] == ["l2"] * n_big
    restart(srv)
    log = srv.log_text()
    assert "Traceback" not in log and "segment removed" in log
    a = client(srv.url)
    looked = a.lookup(NS, small[1])
    assert read_checked(a, NS, looked.hits) == 4 * NS.chunk_size // NS.block_size
    a.close()


def test_corrupt_file_found_at_promotion_is_a_counted_miss(kvtier_server, tmp_path):
    l2 = tmp_path / "l2"
    srv = kvtier_server(l1_gb=0.0625, extra=["--page-size-kb", "4", "--l2-path", str(l2), "--l2-size-gb", "1",
                                             "--no-l1-adopt"])
    prompts = [prompt(40 + i, 2 * NS.chunk_size) for i in range(2)]
    c = client(srv.url)
    store_all(c, prompts, 16384)
    c.close()
    victim = chunk_keys(NS, prompts[0])[0].key
    path = l2 / f"{victim.hex()}.kv"
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF  # a payload byte: only the checksum at promotion can tell
    path.write_bytes(bytes(raw))
    restart(srv)
    c = client(srv.url)
    looked = c.lookup(NS, prompts[0])
    assert [h.tier for h in looked.hits] == ["l2", "l2"]  # reported before the read found the damage
    assert read_checked(c, NS, looked.hits) == 0  # the first chunk is a miss, so nothing of the prefix loads
    s = c.stats()
    assert s["l2_promotion_failures"] == 1 and s["l2_corrupt_chunks"] == 1 and not path.exists()
    assert s["leases"] == 0 and s["l2_promoting"] == 0
    looked = c.lookup(NS, prompts[1])
    assert read_checked(c, NS, looked.hits) == 2 * NS.chunk_size // NS.block_size
    c.close()


HOLDER = """
import json, sys, time
sys.path.insert(0, {here!r})
from _support import prompt
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server.keys import Namespace, chunk_keys
ns = Namespace(**{ns!r})
c = KVTierClient(ClientConfig(url={url!r}, request_timeout_s=20.0, strict=True))
assert c.connect()
chunks = chunk_keys(ns, prompt({seed}, {n} * ns.chunk_size))
reply = c._request({{"op": "lookup", "chunks": [list(k.block_keys) for k in chunks], "acquire": True}}, ns)
print(json.dumps({{"tiers": reply["tiers"], "lease": reply.get("lease", 0)}}), flush=True)
time.sleep(600)
"""


def test_sigkilled_client_after_lookup_with_promotion_leaks_nothing(kvtier_server, tmp_path):
    srv = kvtier_server(l1_gb=0.0625, extra=["--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "1",
                                             "--client-timeout-s", "2", "--lease-ttl-s", "60", "--no-l1-adopt"])
    n = 20
    c = client(srv.url)
    store_all(c, [prompt(70, n * NS.chunk_size)], 100 * 1024)
    c.close()
    restart(srv)
    c = client(srv.url)
    before = c.stats()
    assert before["entries"] == 0 and all(before[f] == 0 for f in HELD)
    code = HOLDER.format(here=str(HERE), ns=NS.to_dict(), url=srv.url, seed=70, n=n)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=REPO, start_new_session=True)
    try:
        ready, _, _ = select.select([holder.stdout], [], [], 30)
        assert ready, "the holder did not report"
        line = holder.stdout.readline()
        assert line, holder.stderr.read()
        held = json.loads(line)
        assert held["tiers"] == ["l2"] * n and held["lease"] > 0
        assert c.stats()["leases"] == 1
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=10)
        holder.stdout.close()
        holder.stderr.close()

    def settled():
        s = c.stats()
        return s if all(s[f] == before[f] for f in HELD) else None

    after = wait_for(settled, timeout=15, interval=0.2, what="nothing held after the client died")
    # Exactly the promoted chunks remain, as ordinary evictable L1 entries; every other page is free.
    assert after["entries"] == n and after["l2_promoted"] == n
    assert after["evictable_bytes"] == after["l1_used_bytes"] == n * 2 * after["page_size"]
    assert after["l1_free_pages"] * after["page_size"] + after["l1_used_bytes"] == after["l1_capacity_bytes"]
    c.close()


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_cache_clear_reaches_l2_by_scope(kvtier_server, tmp_path):
    """/cache/clear with L2: scope tier=l1 leaves L2 (the next lookup promotes), tier=l2 leaves L1, a namespace
    known only to L2 (after a restart) is cleared there, and scope all empties both tiers and their files."""
    l2, http = tmp_path / "l2", free_port()
    srv = kvtier_server(l1_gb=0.0625, extra=["--page-size-kb", "4", "--l2-path", str(l2), "--l2-size-gb", "1",
                                             "--http-port", str(http), "--no-l1-adopt"])
    ns_b = dataclasses.replace(NS, model="org/tiny-l2-other")
    p_a, p_b = prompt(70, 2 * NS.chunk_size), prompt(71, 2 * NS.chunk_size)
    c = client(srv.url)
    store_all(c, [p_a], 16384)
    assert c.store(ns_b, p_b, lambda _c: 16384, lambda ch, span: span.write(0, payload_of(ch.key, 16384))).stored == 2
    wait_for(lambda: c.stats()["l2_written"] >= 4 and c.stats()["l2_inflight"] == 0, timeout=60, what="L2 writes")

    code, r = post(http, "/cache/clear", {"scope": "tier", "tier": "l1"})
    assert code == 200 and set(r["tiers"]) == {"l1"} and r["tiers"]["l1"]["entries"] == 4, r
    looked = c.lookup(NS, p_a)
    assert [h.tier for h in looked.hits] == ["l2", "l2"] and read_checked(c, NS, looked.hits) == 32

    code, r = post(http, "/cache/clear", {"scope": "tier", "tier": "l2"})
    assert code == 200 and r["tiers"]["l2"]["entries"] == 4 and "l1" not in r["tiers"], r
    assert [h.tier for h in c.lookup(NS, p_a).hits] == ["l1", "l1"]  # promoted before the clear: L1 keeps it
    assert sorted(os.listdir(l2)) == [] and c.stats()["l2_entries"] == 0
    c.store(ns_b, p_b, lambda _c: 16384, lambda ch, span: span.write(0, payload_of(ch.key, 16384)))
    wait_for(lambda: c.stats()["l2_entries"] == 2 and c.stats()["l2_inflight"] == 0, timeout=60, what="L2 writes")
    c.close()

    restart(srv)  # namespace B is now only in L2, registered by nobody
    fp_b = ns_b.fingerprint().hex()
    code, r = post(http, "/cache/clear", {"scope": "namespace", "namespace": fp_b})
    assert code == 200 and r["tiers"] == {"l1": {"entries": 0, "bytes": 0}, "l2": r["tiers"]["l2"]}, r
    assert r["tiers"]["l2"]["entries"] == 2 and r["cleared_entries"] == 2
    code, r = post(http, "/cache/clear", {"scope": "namespace", "namespace": fp_b})
    assert code == 404, r  # nothing left of it anywhere
    c = client(srv.url)
    assert c.lookup(ns_b, p_b).hits == []
    store_all(c, [p_a], 16384)
    code, r = post(http, "/cache/clear", {"scope": "all"})
    assert code == 200 and r["tiers"]["l1"]["entries"] >= 2 and r["tiers"]["l2"]["entries"] >= 2, r
    assert c.lookup(NS, p_a).hits == [] and os.listdir(l2) == []
    s = c.stats()
    assert s["l2_entries"] == 0 and s["l2_used_bytes"] == 0 and s["leases"] == 0
    c.close()
