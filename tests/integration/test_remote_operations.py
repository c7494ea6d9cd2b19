"""The remote tier under real operations (issue 29, items 1-3, 14 and 15), against real Redis servers
(tests/integration/redis_servers.py):

* a user that cannot delete (the ACL line of docs/remote.md less +unlink) counts the failed delete, logs it
  as such and counts the chunk once however often it is read or probed (that the documented user deletes:
  test_remote_tier.py's damaged-chunk test);
* an error reply of the store (NOPERM here; LOADING, CLUSTERDOWN, MASTERDOWN and BUSY take the same path) on
  a part GET or the header GET is a counted miss ("unavailable"): not corruption, nothing deleted; so is one
  in a lookup's probe pipeline;
* a Cluster master that died and whose slots went to another master loses its breaker and gauge: health
  follows the current masters;
* a record claiming more blocks than its namespace's chunks hold is a counted miss, never a hit in a lookup
  nor an L1 entry.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest
from kvtier.server import protocol as p
from kvtier.server.config import ServerConfig
from kvtier.server.keys import chunk_keys
from kvtier.server.metrics import Metrics
from kvtier.server.tiers.networked.presence import MISSING_TTL_S
from kvtier.server.tiers.record import ChunkMeta
from kvtier.server.tiers.remote.layout import PART_BYTES
from kvtier.server.tiers.remote.metrics import RemoteMetrics
from kvtier.server.tiers.remote.tier import RemoteTier
from test_remote_tier import NS, answered, corrupt_case, daemon_cache, keys_matching, new_meta, read

pytestmark = pytest.mark.integration
# redis_standalone, redis_acl, make_acl_user, redis_cluster_own
pytest_plugins = ("redis_servers",)

WAIT_S = 20.0


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def tiers(prefix: str) -> Iterator:
    made: list[RemoteTier] = []

    def make(url: str, **kwargs) -> RemoteTier:
        tier = RemoteTier(url, prefix=prefix, **kwargs)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def header_of(tier: RemoteTier, meta: ChunkMeta) -> str:
    return f"{tier.prefix}:{meta.ns.hex()}:{{{meta.key.hex()}}}:h"


def sample(metrics: Metrics, name: str, labels: dict | None = None) -> float | None:
    return metrics.registry.get_sample_value(name, labels or {})


# -- items 1 and 15: deletes (the documented ACL user's: test_remote_tier's damaged-chunk test) --------


def test_a_failed_delete_is_counted_logged_and_the_chunk_counted_once(redis_standalone, tiers, prefix, make_acl_user, caplog):
    """A user without UNLINK (the documented line less +unlink): the chunk stays, and is reported once."""
    metrics = Metrics()
    url = make_acl_user(redis_standalone, f"nodel-{prefix}", drop=("+unlink",))
    a, b = tiers(redis_standalone), tiers(url, metrics=RemoteMetrics(metrics))
    ns = os.urandom(16)
    meta = new_meta(ns)
    assert a.put(meta, os.urandom(meta.size))
    corrupt_case(redis_standalone, a, meta, "flipped")
    chunk = [*meta.aliases, meta.key]
    with caplog.at_level(logging.WARNING, logger="kvtier.server.remote"):
        assert answered(b, [chunk], ns) == [(meta, meta.blocks)]  # reported until read and found bad
        for _ in range(3):
            assert read(b, meta) is None
        time.sleep(MISSING_TTL_S + 0.2)  # the presence cache's miss expired: probed again, still ignored
        assert answered(b, [chunk], ns) == []
        assert read(b, meta) is None
    assert b.corrupt == 1 and sample(metrics, "kvtier_remote_corrupt_chunks_total") == 1
    assert sample(metrics, "kvtier_remote_delete_failures_total") == 1
    assert keys_matching(redis_standalone, header_of(a, meta))  # still there: the delete failed
    messages = [r.getMessage() for r in caplog.records]
    assert not any("corrupt: removed" in m for m in messages), messages
    assert sum("delete failed" in m for m in messages) == 1, messages


# -- item 2: error replies are not corruption ------------------------------------------------------------


def test_an_error_reply_on_a_part_is_unavailable_not_corrupt(redis_standalone, tiers, prefix, make_acl_user):
    """A user that may read headers but not parts: every part GET answers NOPERM."""
    metrics = Metrics()
    url = make_acl_user(redis_standalone, f"noparts-{prefix}", keys=(f"{prefix}:*:h", f"{prefix}:*:a"))
    a, b = tiers(redis_standalone), tiers(url, metrics=RemoteMetrics(metrics))
    meta = new_meta(os.urandom(16))
    data = os.urandom(meta.size)
    assert a.put(meta, data)
    assert read(b, meta) is None
    assert b.corrupt == 0 and sample(metrics, "kvtier_remote_corrupt_chunks_total") == 0
    assert sample(metrics, "kvtier_remote_errors_total", {"op": "get"}) == 1
    assert keys_matching(redis_standalone, header_of(a, meta))  # a healthy shared chunk is not deleted
    assert read(tiers(redis_standalone), meta) == data


def test_an_error_reply_on_the_header_is_a_counted_miss(redis_standalone, tiers, prefix, make_acl_user):
    metrics = Metrics()
    url = make_acl_user(redis_standalone, f"nohdr-{prefix}", keys=(f"{prefix}:*:a",))
    a, b = tiers(redis_standalone), tiers(url, metrics=RemoteMetrics(metrics))
    meta = new_meta(os.urandom(16))
    data = os.urandom(meta.size)
    assert a.put(meta, data)
    assert read(b, meta) is None  # no traceback
    assert sample(metrics, "kvtier_remote_errors_total", {"op": "get"}) == 1
    assert b.corrupt == 0 and b.missing == 0
    assert read(a, meta) == data


def test_an_error_reply_to_a_probe_is_a_counted_miss(redis_standalone, tiers, prefix, make_acl_user):
    """A lookup's probe (a pipeline) whose header GETs answer NOPERM, as a Cluster's CLUSTERDOWN during a
    failover: the chunk is a miss and the error replies are counted, not taken for absent keys silently."""
    metrics = Metrics()
    url = make_acl_user(redis_standalone, f"noprobe-{prefix}", keys=(f"{prefix}:*:a",))
    a, b = tiers(redis_standalone), tiers(url, metrics=RemoteMetrics(metrics))
    ns = os.urandom(16)
    meta = new_meta(ns)
    assert a.put(meta, os.urandom(meta.size))
    assert answered(b, [[*meta.aliases, meta.key]], ns) == []
    assert sample(metrics, "kvtier_remote_errors_total", {"op": "probe"}) >= 1
    assert b.errors >= 1 and b.corrupt == 0
    assert answered(tiers(redis_standalone), [[*meta.aliases, meta.key]], ns) == [(meta, meta.blocks)]


# -- item 3: breakers of departed nodes -----------------------------------------------------------------


def cli(port: int, *args: str) -> str:
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True,
                          timeout=30, check=True).stdout


def test_breaker_of_a_departed_master_is_dropped(redis_cluster_own, tiers):
    """A master is killed (its breaker opens) and its slots are given to another master (CLUSTER FORGET,
    ADDSLOTSRANGE: the node is gone for good, as a pod replaced at a new address): within a slot map
    refresh the tier is healthy again and the dead node's gauge is gone."""
    url, ports = redis_cluster_own
    metrics = Metrics()
    tier = tiers(url, timeout_ms=200, breaker_threshold=1, breaker_reset_s=0.5, metrics=RemoteMetrics(metrics))
    tier.scan()
    meta = new_meta(os.urandom(16), size=PART_BYTES)
    dead = tier._node_of(meta.key)
    dead_port = int(dead.rpartition(":")[2])
    survivors = [port for port in ports if port != dead_port]
    assert tier.put(meta, os.urandom(meta.size))
    dead_id = cli(dead_port, "CLUSTER", "MYID").strip()
    ranges = [line.split()[8:] for line in cli(dead_port, "CLUSTER", "NODES").splitlines() if "myself" in line][0]
    os.kill(int(cli(dead_port, "INFO", "server").split("process_id:")[1].split()[0]), signal.SIGKILL)
    deadline = time.monotonic() + WAIT_S
    while tier.health()[0]:
        assert time.monotonic() < deadline, "the breaker never opened"
        read(tier, meta)
        time.sleep(0.1)
    assert sample(metrics, "kvtier_remote_breaker_open", {"node": dead}) == 1.0
    for port in survivors:
        cli(port, "CLUSTER", "FORGET", dead_id)
    for r in ranges:
        start, _, end = r.partition("-")
        cli(survivors[0], "CLUSTER", "ADDSLOTSRANGE", start, end or start)
    deadline = time.monotonic() + WAIT_S
    while not all("cluster_state:ok" in cli(port, "CLUSTER", "INFO") for port in survivors):
        assert time.monotonic() < deadline, "the cluster never recovered"
        time.sleep(0.2)
    deadline = time.monotonic() + WAIT_S
    while not tier.health()[0]:
        assert time.monotonic() < deadline, f"still degraded: {tier.health()[1]}"
        time.sleep(0.2)
    assert dead not in tier.stats()["remote_breakers_open"]
    assert sample(metrics, "kvtier_remote_breaker_open", {"node": dead}) is None
    assert dead not in dict(tier._breakers.items())


# -- item 14: a record longer than its namespace's chunks -----------------------------------------------


@pytest.mark.parametrize("where", ["remote", "l2"])
def test_a_record_longer_than_its_namespace_chunk_is_a_counted_miss(redis_standalone, tmp_path, where, prefix):
    """Another writer (same prefix, or the L2 directory) plants an intact record claiming 4,096 blocks for
    the first chunk of a 4-block namespace: a lookup reports no hit past what fits, nothing enters L1, and
    the record counts as a failed promotion (as a client's reserve of it would be refused)."""
    metrics = Metrics()
    config = (ServerConfig(remote_url=redis_standalone, remote_prefix=prefix) if where == "remote"
              else ServerConfig(l2_path=str(tmp_path / "l2")))
    store, holds, _, tier, cache = daemon_cache(config, metrics)
    try:
        fp = holds.register(NS)
        chunks = chunk_keys(NS, list(range(3 * 256)))
        assert len(chunks[0].block_keys) == 4
        size = 100_000
        claim = ChunkMeta(chunks[0].key, fp, 4096, (), size)
        holds.hello(b"c", "t", 1)
        with pytest.raises(p.ProtocolError, match="longer than"):  # a client's reserve of the same claim
            holds.reserve(holds.client(b"c"), fp, [p.StoreItem(claim.key, size, claim.blocks, claim.aliases)])
        assert tier.tier.put(claim, os.urandom(size))
        if where == "l2":
            tier.tier.scan()
        deadline = time.monotonic() + WAIT_S
        while (found := cache.lookup(fp, [list(c.block_keys) for c in chunks])).pending:
            assert time.monotonic() < deadline, "the lookup stayed pending"
            time.sleep(0.01)
        assert found.hits == []
        assert claim.key not in store.entries and not store.busy
        assert metrics.registry.get_sample_value(f"kvtier_{where}_promotion_failures_total") == 1
    finally:
        cache.close()
