"""Issue 29, item 10: chunks a killed server had committed to L1 but not yet written behind to a lower tier reach
it after a warm restart, and are served from there bit-exact once L1 is gone.

Real server processes and a real L2 directory. The write-behind is stalled deterministically with what the
filesystem offers: the L2 writer writes each chunk to `.<key hex>.tmp-<server pid>` before renaming it, so a
FIFO made at that name blocks the writer's open() until a reader comes (none does): every write of those chunks
stays queued or in flight, the server's stats say so, and the SIGKILL loses them. The next server (another pid,
so other temp names; its scan leaves FIFOs alone) adopts L1 and queues the chunks L2 lacks again.

The remote tier (a real Redis): a write-behind queue of depth 1 drops most of a prompt's chunks (the commit hands
them over in one loop step); the next server, adopting L1, writes every chunk the store lacks.
"""

from __future__ import annotations

import os
import re
import signal
import time
import uuid

import numpy as np
import pytest
from _support import payload_of, prompt, read_checked, wait_for
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server.keys import Namespace, chunk_keys

pytestmark = pytest.mark.integration
pytest_plugins = ("redis_servers",)  # redis_standalone

NS = Namespace(model="write-behind-restart", dtype="uint8", num_layers=1, kv_heads=1, head_size=16, block_size=16,
               layout="NHD", chunk_size=64)  # 4 blocks a chunk
CHUNK_BYTES = 3 * 4096 - 123
WRITTEN = 10  # chunks written to L2 before the stall
STALLED = 30  # chunks whose L2 write the server is stalled in (or queued behind) when it is killed
SERVER_ARGS = ["--page-size-kb", "4", "--l2-size-gb", "0.1"]


def client(url: str) -> KVTierClient:
    c = KVTierClient(ClientConfig(url=url, strict=True))
    assert c.connect()
    return c


def store(c: KVTierClient, tokens: np.ndarray) -> int:
    return c.store(NS, tokens, lambda _c: CHUNK_BYTES,
                   lambda chunk, span: span.write(0, payload_of(chunk.key, span.size))).stored


def server_pid(log: str) -> int:
    return int(re.findall(r"kvtier server ready: .* pid (\d+)", log)[-1])


def chunk_files(l2) -> set[str]:  # noqa: ANN001
    return {n for n in os.listdir(l2) if n.endswith(".kv")}


def test_chunks_not_yet_written_behind_when_killed_reach_l2_after_a_warm_restart(kvtier_server, tmp_path):
    l2 = tmp_path / "l2"
    srv = kvtier_server(l1_gb=0.0625, extra=[*SERVER_ARGS, "--l2-path", str(l2)])
    first, second = prompt(1, WRITTEN * NS.chunk_size), prompt(2, STALLED * NS.chunk_size)
    c = client(srv.url)
    assert store(c, first) == WRITTEN
    wait_for(lambda: c.stats()["l2_inflight"] == 0, 30, what="the first chunks written")
    assert len(chunk_files(l2)) == WRITTEN
    pid = server_pid(srv.log_text())
    for chunk in chunk_keys(NS, second):
        os.mkfifo(l2 / f".{chunk.key.hex()}.tmp-{pid}")
    assert store(c, second) == STALLED
    s = c.stats()
    assert s["l2_inflight"] == STALLED and s["l2_dropped_writes"] == 0 and s["l2_entries"] == WRITTEN, s
    c.close()
    srv.signal(signal.SIGKILL)
    srv.proc.wait(timeout=10)
    assert len(chunk_files(l2)) == WRITTEN  # the stalled writes died with the server

    srv.start()  # same segment, same L2 directory: L1 adopted, the L2 index rebuilt by the scan
    log = srv.log_text()
    assert f"L1 adopted from {srv.shm_path}: {WRITTEN + STALLED} chunks" in log, log
    c = client(srv.url)
    wait_for(lambda: c.stats()["l2_entries"] == WRITTEN + STALLED, 30, what="the stalled chunks in L2")
    wait_for(lambda: c.stats()["l2_inflight"] == 0, 30, what="L2 writes synced")
    s = c.stats()
    assert s["l2_written"] == STALLED and s["l2_dropped_writes"] == 0, s  # the ten already there: not again
    assert len(chunk_files(l2)) == WRITTEN + STALLED
    assert f"l2 write-behind after adoption: {STALLED} of {WRITTEN + STALLED} adopted chunks queued again " \
           f"({WRITTEN} there already" in srv.log_text()
    c.close()

    srv.signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=15) == 0
    srv.args.append("--l1-discard")  # L1 gone: what is served now comes from L2
    srv.start()
    c = client(srv.url)
    assert c.stats()["entries"] == 0
    for tokens, n in ((first, WRITTEN), (second, STALLED)):
        looked = c.lookup(NS, tokens)
        assert looked.tiers == ["l2"] * n, looked.tiers

        def read(rc) -> None:  # noqa: ANN001
            buf = np.empty(rc.span.size, dtype=np.uint8)
            rc.span.read(0, buf)
            assert np.array_equal(buf, payload_of(rc.chunk.key, CHUNK_BYTES)), "L2 served other bytes"

        assert c.retrieve_chunks(NS, looked.hits, read) == n * NS.chunk_size // NS.block_size
    assert c.stats()["l2_corrupt_chunks"] == 0
    c.close()


def test_chunks_the_remote_write_behind_dropped_reach_the_store_after_a_warm_restart(kvtier_server, redis_standalone):
    n = 20
    tokens = prompt(3, n * NS.chunk_size)
    srv = kvtier_server(l1_gb=0.0625, extra=["--page-size-kb", "4", "--remote-url", redis_standalone,
                                             "--remote-prefix", f"t{uuid.uuid4().hex[:12]}",
                                             "--remote-queue-depth", "1"])
    c = client(srv.url)
    assert store(c, tokens) == n
    before = wait_for(lambda: (s := c.stats())["remote_inflight"] == 0 and s, 30, what="remote writes done")
    assert before["remote_dropped_writes"] >= n // 2 and before["remote_written"] + before["remote_dropped_writes"] == n
    c.close()
    srv.signal(signal.SIGKILL)
    srv.proc.wait(timeout=10)

    srv.start()
    assert f"L1 adopted from {srv.shm_path}: {n} chunks" in srv.log_text()
    c = client(srv.url)
    after = wait_for(lambda: (s := c.stats())["remote_written"] + s["remote_existing_writes"] == n
                     and s["remote_inflight"] == 0 and s, 30, what="every chunk in the store")
    # the store has what the first server wrote (its presence unknown to this one: asked, not written again)
    assert after["remote_written"] == before["remote_dropped_writes"], (before, after)
    assert after["remote_dropped_writes"] == 0, after  # never more than half the queue: no drop
    c.close()

    srv.signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=15) == 0
    srv.args.append("--l1-discard")
    srv.start()
    c = client(srv.url)
    deadline = time.monotonic() + 20
    while (looked := c.lookup(NS, tokens)).pending or len(looked.hits) < n:  # the tier probes the store
        assert time.monotonic() < deadline, looked
        time.sleep(0.05)
    assert looked.tiers == ["remote"] * n
    assert read_checked(c, NS, looked.hits) == n * NS.chunk_size // NS.block_size
    c.close()
