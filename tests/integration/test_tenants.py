"""Operators' control of L1 tenants against a real `kvtier server` process and the real client
(connector/client.py): quota tables changed through POST /reconfigure act at once (a tenant cut below what it
holds sheds; a guarantee added protects a tenant from another's flood); clear and pin per tenant; the tenant rows
of /status and `kvtier status`; a bad table is a 422 that changes nothing (docs/tenants.md)."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest
from _support import free_port
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server.keys import Namespace
from test_admin_api import PAGE, Server, doc, metric, store

pytestmark = pytest.mark.integration

MiB = 1 << 20


def ns(model: str, salt: str) -> Namespace:
    """A namespace of one-page chunks (64 tokens) whose cache salt names its tenant."""
    return Namespace(model=model, dtype="float16", num_layers=2, kv_heads=2, head_size=64, block_size=16,
                     layout="test", chunk_size=64, cache_salt=salt)


NS_A = ns("tenant-test", "A")
NS_A2 = ns("tenant-test-2", "engine-x|A")  # the request's part of the salt names A
NS_B = ns("tenant-test", "B")
NS_OTHER = ns("tenant-test", "nobody")  # named in no table: the default tenant "*"


def rows(s: Server) -> dict[str, dict]:
    return {r["tenant"]: r for r in s.http.get("/status").json()["l1"]["tenants"]}


def reconfigure(s: Server, table: str, **more) -> dict:
    r = s.http.post("/reconfigure", json={"tenant_quotas": table, **more})
    assert r.status_code == 200, r.text
    return r.json()


def cached(c, namespace: Namespace, seeds: range) -> int:
    """Documents (of 256 tokens: 4 chunks) whose whole prefix a lookup finds."""
    return sum(c.lookup(namespace, doc(seed, 256)).tokens == 256 for seed in seeds)


def test_quota_cut_below_usage_sheds_at_once(tmp_path):
    s = Server(tmp_path)  # 64 MiB of L1: 1024 one-page chunks
    try:
        c = s.client()
        for seed in range(50):  # 200 chunks: 12.5 MiB
            store(c, doc(seed, 256), NS_A)
            store(c, doc(1000 + seed, 256), NS_B)
        assert s.http.get("/status").json()["l1"]["tenant_quotas"] == ""
        out = reconfigure(s, "A=0:4MiB,B=1MiB")
        assert out["tenant_quotas"]["table"] == "A=0:4194304,B=1048576"
        now = rows(s)  # no request since: the shedding happened within /reconfigure
        assert 0 < now["A"]["used_bytes"] <= 4 * MiB, now["A"]
        assert now["A"]["max_bytes"] == 4 * MiB and now["B"]["guaranteed_bytes"] == 1 * MiB
        assert now["B"]["used_bytes"] == 200 * PAGE and now["B"]["evictions"].get("quota", 0) == 0
        assert now["A"]["evictions"]["quota"] == 200 - now["A"]["entries"]
        m = s.metrics()
        assert metric(m, "kvtier_tenant_evictions_total", tenant="A", reason="quota") == now["A"]["evictions"]["quota"]
        assert metric(m, "kvtier_tenant_max_bytes", tenant="A") == 4 * MiB
        assert metric(m, "kvtier_tenant_used_bytes", tenant="B") == 200 * PAGE
        assert cached(c, NS_B, range(1000, 1050)) == 50
        assert cached(c, NS_A, range(50)) <= 16  # at most 64 chunks of 4 MiB: 16 whole documents
        # A stays within its maximum as it stores more: it makes room from its own chunks (the pages a reserve
        # takes for its first items count against it before they are committed).
        for seed in range(50, 100):
            store(c, doc(seed, 256), NS_A)
        assert 4 * MiB - 4 * PAGE <= rows(s)["A"]["used_bytes"] <= 4 * MiB
        assert rows(s)["A"]["refused"].get("tenant_max", 0) == 0
        assert cached(c, NS_B, range(1000, 1050)) == 50
        # Removing the table: everything is the default tenant again, with no limit.
        assert reconfigure(s, "")["tenant_quotas"]["table"] == ""
        status = s.http.get("/status").json()["l1"]
        assert status["tenant_quotas"] == "" and [r["tenant"] for r in status["tenants"]] == ["*"]
        c.close()
    finally:
        s.stop()


def test_guarantee_added_protects_b_from_a_flood(tmp_path):
    s = Server(tmp_path, "--eviction-policy", "lru")  # 1024 chunks of L1
    try:
        c = s.client()
        # Without quotas, A's flood (2x L1) takes B's working set.
        for seed in range(25):  # 100 chunks
            store(c, doc(1000 + seed, 256), NS_B)
        for seed in range(512):
            store(c, doc(seed, 256), NS_A)
        assert cached(c, NS_B, range(1000, 1025)) == 0
        # With B guaranteed 10% (~102 chunks), the same flood leaves it whole.
        reconfigure(s, "B=10%")
        for seed in range(25):
            store(c, doc(1000 + seed, 256), NS_B)
        assert rows(s)["B"]["used_bytes"] == 100 * PAGE
        for seed in range(512, 1024):
            store(c, doc(seed, 256), NS_A)
        assert cached(c, NS_B, range(1000, 1025)) == 25
        now = rows(s)
        assert now["B"]["used_bytes"] == 100 * PAGE and now["B"]["guaranteed_bytes"] == int(0.1 * 1024 * PAGE)
        assert now["B"]["hit_tokens"] >= 25 * 256 and now["*"]["used_bytes"] > 800 * PAGE
        c.close()
    finally:
        s.stop()


def test_clear_and_pin_per_tenant(tmp_path):
    s = Server(tmp_path, "--eviction-policy", "lru", "--l1-tenant-quotas", "A=0,B=0")
    try:
        c = s.client()
        for seed in range(10):
            for namespace in (NS_A, NS_A2, NS_B, NS_OTHER):
                store(c, doc(seed, 256), namespace)
        pinned = doc(3, 256)
        r = s.http.post("/cache/pin", json={"tenant": "A", "token_ids": pinned})
        assert r.status_code == 200 and r.json()["entries"] == 8, r.text  # 4 chunks in each of A's namespaces
        pins = {n["model"] + "/" + n["cache_salt"]: n["pinned_bytes"] for n in s.http.get("/status").json()["namespaces"]}
        assert pins == {"tenant-test/A": 4 * PAGE, "tenant-test-2/engine-x|A": 4 * PAGE, "tenant-test/B": 0,
                        "tenant-test/nobody": 0}
        # Pinned chunks outlive a flood of the default tenant (2x L1); A's others do not.
        for seed in range(100, 612):
            store(c, doc(seed, 256), NS_OTHER)
        assert cached(c, NS_A, range(10)) == cached(c, NS_A2, range(10)) == 1
        assert c.lookup(NS_A, pinned).tokens == 256
        # Clear B: B's chunks go, nobody else's.
        for seed in range(10):
            store(c, doc(seed, 256), NS_B)
        r = s.http.post("/cache/clear", json={"scope": "tenant", "tenant": "B"})
        assert r.status_code == 200 and r.json()["cleared_entries"] == 40, r.text
        assert rows(s)["B"]["used_bytes"] == 0 and cached(c, NS_B, range(10)) == 0
        assert c.lookup(NS_A, pinned).tokens == 256
        # Clear A: both of its namespaces, pinned chunks included.
        r = s.http.post("/cache/clear", json={"scope": "tenant", "tenant": "A"})
        assert r.status_code == 200 and r.json()["cleared_entries"] == 8, r.text
        assert c.lookup(NS_A, pinned).tokens == c.lookup(NS_A2, pinned).tokens == 0
        assert rows(s)["A"]["evictions"]["clear"] == 8 and rows(s)["*"]["used_bytes"] > 0
        # Unknown tenants: 404 saying so; nothing is cleared or pinned.
        before = s.http.get("/status").json()["l1"]["entries"]
        for path, body in (("/cache/clear", {"scope": "tenant", "tenant": "nobody"}),
                           ("/cache/pin", {"tenant": "nobody", "token_ids": pinned}),
                           ("/cache/unpin", {"tenant": "C", "token_ids": pinned})):
            r = s.http.post(path, json=body)
            assert r.status_code == 404 and "not in the L1 quota table" in r.json()["detail"], r.text
        assert s.http.get("/status").json()["l1"]["entries"] == before
        # Malformed bodies are 422s.
        for body in ({"scope": "tenant"}, {"scope": "all", "tenant": "A"}, {"scope": "tenant", "tenant": ""}):
            assert s.http.post("/cache/clear", json=body).status_code == 422, body
        for body in ({"tenant": "A"}, {"tenant": "A", "namespace": NS_A.fingerprint().hex(), "token_ids": [1]}):
            assert s.http.post("/cache/pin", json=body).status_code == 422, body
        c.close()
    finally:
        s.stop()


def test_status_and_cli_show_tenant_rows(tmp_path):
    s = Server(tmp_path, "--l1-tenant-quotas", "A=2MiB:8MiB,B=25%")
    try:
        c = s.client()
        for seed in range(8):  # 32 chunks: 2 MiB
            store(c, doc(seed, 256), NS_A)
        assert cached(c, NS_A, range(16)) == 8  # half the documents asked for are there
        status = s.http.get("/status").json()["l1"]
        assert status["tenant_quotas"] == "A=2097152:8388608,B=25%"
        a = {r["tenant"]: r for r in status["tenants"]}["A"]
        assert (a["used_bytes"], a["entries"], a["guaranteed_bytes"], a["max_bytes"]) == (2 * MiB, 32, 2 * MiB, 8 * MiB)
        assert a["requested_tokens"] == 16 * 256 and a["hit_tokens"] == 8 * 256
        assert {r["tenant"] for r in status["tenants"]} == {"A", "B", "*"}
        out = subprocess.run([sys.executable, "-m", "kvtier.server.cli", "status", "--url", s.url],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        at = lines.index("Tenants in L1 (A=2097152:8388608,B=25%)")
        table = {line.split()[0]: line.split() for line in lines[at + 3:at + 6]}
        assert table["A"][1:9] == ["2.0", "MiB", "2.0", "MiB", "8.0", "MiB", "32", "50.0"], lines
        assert table["B"][3:5] == ["16.0", "MiB"] and "*" in table, lines
        c.close()
    finally:
        s.stop()


@pytest.mark.parametrize("table, message", [
    ("A=150%", "more than the whole tier"),
    ("A=60%,B=50%", "add up to 110%"),
    ("A=1GiB", "more than the tier's"),  # guarantees beyond the 64 MiB of L1
    ("A=10%,A=20%", "named twice"),
    ("A B=1MiB", "expected NAME=GUARANTEED"),
    ("A=lots", "is not an amount"),
    ("A=4MiB:1MiB", "exceeds the maximum"),
])
def test_bad_table_is_refused_and_changes_nothing(bad_table_server, table, message):
    s, c = bad_table_server
    before = s.http.get("/status").json()["l1"]
    r = s.http.post("/reconfigure", json={"tenant_quotas": table, "l1_size_bytes": 512 * PAGE})
    assert r.status_code == 422 and message in r.json()["detail"], r.text
    after = s.http.get("/status").json()["l1"]
    assert after["tenant_quotas"] == before["tenant_quotas"] == "A=0:4194304"
    assert after["capacity_bytes"] == before["capacity_bytes"]  # the size in the same body was not applied
    assert [(t["tenant"], t["used_bytes"]) for t in after["tenants"]] == \
           [(t["tenant"], t["used_bytes"]) for t in before["tenants"]]
    assert after["entries"] == before["entries"] > 0


@pytest.fixture(scope="module")
def bad_table_server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("tenants"), "--l1-tenant-quotas", "A=0:4MiB")
    c = s.client()
    for seed in range(16):
        store(c, doc(seed, 256), NS_A)
    yield s, c
    c.close()
    s.stop()


def test_table_too_long_is_422(bad_table_server):
    s, _ = bad_table_server
    r = s.http.post("/reconfigure", json={"tenant_quotas": "A=1," * 5000})
    assert r.status_code == 422


def test_table_set_at_run_time_survives_a_warm_restart(kvtier_server):
    """The table set through /reconfigure comes back after a SIGKILL and after a clean stop (the L1 is
    adopted); a server started with another configured table takes that one instead."""
    http_port = free_port()
    configured = ["--http-port", str(http_port), "--page-size-kb", "64", "--l1-tenant-quotas", "A=1MiB"]
    srv = kvtier_server(l1_gb=1 / 16, extra=configured)
    http = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=10)
    c = KVTierClient(ClientConfig(url=srv.url, strict=True))
    assert c.connect()
    for seed in range(16):  # 64 chunks: 4 MiB
        store(c, doc(seed, 256), NS_A)
    c.close()
    assert http.post("/reconfigure", json={"tenant_quotas": "A=0:2MiB,B=10%"}).json()["tenant_quotas"][
        "evicted_entries"] == 32

    def table_and_a() -> tuple[str, int]:
        l1 = http.get("/status").json()["l1"]
        return l1["tenant_quotas"], {r["tenant"]: r for r in l1["tenants"]}["A"]["used_bytes"]

    for stop in (signal.SIGKILL, signal.SIGTERM):
        srv.signal(stop)
        srv.proc.wait(timeout=15)
        srv.start()
        assert table_and_a() == ("A=0:2097152,B=10%", 2 * MiB), stop  # the table, and A's adopted chunks
    srv.signal(signal.SIGTERM)
    srv.proc.wait(timeout=15)
    srv.args[srv.args.index("A=1MiB")] = "A=0:1MiB"  # the operator changed the configured table: it wins
    srv.start()
    assert table_and_a() == ("A=0:1048576", 1 * MiB)


def test_shrink_below_the_guarantees_in_force_is_409(tmp_path):
    s = Server(tmp_path, "--l1-tenant-quotas", "A=16MiB")
    try:
        r = s.http.post("/reconfigure", json={"l1_size_bytes": 8 * MiB})
        assert r.status_code == 409 and "too small for the tenant quota table in force" in r.json()["detail"], r.text
        assert s.http.get("/status").json()["l1"]["capacity_bytes"] == 64 * MiB
        # Shrinking with a table that fits the new size, in one request: both apply, shares of the new size.
        out = reconfigure(s, "A=10%", l1_size_bytes=8 * MiB)
        assert out["l1"]["capacity_bytes"] == 8 * MiB and out["tenant_quotas"]["table"] == "A=10%"
        assert rows(s)["A"]["guaranteed_bytes"] == int(0.1 * 8 * MiB)
    finally:
        s.stop()
