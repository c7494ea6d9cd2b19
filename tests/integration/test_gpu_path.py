"""The whole GPU path on the CPU stand-in: a worker's GpuTransfers (connector/gpu_transfers.py) over real
ZeroMQ to a real `kvtier server --gpu-fake-engine`, whose copier process moves blocks between a FakeDevice
(a shared-memory "device" laid out like vLLM's KV allocation, sequence-slot events) and the real L1 segment.
Bytes, event ordering, what SIGKILL of the worker, the copier and the daemon leave behind, refused input,
and a server with no cupy serving CPU clients. The CUDA engine itself is checked by tests/gpu/ on a GPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from _gpu_rig import BLOCKS, LAYERS, PAGE_BYTES, FakeGpuWorker, namespace
from _support import copier_pids, free_port, prompt, wait_for
from kvtier.connector.client import ClientConfig, KVTierClient, KVTierError
from kvtier.server import protocol as p
from kvtier.server.keys import chunk_keys

pytestmark = pytest.mark.integration

SERVER_FLAGS = ["--gpu-fake-engine", "--client-timeout-s", "3", "--gpu-op-timeout-s", "3", "--gpu-watchdog-s", "2",
                "--gpu-pin-piece-mb", "4", "--page-size-kb", "16"]
TOKENS = 4 * 64 + 2 * 16  # four whole 64-token chunks and a partial one of two blocks: 18 blocks


@pytest.fixture
def worker():
    workers: list[FakeGpuWorker] = []

    def make(layout: str = "LBNHC", name: str = "") -> FakeGpuWorker:
        workers.append(FakeGpuWorker(layout, name))
        return workers[-1]

    yield make
    for w in workers:
        w.close()


def pattern(seed: int, i: int, layer: int) -> np.ndarray:
    return np.random.default_rng([seed, i, layer]).integers(0, 256, PAGE_BYTES, dtype=np.uint8)


def holds_pattern(w: FakeGpuWorker, block_ids: list[int], seed: int, positions: range) -> bool:
    return all(np.array_equal(w.page(layer, block_ids[i]), pattern(seed, i, layer))
               for i in positions for layer in range(LAYERS))


def store(transfers, ns, tokens, block_ids) -> None:
    assert transfers.store("s", ns, tokens, block_ids)
    (done,) = transfers.poll(wait=True)
    assert done.ok, done


def load(transfers, ns, tokens, block_ids, first, end):
    assert transfers.load("l", ns, tokens, block_ids, first, end)
    (done,) = transfers.poll(wait=True)
    return done


def mapped_by(name: str) -> list[int]:
    """Processes other than this one (the worker) that have the fake device file mapped."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if name in (proc / "maps").read_text():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def stats(url: str) -> dict:
    c = KVTierClient(ClientConfig(url=url, connect_timeout_s=5.0))
    try:
        return c.stats() or {}
    finally:
        c.close()


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_stored_blocks_load_bit_exact_into_other_blocks_also_partially(kvtier_server, worker, layout: str) -> None:
    srv = kvtier_server(extra=SERVER_FLAGS)
    w = worker(layout)
    _, transfers = w.transfers(srv.url)
    ns, tokens = namespace(layout), prompt(1, TOKENS).tolist()
    rng = np.random.default_rng(7)
    ids = rng.permutation(BLOCKS).tolist()
    src, dst, part = ids[:18], ids[18:36], ids[36:45]
    w.fill(src, seed=11)
    store(transfers, ns, tokens, src)
    w.scramble(src)
    done = load(transfers, ns, tokens, dst, 0, 18)
    assert done.ok and not done.failed
    assert holds_pattern(w, dst, 11, range(18))
    # a partial load: prompt blocks 5..13 (from the middle of chunk 1 into chunk 3) into other blocks
    target = [0] * 5 + part + [0] * 4
    done = load(transfers, ns, tokens, target, 5, 14)
    assert done.ok and holds_pattern(w, target, 11, range(5, 14))
    # a prompt that diverges inside chunk 2 loads chunks 0 and 1 only; the rest are load errors
    other = tokens[:150] + prompt(2, TOKENS - 150).tolist()
    w.scramble(dst)
    done = load(transfers, ns, other, dst, 0, 18)
    assert not done.ok and done.failed == set(dst[8:])
    assert holds_pattern(w, dst, 11, range(8))


def test_a_gpu_store_names_its_chunks_tokens_and_parents_on_the_event_feed(kvtier_server, worker) -> None:
    feed = f"tcp://127.0.0.1:{free_port()}"
    srv = kvtier_server(extra=[*SERVER_FLAGS, "--events-endpoint", feed])
    w = worker()
    _, transfers = w.transfers(srv.url)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(feed)
    try:
        ns, tokens = namespace("LBNHC"), prompt(3, TOKENS).tolist()
        chunks = chunk_keys(ns, tokens)
        time.sleep(0.3)  # the subscriber joins
        store(transfers, ns, tokens, list(range(18)))
        got: dict[bytes, dict] = {}

        def all_stored() -> bool:
            while sub.poll(50):
                got.update((e["key"], e) for e in msgpack.unpackb(sub.recv_multipart()[-1])["events"])
            return all(c.key in got for c in chunks)

        wait_for(all_stored, timeout=20, what="the chunks' Stored events")
        for before, chunk in zip([None, *chunks], chunks, strict=False):
            e = got[chunk.key]
            assert e["tokens"] == np.asarray(tokens[chunk.start_token:chunk.start_token + len(chunk.block_keys)
                                                    * ns.block_size], "<u4").tobytes()
            assert e["parent"] == (before.key if before else b"")
    finally:
        ctx.destroy(linger=0)


def test_the_copy_waits_for_the_engines_event(kvtier_server, worker) -> None:
    srv = kvtier_server(extra=SERVER_FLAGS)
    w = worker()
    _, transfers = w.transfers(srv.url)
    ns, tokens = namespace("LBNHC"), prompt(3, 128).tolist()
    src, dst = list(range(8)), list(range(20, 28))
    w.fill(src, seed=1)  # what the blocks hold before the engine's stream finished computing them
    w.events.hold = True
    assert transfers.store("s", ns, tokens, src)
    time.sleep(0.3)
    w.fill(src, seed=2)  # the KV the stream writes before it reaches the event
    w.device.complete(w.events.last)
    (done,) = transfers.poll(wait=True)
    assert done.ok
    w.events.hold = False
    assert load(transfers, ns, tokens, dst, 0, 8).ok
    assert holds_pattern(w, dst, 2, range(8))


def test_a_killed_worker_loses_its_registration_its_pages_and_its_mappings(kvtier_server, worker, start_client) -> None:
    srv = kvtier_server(extra=SERVER_FLAGS)
    name = f"kvtier-fakegpu-{os.getpid()}-killed"
    proc = start_client("gpu_store_and_hang", url=srv.url, name=name, tokens=TOKENS)
    line = json.loads(proc.stdout.readline())
    assert line["submitted"]
    wait_for(lambda: stats(srv.url).get("reservations") == 5, 10, what="the store's reservations")
    assert mapped_by(name), "the copier maps the worker's device"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # the copier closes the registration once the copy waiting on the dead worker's event is given up
    wait_for(lambda: not mapped_by(name), 15, what="the dead worker's memory unmapped")
    wait_for(lambda: (s := stats(srv.url)).get("reservations") == 0 and s.get("l1_used_bytes") == 0, 10,
             what="the store's pages freed")
    assert stats(srv.url)["entries"] == 0  # nothing of the unfinished copy was committed
    os.unlink(f"/dev/shm/{name}")
    # the server goes on serving another worker
    w = worker()
    _, transfers = w.transfers(srv.url)
    w.fill(list(range(8)), seed=5)
    store(transfers, namespace("LBNHC"), prompt(4, 128).tolist(), list(range(8)))


def test_a_killed_copier_fails_its_copies_and_a_new_one_serves_the_registration(kvtier_server, worker) -> None:
    srv = kvtier_server(extra=SERVER_FLAGS)
    w = worker()
    _, transfers = w.transfers(srv.url)
    ns, tokens = namespace("LBNHC"), prompt(5, 128).tolist()
    w.fill(list(range(8)), seed=3)
    w.events.hold = True
    assert transfers.store("s", ns, tokens, list(range(8)))
    (old,) = wait_for(lambda: copier_pids(srv.proc.pid), 10, what="a copier")
    time.sleep(0.2)
    os.kill(old, signal.SIGKILL)
    (done,) = transfers.poll(wait=True)
    assert not done.ok and done.reason == p.COPIER_FAILED
    assert stats(srv.url)["entries"] == 0 and stats(srv.url)["reservations"] == 0
    w.events.hold = False
    store(transfers, ns, tokens, list(range(8)))  # the same registration, on a new copier
    assert copier_pids(srv.proc.pid) != [old]
    assert load(transfers, ns, tokens, list(range(30, 38)), 0, 8).ok
    assert holds_pattern(w, list(range(30, 38)), 3, range(8))


def test_a_store_whose_copier_hangs_is_answered_only_once_the_copier_is_gone(kvtier_server, worker) -> None:
    srv = kvtier_server(extra=SERVER_FLAGS, env={"KVTIER_FAKE_HANG_EVENT": "0"})  # fake.py HANG_EVENT_ENV
    w = worker()
    _, transfers = w.transfers(srv.url)
    ns, tokens = namespace("LBNHC"), prompt(10, 128).tolist()
    src = list(range(0, 16, 2))  # blocks apart: an entry per block and layer
    w.fill(src, seed=6)
    assert transfers.store("s", ns, tokens, src)  # on event 0: its first entry moves, then the copy hangs
    (copier,) = wait_for(lambda: copier_pids(srv.proc.pid), 10, what="a copier")
    (done,) = transfers.poll(wait=True)  # past --gpu-op-timeout-s
    assert not done.ok and done.reason == p.COPIER_FAILED
    assert not os.path.exists(f"/proc/{copier}"), "the failed store was answered while its copier could still write"
    after = stats(srv.url)
    assert after["reservations"] == 0 and after["entries"] == 0 and after["l1_used_bytes"] == 0  # pages freed


def test_a_killed_daemon_takes_its_copier_along_and_the_worker_registers_again(kvtier_server, worker) -> None:
    srv = kvtier_server(extra=SERVER_FLAGS)
    w = worker()
    _, transfers = w.transfers(srv.url, timeout_s=2.0)
    ns, tokens = namespace("LBNHC"), prompt(6, 128).tolist()
    w.fill(list(range(8)), seed=4)
    w.events.hold = True
    assert transfers.store("s", ns, tokens, list(range(8)))
    (copier,) = wait_for(lambda: copier_pids(srv.proc.pid), 10, what="a copier")
    os.kill(srv.proc.pid, signal.SIGKILL)  # the daemon only: its copier must follow by itself
    (done,) = transfers.poll(wait=True)
    assert not done.ok
    wait_for(lambda: not os.path.exists(f"/proc/{copier}") or "Z" in Path(f"/proc/{copier}/stat").read_text().split()[2],
             10, what="the copier gone")
    wait_for(lambda: not mapped_by(w.name), 10, what="nothing maps the device")
    srv.start()
    w.events.hold = False
    wait_for(lambda: transfers.store("s2", ns, tokens, list(range(8))), 10, interval=0.5, what="a store after restart")
    (done,) = transfers.poll(wait=True)
    assert done.ok
    assert load(transfers, ns, tokens, list(range(30, 38)), 0, 8).ok
    assert holds_pattern(w, list(range(30, 38)), 4, range(8))


def test_malformed_registrations_and_block_ids_are_refused_with_codes(kvtier_server, worker) -> None:
    srv = kvtier_server(extra=SERVER_FLAGS)
    w = worker()
    client, transfers = w.transfers(srv.url)
    wire = w.memory.to_wire()
    for change, code, reason in [
        ({"handle": b"kvtier-fakegpu-does-not-exist"}, p.GPU_UNAVAILABLE, p.IPC_REFUSED),
        ({"device": "kvtier-fakegpu-no-such-device"}, p.GPU_UNAVAILABLE, p.NO_DEVICE),
        ({"alloc_size": PAGE_BYTES}, p.BAD_REQUEST, None),
        ({"num_blocks": BLOCKS * 100}, p.BAD_REQUEST, None),
    ]:
        with pytest.raises(KVTierError) as err:
            client.request({"op": "gpu_register", "memory": {**wire, **change}})
        assert err.value.code == code, (change, err.value)
        if reason:
            assert err.value.reason == reason, (change, err.value)
    assert transfers.register()
    ns = namespace("LBNHC")
    chunk = chunk_keys(ns, prompt(8, 64).tolist())[0]
    item = p.StoreItem(chunk.key, LAYERS * 4 * PAGE_BYTES, 4, chunk.aliases).to_wire()
    for ids in ([0, 1, 2, BLOCKS], [0, 1, -1, 3], [0, 1, 2]):
        with pytest.raises(KVTierError) as err:
            client.request({"op": "gpu_store", "reg": transfers._reg, "event": 0, "items": [item],
                            "block_ids": [ids]}, ns)
        assert err.value.code == p.BAD_REQUEST
    with pytest.raises(KVTierError) as err:
        client.request({"op": "gpu_load", "reg": transfers._reg + 1, "event": 0, "keys": [chunk.key], "first": [0],
                        "block_ids": [[0, 1, 2, 3]]}, ns)
    assert err.value.code == p.UNKNOWN_REGISTRATION
    assert stats(srv.url)["reservations"] == 0 and stats(srv.url)["malformed"] >= 0


def test_without_cupy_the_server_refuses_cuda_and_serves_cpu_clients(kvtier_server) -> None:
    srv = kvtier_server(extra=["--client-timeout-s", "3"])
    assert subprocess.run([sys.executable, "-c", "import cupy"], capture_output=True).returncode != 0, \
        "this test needs an environment without cupy"
    client = KVTierClient(ClientConfig(url=srv.url, connect_timeout_s=5.0))
    assert client.connect()
    memory = p.GpuMemory("cuda", "GPU-00000000-0000-0000-0000-000000000000", bytes(64), 1 << 20, (0,), 4096, 16, 4096,
                         1, 0, "LBNHC", (bytes(64),), os.getpid())
    with pytest.raises(KVTierError) as err:
        client.request({"op": "gpu_register", "memory": memory.to_wire()})
    assert (err.value.code, err.value.reason) == (p.GPU_UNAVAILABLE, p.NO_COPIER)
    ns = namespace("LBNHC")
    tokens = prompt(9, 128)
    data = np.arange(4096, dtype=np.uint8)
    result = client.store(ns, tokens, lambda c: 4096, lambda c, span: span.write(0, data))
    assert result.stored == 2
    got: list[bytes] = []

    def read(chunk) -> None:
        buf = np.empty(4096, np.uint8)
        chunk.span.read(0, buf)
        got.append(buf.tobytes())

    assert client.retrieve(ns, tokens, read) == 128 and got == [data.tobytes()] * 2
    client.close()


def cuda_memory(device: str) -> p.GpuMemory:
    """A well-formed `cuda` registration of a GPU this host does not have."""
    return p.GpuMemory("cuda", device, bytes(64), 1 << 20, (0,), 4096, 16, 4096, 1, 0, "LBNHC", (bytes(64),),
                       os.getpid())


def test_a_client_naming_40_made_up_gpus_gets_few_copiers_and_slows_no_other_client(kvtier_server) -> None:
    cap, http = 3, free_port()
    srv = kvtier_server(extra=[*SERVER_FLAGS, "--gpu-max-copiers", str(cap), "--http-port", str(http)])

    def copiers() -> list[dict]:
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/status", timeout=5) as r:
            return json.load(r)["gpu"]["copiers"]

    hostile = KVTierClient(ClientConfig(url=srv.url, connect_timeout_s=5.0, request_timeout_s=60.0))
    other = KVTierClient(ClientConfig(url=srv.url, connect_timeout_s=5.0))  # 5 s request timeout
    assert hostile.connect() and other.connect()
    reasons: list[str] = []

    def register_all() -> None:
        pending = [hostile.submit({"op": "gpu_register", "memory": cuda_memory(f"GPU-{uuid.uuid4()}").to_wire()})
                   for _ in range(40)]
        for reply in pending:
            try:
                reply.result()
            except KVTierError as exc:
                reasons.append(exc.reason)

    storm = threading.Thread(target=register_all)
    storm.start()
    most, beats = 0, []
    while storm.is_alive():
        most = max(most, len(copier_pids(srv.proc.pid)))
        started = time.monotonic()
        assert other.heartbeat()
        beats.append(time.monotonic() - started)
        time.sleep(0.02)
    storm.join()
    assert len(reasons) == 40 and set(reasons) <= {p.NO_COPIER, p.NO_DEVICE}  # no cupy or GPU, or no copier left
    assert most <= cap, f"{most} copier processes at once"
    assert max(beats) < 1.0, f"another client's heartbeat took {max(beats):.2f} s"
    listed = copiers()
    assert len(listed) <= cap and all(c["state"] == "failed" for c in listed), listed
    # a GPU whose copier could not start answers the same verdict for a while, without a new process
    failed = listed[0]
    with pytest.raises(KVTierError) as err:
        other.request({"op": "gpu_register", "memory": cuda_memory(failed["device"]).to_wire()})
    assert err.value.code == p.GPU_UNAVAILABLE and err.value.reason in reasons
    assert [c for c in copiers() if c["device"] == failed["device"]] == [failed]  # the same pid: no new copier
    assert not copier_pids(srv.proc.pid)
