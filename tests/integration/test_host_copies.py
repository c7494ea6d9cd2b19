"""Server-side stores of a CPU worker (server/transfer/host.py, connector/host_memory.py): this test process is the
worker, its numpy arrays the KV layers; a real `kvtier server` and its copier process read the blocks out of
this process with process_vm_readv. What it stores must be the bytes the worker's own copy (PagedKV) would
have stored, loadable by PagedKV; a registration that does not prove it is this process, a load through the
host engine, and a server with --no-host-copies are refused, and the worker then copies by itself; a store
from a process that no longer holds the registration's token commits nothing."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from _support import copier_pids, prompt, wait_for
from kvtier.connector.client import ClientConfig, KVTierClient, KVTierError
from kvtier.connector.gpu_transfers import GpuTransfers
from kvtier.connector.host_memory import HostMemory
from kvtier.connector.kv_blocks import PagedKV
from kvtier.server import protocol as p
from kvtier.server.keys import Namespace

pytestmark = pytest.mark.integration

LAYERS, BLOCKS, BLOCK_BYTES, BLOCK_TOKENS = 3, 48, 4096, 16
TOKENS = 4 * 64 + 2 * 16  # four whole 64-token chunks and a partial one of two blocks: 18 blocks
FLAGS = ["--page-size-kb", "16"]


def namespace() -> Namespace:
    return Namespace(
        model="host-copies-model",
        dtype="bfloat16",
        num_layers=LAYERS,
        kv_heads=2,
        head_size=64,
        block_size=BLOCK_TOKENS,
        layout="cpu-test",
        chunk_size=64,
    )


def layers() -> list[np.ndarray]:
    """Separate allocations, as vLLM's CPU backend makes one tensor per layer."""
    return [np.zeros((BLOCKS, BLOCK_BYTES), np.uint8) for _ in range(LAYERS)]


def fill(kv: list[np.ndarray], block_ids: list[int], seed: int) -> None:
    for i, block in enumerate(block_ids):
        for layer in range(LAYERS):
            kv[layer][block] = np.random.default_rng([seed, i, layer]).integers(
                0, 256, BLOCK_BYTES, dtype=np.uint8
            )


def client(url: str) -> KVTierClient:
    c = KVTierClient(ClientConfig(url=url, connect_timeout_s=5.0, request_timeout_s=10.0))
    assert c.connect()
    return c


def test_a_host_store_holds_the_bytes_a_worker_copy_would_and_loads_with_paged_kv(kvtier_server) -> None:
    srv = kvtier_server(extra=FLAGS)
    kv, ns, tokens = layers(), namespace(), prompt(1, TOKENS).tolist()
    src = list(range(40, 22, -1))  # 18 blocks, out of order
    fill(kv, src, seed=5)
    host = HostMemory(kv)
    c = client(srv.url)
    transfers = GpuTransfers(c, host.memory, host, fallback="test")
    try:
        assert transfers.register()
        op = transfers.store("r", ns, tokens, src)
        assert op is not None
        done = transfers.wait(op)
        assert done.ok, done
        # a plain CPU client reads the chunks back into other blocks with the worker's own copier
        other = layers()
        paged = PagedKV(other)
        loaded: list[int] = []

        def read(chunk) -> None:
            base = chunk.chunk.start_token // BLOCK_TOKENS
            ids = list(range(base, base + chunk.match))
            paged.load(chunk.span, chunk.blocks, 0, ids)
            loaded.extend(ids)

        reader = client(srv.url)
        try:
            reader.read_prefix(ns, tokens, read)
        finally:
            reader.close()
        assert loaded == list(range(18))  # four whole chunks and the partial one of two blocks
        for i in range(18):
            for layer in range(LAYERS):
                assert np.array_equal(other[layer][i], kv[layer][src[i]]), (i, layer)
        again = transfers.store("r2", ns, tokens, src)  # already held: nothing copied, still ok
        assert again is not None and transfers.wait(again).ok
    finally:
        transfers.close()
        c.close()


def test_a_registration_that_does_not_prove_this_process_is_refused(kvtier_server) -> None:
    srv = kvtier_server(extra=FLAGS)
    kv = layers()
    memory = HostMemory(kv).memory
    base, token_at, token = p.GpuMemory.HOST.unpack(memory.handle)
    forged = p.GpuMemory(**{**memory.__dict__, "handle": p.GpuMemory.HOST.pack(base, token_at, bytes(16))})
    other_pid = p.GpuMemory(**{**memory.__dict__, "pid": os.getppid()})
    c = client(srv.url)
    try:
        for bad in (forged, other_pid):
            with pytest.raises(KVTierError) as refused:
                c.request({"op": "gpu_register", "memory": bad.to_wire()}, timeout_s=30.0)
            assert refused.value.reason == p.IPC_REFUSED, refused.value
    finally:
        c.close()


def test_the_host_engine_never_writes_into_a_worker(kvtier_server) -> None:
    srv = kvtier_server(extra=FLAGS)
    kv, ns, tokens = layers(), namespace(), prompt(2, TOKENS).tolist()
    fill(kv, list(range(18)), seed=9)
    host = HostMemory(kv)
    c = client(srv.url)
    transfers = GpuTransfers(c, host.memory, host, fallback="test")
    try:
        assert transfers.register()
        assert transfers.wait(transfers.store("s", ns, tokens, list(range(18)))).ok
        before = [layer.copy() for layer in kv]
        op = transfers.load("l", ns, tokens, list(range(20, 38)), 0, 18)
        assert op is not None
        done = transfers.wait(op)
        assert not done.ok and done.failed == set(range(20, 38))
        assert all(np.array_equal(a, b) for a, b in zip(before, kv, strict=True))
    finally:
        transfers.close()
        c.close()


def test_a_server_without_host_copies_refuses_once_and_the_keeper_stops(kvtier_server) -> None:
    srv = kvtier_server(extra=[*FLAGS, "--no-host-copies"])
    host = HostMemory(layers())
    c = client(srv.url)
    transfers = GpuTransfers(c, host.memory, host, fallback="test")
    try:
        transfers.start()
        wait_for(lambda: transfers.unavailable != "", timeout=10.0)
        assert transfers.unavailable == p.BAD_REQUEST and not transfers.registered
        assert transfers._keeper is not None
        transfers._keeper.join(5.0)
        assert not transfers._keeper.is_alive()  # no retries, no log line a minute
        time.sleep(0.1)
        assert transfers.store("s", namespace(), prompt(3, TOKENS).tolist(), list(range(18))) is None
    finally:
        transfers.close()
        c.close()


def test_a_store_from_a_process_that_no_longer_holds_the_token_commits_nothing(kvtier_server) -> None:
    """What the copier reads is a worker's KV only while that worker lives: its token is read again after each
    copy, so a worker that exited (or a process that took its pid) fails the store instead of filling it. The
    lookups here come right after the registration, before the copier's first heartbeat: a host registration's
    copier never loads, so it never turns lookups of the worker's namespace into misses (server/pinning.py)."""
    srv = kvtier_server(extra=FLAGS)
    kv, ns, tokens = layers(), namespace(), prompt(4, TOKENS).tolist()
    fill(kv, list(range(18)), seed=11)
    host = HostMemory(kv)
    c, reader = client(srv.url), client(srv.url)  # lookups from another client, as vLLM's scheduler's are
    transfers = GpuTransfers(c, host.memory, host, fallback="test")
    try:
        assert transfers.register()
        token = host._token.copy()
        host._token[:] = 0  # this pid no longer shows the registration's token
        done = transfers.wait(transfers.store("gone", ns, tokens, list(range(18))))
        assert not done.ok and done.reason == p.COPIER_FAILED, done
        assert reader.lookup(ns, tokens).tokens == 0  # nothing committed
        host._token[:] = token  # the same copier goes on serving the registration
        assert transfers.wait(transfers.store("back", ns, tokens, list(range(18)))).ok
        assert reader.lookup(ns, tokens).tokens == TOKENS
    finally:
        transfers.close()
        reader.close()
        c.close()


def test_a_copier_leaves_sigterm_and_sigint_to_the_daemon(kvtier_server) -> None:
    """systemd's default stop (and a terminal's Ctrl-C) signals the daemon's whole process group, its copier
    included: the copier ignores them (the daemon stops it itself), so it neither dies first and gets
    restarted by a daemon on its way down, nor drops the stores it is copying; the daemon stops cleanly."""
    srv = kvtier_server(extra=FLAGS)
    kv, ns = layers(), namespace()
    fill(kv, list(range(18)), seed=13)
    host = HostMemory(kv)
    c = client(srv.url)
    transfers = GpuTransfers(c, host.memory, host, fallback="test")
    try:
        assert transfers.register()  # the host copier process runs
        assert srv.proc is not None
        [copier] = copier_pids(srv.proc.pid)
        for sig in (signal.SIGTERM, signal.SIGINT):
            os.kill(copier, sig)
        time.sleep(0.5)
        assert copier_pids(srv.proc.pid) == [copier]  # still the same process
        assert transfers.wait(transfers.store("s", ns, prompt(5, TOKENS).tolist(), list(range(18)))).ok
        srv.signal(signal.SIGTERM)  # the whole group, as systemd does
        assert srv.proc.wait(timeout=30) == 0, srv.log_text()
    finally:
        transfers.close()
        c.close()
    assert "restarting" not in srv.log_text() and "copier exited" not in srv.log_text(), srv.log_text()
