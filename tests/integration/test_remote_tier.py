"""The remote tier (server/tiers/remote/) against real servers (tests/integration/redis_servers.py): a
standalone Redis 7, a 3-master Redis Cluster, a standalone Valkey 8 and the standalone Redis as the ACL user
docs/remote.md documents (the tests taking `url`), and a Redis of the test's own where it is stopped with
SIGSTOP.

Two RemoteTier objects with one prefix stand for two nodes sharing a store; each test uses a prefix of its
own, so tests sharing a server never see each other's keys.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import glide_sync as glide
import numpy as np
import pytest
from kvtier.server import protocol as p
from kvtier.server.cache import Cache
from kvtier.server.config import ServerConfig, parse_remote_url
from kvtier.server.eviction import make_policy
from kvtier.server.keys import Namespace, chunk_keys
from kvtier.server.l1.holds import Holds
from kvtier.server.l1.pool import PagePool
from kvtier.server.l1.store import L1Store
from kvtier.server.metrics import Metrics
from kvtier.server.tier_setup import make_tiers
from kvtier.server.tiers.attached import AttachedTier
from kvtier.server.tiers.record import ChunkMeta
from kvtier.server.tiers.remote.layout import PART_BYTES
from kvtier.server.tiers.remote.layout import slot as slot_of
from kvtier.server.tiers.remote.metrics import RemoteMetrics
from kvtier.server.tiers.remote.tier import RemoteTier

# redis_standalone, redis_cluster, valkey_standalone, redis_acl (docs/remote.md's ACL user), redis_server
pytest_plugins = ("redis_servers",)

SIZE = 2 * PART_BYTES + 12_345  # three parts, the last short
BLOCKS = 4
WAIT_S = 10.0


def new_meta(ns: bytes, size: int = SIZE, blocks: int = BLOCKS) -> ChunkMeta:
    return ChunkMeta(os.urandom(16), ns, blocks, tuple(os.urandom(16) for _ in range(blocks - 1)), size)


def split(data: bytes | bytearray, cuts: tuple[int, ...] = (65536, PART_BYTES + 7)) -> list[memoryview]:
    """`data` as consecutive views cut at `cuts` (parts that cross a view go through staging)."""
    view = memoryview(data)
    edges = [0, *(c for c in cuts if c < len(data)), len(data)]
    return [view[a:b] for a, b in zip(edges, edges[1:], strict=False)]


def read(tier: RemoteTier, meta: ChunkMeta) -> bytes | None:
    out = bytearray(meta.size)
    return bytes(out) if tier.get(meta, split(out, (4096, 3 * 65536))) else None


def answered(tier: RemoteTier, chunks: list[list[bytes]], ns: bytes | None) -> list[tuple[ChunkMeta, int]]:
    """find_prefix asked again until it is not pending."""
    deadline = time.monotonic() + WAIT_S
    while (found := tier.find_prefix(chunks, ns)) is None:
        assert time.monotonic() < deadline, "find_prefix stayed pending"
        time.sleep(0.01)
    return found


def raw_client(url: str):
    u = parse_remote_url(url)
    nodes = [glide.NodeAddress(h, p) for h, p in u.nodes]
    if u.cluster:
        return glide.GlideClusterClient.create(glide.GlideClusterClientConfiguration(nodes, request_timeout=2000))
    return glide.GlideClient.create(glide.GlideClientConfiguration(nodes, request_timeout=2000))


def keys_matching(url: str, pattern: str) -> list[bytes]:
    client = raw_client(url)
    out: list[bytes] = []
    try:
        if parse_remote_url(url).cluster:
            cursor = glide.ClusterScanCursor()
            while not cursor.is_finished():
                cursor, keys = client.scan(cursor, match=pattern, count=1000)
                out += keys
        else:
            cursor = b"0"
            while True:
                cursor, keys = client.scan(cursor, match=pattern, count=1000)
                out += keys
                if cursor in (b"0", "0"):
                    break
    finally:
        client.close()
    return sorted(set(out))


@pytest.fixture
def tiers() -> Iterator:
    """tiers(url, **kwargs) -> RemoteTier; each test's tiers share one fresh prefix; all closed at the end."""
    made: list[RemoteTier] = []
    prefix = f"t{uuid.uuid4().hex[:12]}"

    def make(url: str, **kwargs) -> RemoteTier:
        kwargs.setdefault("prefix", prefix)
        tier = RemoteTier(url, **kwargs)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


@pytest.fixture(params=["redis_standalone", "redis_cluster", "valkey_standalone", "redis_acl"])
def url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(request.param)


def test_round_trip_bit_exact_across_nodes(url, tiers):
    a, b = tiers(url), tiers(url)
    assert a.scan() == 0 and a.rtt_s > 0 and a.used_bytes > 0
    ns = os.urandom(16)
    meta = new_meta(ns)
    data = os.urandom(meta.size)
    assert a.put(meta, a.prepare(meta, split(data)))
    assert read(a, meta) == data
    assert read(b, meta) == data  # another node's object, nothing known locally
    assert a.written == 1 and a.written_bytes == meta.size
    one_mib = new_meta(ns, PART_BYTES)  # exactly one part, from one view
    payload = os.urandom(PART_BYTES)
    assert a.put(one_mib, payload) and read(b, one_mib) == payload


def test_a_chunk_is_written_once(url, tiers):
    a, b = tiers(url), tiers(url)
    meta = new_meta(os.urandom(16))
    data = os.urandom(meta.size)
    assert a.put(meta, data)
    assert not a.put(meta, data)  # known here: not even asked
    assert not b.put(meta, os.urandom(meta.size))  # another node: the header exists
    assert b.existing == 1 and b.written == 0
    parts = keys_matching(url, f"{a.prefix}:{meta.ns.hex()}:{{{meta.key.hex()}}}:*")
    assert len(parts) == 1 + 3  # the header and one generation's three parts
    assert read(b, meta) == data


def test_find_prefix_pending_then_answered(url, tiers):
    a, b = tiers(url), tiers(url)
    ns = os.urandom(16)
    metas = [new_meta(ns, 70_000) for _ in range(3)]
    for m in metas:
        assert a.put(m, os.urandom(m.size))
    chunks = [[*m.aliases, m.key] for m in metas]
    assert b.find_prefix(chunks, ns) is None and b.pending == 1
    assert answered(b, chunks, ns) == [(m, BLOCKS) for m in metas]
    assert b.entries == 3 and b.contains(metas[0].key)
    # a known miss ends the run, and the answers after it are kept for the next lookup
    absent = [os.urandom(16) for _ in range(BLOCKS)]
    assert answered(b, [chunks[0], absent, chunks[1]], ns) == [(metas[0], BLOCKS)]
    assert b.find_prefix([chunks[0], absent, chunks[1]], ns) == [(metas[0], BLOCKS)]
    # the writer knows its own chunks without asking, and a lookup without a namespace uses the ones it saw
    assert a.find_prefix(chunks, None) == [(m, BLOCKS) for m in metas]


def test_partial_chunk_matches_through_aliases(url, tiers):
    a, b = tiers(url), tiers(url)
    ns = os.urandom(16)
    meta = new_meta(ns, 70_000)
    data = os.urandom(meta.size)
    assert a.put(meta, data)
    # a lookup whose last chunk shares only the first two blocks with the stored one
    other = [meta.aliases[0], meta.aliases[1], os.urandom(16), os.urandom(16)]
    assert answered(b, [other], ns) == [(meta, 2)]
    # and one that ends after two blocks (a shorter prompt)
    c = tiers(url)
    assert answered(c, [[meta.aliases[0], meta.aliases[1]]], ns) == [(meta, 2)]
    assert read(c, meta) == data


def corrupt_case(url: str, tier: RemoteTier, meta: ChunkMeta, how: str) -> None:
    client = raw_client(url)
    base = f"{tier.prefix}:{meta.ns.hex()}:{{{meta.key.hex()}}}"
    parts = [k for k in keys_matching(url, f"{base}:*") if not k.endswith(b":h")]
    try:
        if how == "flipped":
            client.custom_command(["SETRANGE", parts[1], "100", "X"])
        elif how == "part_missing":
            client.unlink([parts[2]])
        elif how == "parts_missing":
            client.unlink(parts)
        elif how == "part_longer":
            client.custom_command(["APPEND", parts[0], "tail"])
    finally:
        client.close()


@pytest.mark.parametrize("user", ["default", "redis_acl"])
@pytest.mark.parametrize("how,counter", [("flipped", "corrupt"), ("part_longer", "corrupt"),
                                         ("part_missing", "missing"), ("parts_missing", "missing")])
def test_damaged_chunk_is_a_counted_miss_and_its_header_goes(request, redis_standalone, tiers, how, counter, user):
    """Also as the ACL user docs/remote.md documents (`redis_acl`): its commands delete the chunk."""
    url = redis_standalone if user == "default" else request.getfixturevalue(user)
    metrics = Metrics()
    a, b = tiers(url), tiers(url, metrics=RemoteMetrics(metrics))
    meta = new_meta(os.urandom(16))
    assert a.put(meta, os.urandom(meta.size))
    corrupt_case(redis_standalone, a, meta, how)
    assert read(b, meta) is None
    assert getattr(b, counter) == 1
    assert metrics.registry.get_sample_value(f"kvtier_remote_{counter}_chunks_total") == 1
    chunk = f"{a.prefix}:{meta.ns.hex()}:{{{meta.key.hex()}}}"
    assert keys_matching(redis_standalone, f"{chunk}:h") == []  # cleaned up: never served again
    assert [k for k in keys_matching(redis_standalone, f"{chunk}:*") if not k.endswith(b":h")] == []  # parts too
    assert metrics.registry.get_sample_value("kvtier_remote_delete_failures_total") == 0
    assert read(a, meta) is None and not b.contains(meta.key)


def test_two_writers_never_mix_bytes(url, tiers):
    a, b, reader = tiers(url), tiers(url), tiers(url)
    ns = os.urandom(16)
    for _ in range(6):
        meta = new_meta(ns)
        payloads = {a: os.urandom(meta.size), b: os.urandom(meta.size)}
        go = threading.Barrier(3)
        seen: list[bytes | None] = []

        def write(tier: RemoteTier, meta: ChunkMeta = meta, go: threading.Barrier = go,
                  payloads: dict = payloads) -> None:
            go.wait()
            tier.put(meta, payloads[tier])

        def poll(meta: ChunkMeta = meta, go: threading.Barrier = go, seen: list = seen) -> None:
            go.wait()
            for _ in range(5):
                seen.append(read(tiers(url), meta))

        threads = [threading.Thread(target=write, args=(t,)) for t in (a, b)] + [threading.Thread(target=poll)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        final = read(reader, meta)
        assert final in payloads.values()
        assert all(s is None or s == final for s in seen)


def test_clear_removes_only_its_namespace(url, tiers):
    a = tiers(url)
    ns1, ns2 = os.urandom(16), os.urandom(16)
    one = [new_meta(ns1, 70_000) for _ in range(3)]
    two = [new_meta(ns2, 70_000) for _ in range(2)]
    for m in one + two:
        assert a.put(m, os.urandom(m.size))
    cleared = a.clear(ns1)
    assert (cleared.entries, cleared.failed) == (3, 0)
    assert keys_matching(url, f"{a.prefix}:{ns1.hex()}:*") == []
    assert keys_matching(url, f"{a.prefix}:{ns2.hex()}:*")
    assert not a.contains(one[0].key) and read(a, one[0]) is None
    assert read(tiers(url), two[0]) is not None
    assert a.clear(None).entries == 2 and keys_matching(url, f"{a.prefix}:*") == []


def test_cluster_keys_of_a_chunk_share_its_slot(redis_cluster, tiers):
    a = tiers(redis_cluster)
    a.scan()
    meta = new_meta(os.urandom(16))
    client = raw_client(redis_cluster)
    try:
        for key in (a._key(meta.ns, meta.key, "h"), a._part_key(meta.ns, meta.key, b"\0" * 8, 3)):
            slot = client.custom_command(["CLUSTER", "KEYSLOT", key], route=glide.RandomNode())
            assert slot == slot_of(meta.key.hex().encode())
        assert len(set(a._slot_nodes)) == 3  # the slot map names the three masters
    finally:
        client.close()


def test_breaker_opens_on_a_stopped_server_and_recovers(redis_server, tiers):
    server = redis_server()
    metrics = Metrics()
    tier = tiers(server.url, timeout_ms=150, breaker_threshold=3, breaker_reset_s=0.5,
                 metrics=RemoteMetrics(metrics))
    tier.scan()
    ns = os.urandom(16)
    stored = new_meta(ns)
    data = os.urandom(stored.size)
    assert tier.put(stored, data) and read(tier, stored) == data
    os.kill(server.pid, signal.SIGSTOP)
    try:
        for _ in range(3):  # each waits its timeout, then the breaker opens
            assert read(tier, stored) is None
        assert tier.timeouts >= 3
        ok, why = tier.health()
        assert not ok and "breaker open" in why
        start = time.perf_counter()
        assert read(tier, stored) is None  # at once now
        assert not tier.put(new_meta(ns), os.urandom(SIZE))
        unknown = [[os.urandom(16) for _ in range(BLOCKS)]]
        assert tier.find_prefix(unknown, ns) == []  # a miss, not pending
        assert time.perf_counter() - start < 0.1
        assert tier.rejected >= 2
        node = server.url.removeprefix("redis://")
        assert metrics.registry.get_sample_value("kvtier_remote_breaker_open", {"node": node}) == 1.0
        assert metrics.registry.get_sample_value("kvtier_remote_rejected_calls_total", {"op": "get"}) >= 1
    finally:
        os.kill(server.pid, signal.SIGCONT)
    deadline = time.monotonic() + WAIT_S
    while not tier.health()[0]:  # a PING after the reset time closes it
        assert time.monotonic() < deadline, "the breaker did not close after the server came back"
        time.sleep(0.05)
    assert read(tier, stored) == data
    again = new_meta(ns)
    assert tier.put(again, os.urandom(SIZE)) and read(tiers(server.url), again) is not None


def test_config_validates_the_remote_settings():
    ok = ServerConfig(remote_url="redis+cluster://h1:7001,[::1]:7002", remote_prefix="kv.prod-1")
    ok.validate()
    bad = [
        ({"remote_url": "http://h:1"}, "must start with redis://"),
        ({"remote_url": "redis://a:1,b:2"}, "use redis+cluster://"),
        ({"remote_url": "redis://:s3cret@h:99999"}, "1..65535"),
        ({"remote_url": "redis+cluster://h:1/3"}, "0 for a Cluster"),
        ({"remote_url": "redis://h", "remote_prefix": "a*b"}, "--remote-prefix"),
        ({"remote_url": "redis://h", "remote_ttl_s": -1.0}, "--remote-ttl-s"),
        ({"remote_url": "redis://h", "remote_timeout_ms": 0}, "--remote-timeout-ms"),
        ({"remote_url": "redis://h", "remote_breaker_threshold": 0}, "--remote-breaker-threshold"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)) as err:
            ServerConfig(**kwargs).validate()
        assert "s3cret" not in str(err.value)
    url = parse_remote_url("rediss://user:p%40ss@cache.internal:6380/2")
    assert (url.tls, url.cluster, url.nodes, url.username, url.password, url.db) == (
        True, False, (("cache.internal", 6380),), "user", "p@ss", 2)
    assert url.redacted() == "rediss://user@cache.internal:6380/2" and "p@ss" not in repr(url)


NS = Namespace(model="m", dtype="bf16", num_layers=2, kv_heads=2, head_size=8, block_size=64,
               layout="NHD", chunk_size=256)
PAGE = 64 * 1024


def daemon_cache(config: ServerConfig, metrics: Metrics) -> tuple[L1Store, Holds, np.ndarray, AttachedTier, Cache]:
    """An L1 of 96 pages with the lower tier `config` names, as the daemon builds them (make_tiers), open."""
    store = L1Store(PagePool(96, PAGE), make_policy("lru"), metrics)
    holds = Holds(store, metrics)
    segment = np.zeros(96 * PAGE, dtype=np.uint8)
    [tier] = make_tiers(config, store, segment, metrics)
    cache = Cache(store, holds, metrics, [tier])
    cache.open()
    return store, holds, segment, tier, cache


def test_write_behind_and_promotion_through_the_cache(redis_standalone):
    """The tier as the daemon builds it (make_tiers): chunks L1 commits go out on the writer threads from
    their L1 pages; once L1 forgot them, a lookup promotes them back from the store, bit-exact."""
    metrics = Metrics()
    config = ServerConfig(remote_url=redis_standalone, remote_prefix=f"t{uuid.uuid4().hex[:12]}")
    store, holds, segment, tier, cache = daemon_cache(config, metrics)
    try:
        fp = holds.register(NS)
        chunks = chunk_keys(NS, list(range(3 * 256)))
        size = PART_BYTES + 300_000  # two parts over 21 pages
        data = {c.key: os.urandom(size) for c in chunks}
        holds.hello(b"c", "t", 1)
        owner = holds.client(b"c")
        res = holds.reserve(owner, fp, [p.StoreItem(c.key, size, len(c.block_keys), c.aliases) for c in chunks])
        for c, (status, _, ext) in zip(chunks, res, strict=True):
            assert status == p.RESERVED
            view, off = np.frombuffer(data[c.key], dtype=np.uint8), 0
            for i in range(0, len(ext), 2):
                n = min(ext[i + 1] * PAGE, size - off)
                segment[ext[i] * PAGE: ext[i] * PAGE + n] = view[off: off + n]
                off += n
        cache.commit(owner, [r[1] for r in res])
        assert tier.writer.wait_idle(WAIT_S) and tier.tier.written == 3
        assert store.clear(fp)[0] == 3
        found = cache.lookup(fp, [list(c.block_keys) for c in chunks])
        assert found.tiers == ["remote"] * 3 and [m for _, m in found.hits] == [4, 4, 4]
        for c, (entry, _) in zip(chunks, found.hits, strict=True):
            got = np.concatenate([segment[entry.extents[i] * PAGE:(entry.extents[i] + entry.extents[i + 1]) * PAGE]
                                  for i in range(0, len(entry.extents), 2)])[:size]
            assert got.tobytes() == data[c.key]
        status = cache.status()
        assert status["remote_written"] == 3 and status["remote_promoted"] == 3 and status["remote_rtt_s"] > 0
        assert metrics.registry.get_sample_value("kvtier_remote_written_chunks") == 3
    finally:
        cache.close()
    assert not any(t.is_alive() for t in tier.tier._threads)
