"""Tenant quotas in the L2 disk tier against a real server process, real clients and real chunk files: two
tenants by cache salt, B guaranteed a share by --l2-tenant-quotas; A's flood of more than L2 leaves B's chunk
files on disk (without the table they go); /status and /metrics show the tenants; after a restart B's files
count to `*` until B's namespace registers again."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from _support import free_port, payload_of, prompt, wait_for
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server.keys import Namespace, chunk_keys
from kvtier.server.tiers.fs_io import file_name

pytestmark = pytest.mark.integration

NS = Namespace(model="org/tiny-l2-tenants", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64,
               block_size=16, layout="NHD", chunk_size=256)
NS_A = dataclasses.replace(NS, cache_salt="engine|A")  # the request's part names the tenant
NS_B = dataclasses.replace(NS, cache_salt="B")
SIZE = 256 * 1024  # payload bytes a chunk
FILE = 4096 + SIZE  # its file: one header block and the payload
L2_BYTES = 8 << 20  # 31 files
CHUNKS = 4  # chunks a prompt


def client(url: str) -> KVTierClient:
    c = KVTierClient(ClientConfig(url=url, connect_timeout_s=5.0, request_timeout_s=20.0, strict=True))
    assert c.connect()
    return c


def store(c: KVTierClient, ns: Namespace, prompts: list) -> None:
    for tokens in prompts:
        assert c.store(ns, tokens, lambda _c: SIZE, lambda ch, span: span.write(0, payload_of(ch.key, SIZE))).stored \
            == CHUNKS
        wait_for(lambda: c.stats()["l2_inflight"] == 0, timeout=60, what="L2 writes durable")


def on_disk(l2, ns: Namespace, prompts: list) -> int:
    return sum((l2 / file_name(ch.key)).exists() for tokens in prompts for ch in chunk_keys(ns, tokens))


def get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.read().decode()


def tenants(port: int) -> dict[str, dict]:
    [l2] = [t for t in json.loads(get(port, "/status"))["tiers"] if t["name"] == "l2"]
    return {row["tenant"]: row for row in l2["l2_tenants"]}


@pytest.mark.parametrize("table", ["A=0,B=40%", ""])
def test_a_flood_leaves_the_guaranteed_tenants_chunks_on_disk(kvtier_server, tmp_path, table):
    l2, http = tmp_path / "l2", free_port()
    srv = kvtier_server(l1_gb=0.0625, extra=["--l2-path", str(l2), "--l2-size-gb", str(L2_BYTES / (1 << 30)),
                                             "--l2-tenant-quotas", table, "--http-port", str(http),
                                             "--no-l1-adopt"])
    quiet = [prompt(100 + i, CHUNKS * NS.chunk_size) for i in range(2)]  # 8 chunks, under B's 12-file guarantee
    flood = [prompt(200 + i, CHUNKS * NS.chunk_size) for i in range(20)]  # 80 chunks: 2.5x L2
    b, a = client(srv.url), client(srv.url)
    store(b, NS_B, quiet)
    assert on_disk(l2, NS_B, quiet) == 8
    store(a, NS_A, flood)
    rows = tenants(http)
    assert sum(r["used_bytes"] for r in rows.values()) <= L2_BYTES
    if not table:
        assert on_disk(l2, NS_B, quiet) == 0  # LRU: the oldest files go first
        assert list(rows) == ["*"] and rows["*"]["evictions"]["capacity"] == 8 + 80 - L2_BYTES // FILE
        return
    assert on_disk(l2, NS_B, quiet) == 8
    assert rows["B"]["entries"] == 8 and rows["B"]["used_bytes"] == 8 * FILE and rows["B"]["evictions"] == {}
    assert rows["B"]["guaranteed_bytes"] == int(0.4 * L2_BYTES) and rows["A"]["max_bytes"] == L2_BYTES
    assert rows["A"]["evictions"]["capacity"] == 8 + 80 - L2_BYTES // FILE
    assert on_disk(l2, NS_A, flood) == rows["A"]["entries"] == L2_BYTES // FILE - 8
    metrics = dict(line.rsplit(" ", 1) for line in get(http, "/metrics").splitlines() if line[:1] != "#")
    assert float(metrics['kvtier_l2_tenant_used_bytes{tenant="B"}']) == 8 * FILE
    assert float(metrics['kvtier_l2_tenant_evictions_total{reason="capacity",tenant="A"}']) == 80 - 23
    a.close()
    b.close()

    # After a restart the scan finds the files before their namespaces are registered: they count to `*`
    # until they are, then to their tenant again (and a lookup finds B's in L2).
    srv.signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=30) == 0, srv.log_text()
    srv.start()
    rows = tenants(http)
    assert rows["A"]["entries"] == rows["B"]["entries"] == 0 and rows["*"]["entries"] == L2_BYTES // FILE
    b = client(srv.url)
    assert [h.tier for h in b.lookup(NS_B, quiet[0]).hits] == ["l2"] * CHUNKS
    rows = tenants(http)
    assert rows["B"]["entries"] == 8 and rows["*"]["entries"] == L2_BYTES // FILE - 8
    b.close()


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_table_set_through_reconfigure_acts_at_once_and_survives_a_warm_restart(kvtier_server, tmp_path):
    l2, http = tmp_path / "l2", free_port()
    srv = kvtier_server(l1_gb=0.0625, extra=["--l2-path", str(l2), "--l2-size-gb", str(L2_BYTES / (1 << 30)),
                                             "--http-port", str(http)])
    noisy = [prompt(300 + i, CHUNKS * NS.chunk_size) for i in range(5)]
    quiet = [prompt(400 + i, CHUNKS * NS.chunk_size) for i in range(2)]
    a, b = client(srv.url), client(srv.url)
    store(a, NS_A, noisy[:4])
    store(b, NS_B, quiet)
    assert on_disk(l2, NS_A, noisy) == 16 and on_disk(l2, NS_B, quiet) == 8
    status, reply = post(http, "/reconfigure", {"l2_tenant_quotas": "A=0:25%"})
    most = L2_BYTES // 4 // FILE  # A's maximum, in files
    assert status == 200 and reply["l2_tenant_quotas"] == {"table": "A=0:25%", "evicted_entries": 16 - most,
                                                           "evicted_bytes": (16 - most) * FILE}, reply
    assert on_disk(l2, NS_A, noisy) == most and on_disk(l2, NS_B, quiet) == 8  # at once, A's own only
    for bad in ("A=9GiB", "A=0:25%,A=1%", "no table"):
        status, reply = post(http, "/reconfigure", {"l2_tenant_quotas": bad})
        assert status == 422 and "l2_tenant_quotas" in json.dumps(reply), (bad, reply)
    store(a, NS_A, noisy[4:])  # A at its maximum makes room from its own chunks
    assert on_disk(l2, NS_A, noisy) == most and on_disk(l2, NS_B, quiet) == 8
    [tier] = [t for t in json.loads(get(http, "/status"))["tiers"] if t["name"] == "l2"]
    assert tier["l2_tenant_quotas"] == "A=0:25%"
    assert {r["tenant"]: r["evictions"] for r in tier["l2_tenants"]}["A"] == {"quota": 16 - most + CHUNKS}
    a.close()
    b.close()

    srv.signal(signal.SIGTERM)  # a clean stop keeps the segment (--l1-adopt) and the tables beside it
    assert srv.proc.wait(timeout=30) == 0, srv.log_text()
    srv.start()
    [tier] = [t for t in json.loads(get(http, "/status"))["tiers"] if t["name"] == "l2"]
    assert tier["l2_tenant_quotas"] == "A=0:25%", tier
    assert "tenant quota tables: kept from the last run" in srv.log_text()
    status, reply = post(http, "/reconfigure", {"l2_tenant_quotas": ""})
    assert status == 200 and reply["l2_tenant_quotas"]["table"] == ""
    assert [r["tenant"] for r in json.loads(get(http, "/status"))["tiers"][0]["l2_tenants"]] == ["*"]

    # A kept table that no longer fits L2 (resized across the warm restart) gives way to the configured one.
    assert post(http, "/reconfigure", {"l2_tenant_quotas": "A=6MiB"})[0] == 200
    srv.signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=30) == 0, srv.log_text()
    srv.args[srv.args.index("--l2-size-gb") + 1] = str(L2_BYTES / 2 / (1 << 30))
    srv.start()
    [tier] = [t for t in json.loads(get(http, "/status"))["tiers"] if t["name"] == "l2"]
    assert tier["l2_tenant_quotas"] == "" and tier["l2_capacity_bytes"] == L2_BYTES // 2
    assert "the kept l2 tenant quota table 'A=6291456' does not fit the tier now" in srv.log_path.read_text()


@pytest.mark.parametrize(("table", "why"), [("B=60%,A=50%", "add up to 110%"), ("B=1GiB", "more than the tier"),
                                            ("B", "NAME=GUARANTEED")])
def test_a_bad_table_stops_the_server_at_start_naming_the_flag(tmp_path, table, why):
    cmd = [sys.executable, "-m", "kvtier.server.cli", "server", "--port", str(free_port()), "--http-port", "0",
           "--l1-size-gb", "0.01", "--shm-name", f"kvtier-l2tenants-{os.getpid()}", "--l2-path", str(tmp_path / "l2"),
           "--l2-size-gb", "0.5", "--l2-tenant-quotas", table]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "kvtier server ready" not in r.stdout + r.stderr
    assert "--l2-tenant-quotas" in r.stderr and why in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
