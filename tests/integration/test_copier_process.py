"""The daemon's copiers (server/transfer/copiers.py) driving real copier processes (server/transfer/copier.py)
with the fake engine: a shared-memory "device" laid out like a vLLM LBNHC allocation, a real L1 segment file,
sequence-slot events. Bytes, event ordering, failure and restart, and the release of the engine's memory."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import pytest
import uvloop
from kvtier.server.protocol import COPIER_FAILED, IPC_REFUSED, NO_COPIER, NO_DEVICE, NOT_PINNED, GpuMemory
from kvtier.server.transfer import copiers
from kvtier.server.transfer.base import LOAD, STORE, Copy, GpuUnavailable
from kvtier.server.transfer.copiers import Copiers, CopiersConfig
from kvtier.shm.fake_device import FakeDevice
from kvtier.shm.pages import extent_views
from kvtier.shm.segment import SHM_DIR, Segment

pytestmark = pytest.mark.integration

PAGE = 16 << 10  # L1 page
SEGMENT_PAGES = 64
PIECE = 256 << 10  # page-locking piece: 16 L1 pages
LAYERS, BLOCKS, BLOCK_PAGE = 3, 40, 2048  # engine page (one layer of one block): 2 KiB
BASE = 4096  # the KV tensor starts this far into the allocation
EVENTS = 8


@dataclass
class Rig:
    segment: Segment
    device: FakeDevice
    memory: GpuMemory

    @property
    def l1(self) -> np.ndarray:
        return self.segment.array()

    def page(self, layer: int, block: int) -> np.ndarray:
        """The engine's bytes of (layer, block) in the LBNHC allocation."""
        at = BASE + (layer * BLOCKS + block) * BLOCK_PAGE
        return self.device.data[at : at + BLOCK_PAGE]

    def chunk_bytes(self, block_ids: tuple[int, ...], blocks: int) -> bytes:
        """What L1 must hold for a chunk of `blocks` blocks whose blocks 0.. are `block_ids`: layer-major pages."""
        assert len(block_ids) == blocks
        return b"".join(self.page(layer, b).tobytes() for layer in range(LAYERS) for b in block_ids)

    def l1_bytes(self, copy: Copy) -> bytes:
        return b"".join(bytes(v) for v in extent_views(self.l1, copy.extents, PAGE, copy.size))

    def fired(self, slot: int) -> int:
        self.device.record(slot)
        self.device.complete(slot)
        return slot

    def engine(self, **overrides: Any) -> Copiers:
        config = dict(segment_path=os.path.join(SHM_DIR, self.segment.name), segment_size=self.segment.size,
                      page_size=PAGE, piece_bytes=PIECE, watchdog_s=2.0, op_timeout_s=5.0)
        return Copiers(CopiersConfig(**{**config, **overrides}))


def fake_memory(dev: FakeDevice, **overrides: Any) -> GpuMemory:
    fields = dict(engine="fake", device=dev.name, handle=dev.name.encode(), alloc_size=dev.size,
                  layer_offsets=tuple(BASE + layer * BLOCKS * BLOCK_PAGE for layer in range(LAYERS)),
                  block_stride=BLOCK_PAGE, num_blocks=BLOCKS, page_bytes=BLOCK_PAGE, runs=1, run_stride=0,
                  layout="LBNHC", events=tuple(dev.event_handle(i) for i in range(EVENTS)), pid=os.getpid())
    return GpuMemory.from_wire(GpuMemory(**{**fields, **overrides}).to_wire())


@pytest.fixture
def rig():
    tag = uuid.uuid4().hex[:10]
    segment = Segment.create(f"kvtier-copier-test-{tag}", SEGMENT_PAGES * PAGE, 0o600, SHM_DIR)
    device = FakeDevice.create(f"kvtier-fake-gpu-{tag}", BASE + LAYERS * BLOCKS * BLOCK_PAGE + 512, EVENTS)
    device.data[:] = np.random.default_rng(7).integers(0, 256, device.size, dtype=np.uint8)
    yield Rig(segment, device, fake_memory(device))
    device.close()
    device.unlink()
    segment.close()


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    uvloop.run(asyncio.wait_for(main(), 25))


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def copier_pid(engine: Copiers) -> int:
    (copier,) = engine.status()["copiers"]
    return copier["pid"]


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


def size(blocks: int) -> int:
    return LAYERS * blocks * BLOCK_PAGE


def test_store_then_load_into_other_blocks_is_bit_exact(rig):
    whole = Copy(key(1), (5, 9, 2, 7), 0, 4, (15, 2), size(4))  # its pages straddle a page-locking piece
    partial = Copy(key(2), (11, 12, 13), 0, 3, (40, 1, 3, 1), size(3))  # a short chunk in two runs
    expected = {whole.key: rig.chunk_bytes(whole.block_ids, 4), partial.key: rig.chunk_bytes(partial.block_ids, 3)}
    before = rig.device.data.copy()

    async def main() -> None:
        engine = rig.engine()
        try:
            reg = await engine.register(rig.memory)
            await engine.copy(reg, STORE, [whole, partial], rig.fired(0))
            assert rig.l1_bytes(whole) == expected[whole.key]
            assert rig.l1_bytes(partial) == expected[partial.key]
            assert np.array_equal(rig.device.data, before)  # a store reads the device only
            # Load blocks 1..3 of the whole chunk and all of the partial one into other engine blocks.
            tail = Copy(whole.key, (20, 21, 22), 1, 4, whole.extents, whole.size)
            short = Copy(partial.key, (30, 31, 32), 0, 3, partial.extents, partial.size)
            await engine.copy(reg, LOAD, [tail, short], rig.fired(1))
        finally:
            await engine.close()

    run(main)
    want = before.copy()
    for layer in range(LAYERS):
        for src, dst in [(9, 20), (2, 21), (7, 22), (11, 30), (12, 31), (13, 32)]:
            at = BASE + (layer * BLOCKS + dst) * BLOCK_PAGE
            src_at = BASE + (layer * BLOCKS + src) * BLOCK_PAGE
            want[at : at + BLOCK_PAGE] = before[src_at : src_at + BLOCK_PAGE]
    assert np.array_equal(rig.device.data, want)


def test_a_copy_waits_for_its_event(rig):
    chunk = Copy(key(3), (1, 2), 0, 2, (8, 1), size(2))

    async def main() -> None:
        engine = rig.engine()
        try:
            reg = await engine.register(rig.memory)
            rig.device.record(2)  # the worker records, then sends; its stream writes the blocks later
            copy = asyncio.ensure_future(engine.copy(reg, STORE, [chunk], 2))
            await asyncio.sleep(0.3)
            assert not copy.done()
            for layer in range(LAYERS):
                rig.page(layer, 1)[:] = 0xA1 + layer
                rig.page(layer, 2)[:] = 0xB1 + layer
            rig.device.complete(2)
            await copy
        finally:
            await engine.close()

    run(main)
    assert rig.l1_bytes(chunk) == b"".join(bytes([0xA1 + layer]) * BLOCK_PAGE + bytes([0xB1 + layer]) * BLOCK_PAGE
                                           for layer in range(LAYERS))


def test_copies_of_one_stream_run_in_order_and_other_streams_do_not_wait(rig):
    first = Copy(key(10), (1,), 0, 1, (10, 1), size(1))
    second = Copy(key(11), (2,), 0, 1, (11, 1), size(1))
    loaded = Copy(key(12), (3,), 0, 1, (12, 1), size(1))
    rig.l1[12 * PAGE : 12 * PAGE + size(1)] = 0x5C

    async def main() -> None:
        engine = rig.engine()
        try:
            reg = await engine.register(rig.memory)
            rig.device.record(0)  # fires late
            stores = [asyncio.ensure_future(engine.copy(reg, STORE, [first], 0)),
                      asyncio.ensure_future(engine.copy(reg, STORE, [second], rig.fired(1)))]
            await engine.copy(reg, LOAD, [loaded], rig.fired(2))  # the load stream runs meanwhile
            await asyncio.sleep(0.3)
            assert not any(store.done() for store in stores)  # the second waits behind the first
            rig.device.complete(0)
            await asyncio.gather(*stores)
        finally:
            await engine.close()

    run(main)
    assert all(np.all(rig.page(layer, 3) == 0x5C) for layer in range(LAYERS))
    assert rig.l1_bytes(first) == rig.chunk_bytes((1,), 1) and rig.l1_bytes(second) == rig.chunk_bytes((2,), 1)


def test_an_event_that_never_fires_fails_the_copy_and_the_copier_is_replaced(rig):
    chunk = Copy(key(4), (3,), 0, 1, (20, 1), size(1))

    async def main() -> None:
        engine = rig.engine(op_timeout_s=1.0)
        try:
            reg = await engine.register(rig.memory)
            first = copier_pid(engine)
            rig.device.record(3)  # never completed
            with pytest.raises(GpuUnavailable) as failed:
                await engine.copy(reg, STORE, [chunk], 3)
            assert failed.value.reason == COPIER_FAILED
            await engine.copy(reg, STORE, [chunk], rig.fired(4))  # the same registration, served again
            (status,) = engine.status()["copiers"]
            assert status["restarts"] == 1 and status["pid"] != first and status["registrations"] == [reg]
        finally:
            await engine.close()

    run(main)
    assert rig.l1_bytes(chunk) == rig.chunk_bytes((3,), 1)


def test_a_killed_copier_fails_its_copy_and_a_new_one_serves_the_registration(rig):
    chunk = Copy(key(5), (6, 8), 0, 2, (30, 1), size(2))

    async def main() -> None:
        engine = rig.engine(op_timeout_s=20.0)
        try:
            reg = await engine.register(rig.memory)
            first = copier_pid(engine)
            rig.device.record(5)
            copy = asyncio.ensure_future(engine.copy(reg, STORE, [chunk], 5))
            await asyncio.sleep(0.2)
            os.kill(first, signal.SIGKILL)
            with pytest.raises(GpuUnavailable) as failed:
                await asyncio.wait_for(copy, 10)  # long before the op timeout
            assert failed.value.reason == COPIER_FAILED
            rig.device.complete(5)
            await engine.copy(reg, STORE, [chunk], rig.fired(6))
            assert copier_pid(engine) != first
            with pytest.raises(ProcessLookupError):
                os.kill(first, 0)  # reaped
        finally:
            await engine.close()

    run(main)
    assert rig.l1_bytes(chunk) == rig.chunk_bytes((6, 8), 2)


def test_a_stopped_copier_is_replaced_when_its_heartbeats_stop(rig):
    async def main() -> None:
        engine = rig.engine(watchdog_s=1.0)
        try:
            reg = await engine.register(rig.memory)
            first = copier_pid(engine)
            os.kill(first, signal.SIGSTOP)
            await until(lambda: engine.status()["copiers"][0]["restarts"] == 1)
            chunk = Copy(key(6), (0,), 0, 1, (50, 1), size(1))
            await engine.copy(reg, STORE, [chunk], rig.fired(7))
            assert copier_pid(engine) != first
            assert rig.l1_bytes(chunk) == rig.chunk_bytes((0,), 1)
        finally:
            await engine.close()

    run(main)


def test_a_gpu_whose_copier_cannot_start_keeps_that_verdict_a_while_and_copiers_are_capped(rig, other, monkeypatch):
    monkeypatch.setattr(copiers, "VERDICT_S", 1.0)
    missing = f"{rig.device.name}-none"
    absent = fake_memory(rig.device, device=missing, handle=missing.encode())

    async def main() -> None:
        engine = rig.engine(max_copiers=1)
        try:
            with pytest.raises(GpuUnavailable) as first:
                await engine.register(absent)
            assert first.value.reason == NO_DEVICE
            (failed,) = engine.status()["copiers"]
            with pytest.raises(GpuUnavailable) as again:
                await engine.register(absent)
            assert (again.value.reason, again.value.detail) == (NO_DEVICE, first.value.detail)
            assert engine.status()["copiers"] == [failed]  # that process's verdict: no new one
            await asyncio.sleep(1.1)
            assert engine.status()["copiers"] == []  # forgotten
            with pytest.raises(GpuUnavailable):
                await engine.register(absent)
            (retried,) = engine.status()["copiers"]
            assert retried["pid"] != failed["pid"]  # tried again
            await engine.register(rig.memory)  # a failed copier does not count against the cap
            with pytest.raises(GpuUnavailable) as capped:
                await engine.register(fake_memory(rig.device, device=other.name, handle=other.name.encode()))
            assert capped.value.reason == NO_COPIER and "--gpu-max-copiers 1" in capped.value.detail
            assert {c["device"] for c in engine.status()["copiers"]} == {missing, rig.device.name}
        finally:
            await engine.close()

    run(main)


@pytest.mark.parametrize("cause", ["hangs mid-copy", "stops", "never sees its event"])
def test_a_failed_copiers_copies_fail_only_once_its_process_has_exited(rig, monkeypatch, cause):
    """Nothing a copy held (L1 pages, a lease, the engine's blocks) may be handed on while the process that
    was copying can still write: the copy fails only after the process is gone, whichever way it failed."""
    chunk = Copy(key(9), (6, 8), 0, 2, (30, 1), size(2))  # two blocks apart: an entry per block and layer
    if cause == "hangs mid-copy":
        monkeypatch.setenv("KVTIER_FAKE_HANG_EVENT", "2")  # moves its first entry, then never ends: the daemon's op timeout
    overrides = {"hangs mid-copy": {"op_timeout_s": 1.0}, "stops": {"watchdog_s": 1.0, "op_timeout_s": 20.0},
                 "never sees its event": {"op_timeout_s": 1.0}}[cause]

    async def main() -> None:
        engine = rig.engine(**overrides)
        try:
            reg = await engine.register(rig.memory)
            pid = copier_pid(engine)
            if cause == "hangs mid-copy":
                rig.fired(2)
            else:
                rig.device.record(2)  # never completed: the copy waits
            copy = asyncio.ensure_future(engine.copy(reg, STORE, [chunk], 2))
            await asyncio.sleep(0.2)
            if cause == "stops":
                os.kill(pid, signal.SIGSTOP)  # its heartbeats stop: the watchdog
            with pytest.raises(GpuUnavailable) as failed:
                await copy
            assert failed.value.reason == COPIER_FAILED
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)  # exited and reaped before the copy failed
            assert engine.status()["copiers"][0]["pid"] == pid  # and before a new one was spawned
        finally:
            await engine.close()

    run(main)


@pytest.fixture
def other(rig):
    dev = FakeDevice.create(f"{rig.device.name}-b", 4096, 2)
    yield dev
    dev.close()
    dev.unlink()


def test_registrations_the_copier_cannot_open_are_refused_with_a_reason(rig, other):
    missing = f"{rig.device.name}-none"
    cases = [
        (fake_memory(rig.device, device=missing, handle=missing.encode()), NO_DEVICE),  # no such device
        (fake_memory(rig.device, handle=missing.encode()), IPC_REFUSED),  # a handle that opens nothing
        (fake_memory(rig.device, handle=other.name.encode()), NO_DEVICE),  # memory of another device
        (fake_memory(rig.device, events=(other.event_handle(0),)), IPC_REFUSED),  # another device's event
        (fake_memory(rig.device, events=(b"garbage",)), IPC_REFUSED),
        (fake_memory(rig.device, alloc_size=rig.device.size + 1), IPC_REFUSED),  # larger than the device
    ]

    async def main() -> None:
        engine = rig.engine()
        try:
            for memory, reason in cases:
                with pytest.raises(GpuUnavailable) as refused:
                    await engine.register(memory)
                assert refused.value.reason == reason, memory
            reg = await engine.register(rig.memory)  # the copier still serves good ones
            await engine.copy(reg, STORE, [Copy(key(7), (1,), 0, 1, (2, 1), size(1))], rig.fired(0))
            assert {c["device"]: c["state"] for c in engine.status()["copiers"]} == {
                rig.device.name: "serving", missing: "failed"}
        finally:
            await engine.close()

    run(main)


def test_copies_before_l1_is_page_locked_answer_not_pinned(rig, monkeypatch):
    monkeypatch.setenv("KVTIER_FAKE_PIN_DELAY_S", "0.3")  # 4 pieces: about 1.2 s
    chunk = Copy(key(8), (4,), 0, 1, (1, 1), size(1))

    async def main() -> None:
        engine = rig.engine()
        try:
            reg = await engine.register(rig.memory)
            with pytest.raises(GpuUnavailable) as refused:
                await engine.copy(reg, STORE, [chunk], rig.fired(0))
            assert refused.value.reason == NOT_PINNED
            seen: list[int] = []

            def pinned() -> bool:
                (status,) = engine.status()["copiers"]
                seen.append(status["pinned_bytes"])
                return status["pinned_bytes"] == status["total_bytes"] == rig.segment.size

            await until(pinned)
            assert seen == sorted(seen) and len(set(seen)) > 1  # progress in steps
            await engine.copy(reg, STORE, [chunk], rig.fired(0))
        finally:
            await engine.close()

    run(main)
    assert rig.l1_bytes(chunk) == rig.chunk_bytes((4,), 1)


def maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_unregister_and_close_release_the_engines_memory(rig):
    async def main() -> None:
        engine = rig.engine()
        reg = await engine.register(rig.memory)
        pid = copier_pid(engine)
        await engine.copy(reg, STORE, [Copy(key(9), (1,), 0, 1, (2, 1), size(1))], rig.fired(0))
        assert rig.device.path in maps(pid)
        engine.unregister(reg)
        engine.unregister(reg)  # idempotent
        await until(lambda: rig.device.name not in maps(pid))
        with pytest.raises(KeyError):
            await engine.copy(reg, STORE, [Copy(key(9), (1,), 0, 1, (2, 1), size(1))], rig.fired(0))
        assert engine.status()["copiers"][0]["registrations"] == []
        await engine.register(rig.memory)
        await until(lambda: rig.device.path in maps(pid))
        await engine.close()
        assert not os.path.exists(f"/proc/{pid}")

    run(main)


DAEMON = """
import asyncio, sys, uvloop
from kvtier.server.protocol import GpuMemory
from kvtier.server.transfer import copiers
from kvtier.server.transfer.copiers import Copiers, CopiersConfig
import msgpack

async def main():
    config, memory = msgpack.unpackb(bytes.fromhex(sys.argv[1]))
    engine = Copiers(CopiersConfig(**config))
    await engine.register(GpuMemory.from_wire(memory))
    print(engine.status()["copiers"][0]["pid"], flush=True)
    await asyncio.sleep(60)

uvloop.run(main())
"""


def test_a_killed_daemon_takes_its_copier_along(rig):
    config = dict(segment_path=os.path.join(SHM_DIR, rig.segment.name), segment_size=rig.segment.size,
                  page_size=PAGE, piece_bytes=PIECE, watchdog_s=2.0, op_timeout_s=5.0)
    arg = msgpack.packb([config, rig.memory.to_wire()]).hex()
    daemon = subprocess.Popen([sys.executable, "-c", DAEMON, arg], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(daemon.stdout.readline())
        assert rig.device.path in maps(pid)
        daemon.kill()
        daemon.wait()
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and not exited(pid):
            assert time.monotonic() < deadline, "the copier outlived its daemon"
            time.sleep(0.05)
    finally:
        daemon.kill()
        daemon.wait()


def exited(pid: int) -> bool:
    """Dead and waiting to be reaped (its new parent may not reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed here")
def test_a_cuda_registration_without_cupy_is_refused_as_no_copier(rig):
    memory = fake_memory(rig.device, engine="cuda", device="GPU-00000000-0000-0000-0000-000000000000",
                         handle=bytes(64))

    async def main() -> None:
        engine = rig.engine()
        try:
            with pytest.raises(GpuUnavailable) as refused:
                await engine.register(memory)
            assert refused.value.reason == NO_COPIER
            (status,) = engine.status()["copiers"]
            assert status["state"] == "failed" and not os.path.exists(f"/proc/{status['pid']}")
        finally:
            await engine.close()

    run(main)
