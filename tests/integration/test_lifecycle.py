"""Server lifecycle: SIGKILL + restart on the same port (clients recover), segment ownership, SIGTERM."""

from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path

import numpy as np
import pytest
from _support import prompt, wait_for
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server import protocol as p
from kvtier.server.keys import Namespace, chunk_keys

pytestmark = pytest.mark.integration

NS = Namespace(model="org/tiny", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64, block_size=16,
               layout="NHD", chunk_size=256)
CHUNK_BYTES = 32 * 1024
N = 8


def payload_of(chunk) -> np.ndarray:
    return np.random.default_rng(chunk.index + 1).integers(0, 256, CHUNK_BYTES, dtype=np.uint8)


def store(c: KVTierClient, tokens):
    return c.store(NS, tokens, lambda _c: CHUNK_BYTES, lambda ch, span: span.write(0, payload_of(ch)))


def retrieve_ok(c: KVTierClient, tokens) -> int:
    """Tokens retrieved whose bytes match what was stored (raises on a mismatch)."""
    def read(rc) -> None:
        buf = np.empty(rc.span.size, dtype=np.uint8)
        rc.span.read(0, buf)
        assert np.array_equal(buf, payload_of(rc.chunk))

    return c.retrieve(NS, tokens, read)


def test_client_survives_server_kill_and_restart(kvtier_server):
    srv = kvtier_server(l1_gb=0.0625, extra=["--no-l1-adopt"])  # a cold restart (warm: test_warm_restart.py)
    c = KVTierClient(ClientConfig(url=srv.url, connect_timeout_s=0.5, request_timeout_s=1.0, retry_backoff_s=0.2))
    tokens = prompt(3, N * NS.chunk_size)
    assert store(c, tokens).stored == N
    assert c.lookup(NS, tokens).tokens == N * NS.chunk_size
    first_id = c.server_id
    assert first_id

    srv.signal(signal.SIGKILL)
    assert srv.proc.wait(timeout=10) == -signal.SIGKILL
    assert srv.shm_path.exists(), "a SIGKILLed server cannot remove its segment"

    # A dead server is a miss, not an exception.
    assert c.lookup(NS, tokens).tokens == 0
    assert retrieve_ok(c, tokens) == 0
    r = store(c, tokens)
    assert r.stored == 0 and r.refused.get("unreachable") == N
    assert c.heartbeat() is False

    srv.start()  # same port, same segment name: the stale segment is taken over
    assert srv.proc.poll() is None

    # The same client object reconnects by itself (after its backoff) and stores again.
    wait_for(lambda: store(c, tokens).stored == N, timeout=10, interval=0.1, what="store after restart")
    assert c.server_id and c.server_id != first_id
    assert c.lookup(NS, tokens).tokens == N * NS.chunk_size
    assert retrieve_ok(c, tokens) == N * NS.chunk_size
    c.close()


def test_second_server_on_the_same_segment_fails_clearly(kvtier_server):
    srv = kvtier_server(l1_gb=0.0625)
    c = KVTierClient(ClientConfig(url=srv.url, strict=True))
    tokens = prompt(4, 2 * NS.chunk_size)
    assert store(c, tokens).stored == 2

    other = kvtier_server(l1_gb=0.0625, shm_name=srv.shm_name, wait=False)
    assert other.proc.wait(timeout=30) == 2
    log = other.log_text()
    assert "owned by a running server" in log and srv.shm_name in log
    assert "Traceback" not in log

    # The first server and its segment are untouched.
    assert srv.proc.poll() is None and srv.shm_path.exists()
    assert retrieve_ok(c, tokens) == 2 * NS.chunk_size
    c.close()


def test_sigterm_exits_zero_and_removes_segment(kvtier_server):
    srv = kvtier_server(l1_gb=0.0625, extra=["--no-l1-adopt"])  # an adopting server keeps it (test_warm_restart.py)
    c = KVTierClient(ClientConfig(url=srv.url, strict=True, request_timeout_s=1.0))
    tokens = prompt(5, 2 * NS.chunk_size)
    assert store(c, tokens).stored == 2
    # Hold a lease and an open reservation (and the client's mapping of the segment) across the shutdown.
    keys = [k.key for k in chunk_keys(NS, tokens)]
    assert c._request({"op": "acquire", "keys": keys}, NS)["lease"] > 0
    other = chunk_keys(NS, prompt(6, NS.chunk_size))[0]
    reply = c._request({"op": "reserve", "items": [p.StoreItem(other.key, CHUNK_BYTES, 16, other.aliases).to_wire()]},
                       NS)
    assert reply["results"][0][0] == p.RESERVED
    assert srv.shm_path.exists()

    srv.signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=15) == 0, srv.log_text()
    assert not srv.shm_path.exists()
    assert "segment removed" in srv.log_text()
    c.close()


@pytest.mark.parametrize("prefault", [True, False])
def test_l1_is_backed_by_memory_in_the_background_unless_disabled(kvtier_server, prefault):
    """With the default --l1-prefault every page of the segment gets memory behind it (tmpfs blocks), so
    a store never pays first-touch allocation; --no-l1-prefault leaves the segment sparse."""
    srv = kvtier_server(l1_gb=0.125, extra=[] if prefault else ["--no-l1-prefault"])
    c = KVTierClient(ClientConfig(url=srv.url, strict=True))
    c.connect()
    size = c.stats()["l1_capacity_bytes"]
    if prefault:
        wait_for(lambda: c.stats()["l1_prefault"] == "done", 30, what="L1 prefault")
        assert c.stats()["l1_backed_bytes"] == size
        assert srv.shm_path.stat().st_blocks * 512 >= size
        assert "L1 backed by memory" in srv.log_text()
    else:
        assert c.stats()["l1_backed_bytes"] == 0 and c.stats()["l1_prefault"] == "off"
        assert srv.shm_path.stat().st_blocks == 0
    assert store(c, prompt(1, 4 * 256)).stored == 4 and retrieve_ok(c, prompt(1, 4 * 256)) == 4 * 256
    c.close()


def test_segment_in_another_tmpfs_directory(kvtier_server, tmp_path):
    """--shm-dir puts L1 in another tmpfs directory (here one below /dev/shm); clients learn it in hello."""
    directory = Path(tempfile.mkdtemp(prefix="kvtier-test-dir-", dir="/dev/shm"))
    try:
        srv = kvtier_server(l1_gb=0.0625, extra=["--shm-dir", str(directory), "--no-l1-adopt"])
        c = KVTierClient(ClientConfig(url=srv.url, strict=True))
        c.connect()
        assert (directory / srv.shm_name).exists() and not srv.shm_path.exists()
        assert store(c, prompt(2, 2 * 256)).stored == 2 and retrieve_ok(c, prompt(2, 2 * 256)) == 2 * 256
        c.close()
        srv.signal(signal.SIGTERM)
        wait_for(lambda: not (directory / srv.shm_name).exists(), 15, what="segment removed")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
