"""The remote tier's failures through real kvtier servers and a real Redis (issue 15, checks 2 and 3).

"Nodes" are kvtier servers on this machine with nothing in common but the Redis server: their own L1 segments,
ports and L2 directories, and different PYTHONHASHSEED values. Node A writes, node B reads, and B's reads are
checked byte for byte against what A stored (_support.payload_of). Each test has a Redis of its own
(redis_servers.redis_server: it is stopped, killed, reconfigured and damaged here).

* Redis stopped (SIGSTOP) and then killed (SIGKILL) mid-workload: stores and L1 hits go on without waiting
  on it, the breaker state, timeouts and dropped calls are counted, /healthz says degraded (still ready);
  Redis back (SIGCONT; a new redis-server on the same port): sharing resumes with the same kvtier processes.
  A Redis already down when kvtier starts opens the breaker too (glide's failed lazy connect is a plain
  RequestError "... connect failed": a node failure, not an answer).
* A corrupted part (SETRANGE), a missing part (DEL; and evicted by a tiny maxmemory with allkeys-lru), a
  header without parts, two writers of one chunk with different bytes: never served wrong, counted in B's
  /status, and the bad header gone from Redis afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import blake3
import numpy as np
import pytest
from _support import REPO, ServerProc, free_port, payload_of, prompt, read_checked, wait_for
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.connector.results import LookupResult, ReadChunk
from kvtier.server.config import parse_remote_url
from kvtier.server.keys import Namespace, chunk_keys
from kvtier.server.tiers.remote.layout import PART_BYTES

if TYPE_CHECKING:
    from redis_servers import RedisServer

pytestmark = pytest.mark.integration
pytest_plugins = ("redis_servers",)  # redis_server: a standalone Redis of the test's own

# Two engine blocks per chunk (one block-prefix alias), three parts per chunk, the last short.
NS = Namespace(model="org/tiny-remote-failures", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64,
               block_size=128, layout="NHD", chunk_size=256)
SIZE = 2 * PART_BYTES + 100_000
PARTS = -(-SIZE // PART_BYTES)
BLOCKS = NS.chunk_size // NS.block_size
TIMEOUT_MS = 300  # the remote calls' timeout floor: a store or L1 hit that waited on Redis takes longer
# Fast failure handling, so that the breaker opens and closes within the test's time.
FAST = ["--remote-timeout-ms", str(TIMEOUT_MS), "--remote-breaker-threshold", "3", "--remote-breaker-reset-s", "0.5"]
WAIT_S = 20.0
CONNECTED_S = 6.0  # a node's remote maintenance thread connects at its first INFO refresh, 5 s after the start
REDIS_ENV = REPO / "scripts" / "redis_env.sh"


@dataclass
class Node:
    srv: ServerProc
    http: int
    client: KVTierClient

    def get(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}{path}", timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def remote(self) -> dict:
        return self.get("/status")[1]["remote"]

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/metrics", timeout=10) as r:
            lines = r.read().decode().splitlines()
        values = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name)]
        assert values, f"no {name} in /metrics"
        return sum(values)


@pytest.fixture
def nodes(kvtier_server, tmp_path: Path):
    """nodes(url, name, seed, extra=[]) -> Node: a kvtier server with the remote tier at `url` (this test's
    prefix), an L2 directory and an admin port of its own, PYTHONHASHSEED=`seed`, and a connected client."""
    prefix = f"t{uuid.uuid4().hex[:12]}"
    made: list[Node] = []

    def start(url: str, name: str, seed: str, extra: list[str] | None = None) -> Node:
        http = free_port()
        srv = kvtier_server(l1_gb=0.125, env={"PYTHONHASHSEED": seed}, extra=[
            "--remote-url", url, "--remote-prefix", prefix, "--l2-path", str(tmp_path / f"l2-{name}"),
            "--l2-size-gb", "0.25", "--http-port", str(http), *(extra or [])])
        c = KVTierClient(ClientConfig(url=srv.url, connect_timeout_s=5.0, request_timeout_s=20.0, strict=True))
        assert c.connect()
        node = Node(srv, http, c)
        made.append(node)
        return node

    start.prefix = prefix  # type: ignore[attr-defined]
    yield start
    for node in made:
        node.client.close()


def redis_cli(url: str, *args: str) -> str:
    u = parse_remote_url(url)
    (host, port), = u.nodes
    out = subprocess.run(["redis-cli", "-h", host, "-p", str(port), *args], capture_output=True, text=True,
                         timeout=30, check=True)
    return out.stdout.strip()


def chunk_keys_in_redis(url: str, prefix: str, key: bytes) -> tuple[list[str], list[str]]:
    """A chunk's header keys and part keys in Redis (whatever its namespace and generation)."""
    keys = redis_cli(url, "--scan", "--pattern", f"{prefix}:*:{{{key.hex()}}}:*").split()
    return [k for k in keys if k.endswith(":h")], sorted(k for k in keys if not k.endswith((":h", ":a")))


def store(node: Node, tokens: np.ndarray, payload: Callable[[bytes, int], np.ndarray] = payload_of) -> float:
    """Store a prompt's chunks (every one of them, or fail); the seconds it took."""
    n = len(chunk_keys(NS, tokens))
    t0 = time.perf_counter()
    res = node.client.store(NS, tokens, lambda _c: SIZE, lambda ch, span: span.write(0, payload(ch.key, SIZE)))
    took = time.perf_counter() - t0
    assert res.stored == n, res
    return took


def drained(node: Node, written: int) -> dict:
    """Wait until the node's remote writes are done (none queued or in flight) and `written` chunks went out."""
    return wait_for(lambda: (s := node.remote())["remote_inflight"] == 0 and s["remote_queue_depth"] == 0
                    and s["remote_written"] >= written and s, timeout=WAIT_S, what=f"{written} remote writes")


def settled(node: Node, tokens: np.ndarray) -> LookupResult:
    """A lookup asked again while it answers pending (the remote tier probes), as the connector does."""
    deadline = time.monotonic() + WAIT_S
    while (found := node.client.lookup(NS, tokens)).pending:
        assert time.monotonic() < deadline, "the lookup stayed pending"
        time.sleep(0.02)
    return found


def fetched(node: Node, tokens: np.ndarray) -> tuple[list[str], int]:
    """The tiers of a settled lookup and the tokens read from them, checked against payload_of."""
    found = settled(node, tokens)
    return [h.tier for h in found.hits], read_checked(node.client, NS, found.hits) * NS.block_size


def breaker_node(url: str) -> str:
    return url.removeprefix("redis://")


def info(url: str, field: str) -> int:
    """A field of the Redis server's INFO."""
    return int(next(line.split(":", 1)[1] for line in redis_cli(url, "INFO").splitlines()
                    if line.startswith(f"{field}:")))


# -- check 2: Redis stopped, then killed, mid-workload ---------------------------------------------------------


def outage_workload(a: Node, seeds: range, l1_hits: list[np.ndarray]) -> tuple[float, float]:
    """Stores of new prompts and L1 hits of stored ones, interleaved; the slowest of each (seconds)."""
    worst_store = worst_hit = 0.0
    for seed in seeds:
        worst_store = max(worst_store, store(a, prompt(seed, 2 * NS.chunk_size)))
        for tokens in l1_hits:
            t0 = time.perf_counter()
            tiers, got = fetched(a, tokens)
            worst_hit = max(worst_hit, time.perf_counter() - t0)
            assert tiers == ["l1"] * (len(tokens) // NS.chunk_size) and got == len(tokens)
    return worst_store, worst_hit


def test_redis_stopped_then_killed_mid_workload(redis_server: Callable[[], RedisServer], nodes, tmp_path: Path):
    redis = redis_server()
    a, b = nodes(redis.url, "a", "1", FAST), nodes(redis.url, "b", "2", FAST)
    shared, unseen = prompt(1, 2 * NS.chunk_size), prompt(2, 2 * NS.chunk_size)
    store(a, shared)
    store(a, unseen)
    drained(a, 4)
    assert fetched(b, shared) == (["remote"] * 2, 2 * NS.chunk_size)
    node = breaker_node(redis.url)
    # The outage starts once each node's maintenance thread has connected (its first INFO refresh): a glide
    # client that never connected mistakes a down Redis for an answer (test_redis_down_at_start_...).
    wait_for(lambda: all(n.get("/status")[1]["uptime_s"] > CONNECTED_S for n in (a, b)), 2 * CONNECTED_S,
             what="the maintenance threads connected")

    os.kill(redis.pid, signal.SIGSTOP)
    try:
        worst_store, worst_hit = outage_workload(a, range(10, 16), [shared, unseen])
        # No store or L1 hit waited for a Redis timeout (the write-behind does, off the serving loop).
        assert worst_store < TIMEOUT_MS / 1000 and worst_hit < TIMEOUT_MS / 1000, (worst_store, worst_hit)
        s = wait_for(lambda: (s := a.remote())["remote_breakers_open"] == [node] and s, WAIT_S,
                     what="A's breaker open")
        assert s["remote_timeouts"] >= 3 and s["remote_written"] == 4
        assert a.metric(f'kvtier_remote_breaker_open{{node="{node}"}}') == 1.0
        assert a.metric("kvtier_remote_timeouts_total") >= 3
        wait_for(lambda: a.remote()["remote_rejected_calls"] > 0, WAIT_S, what="writes dropped by the breaker")
        code, health = a.get("/healthz")
        assert code == 200 and health["ok"] and "breaker open" in health["degraded"]["remote"]
        assert a.metric('kvtier_remote_rejected_calls_total{op="put"}') >= 1
        # B never saw `unseen`: its probe times out and the lookup settles as a miss (counted); probes of other
        # prompts add timeouts until B's breaker opens, and then lookups miss at once.
        assert fetched(b, unseen) == ([], 0)
        assert b.remote()["remote_timeouts"] >= 1
        seeds = iter(range(100, 200))
        wait_for(lambda: fetched(b, prompt(next(seeds), NS.chunk_size)) == ([], 0)
                 and b.remote()["remote_breakers_open"] == [node], WAIT_S, what="B's breaker open")
        t0 = time.perf_counter()
        found = b.client.lookup(NS, prompt(3, 2 * NS.chunk_size))
        assert not found.pending and found.tokens == 0 and time.perf_counter() - t0 < TIMEOUT_MS / 1000
    finally:
        os.kill(redis.pid, signal.SIGCONT)

    for n in (a, b):  # a PING after the reset time closes the breakers: the same processes share again
        wait_for(lambda n=n: n.remote()["remote_breakers_open"] == [], WAIT_S, what="breakers closed")
    assert a.get("/healthz")[1].get("degraded") is None
    after = prompt(20, 2 * NS.chunk_size)
    store(a, after)
    drained(a, 6)
    assert fetched(b, after) == (["remote"] * 2, 2 * NS.chunk_size)
    wait_for(lambda: fetched(b, unseen) == (["remote"] * 2, 2 * NS.chunk_size), WAIT_S,
             what="B finds what it missed in the outage")  # once the miss it remembers expired

    os.kill(redis.pid, signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{redis.pid}").exists() or "State:\tZ" in Path(
        f"/proc/{redis.pid}/status").read_text(), WAIT_S, what="redis-server gone")
    worst_store, worst_hit = outage_workload(a, range(30, 34), [shared, after])
    assert worst_store < TIMEOUT_MS / 1000 and worst_hit < TIMEOUT_MS / 1000, (worst_store, worst_hit)
    wait_for(lambda: a.remote()["remote_breakers_open"] == [node], WAIT_S, what="A's breaker open after SIGKILL")
    before = a.remote()
    assert before["remote_errors"] + before["remote_timeouts"] > s["remote_timeouts"]

    port = parse_remote_url(redis.url).nodes[0][1]  # a new, empty redis-server on the same port
    subprocess.run(["bash", str(REDIS_ENV), "standalone", str(tmp_path / "redis"), str(port)], check=True,
                   capture_output=True, timeout=60)
    for n in (a, b):
        wait_for(lambda n=n: n.remote()["remote_breakers_open"] == [], WAIT_S, what="breakers closed again")
    # A thread's glide client may still be in its reconnect backoff (up to ~3 s) when the maintenance thread's
    # PING closed the breaker: a write in that window is dropped (counted), so prompts are stored until one is
    # shared.
    seeds = iter(range(40, 100))

    def shared_again() -> bool:
        tokens = prompt(next(seeds), 2 * NS.chunk_size)
        store(a, tokens)
        drained(a, 0)
        return fetched(b, tokens) == (["remote"] * 2, 2 * NS.chunk_size)

    wait_for(shared_again, WAIT_S, interval=0.2, what="a prompt stored on A read by B from the new redis-server")
    assert a.remote()["remote_written"] > before["remote_written"]
    assert a.srv.proc.poll() is None and b.srv.proc.poll() is None and len(a.srv.history) == 1


def test_redis_down_at_start_opens_the_breaker(redis_server: Callable[[], RedisServer], nodes):
    redis = redis_server()
    os.kill(redis.pid, signal.SIGSTOP)
    try:
        a = nodes(redis.url, "a", "1", FAST)
        for seed in range(60, 63):  # six writes, each failing: the breaker opens at the third
            store(a, prompt(seed, 2 * NS.chunk_size))
        wait_for(lambda: a.remote()["remote_breakers_open"] == [breaker_node(redis.url)], 4.0,
                 what="the breaker open, Redis stopped since the start")
    finally:
        os.kill(redis.pid, signal.SIGCONT)


# -- check 3: damaged chunks are never served, counted, and cleaned up ------------------------------------------


def test_damaged_chunks_are_counted_misses_and_their_headers_go(redis_server, nodes):
    redis = redis_server()
    a, b = nodes(redis.url, "a", "1"), nodes(redis.url, "b", "2")
    prompts = {how: prompt(50 + i, 2 * NS.chunk_size) for i, how in
               enumerate(("setrange", "del_part", "no_parts", "intact"))}
    for tokens in prompts.values():
        store(a, tokens)
    drained(a, 2 * len(prompts))
    victims = {how: chunk_keys(NS, tokens)[1].key for how, tokens in prompts.items()}  # each prompt's 2nd chunk
    for how, key in victims.items():
        headers, parts = chunk_keys_in_redis(redis.url, nodes.prefix, key)
        assert len(headers) == 1 and len(parts) == PARTS
        if how == "setrange":  # one byte of the middle part changed
            byte = payload_of(key, SIZE)[PART_BYTES + 1000]
            assert redis_cli(redis.url, "SETRANGE", parts[1], "1000", "Z" if byte == ord("Y") else "Y") == str(
                PART_BYTES)
        elif how == "del_part":
            assert redis_cli(redis.url, "DEL", parts[-1]) == "1"
        elif how == "no_parts":  # a header without parts
            assert redis_cli(redis.url, "DEL", *parts) == str(PARTS)

    whole, first = (["remote"] * 2, 2 * NS.chunk_size), (["remote"] * 2, NS.chunk_size)
    # The lookup finds both chunks' headers; the damaged second chunk fails its promotion: only the first loads.
    assert {how: fetched(b, tokens) for how, tokens in prompts.items()} == {
        "setrange": first, "del_part": first, "no_parts": first, "intact": whole}
    s = b.remote()
    assert (s["remote_corrupt_chunks"], s["remote_missing_chunks"], s["remote_promotion_failures"]) == (1, 2, 3)
    assert b.metric("kvtier_remote_corrupt_chunks_total") == 1 and b.metric("kvtier_remote_missing_chunks_total") == 2
    for how, key in victims.items():
        headers, _ = chunk_keys_in_redis(redis.url, nodes.prefix, key)
        assert len(headers) == (1 if how == "intact" else 0), how  # cleaned up: never read again
    # Asked again, the damaged chunks are misses (not pending, not served); a new node does not find them either.
    assert fetched(b, prompts["setrange"]) == (["l1"], NS.chunk_size)
    c = nodes(redis.url, "c", "3")
    assert fetched(c, prompts["no_parts"]) == (["remote"], NS.chunk_size)
    assert fetched(c, prompts["intact"]) == whole
    assert c.remote()["remote_promotion_failures"] == 0


def test_parts_evicted_by_a_tiny_maxmemory_are_never_served(redis_server, nodes):
    redis = redis_server()
    a, b = nodes(redis.url, "a", "1"), nodes(redis.url, "b", "2")
    used = info(redis.url, "used_memory")
    redis_cli(redis.url, "CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
    redis_cli(redis.url, "CONFIG", "SET", "maxmemory", str(used + 8 * SIZE))  # room for ~8 of 16 chunks
    prompts = [prompt(70 + i, NS.chunk_size) for i in range(16)]  # one chunk each: every chunk is looked up
    for tokens in prompts:
        store(a, tokens)
    drained(a, len(prompts))
    redis_cli(redis.url, "CONFIG", "SET", "maxmemory", "0")  # B's reads must not evict more
    assert info(redis.url, "evicted_keys") > 0
    whole, torn = [], []
    for tokens in prompts:
        headers, parts = chunk_keys_in_redis(redis.url, nodes.prefix, chunk_keys(NS, tokens)[0].key)
        if headers:
            (whole if len(parts) == PARTS else torn).append(tokens)
    assert torn, "no chunk lost a part and kept its header: the eviction did not exercise the check"
    got = [fetched(b, tokens)[1] for tokens in prompts]  # read_checked: a chunk served is a byte-exact one
    assert sum(got) == len(whole) * NS.chunk_size
    s = b.remote()
    assert s["remote_missing_chunks"] == len(torn) and s["remote_corrupt_chunks"] == 0
    for tokens in torn:
        assert chunk_keys_in_redis(redis.url, nodes.prefix, chunk_keys(NS, tokens)[0].key)[0] == []


def other_of(key: bytes, size: int) -> np.ndarray:
    """The second writer's bytes for a chunk: not payload_of's."""
    return np.frombuffer(blake3.blake3(b"other" + key).digest(length=size), dtype=np.uint8)


def test_two_writers_of_one_chunk_never_mix(redis_server, nodes):
    redis = redis_server()
    a, c, b = nodes(redis.url, "a", "1"), nodes(redis.url, "c", "3"), nodes(redis.url, "b", "2")
    prompts = [prompt(90 + i, 2 * NS.chunk_size) for i in range(4)]
    with ThreadPoolExecutor(2) as pool:
        for tokens in prompts:  # both nodes store the same chunks with different bytes at the same moment
            go = threading.Barrier(2)

            def write(node: Node, payload: Callable[[bytes, int], np.ndarray], tokens=tokens, go=go) -> float:
                go.wait()
                return store(node, tokens, payload)

            for f in [pool.submit(write, a, payload_of), pool.submit(write, c, other_of)]:
                f.result()
    n = 2 * len(prompts)
    sa, sc = drained(a, 0), drained(c, 0)
    assert sa["remote_written"] + sc["remote_written"] == n
    assert sa["remote_existing_writes"] + sc["remote_existing_writes"] == n  # each chunk's loser knows it lost
    seen: dict[bytes, str] = {}

    def read(rc: ReadChunk) -> None:
        buf = np.empty(rc.span.size, dtype=np.uint8)
        rc.span.read(0, buf)
        writer = [name for name, f in (("a", payload_of), ("c", other_of)) if np.array_equal(buf, f(rc.chunk.key, SIZE))]
        assert writer, "B read bytes of neither writer (a mix)"
        seen[rc.chunk.key] = writer[0]

    for tokens in prompts:
        found = settled(b, tokens)
        assert [h.tier for h in found.hits] == ["remote"] * 2
        assert b.client.retrieve_chunks(NS, found.hits, read) == 2 * BLOCKS
    assert len(seen) == n
    for key, writer in seen.items():  # one generation's parts left per chunk: the loser's are gone
        headers, parts = chunk_keys_in_redis(redis.url, nodes.prefix, key)
        assert len(headers) == 1 and len(parts) == PARTS and len({p.rsplit(":", 2)[1] for p in parts}) == 1
        assert writer in ("a", "c")
    s = b.remote()
    assert s["remote_corrupt_chunks"] == 0 and s["remote_missing_chunks"] == 0
