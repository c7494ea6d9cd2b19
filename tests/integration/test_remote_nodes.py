"""Two kvtier servers as two nodes sharing one Redis (issue 15, check 1): chunks stored through node A are found
and read bit-exact through node B, against a standalone Redis and a three-master Redis Cluster, also while the
Cluster's slots are being resharded.

The nodes share nothing but the store: their own L1 segments, ports and L2 directories, and different
PYTHONHASHSEED values (kvtier's keys must not depend on Python's hash seed). Every block's bytes are a function
of its prefix key (as real KV is of the prefix tokens), so a read checks each byte, partial chunks included.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request
import uuid

import numpy as np
import pytest
from _support import free_port, prompt, wait_for
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.connector.results import LookupResult
from kvtier.server.keys import Namespace
from redis_servers import redis_cluster, redis_standalone  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

NS = Namespace(model="org/remote-nodes", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64, block_size=16,
               layout="cpu", chunk_size=64)  # 4 blocks per chunk
BLOCK_BYTES = 320 << 10  # 1.25 MiB chunks: two payload parts each
BLOCKS = NS.chunk_size // NS.block_size


def block_bytes(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key, "little")).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


def write(chunk, span) -> None:  # type: ignore[no-untyped-def]
    span.write(0, np.concatenate([block_bytes(k) for k in chunk.block_keys]))


def client(url: str) -> KVTierClient:
    c = KVTierClient(ClientConfig(url=url, strict=True, request_timeout_s=10.0))
    assert c.connect()
    return c


def lookup(c: KVTierClient, tokens: np.ndarray, timeout: float = 10.0) -> LookupResult:
    """A lookup asked again while the remote tier is still probing ("pending"), as the connector does."""
    deadline = time.monotonic() + timeout
    while True:
        found = c.lookup(NS, tokens)
        if not found.pending or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


def read_blocks(c: KVTierClient, found: LookupResult) -> int:
    """Blocks read from what `found` names, every byte checked."""
    def read(rc) -> None:  # type: ignore[no-untyped-def]
        buf = np.empty(rc.match * BLOCK_BYTES, dtype=np.uint8)
        rc.span.read(0, buf)
        want = np.concatenate([block_bytes(k) for k in rc.chunk.block_keys[: rc.match]])
        assert np.array_equal(buf, want), "bytes of another chunk were served"

    return c.retrieve_chunks(NS, found.hits, read)


def start_nodes(kvtier_server, url: str, tmp_path):  # type: ignore[no-untyped-def]
    prefix = f"t{uuid.uuid4().hex[:10]}"  # this test's keys only: the store is shared by the session
    nodes = []
    for name, seed in (("a", "1"), ("b", "2")):
        nodes.append(kvtier_server(l1_gb=0.125, env={"PYTHONHASHSEED": seed}, extra=[
            "--remote-url", url, "--remote-prefix", prefix, "--remote-timeout-ms", "2000",
            "--l2-path", str(tmp_path / f"l2-{name}"), "--l2-size-gb", "0.125"]))
    return nodes


def store_and_drain(c: KVTierClient, prompts: list[np.ndarray]) -> None:
    for tokens in prompts:
        c.store(NS, tokens, lambda ch: len(ch.block_keys) * BLOCK_BYTES, write)
    wait_for(lambda: (s := c.stats()) and s["remote_queue_depth"] == 0 and s["remote_inflight"] == 0
             and s["remote_written"] >= 1, timeout=60, what="node A's remote writes done")


@pytest.mark.parametrize("store", ["redis_standalone", "redis_cluster"])
def test_chunks_stored_through_a_are_read_bit_exact_through_b(store, request, kvtier_server, tmp_path):
    a, b = start_nodes(kvtier_server, request.getfixturevalue(store), tmp_path)
    doc = prompt(1, 10 * NS.block_size)  # 2.5 chunks
    first = np.concatenate([doc, prompt(2, 6 * NS.block_size)])  # 16 blocks: 4 whole chunks
    ca, cb = client(a.url), client(b.url)
    store_and_drain(ca, [first])

    found = lookup(cb, first)
    assert not found.pending and found.blocks == 16 and set(found.tiers) == {"remote"}
    assert read_blocks(cb, found) == 16
    again = cb.lookup(NS, first)  # promoted into B's L1 by the read
    assert again.blocks == 16 and set(again.tiers) == {"l1"}

    # Another question after the same document: through the remote aliases, B finds the document's 10 blocks,
    # the last two inside chunk 2, which A stored with other blocks after them.
    other = np.concatenate([doc, prompt(3, 6 * NS.block_size)])
    fresh = client(b.url)
    partial = lookup(fresh, other)
    assert partial.blocks == 10 and read_blocks(fresh, partial) == 10
    missing = lookup(cb, prompt(4, 8 * NS.block_size))
    assert missing.blocks == 0 and not missing.pending


def cluster_ports(url: str) -> list[int]:
    return [int(node.rsplit(":", 1)[1]) for node in url.removeprefix("redis+cluster://").split(",")]


def cli(port: int, *args: str, timeout: float = 120) -> str:
    run = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args], capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_reads_through_b_stay_exact_while_the_cluster_reshards(redis_cluster, kvtier_server, tmp_path):  # noqa: F811
    a, b = start_nodes(kvtier_server, redis_cluster, tmp_path)
    ports = cluster_ports(redis_cluster)
    prompts = [prompt(100 + i, 2 * NS.chunk_size) for i in range(24)]  # 48 chunks over every master
    ca, cb = client(a.url), client(b.url)
    store_and_drain(ca, prompts)

    source, target = (cli(port, "cluster", "myid").strip() for port in ports[:2])
    done = threading.Event()
    moved: list[str] = []

    def reshard() -> None:
        try:
            moved.append(cli(ports[0], "--cluster", "reshard", f"127.0.0.1:{ports[0]}", "--cluster-from", source,
                             "--cluster-to", target, "--cluster-slots", "3000", "--cluster-yes"))
        finally:
            done.set()

    mover = threading.Thread(target=reshard, daemon=True)
    mover.start()
    reads = 0
    for tokens in prompts:  # each prompt read once, from the store (B has none of them in L1 yet)
        found = lookup(cb, tokens)
        assert found.blocks == 2 * BLOCKS, f"a prompt not found during resharding ({found})"
        assert read_blocks(cb, found) == 2 * BLOCKS
        reads += 1
    mover.join(180)
    assert done.is_set() and moved, "resharding did not finish"
    assert reads == len(prompts)
    # and after it, the moved slots answer from their new master
    late = client(b.url)
    for tokens in prompts[:4]:
        found = lookup(late, tokens)
        assert found.blocks == 2 * BLOCKS and read_blocks(late, found) == 2 * BLOCKS


def test_a_namespace_clear_on_one_node_clears_the_store_for_every_node(redis_standalone, kvtier_server,  # noqa: F811
                                                                       tmp_path):
    http = free_port()
    prefix = f"t{uuid.uuid4().hex[:10]}"
    flags = ["--remote-url", redis_standalone, "--remote-prefix", prefix]
    a = kvtier_server(l1_gb=0.125, extra=[*flags, "--http-port", str(http)])
    b = kvtier_server(l1_gb=0.125, extra=flags, env={"PYTHONHASHSEED": "2"})
    tokens = prompt(7, 3 * NS.chunk_size)
    ca = client(a.url)
    store_and_drain(ca, [tokens])
    body = json.dumps({"scope": "namespace", "namespace": NS.fingerprint().hex()}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{http}/cache/clear", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        cleared = json.loads(reply.read())
    assert cleared["tiers"]["remote"]["entries"] == 3 and cleared["tiers"]["l1"]["entries"] == 3
    gone = lookup(client(b.url), tokens)
    assert gone.blocks == 0 and not gone.pending  # node B, which never held them, finds nothing either
