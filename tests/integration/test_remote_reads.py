"""The remote tier's read path in round trips (server/tiers/remote/reads.py `get`): a chunk whose header a lookup's
probe read comes back with one MGET per GROUP_PARTS parts, the header in the first; one not looked up costs
the header's GET first. Counted with the server's own command statistics on a Redis of the test's own.
Also: a chunk rewritten after the probe (another generation) is read right, and damage found with a known
generation is classified as without one (a wrong size or an overflow: corrupt; a part gone: missing; an
error reply: not the chunk's fault, nothing deleted)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest
from kvtier.server.tiers.record import ChunkMeta
from kvtier.server.tiers.remote.layout import GROUP_PARTS, PART_BYTES
from kvtier.server.tiers.remote.tier import RemoteTier

pytestmark = pytest.mark.integration
pytest_plugins = ("redis_servers",)  # redis_server, redis_cluster_own: servers of the test's own; make_acl_user

BLOCKS = 4
WAIT_S = 10.0


def new_meta(ns: bytes, size: int) -> ChunkMeta:
    return ChunkMeta(os.urandom(16), ns, BLOCKS, tuple(os.urandom(16) for _ in range(BLOCKS - 1)), size)


def cli(url: str, *args: str) -> str:
    port = url.rsplit(":", 1)[1]
    return subprocess.run(["redis-cli", "-p", port, *args], capture_output=True, text=True, timeout=30,
                          check=True).stdout.strip()


def calls(url: str) -> dict[str, int]:
    """Calls per command since the last CONFIG RESETSTAT."""
    out = {}
    for line in cli(url, "INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_"):
            name, _, fields = line.partition(":")
            out[name.removeprefix("cmdstat_")] = int(dict(f.split("=") for f in fields.split(","))["calls"])
    return out


def looked_up(tier: RemoteTier, meta: ChunkMeta) -> None:
    """find_prefix until it finds the chunk (its probe read the header)."""
    deadline = time.monotonic() + WAIT_S
    while not tier.find_prefix([[*meta.aliases, meta.key]], meta.ns):
        assert time.monotonic() < deadline, "the lookup did not find the chunk"
        time.sleep(0.01)


def read(tier: RemoteTier, meta: ChunkMeta) -> bytes | None:
    """`get` into three buffers cut inside parts (those parts go through staging)."""
    out = bytearray(meta.size)
    view = memoryview(out)
    cuts = [0, 4096, PART_BYTES + 3 * 65536, meta.size]
    return bytes(out) if tier.get(meta, [view[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]) else None


def parts_of(url: str, tier: RemoteTier, meta: ChunkMeta) -> list[str]:
    keys = cli(url, "--scan", "--pattern", f"{tier.prefix}:{meta.ns.hex()}:{{{meta.key.hex()}}}:*:*").split()
    return sorted(keys, key=lambda k: int(k.rsplit(":", 1)[1]))


def header_of(tier: RemoteTier, meta: ChunkMeta) -> str:
    return f"{tier.prefix}:{meta.ns.hex()}:{{{meta.key.hex()}}}:h"


@pytest.fixture
def tiers() -> Iterator:
    made: list[RemoteTier] = []
    prefix = f"t{uuid.uuid4().hex[:12]}"

    def make(url: str) -> RemoteTier:
        tier = RemoteTier(url, prefix=prefix)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


@pytest.mark.parametrize("parts", [3, 2 * GROUP_PARTS + 1])
def test_a_looked_up_chunk_is_read_in_one_mget_per_group(redis_server, tiers, parts):
    redis = redis_server()
    writer, reader, cold = tiers(redis.url), tiers(redis.url), tiers(redis.url)
    for t in (writer, reader, cold):
        t.scan()
    ns = os.urandom(16)
    meta = new_meta(ns, (parts - 1) * PART_BYTES + 777)
    data = os.urandom(meta.size)
    assert writer.put(meta, data)
    looked_up(reader, meta)
    groups = -(-parts // reader._group_parts())  # GROUP_PARTS at loopback bandwidth; fewer on a slow link
    cli(redis.url, "CONFIG", "RESETSTAT")
    assert read(reader, meta) == data
    got = calls(redis.url)
    assert (got.get("mget", 0), got.get("get", 0)) == (groups, 0), got  # the header came with the first parts
    cli(redis.url, "CONFIG", "RESETSTAT")
    assert read(cold, meta) == data  # never looked up: the header first
    got = calls(redis.url)
    assert (got.get("mget", 0), got.get("get", 0)) == (groups, 1), got


def test_a_chunk_rewritten_after_the_lookup_is_read_from_its_new_generation(redis_server, tiers):
    redis = redis_server()
    writer, reader = tiers(redis.url), tiers(redis.url)
    ns = os.urandom(16)
    meta = new_meta(ns, 2 * PART_BYTES + 5)
    assert writer.put(meta, os.urandom(meta.size))
    looked_up(reader, meta)
    old_parts = parts_of(redis.url, writer, meta)
    cli(redis.url, "DEL", header_of(writer, meta))  # its header went (expired); another node writes it again
    again = os.urandom(meta.size)
    assert tiers(redis.url).put(meta, again)
    assert old_parts and all(p in parts_of(redis.url, writer, meta) for p in old_parts)  # the old ones are there
    cli(redis.url, "CONFIG", "RESETSTAT")
    assert read(reader, meta) == again
    got = calls(redis.url)
    assert (got.get("mget", 0), got.get("get", 0)) == (2, 1), got  # found another generation: read again
    assert reader.corrupt == reader.missing == 0


@pytest.mark.parametrize("how", ["grown", "shortened", "deleted", "header_gone"])
def test_damage_found_with_a_known_generation(redis_server, tiers, how):
    redis = redis_server()
    writer, reader = tiers(redis.url), tiers(redis.url)
    ns = os.urandom(16)
    meta = new_meta(ns, 3 * PART_BYTES)
    assert writer.put(meta, os.urandom(meta.size))
    looked_up(reader, meta)
    part = parts_of(redis.url, writer, meta)[1]
    if how == "grown":  # longer than its buffer: glide refuses the overflow
        cli(redis.url, "SETRANGE", part, str(PART_BYTES), "x")
    elif how == "shortened":
        cli(redis.url, "SET", part, "short")
    elif how == "deleted":
        cli(redis.url, "DEL", part)
    else:
        cli(redis.url, "DEL", header_of(writer, meta))
    assert read(reader, meta) is None
    assert (reader.corrupt, reader.missing) == ((1, 0) if how in ("grown", "shortened") else (0, 1))
    assert cli(redis.url, "EXISTS", header_of(writer, meta)) == "0"  # deleted: never read again
    assert read(reader, meta) is None  # a miss (the header is gone)


def test_an_error_reply_is_not_corruption(redis_standalone, tiers, make_acl_user):
    """A user refused MGET (the documented ACL line less +mget): its lookups and reads are counted errors
    (misses), never corruption, and the chunk stays."""
    url = make_acl_user(redis_standalone, f"nomget-{uuid.uuid4().hex[:8]}", drop=("+mget",))
    writer, reader = tiers(redis_standalone), tiers(url)
    ns = os.urandom(16)
    meta = new_meta(ns, 2 * PART_BYTES)
    data = os.urandom(meta.size)
    assert writer.put(meta, data)
    deadline = time.monotonic() + WAIT_S
    while (found := reader.find_prefix([[*meta.aliases, meta.key]], ns)) is None:  # the probe's MGET refused
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert found == [] and reader.errors >= 1
    errors = reader.errors
    assert read(reader, meta) is None  # the header's GET is allowed, the parts' MGET refused
    assert reader.errors == errors + 1 and reader.corrupt == reader.missing == 0
    assert read(writer, meta) == data  # still there


def test_reads_fit_their_mgets_in_the_request_timeout(redis_server, tiers):
    """At a measured bandwidth too low for several parts in `timeout_ms`, each MGET asks for one part."""
    redis = redis_server()
    writer, reader = tiers(redis.url), RemoteTier(redis.url, prefix=tiers(redis.url).prefix, timeout_ms=50)
    try:
        ns = os.urandom(16)
        meta = new_meta(ns, 3 * PART_BYTES)
        data = os.urandom(meta.size)
        assert writer.put(meta, data)
        looked_up(reader, meta)
        reader._bw.add(PART_BYTES, 0.0, 0.05)  # 21 MB/s measured: a part takes 50 ms, 4x that > 50 ms
        cli(redis.url, "CONFIG", "RESETSTAT")
        assert read(reader, meta) == data
        assert calls(redis.url).get("mget", 0) == 3
    finally:
        reader.close()


def test_a_probe_over_every_master_with_one_stopped(redis_cluster_own, tiers, tmp_path):
    """Lookups whose probes cover three masters, one of them SIGSTOPped: the one MGET for all fails, then one
    per master: the two others answer (the lookup finds their chunks, never a wrong one) and the stopped
    master's failures count for its own breaker, which opens; the healthy masters' stay closed."""
    url, _ = redis_cluster_own
    writer = tiers(url)
    reader = RemoteTier(url, prefix=writer.prefix, breaker_threshold=2, breaker_reset_s=60.0)
    writer.scan()
    ns = os.urandom(16)
    metas: dict[str, ChunkMeta] = {}
    while len(metas) < 3:  # one chunk per master
        meta = new_meta(ns, 1000)
        metas.setdefault(writer._node_of(meta.key), meta)
    stopped = max(metas)
    run = [metas[node] for node in sorted(metas) if node != stopped] + [metas[stopped]]
    for meta in run:
        assert writer.put(meta, os.urandom(meta.size))
    pid = int((tmp_path / "cluster" / f"redis-{stopped.rsplit(':', 1)[1]}.pid").read_text())
    reader.scan()
    os.kill(pid, signal.SIGSTOP)
    try:
        chunks = [[*m.aliases, m.key] for m in run]
        deadline = time.monotonic() + 2 * WAIT_S
        while (found := reader.find_prefix(chunks, ns)) is None or len(found) < 2:
            assert found is None or [m for m, _ in found] == run[:len(found)], found
            assert time.monotonic() < deadline, f"the lookup did not find the live masters' chunks: {reader.stats()}"
            time.sleep(0.05)
        assert [m for m, _ in found] == run[:2]
        deadline = time.monotonic() + 2 * WAIT_S
        while reader.stats()["remote_breakers_open"] != [stopped]:  # more lookups: the stopped one's breaker
            assert time.monotonic() < deadline, reader.stats()
            reader.find_prefix([[os.urandom(16)] for _ in range(3)], ns)  # unknown keys on every master
            time.sleep(0.05)
    finally:
        os.kill(pid, signal.SIGCONT)
        reader.close()
