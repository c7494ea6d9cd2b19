"""Admin API, metrics, security and `kvtier status` against a real `kvtier server` process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
import zmq
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server.eviction import DEFAULT_POLICY
from kvtier.server.keys import Namespace, chunk_keys
from prometheus_client.parser import text_string_to_metric_families
from redis_servers import redis_acl, redis_standalone  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PAGE = 64 * 1024
CHUNK_BYTES = PAGE  # one page per chunk: capacity in chunks = L1 bytes / 64 KiB
NS = Namespace(model="admin-test", dtype="float16", num_layers=2, kv_heads=2, head_size=64, block_size=16,
               layout="test", chunk_size=64)
NS_B = Namespace(model="admin-test-b", dtype="float16", num_layers=2, kv_heads=2, head_size=64, block_size=16,
                 layout="test", chunk_size=64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update(extra)
    return env


class Server:
    """A `kvtier server` subprocess with its admin API."""

    def __init__(self, logdir: Path, *args: str, l1_gb: float = 0.0625, env: dict[str, str] | None = None,
                 http_host: str = "127.0.0.1") -> None:
        self.port, self.http_port = free_port(), free_port()
        self.shm_name = f"kvtier-admintest-{self.port}"
        self.log_path = logdir / f"server-{self.port}.log"
        cmd = [sys.executable, "-m", "kvtier.server.cli", "server", "--port", str(self.port),
               "--http-port", str(self.http_port), "--http-host", http_host, "--l1-size-gb", str(l1_gb),
               "--shm-name", self.shm_name, "--no-l1-adopt", *args]  # throwaway: no L1 kept at stop
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env or clean_env())
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.zmq_url = f"tcp://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 20
        while "kvtier server ready" not in self.log_path.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start:\n{self.log_path.read_text()}")
            time.sleep(0.05)
        self.http = httpx.Client(base_url=self.url, timeout=10)

    def client(self, **kw) -> KVTierClient:
        cfg = ClientConfig(url=self.zmq_url, strict=True, **kw)
        c = KVTierClient(cfg)
        assert c.connect()
        return c

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = self.http.get("/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def metric(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def pattern(key: bytes, size: int = CHUNK_BYTES) -> np.ndarray:
    return np.frombuffer((key * (size // len(key) + 1))[:size], dtype=np.uint8)


def store(client: KVTierClient, tokens, ns: Namespace = NS, size: int = CHUNK_BYTES):
    return client.store(ns, tokens, lambda c: size, lambda c, span: span.write(0, pattern(c.key, size)))


def doc(seed: int, n_tokens: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50000, n_tokens)]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    # Non-loopback admin bind with the token from the environment: the secure-by-default configuration.
    s = Server(tmp_path_factory.mktemp("admin"), "--lease-ttl-s", "1", http_host="0.0.0.0",
               env=clean_env(KVTIER_ADMIN_TOKEN=TOKEN))
    yield s
    s.stop()


@pytest.fixture
def client(srv):
    c = srv.client(token=TOKEN)
    r = srv.http.post("/cache/clear", json={"scope": "all"}, headers=AUTH)
    assert r.status_code == 200
    yield c
    c.close()


# -- check 2: security -------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--http-host", "--host"])
def test_non_loopback_without_token_refuses_to_start(flag, tmp_path):
    cmd = [sys.executable, "-m", "kvtier.server.cli", "server", flag, "0.0.0.0", "--port", str(free_port()),
           "--http-port", str(free_port()), "--l1-size-gb", "0.01", "--shm-name", f"kvtier-admintest-r{os.getpid()}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=clean_env())
    assert r.returncode != 0
    assert f"{flag} 0.0.0.0 is not loopback" in r.stderr
    assert "--admin-token" in r.stderr and "KVTIER_ADMIN_TOKEN" in r.stderr
    assert "kvtier server ready" not in r.stderr + r.stdout


def test_mutating_routes_need_the_token_and_nothing_is_cleared(srv, client):
    store(client, doc(1, 256))
    before = srv.http.get("/status").json()["l1"]["entries"]
    assert before == 4
    bodies = {"/cache/clear": {"scope": "all"}, "/cache/pin": {"keys": ["00" * 16]},
              "/cache/unpin": {"keys": ["00" * 16]}, "/reconfigure": {"log_level": "debug"}}
    for path, body in bodies.items():
        r = srv.http.post(path, json=body)
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        assert srv.http.post(path, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 403
        assert srv.http.post(path, json=body, headers={"Authorization": TOKEN}).status_code == 401
        # Refused before the body is even parsed: garbage without a token is 401, not 422.
        assert srv.http.post(path, content=b"{not json").status_code == 401
    assert srv.http.get("/status").json()["l1"]["entries"] == before
    assert client.lookup(NS, doc(1, 256)).tokens == 256
    # Reads stay open; the status never shows the token.
    for path in ("/healthz", "/status", "/metrics", "/openapi.json"):
        r = srv.http.get(path)
        assert r.status_code == 200 and TOKEN not in r.text
    # No interactive docs (they would load scripts from a CDN) and nothing else is served.
    for path in ("/docs", "/redoc", "/env", "/config", "/../etc/passwd"):
        assert srv.http.get(path).status_code == 404


def test_zmq_port_needs_the_token_when_one_is_set(srv):
    with pytest.raises(Exception, match="unauthorized"):
        srv.client(token="wrong")


def test_a_non_ascii_token_works_on_both_ports(tmp_path):
    """One comparison, one encoding: the token's UTF-8 bytes, on the HTTP header and in the hello."""
    token = "clé-секрет-鍵"
    s = Server(tmp_path, env=clean_env(KVTIER_ADMIN_TOKEN=token))
    try:
        good = {"Authorization": b"Bearer " + token.encode()}
        assert s.http.post("/cache/clear", json={"scope": "all"}, headers=good).status_code == 200
        latin1 = {"Authorization": b"Bearer " + token.encode("utf-8").decode("latin-1").encode("utf-8")}
        assert s.http.post("/cache/clear", json={"scope": "all"}, headers=latin1).status_code == 403
        s.client(token=token).close()
        with pytest.raises(Exception, match="unauthorized"):
            s.client(token=token[:-1])
    finally:
        s.stop()


# -- check 1: routes ---------------------------------------------------------------------------------


def test_healthz_and_status(srv, client):
    assert srv.http.get("/healthz").json() == {"ok": True, "checks": {"l1_mapped": True}}
    store(client, doc(2, 128))
    store(client, doc(3, 192), ns=NS_B)
    st = srv.http.get("/status").json()
    assert st["version"] and st["uptime_s"] > 0 and st["policy"] == DEFAULT_POLICY
    l1 = st["l1"]
    assert l1["capacity_bytes"] == l1["segment_bytes"] == 64 << 20
    assert l1["entries"] == 5 and l1["used_bytes"] == 5 * PAGE
    by_fp = {n["fingerprint"]: n for n in st["namespaces"]}
    assert by_fp[NS.fingerprint().hex()]["entries"] == 2
    assert by_fp[NS_B.fingerprint().hex()]["bytes"] == 3 * CHUNK_BYTES
    assert by_fp[NS.fingerprint().hex()]["model"] == "admin-test"
    [me] = [c for c in st["clients"] if c["instance"] == client.config.instance]
    assert me["pid"] == os.getpid() and me["last_seen_s_ago"] < 5


def test_clear_scopes(srv, client):
    store(client, doc(4, 128))
    store(client, doc(5, 128), ns=NS_B)
    r = srv.http.post("/cache/clear", json={"scope": "namespace", "namespace": NS_B.fingerprint().hex()}, headers=AUTH)
    assert r.status_code == 200 and r.json()["cleared_entries"] == 2
    assert r.json()["cleared_bytes"] == 2 * CHUNK_BYTES
    assert client.lookup(NS, doc(4, 128)).tokens == 128 and client.lookup(NS_B, doc(5, 128)).tokens == 0
    r = srv.http.post("/cache/clear", json={"scope": "tier", "tier": "l1"}, headers=AUTH)
    assert r.json()["cleared_entries"] == 2 and r.json()["used_bytes"] == 0
    assert srv.http.post("/cache/clear", json={"scope": "tier", "tier": "l2"}, headers=AUTH).status_code == 404
    unknown = {"scope": "namespace", "namespace": "ab" * 16}
    assert srv.http.post("/cache/clear", json=unknown, headers=AUTH).status_code == 404
    for bad in ({}, {"scope": "everything"}, {"scope": "namespace"}, {"scope": "all", "tier": "l1"},
                {"scope": "namespace", "namespace": "xyz"}, {"scope": "all", "extra": 1}, [], "all"):
        assert srv.http.post("/cache/clear", json=bad, headers=AUTH).status_code == 422, bad


def test_pin_routes_errors_and_keys(srv, client):
    tokens = doc(6, 128)
    store(client, tokens)
    keys = [c.key.hex() for c in chunk_keys(NS, tokens)]
    r = srv.http.post("/cache/pin", json={"keys": [keys[0], "00" * 16]}, headers=AUTH)
    assert r.status_code == 200
    assert r.json()["found"] == [keys[0]] and r.json()["missing"] == ["00" * 16] and r.json()["entries"] == 1
    assert r.json()["pinned_bytes"] == PAGE
    r = srv.http.post("/cache/unpin", json={"keys": [keys[0]]}, headers=AUTH)
    assert r.json()["entries"] == 1 and r.json()["pinned_bytes"] == 0
    r = srv.http.post("/cache/pin", json={"namespace": "cd" * 16, "token_ids": tokens}, headers=AUTH)
    assert r.status_code == 404
    for bad in ({}, {"keys": ["zz"]}, {"keys": [keys[0]], "namespace": NS.fingerprint().hex()},
                {"namespace": NS.fingerprint().hex()}, {"namespace": NS.fingerprint().hex(), "token_ids": [-1]},
                {"namespace": NS.fingerprint().hex(), "token_ids": [2**32]}, {"keys": "ab" * 16},
                {"namespace": NS.fingerprint().hex(), "token_ids": ["1"]}):
        for path in ("/cache/pin", "/cache/unpin"):
            assert srv.http.post(path, json=bad, headers=AUTH).status_code == 422, (path, bad)


def test_body_limit(srv):
    big = b'{"keys": [' + b",".join([b'"' + b"0" * 32 + b'"'] * 40000) + b"]}"
    assert len(big) > 1 << 20
    r = srv.http.post("/cache/pin", content=big, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413

    def chunks():
        for _ in range(40):
            yield b" " * 65536

    r = srv.http.post("/cache/pin", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413


def test_reconfigure_policy_and_log_level(srv, client):
    tokens = doc(7, 256)
    store(client, tokens)
    r = srv.http.post("/reconfigure", json={"eviction_policy": "lru", "log_level": "debug"}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["eviction_policy"] == {"old": DEFAULT_POLICY, "new": "lru", "entries": 4}
    st = srv.http.get("/status").json()
    assert st["policy"] == "lru" and st["log_level"] == "debug"
    assert client.lookup(NS, tokens).tokens == 256  # entries survive the swap
    r = srv.http.post("/reconfigure", json={"eviction_policy": DEFAULT_POLICY, "log_level": "info"}, headers=AUTH)
    assert r.json()["eviction_policy"]["entries"] == 4
    for bad in ({}, {"eviction_policy": "fifo"}, {"log_level": "trace"}, {"l1_size_gb": -1},
                {"l1_size_gb": 0.01, "l1_size_bytes": 1 << 20}, {"l1_size_bytes": "1"}, {"l1_size_bytes": 1.5},
                {"l1_size_bytes": 1000}, {"l1_size_gb": 1.0}):
        assert srv.http.post("/reconfigure", json=bad, headers=AUTH).status_code == 422, bad
    assert srv.http.get("/status").json()["l1"]["capacity_bytes"] == 64 << 20


def test_reconfigure_resize_returns_memory_and_refuses_below_pins(srv, client):
    shm = Path("/dev/shm") / srv.shm_name
    for i in range(12):  # 48 chunks = 3 MiB, in 12 documents
        store(client, doc(100 + i, 256))
    pinned = doc(100, 256)
    assert srv.http.post("/cache/pin", json={"namespace": NS.fingerprint().hex(), "token_ids": pinned},
                         headers=AUTH).json()["entries"] == 4
    r = srv.http.post("/reconfigure", json={"l1_size_bytes": 3 * PAGE}, headers=AUTH)
    assert r.status_code == 409 and "pinned, leased or kept" in r.json()["detail"]
    assert srv.http.get("/status").json()["l1"]["capacity_bytes"] == 64 << 20
    r = srv.http.post("/reconfigure", json={"l1_size_bytes": 8 * PAGE}, headers=AUTH)
    assert r.status_code == 200, r.text
    res = r.json()["l1"]
    assert res["capacity_bytes"] == 8 * PAGE and res["evicted_entries"] == 40 and res["draining_bytes"] == 0
    assert res["released_bytes"] >= 56 * PAGE
    assert os.stat(shm).st_blocks * 512 <= 8 * PAGE  # tmpfs pages of the freed chunks went back to the OS
    assert client.lookup(NS, pinned).tokens == 256
    m = srv.metrics()
    assert metric(m, "kvtier_l1_capacity_bytes") == 8 * PAGE
    assert metric(m, "kvtier_evictions_total", tier="l1", reason="resize") >= 40
    for i in range(4):  # 16 chunks into 4 free pages: evicts, never over budget
        assert store(client, doc(200 + i, 256)).stored == 4
        assert srv.http.get("/status").json()["l1"]["used_bytes"] <= 8 * PAGE
    assert client.lookup(NS, pinned).tokens == 256
    r = srv.http.post("/reconfigure", json={"l1_size_gb": 0.0625}, headers=AUTH)
    assert r.json()["l1"]["capacity_bytes"] == 64 << 20
    srv.http.post("/cache/unpin", json={"namespace": NS.fingerprint().hex(), "token_ids": pinned}, headers=AUTH)


# -- check 1: metrics move with a scripted workload ----------------------------------------------------


def test_metrics_hit_rate_matches_workload(srv, client):
    a, b, c = doc(10, 256), doc(11, 256), doc(12, 256)
    store(client, a)
    store(client, b)
    m0 = srv.metrics()
    # Known pattern: (requested tokens, hit tokens) per lookup.
    workload = [(a, 256, 256), (b[:128], 128, 128), (c, 256, 0), (a + doc(13, 128), 384, 256)]
    for tokens, requested, hit in workload:
        r = client.lookup(NS, tokens)
        assert r.tokens == hit and len(tokens) == requested
    m1 = srv.metrics()
    requested = metric(m1, "kvtier_requested_tokens_total") - metric(m0, "kvtier_requested_tokens_total")
    hits = metric(m1, "kvtier_hit_tokens_total", tier="l1") - metric(m0, "kvtier_hit_tokens_total", tier="l1")
    assert requested == 1024 and hits == 640
    assert hits / requested == pytest.approx(640 / 1024)
    assert metric(m1, "kvtier_lookups_total") - metric(m0, "kvtier_lookups_total") == 4

    # Stores, retrieves, refusals, evictions, malformed requests, leases and gauges move too.
    got = []
    assert client.retrieve(NS, a, lambda rc: got.append(rc)) == 256
    big = store(client, doc(14, 64), size=(64 << 20) + 1)
    assert big.refused == {"too_large": 1}
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(srv.zmq_url)
    sock.send(b"\xc1 not msgpack")
    assert sock.poll(5000)
    sock.recv()
    sock.close(0)
    keys = [ck.key for ck in chunk_keys(NS, b)]
    client._request({"op": "acquire", "keys": keys[:1]}, NS)  # a lease never released: expires (TTL 1 s)
    time.sleep(2.0)
    m2 = srv.metrics()
    assert metric(m2, "kvtier_stores_total") - metric(m0, "kvtier_stores_total") == 0
    assert metric(m2, "kvtier_store_bytes_total") >= 8 * CHUNK_BYTES
    assert metric(m2, "kvtier_store_seconds_count") >= 8
    assert metric(m2, "kvtier_retrieves_total") - metric(m0, "kvtier_retrieves_total") == 5
    assert metric(m2, "kvtier_retrieve_bytes_total") - metric(m0, "kvtier_retrieve_bytes_total") == 5 * CHUNK_BYTES
    assert metric(m2, "kvtier_retrieve_seconds_count") - metric(m0, "kvtier_retrieve_seconds_count") == 1
    assert metric(m2, "kvtier_refused_stores_total", reason="too_large") - metric(
        m0, "kvtier_refused_stores_total", reason="too_large") == 1
    assert metric(m2, "kvtier_malformed_requests_total") - metric(m0, "kvtier_malformed_requests_total") == 1
    assert metric(m2, "kvtier_leases_expired_total") - metric(m0, "kvtier_leases_expired_total") == 1
    assert metric(m2, "kvtier_entries", tier="l1") == 8
    assert metric(m2, "kvtier_l1_used_bytes") == 8 * PAGE
    assert metric(m2, "kvtier_l1_capacity_bytes") == metric(m2, "kvtier_l1_segment_bytes") == 64 << 20
    assert metric(m2, "kvtier_clients_connected") >= 1
    assert metric(m2, "kvtier_request_seconds_count", op="lookup") > 0
    srv.http.post("/cache/clear", json={"scope": "all"}, headers=AUTH)
    m3 = srv.metrics()
    assert metric(m3, "kvtier_evictions_total", tier="l1", reason="clear") - metric(
        m2, "kvtier_evictions_total", tier="l1", reason="clear") == 8
    assert metric(m3, "kvtier_admin_requests_total", route="/cache/clear", code="200") >= 1
    assert metric(m3, "kvtier_build_info", version=srv.http.get("/status").json()["version"]) == 1


# -- check 3: pinning survives eviction ------------------------------------------------------------------


def test_pinned_prefix_survives_eviction_until_unpinned(tmp_path):
    s = Server(tmp_path, "--eviction-policy", "lru", l1_gb=1 / 64)  # 16 MiB = 256 one-page chunks; no token
    try:
        c = s.client()
        prefix = doc(20, 64 * 8 + 32)  # 8 full chunks and a partial one of 2 blocks
        store(c, prefix)
        fp = NS.fingerprint().hex()
        r = s.http.post("/cache/pin", json={"namespace": fp, "token_ids": prefix})
        assert r.status_code == 200
        assert r.json()["entries"] == 9 and not r.json()["missing"] and r.json()["pinned_bytes"] == 9 * PAGE
        others = [doc(1000 + i, 64 * 10) for i in range(60)]  # 600 chunks through a 256-chunk cache
        for d in others:
            store(c, d)
        assert c.lookup(NS, prefix).tokens == len(prefix)
        assert c.lookup(NS, others[0]).tokens == 0  # the rest was evicted
        m = s.metrics()
        assert metric(m, "kvtier_evictions_total", tier="l1", reason="capacity") >= 350
        assert metric(m, "kvtier_pinned_bytes") == 9 * PAGE
        assert s.http.get("/status").json()["namespaces"][0]["pinned_bytes"] == 9 * CHUNK_BYTES
        evictable = s.http.get("/status").json()["l1"]["evictable_bytes"]
        r = s.http.post("/cache/unpin", json={"namespace": fp, "token_ids": prefix})
        assert r.json()["entries"] == 9 and r.json()["pinned_bytes"] == 0
        assert s.http.get("/status").json()["l1"]["evictable_bytes"] == evictable + 9 * PAGE
        for d in others[:30]:
            store(c, d)
        assert c.lookup(NS, prefix).tokens == 0  # evictable again, and evicted by more load
        c.close()
    finally:
        s.stop()


# -- kvtier status -----------------------------------------------------------------------------------------


def test_status_cli(srv, client):
    store(client, doc(30, 256))
    cmd = [sys.executable, "-m", "kvtier.server.cli", "status", "--url", srv.url]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "L1  256.0 KiB used of 64.0 MiB" in r.stdout and "L2  off" in r.stdout
    assert NS.fingerprint().hex()[:12] in r.stdout and "admin-test" in r.stdout
    assert client.config.instance[:48] in r.stdout
    r = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=30)
    assert json.loads(r.stdout)["l1"]["entries"] == 4
    r = subprocess.run([*cmd[:-1], f"http://127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "cannot read" in r.stderr


def test_status_shows_l2(tmp_path):
    s = Server(tmp_path, "--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "0.01")
    try:
        c = s.client()
        assert store(c, doc(31, 128)).stored == 2
        deadline = time.monotonic() + 20
        while s.http.get("/status").json()["l2"]["l2_written"] < 2:
            assert time.monotonic() < deadline, s.http.get("/status").json()["l2"]
            time.sleep(0.05)
        l2 = s.http.get("/status").json()["l2"]
        assert l2["l2_enabled"] and l2["l2_entries"] == 2 and l2["l2_capacity_bytes"] == int(0.01 * (1 << 30))
        assert l2["l2_write_bytes_per_s"] > 0
        r = subprocess.run([sys.executable, "-m", "kvtier.server.cli", "status", "--url", s.url],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and "L2  " in r.stdout and "2 chunks" in r.stdout, r.stdout
        c.close()
    finally:
        s.stop()


def test_status_shows_every_tier(tmp_path, redis_acl):  # noqa: F811 - fixture
    """With an L2 and a remote tier, /status `tiers` lists both (lookup order) and `kvtier status` prints the
    remote tier: its URL without the password, its counts."""
    password = redis_acl.split("@")[0].rsplit(":", 1)[1]
    s = Server(tmp_path, "--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "0.01", "--remote-url", redis_acl,
               "--remote-prefix", f"t{uuid.uuid4().hex[:10]}")
    try:
        c = s.client()
        assert store(c, doc(32, 128)).stored == 2
        deadline = time.monotonic() + 20
        while (t := s.http.get("/status").json())["remote"].get("remote_written", 0) < 2:
            assert time.monotonic() < deadline, t["remote"]
            time.sleep(0.05)
        tiers = {tier["name"]: tier for tier in t["tiers"]}
        assert [tier["name"] for tier in t["tiers"]] == ["l2", "remote"]
        assert tiers["remote"]["remote_url"] == t["remote"]["remote_url"] and password not in json.dumps(t)
        assert tiers["l2"]["l2_enabled"] and tiers["remote"]["remote_written"] >= 2
        r = subprocess.run([sys.executable, "-m", "kvtier.server.cli", "status", "--url", s.url],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        remote = [line for line in r.stdout.splitlines() if line.startswith("remote  ")]
        assert len(remote) == 1 and t["remote"]["remote_url"] in remote[0], r.stdout
        assert password not in r.stdout and "L2  " in r.stdout
        written = s.http.get("/status").json()["remote"]["remote_written"]
        assert f"{written} written" in r.stdout and "0 corrupt" in r.stdout, r.stdout
        assert "0 timeouts, 0 errors" in r.stdout and "breakers open: none" in r.stdout, r.stdout
        c.close()
    finally:
        s.stop()
