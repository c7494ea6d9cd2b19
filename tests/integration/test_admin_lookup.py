"""POST /cache/lookup against a real `kvtier server` process: a prompt's cached prefix per namespace and tier,
read-only (no policy touch, promotion, lease or lookup metric), bounded, behind the admin token."""

from __future__ import annotations

import dataclasses
import time
import uuid

import pytest
from _support import wait_for
from kvtier.admin_api.models import MAX_LOOKUP_TOKENS
from redis_servers import redis_standalone  # noqa: F401 - fixture
from test_admin_api import AUTH, NS, NS_B, TOKEN, Server, clean_env, doc, metric, store

pytestmark = pytest.mark.integration

NS_BF16 = dataclasses.replace(NS, dtype="bfloat16")  # the same model, another namespace


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("lookup"), env=clean_env(KVTIER_ADMIN_TOKEN=TOKEN))
    yield s
    s.stop()


@pytest.fixture
def client(srv):
    c = srv.client(token=TOKEN)
    assert srv.http.post("/cache/clear", json={"scope": "all"}, headers=AUTH).status_code == 200
    yield c
    c.close()


def ask(s: Server, headers: dict | None = None, **body) -> dict:
    r = s.http.post("/cache/lookup", json=body, headers=AUTH if headers is None else headers)
    assert r.status_code == 200, r.text
    return r.json()


def by_ns(answer: dict) -> dict[str, dict]:
    return {a["namespace"]: a for a in answer["namespaces"]}


def test_empty_then_stored_prefix_in_l1_per_namespace(srv, client):
    prompt = doc(1, 256)  # 4 chunks of 64 tokens (4 blocks of 16 each)
    assert client.register(NS) and client.register(NS_BF16) and client.register(NS_B)
    fp, fp_bf16 = NS.fingerprint().hex(), NS_BF16.fingerprint().hex()
    empty = ask(srv, tokens=prompt, namespace=fp)
    assert empty["tokens"] == 256
    assert empty["namespaces"] == [{"namespace": fp, "model": NS.model, "tp_rank": 0, "pp_rank": 0, "block_size": 16,
                                    "chunk_size": 64, "cached_tokens": 0, "tiers": {"l1": 0}, "pending": False}]
    assert store(client, prompt).stored == 4
    # By model: every registered namespace of it (not NS_B's model), each answered on its own key chain.
    answer = by_ns(ask(srv, tokens=prompt + doc(2, 40), model=NS.model))
    assert set(answer) == {fp, fp_bf16}
    assert answer[fp]["cached_tokens"] == 256 and answer[fp]["tiers"] == {"l1": 256}
    assert answer[fp_bf16]["cached_tokens"] == 0
    # A prompt that ends inside a chunk, and inside a block: whole blocks only (6 blocks = 96 tokens).
    assert ask(srv, tokens=prompt[:100], namespace=fp)["namespaces"][0]["tiers"] == {"l1": 96}
    # A prompt that leaves the stored one after 70 tokens: the first chunk (64) only, its next block differs.
    assert ask(srv, tokens=prompt[:70] + doc(3, 100), namespace=fp)["namespaces"][0]["cached_tokens"] == 64
    # The engine's own lookup agrees.
    assert client.lookup(NS, prompt[:100]).tokens == 96


def test_unknown_namespace_and_bad_bodies(srv, client):
    before = metric(srv.metrics(), "kvtier_admin_lookups_refused_total", reason="not_registered")
    client.register(NS)
    for body in ({"tokens": [1, 2], "namespace": "ab" * 16}, {"tokens": [1], "model": "no-such-model"},
                 {"tokens": [1], "model": NS.model, "cache_salt": "tenant-a"}):
        r = srv.http.post("/cache/lookup", json=body, headers=AUTH)
        assert r.status_code == 404 and "not registered" in r.json()["detail"], r.text
    after = metric(srv.metrics(), "kvtier_admin_lookups_refused_total", reason="not_registered")
    assert after == before + 3
    fp = NS.fingerprint().hex()
    for body in ({"tokens": [1]}, {"tokens": [1], "namespace": fp, "model": NS.model},
                 {"tokens": [1], "namespace": fp, "cache_salt": "x"}, {"tokens": [-1], "namespace": fp},
                 {"tokens": [0xFFFFFFFF], "namespace": fp}, {"tokens": ["1"], "namespace": fp},
                 {"tokens": [1], "namespace": fp, "text": "hello"}):
        r = srv.http.post("/cache/lookup", json=body, headers=AUTH)
        assert r.status_code == 422, (body, r.text)


def test_too_many_tokens_refused_and_counted(srv, client):
    client.register(NS)
    fp = NS.fingerprint().hex()
    before = metric(srv.metrics(), "kvtier_admin_lookups_refused_total", reason="too_many_tokens")
    assert ask(srv, tokens=[7] * MAX_LOOKUP_TOKENS, namespace=fp)["tokens"] == MAX_LOOKUP_TOKENS
    r = srv.http.post("/cache/lookup", json={"tokens": [7] * (MAX_LOOKUP_TOKENS + 1), "namespace": fp}, headers=AUTH)
    assert r.status_code == 413 and f"at most {MAX_LOOKUP_TOKENS}" in r.json()["detail"]
    m = srv.metrics()
    assert metric(m, "kvtier_admin_lookups_refused_total", reason="too_many_tokens") == before + 1
    assert metric(m, "kvtier_admin_requests_total", route="/cache/lookup", code="413") >= 1


def test_needs_the_admin_token(srv, client):
    prompt = doc(4, 128)
    store(client, prompt)
    body = {"tokens": prompt, "namespace": NS.fingerprint().hex()}
    r = srv.http.post("/cache/lookup", json=body)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert srv.http.post("/cache/lookup", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert ask(srv, **body)["namespaces"][0]["cached_tokens"] == 128


def test_no_token_needed_when_none_is_set(tmp_path):
    s = Server(tmp_path)
    try:
        c = s.client()
        store(c, doc(5, 64))
        assert ask(s, headers={}, tokens=doc(5, 64), model=NS.model)["namespaces"][0]["tiers"] == {"l1": 64}
        c.close()
    finally:
        s.stop()


def test_read_only_no_lease_no_lookup_metrics_no_touch(tmp_path):
    """Under LRU, a prefix the route asked about stays the oldest and is evicted first; one the engine looked
    up is touched and survives. No lease, and the lookup metrics do not move."""
    s = Server(tmp_path, "--eviction-policy", "lru", l1_gb=1 / 64)  # 256 one-page chunks
    try:
        c = s.client()
        fp = NS.fingerprint().hex()
        asked, looked_up = doc(10, 64 * 8), doc(11, 64 * 8)
        store(c, asked)
        store(c, looked_up)
        fill = [doc(100 + i, 64 * 10) for i in range(24)]  # 240 chunks more: 256 in all, the cache is full
        for d in fill:
            store(c, d)
        m0 = s.metrics()
        for _ in range(3):
            assert ask(s, headers={}, tokens=asked, namespace=fp)["namespaces"][0]["tiers"] == {"l1": len(asked)}
        m1 = s.metrics()
        for name in ("kvtier_lookups_total", "kvtier_requested_tokens_total"):
            assert metric(m1, name) == metric(m0, name), name
        assert metric(m1, "kvtier_hit_tokens_total", tier="l1") == metric(m0, "kvtier_hit_tokens_total", tier="l1")
        l1 = s.http.get("/status").json()["l1"]
        assert l1["leases"] == 0 and l1["held_bytes"] == 0
        assert c.lookup(NS, looked_up).tokens == len(looked_up)  # the engine's lookup: a touch
        for d in (doc(200 + i, 64 * 10) for i in range(2)):  # 20 chunks in: the 20 least recent go
            store(c, d)
        assert ask(s, headers={}, tokens=asked, namespace=fp)["namespaces"][0]["cached_tokens"] == 0
        assert ask(s, headers={}, tokens=looked_up, namespace=fp)["namespaces"][0]["cached_tokens"] == len(looked_up)
        assert ask(s, headers={}, tokens=fill[0], namespace=fp)["namespaces"][0]["cached_tokens"] == 0
        c.close()
    finally:
        s.stop()


def test_l2_prefix_reported_under_l2_without_promotion(tmp_path):
    s = Server(tmp_path, "--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "0.01")
    try:
        c = s.client()
        prompt = doc(20, 256)
        fp = NS.fingerprint().hex()
        assert store(c, prompt).stored == 4
        deadline = time.monotonic() + 20
        while s.http.get("/status").json()["l2"]["l2_written"] < 4:
            assert time.monotonic() < deadline, s.http.get("/status").json()["l2"]
            time.sleep(0.05)
        # Both tiers hold it: reported in L1.
        assert ask(s, headers={}, tokens=prompt, namespace=fp)["namespaces"][0]["tiers"] == {"l1": 256, "l2": 0}
        r = s.http.post("/cache/clear", json={"scope": "tier", "tier": "l1"})
        assert r.status_code == 200 and r.json()["cleared_entries"] == 4
        answer = ask(s, headers={}, tokens=prompt, namespace=fp)["namespaces"][0]
        assert answer["tiers"] == {"l1": 0, "l2": 256} and answer["cached_tokens"] == 256
        # The first chunk back in L1: the prefix starts there and goes on in L2.
        assert store(c, prompt[:64]).stored == 1
        answer = ask(s, headers={}, tokens=prompt, namespace=fp)["namespaces"][0]
        assert answer["tiers"] == {"l1": 64, "l2": 192} and not answer["pending"]
        # Nothing was promoted by the questions: L1 holds only what the client stored.
        time.sleep(0.3)
        assert s.http.get("/status").json()["l1"]["entries"] == 1
        assert metric(s.metrics(), "kvtier_l2_promotions_total") == 0
        # The engine's lookup does promote (the route's answer can change after it).
        assert c.lookup(NS, prompt).tokens == 256
        c.close()
    finally:
        s.stop()


def test_remote_prefix_pending_then_answered_without_promotion(tmp_path, redis_standalone):  # noqa: F811
    """Node A writes a prompt to the shared store; node B never saw it: its first answer is pending (its
    presence cache does not know the chunks; the probe starts), later ones report them under remote."""
    flags = ["--remote-url", redis_standalone, "--remote-prefix", f"t{uuid.uuid4().hex[:10]}"]
    a = Server(tmp_path, *flags)
    b = None
    try:
        b = Server(tmp_path, *flags)
        prompt = doc(30, 192)
        ca, cb = a.client(), b.client()
        assert store(ca, prompt).stored == 3
        wait_for(lambda: (r := a.http.get("/status").json()["remote"])["remote_queue_depth"] == 0
                 and r["remote_inflight"] == 0 and r["remote_written"] >= 3, timeout=30, what="A's remote writes")
        assert cb.register(NS)
        body = {"tokens": prompt, "namespace": NS.fingerprint().hex()}
        first = ask(b, headers={}, **body)["namespaces"][0]
        assert first["pending"] and first["cached_tokens"] == 0
        assert first["tiers"] == {"l1": 0, "remote": 0}

        def answered() -> dict | None:
            answer = ask(b, headers={}, **body)["namespaces"][0]
            return None if answer["pending"] else answer

        answer = wait_for(answered, timeout=20, what="the probe's answer")
        assert answer["tiers"] == {"l1": 0, "remote": 192}
        time.sleep(0.3)
        assert b.http.get("/status").json()["l1"]["entries"] == 0  # nothing promoted by the questions
        assert metric(b.metrics(), "kvtier_remote_promotions_total") == 0
        ca.close()
        cb.close()
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_reserved_token_id_is_a_422_for_pin_too(srv, client):
    """0xFFFFFFFF marks a block's extra digest in the key chain (keys.py): no token id may take it. /cache/pin
    hashed it and failed with a 500 before; both routes refuse it as invalid input."""
    client.register(NS)
    body = {"namespace": NS.fingerprint().hex(), "token_ids": [0xFFFFFFFF] * 16}
    r = srv.http.post("/cache/pin", json=body, headers=AUTH)
    assert r.status_code == 422, r.text
