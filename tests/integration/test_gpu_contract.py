"""The contract around GPU copies (issue 27, defects 1, 2, 7, 8), on the CPU stand-in behind the real copier
process and a real `kvtier server --gpu-fake-engine`: a slow copier (KVTIER_FAKE_STORE_DELAY_S) is waited for
and never copies after the worker took its blocks back, an operation that cannot start by its `start_by` is
refused with a typed reason, an idle worker's operation refused for a lost registration is sent again, a
registration waits for a slow copier start under its own timeout, and a refused operation gives its event
back."""

from __future__ import annotations

import time

import numpy as np
import pytest
from _gpu_rig import BLOCK_TOKENS, EVENTS, LAYERS, PAGE_BYTES, FakeGpuWorker, namespace
from _support import prompt
from kvtier.connector.client import ClientConfig, KVTierClient, KVTierError
from kvtier.connector.gpu_transfers import GpuTransfers
from kvtier.server import protocol as p
from kvtier.server.keys import Namespace

pytestmark = pytest.mark.integration

FLAGS = ["--gpu-fake-engine", "--gpu-pin-piece-mb", "4", "--page-size-kb", "16", "--gpu-op-timeout-s", "10"]
STORE_DELAY_ENV = "KVTIER_FAKE_STORE_DELAY_S"  # server/transfer/fake.py
START_DELAY_ENV = "KVTIER_FAKE_START_DELAY_S"


@pytest.fixture
def worker():
    w = FakeGpuWorker()
    yield w
    w.close()


def registered(w: FakeGpuWorker, url: str, **kwargs: float) -> tuple[KVTierClient, GpuTransfers]:
    """A client with the vLLM connector's request timeout (2 s) and its registered GpuTransfers (no keeper)."""
    client = KVTierClient(ClientConfig(url=url, connect_timeout_s=5.0, request_timeout_s=2.0, retry_backoff_s=0.2))
    assert client.connect()
    transfers = GpuTransfers(client, w.memory, w.events, **kwargs)
    assert transfers.register()
    return client, transfers


def holds_seed(w: FakeGpuWorker, block_ids: list[int], seed: int) -> bool:
    return all(np.array_equal(w.page(layer, b), np.random.default_rng([seed, i, layer]).integers(
        0, 256, PAGE_BYTES, dtype=np.uint8)) for i, b in enumerate(block_ids) for layer in range(LAYERS))


def test_a_slow_store_is_waited_for_and_the_reload_returns_the_first_prompts_bytes(kvtier_server, worker) -> None:
    srv = kvtier_server(extra=FLAGS, env={STORE_DELAY_ENV: "3"})
    client, transfers = registered(worker, srv.url)
    ns, tokens, blocks = namespace("LBNHC"), prompt(1, 128).tolist(), list(range(8))
    worker.fill(blocks, seed=1)  # the first prompt's KV
    started = time.monotonic()
    op = transfers.store("first", ns, tokens, blocks)
    assert op is not None
    done = transfers.wait(op)
    took = time.monotonic() - started
    # the worker has its reply: vLLM frees the blocks and computes the next request into them
    worker.fill(blocks, seed=2)
    time.sleep(max(0.0, 4.0 - took))  # past any copy the server could still run
    connected = client.connected
    dst = list(range(20, 28))
    worker.scramble(dst)
    op = transfers.load("reload", ns, tokens, dst, 0, 8)
    assert op is not None
    loaded = transfers.wait(op)
    assert loaded.ok and not loaded.failed, loaded
    assert not holds_seed(worker, dst, 2), "wrong KV: the first prompt's key holds the next request's bytes"
    assert holds_seed(worker, dst, 1)
    assert done.ok and took >= 2.9, (done, took)
    assert connected  # a slow operation is not an unreachable server


def test_an_operation_that_cannot_start_by_its_deadline_is_refused_late_and_copies_nothing(kvtier_server,
                                                                                           worker) -> None:
    srv = kvtier_server(extra=FLAGS, env={STORE_DELAY_ENV: "3"})
    client, transfers = registered(worker, srv.url, start_s=1.0)
    ns = namespace("LBNHC")
    first, second = prompt(2, 128).tolist(), prompt(3, 128).tolist()
    worker.fill(list(range(8)), seed=1)
    worker.fill(list(range(8, 16)), seed=2)
    started = time.monotonic()
    a = transfers.store("a", ns, first, list(range(8)))
    b = transfers.store("b", ns, second, list(range(8, 16)))  # queued behind a's 3 s copy on the store stream
    assert a is not None and b is not None
    done_a, done_b = transfers.wait(a), transfers.wait(b)
    assert done_a.ok, done_a
    assert not done_b.ok and done_b.reason == p.LATE, done_b
    assert time.monotonic() - started >= 2.9  # the typed answer was waited for, not given up at 2 s
    assert client.connected
    assert client.lookup(ns, second).tokens == 0  # b's blocks were never read
    assert client.lookup(ns, first).tokens == 128


def test_an_idle_workers_operation_refused_for_its_lost_registration_is_sent_again(kvtier_server, worker) -> None:
    srv = kvtier_server(extra=[*FLAGS, "--client-timeout-s", "1"])
    _, transfers = registered(worker, srv.url)
    ns, tokens, src, dst = namespace("LBNHC"), prompt(4, 128).tolist(), list(range(8)), list(range(20, 28))
    worker.fill(src, seed=4)
    op = transfers.store("s", ns, tokens, src)
    assert op is not None and transfers.wait(op).ok
    time.sleep(2.5)  # silent past --client-timeout-s: the server retires the client and its registration
    op = transfers.load("l", ns, tokens, dst, 0, 8)
    assert op is not None
    done = transfers.wait(op)
    assert done.ok and not done.failed, done
    assert worker.blocks_equal(src, dst)


def test_an_idle_worker_with_its_keeper_keeps_its_registration(kvtier_server, worker) -> None:
    srv = kvtier_server(extra=[*FLAGS, "--client-timeout-s", "1"])
    _, transfers = worker.transfers(srv.url, timeout_s=2.0)  # the keeper registers and heartbeats
    reg = transfers._reg
    ns, tokens, src, dst = namespace("LBNHC"), prompt(5, 128).tolist(), list(range(8)), list(range(20, 28))
    worker.fill(src, seed=5)
    time.sleep(2.5)
    assert transfers.registered and transfers._reg == reg  # heartbeats kept it: nothing was registered again
    op = transfers.store("s", ns, tokens, src)
    assert op is not None and transfers.wait(op).ok
    op = transfers.load("l", ns, tokens, dst, 0, 8)
    assert op is not None and transfers.wait(op).ok and worker.blocks_equal(src, dst)


def test_a_registration_waits_for_a_slow_copier_start_under_its_own_timeout(kvtier_server, worker) -> None:
    srv = kvtier_server(extra=FLAGS, env={START_DELAY_ENV: "3"})
    started = time.monotonic()
    client, transfers = registered(worker, srv.url)  # the request timeout is 2 s; the copier starts in 3
    assert time.monotonic() - started >= 2.9
    assert client.connected
    ns, tokens = namespace("LBNHC"), prompt(6, 128).tolist()
    worker.fill(list(range(8)), seed=6)
    op = transfers.store("s", ns, tokens, list(range(8)))
    assert op is not None and transfers.wait(op).ok


def test_the_keeper_registers_off_the_callers_thread_and_backs_off_a_refusing_server(kvtier_server, worker) -> None:
    srv = kvtier_server(extra=FLAGS)
    worker.device.unlink()  # the server sees no such device: every registration is refused (no_device)
    client = KVTierClient(ClientConfig(url=srv.url, connect_timeout_s=5.0, request_timeout_s=2.0))
    assert client.connect()
    transfers = GpuTransfers(client, worker.memory, worker.events)
    transfers.start()
    ns, tokens = namespace("LBNHC"), prompt(7, 128).tolist()
    slowest, end = 0.0, time.monotonic() + 4.0
    try:
        while time.monotonic() < end:  # the engine's steps meanwhile: misses at once
            started = time.monotonic()
            assert transfers.store("s", ns, tokens, list(range(8))) is None
            assert transfers.load("l", ns, tokens, list(range(8)), 0, 8) is None
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.05)
    finally:
        transfers.close()
    assert slowest < 0.1, slowest
    assert transfers.unavailable == p.NO_DEVICE
    attempts = srv.log_text().count("GPU registration refused")
    assert 1 <= attempts <= 3, attempts  # 1 s, 2 s, ... apart, not one per step


def test_an_operation_the_server_refuses_gives_its_event_back(kvtier_server, worker) -> None:
    srv = kvtier_server(extra=FLAGS)
    _, transfers = registered(worker, srv.url)
    ns, tokens = namespace("LBNHC"), prompt(8, 128).tolist()
    refused = Namespace(model="fake-gpu-model", dtype="bfloat16", num_layers=LAYERS, kv_heads=2, head_size=64,
                        block_size=BLOCK_TOKENS, layout=ns.layout, chunk_size=BLOCK_TOKENS * 5000)  # too many blocks
    for _ in range(EVENTS + 2):
        with pytest.raises(KVTierError):
            transfers.load("l", refused, tokens, list(range(8)), 0, 8)
    worker.fill(list(range(8)), seed=8)
    op = transfers.store("s", ns, tokens, list(range(8)))  # an event is still there for it
    assert op is not None and transfers.wait(op).ok
