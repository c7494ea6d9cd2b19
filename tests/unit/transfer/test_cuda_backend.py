"""server/transfer/cuda.py's own logic on CPU: cupy's runtime and the driver calls of shm/cuda_ipc.py are
replaced by a recorder, so what is checked is which calls the backend makes, in which order, and what it
answers when a call fails. Whether the calls do what CUDA documents is for tests/gpu/ on a GPU."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import numpy as np
import pytest
from kvtier.server import transfer
from kvtier.server.protocol import IPC_REFUSED, GpuMemory
from kvtier.server.transfer.base import LOAD, STORE, GpuUnavailable
from kvtier.shm import cuda_ipc

pytestmark = pytest.mark.unit

UUID = "GPU-00000000-1111-2222-3333-444444444444"
BASE = 0x7F0000000000  # where the engine's allocation is mapped in the copier
ALLOC = 1 << 20
DEVICE_TO_HOST = 2


class CUDARuntimeError(RuntimeError):
    pass


class Runtime:
    """The cupy.cuda.runtime calls cuda.py makes, recorded; every stream is idle when queried."""

    CUDARuntimeError = CUDARuntimeError

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def getDeviceCount(self) -> int:  # noqa: N802 (cupy's names)
        return 1

    def setDevice(self, ordinal: int) -> None:  # noqa: N802
        pass

    def ipcOpenMemHandle(self, handle: bytes) -> int:  # noqa: N802
        return BASE

    def pointerGetAttributes(self, ptr: int) -> types.SimpleNamespace:  # noqa: N802
        return types.SimpleNamespace(device=0)

    def ipcOpenEventHandle(self, handle: bytes) -> int:  # noqa: N802
        return 0xE0

    def hostRegister(self, ptr: int, size: int, flags: int) -> None:  # noqa: N802
        pass

    def streamCreateWithFlags(self, flags: int) -> int:  # noqa: N802
        self.calls.append(("stream",))
        return 0x50 + len([c for c in self.calls if c[0] == "stream"])

    def streamDestroy(self, stream: int) -> None:  # noqa: N802
        pass

    def eventDestroy(self, event: int) -> None:  # noqa: N802
        pass

    def ipcCloseMemHandle(self, ptr: int) -> None:  # noqa: N802
        self.calls.append(("close", ptr))

    def streamWaitEvent(self, stream: int, event: int, flags: int) -> None:  # noqa: N802
        self.calls.append(("wait", stream, event))

    def memcpyAsync(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:  # noqa: N802
        self.calls.append(("memcpy", dst, src, size, kind, stream))

    def streamQuery(self, stream: int) -> int:  # noqa: N802
        return 0


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Runtime, list[int], int]:
    """A CudaBackend over the recorder, L1 "pinned"; the entry count of each batch call the driver got, and
    L1's address."""
    runtime = Runtime()
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=runtime)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.delitem(sys.modules, "kvtier.server.transfer.cuda", raising=False)
    monkeypatch.setattr(transfer, "cuda", None, raising=False)  # undone: the package forgets this import
    module = importlib.import_module("kvtier.server.transfer.cuda")
    monkeypatch.delitem(sys.modules, "kvtier.server.transfer.cuda")  # the next test imports it afresh
    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda ordinal: UUID)
    monkeypatch.setattr(cuda_ipc, "address_range", lambda ptr: (ptr, ALLOC))
    batches: list[int] = []

    def batch(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> bool:
        batches.append(len(dsts))
        return True

    monkeypatch.setattr(cuda_ipc, "memcpy_batch_async", batch)
    engine = module.CudaBackend(UUID)
    segment = np.zeros(1 << 16, np.uint8)
    engine.pin(memoryview(segment), 1 << 16, lambda done: None)
    return engine, runtime, batches, segment.ctypes.data


def memory(**overrides: Any) -> GpuMemory:
    fields = dict(engine="cuda", device=UUID, handle=bytes(64), alloc_size=ALLOC, layer_offsets=(0,),
                  block_stride=4096, num_blocks=16, page_bytes=4096, runs=1, run_stride=0, layout="LBNHC",
                  events=(bytes(64),), pid=1)
    return GpuMemory(**{**fields, **overrides})


ENTRIES = [(i * 8192, i * 4096, 4096) for i in range(6)]  # (device offset, L1 offset, bytes): not contiguous


def test_a_batch_the_driver_rejects_is_copied_entry_by_entry_and_later_copies_skip_the_batch(backend, monkeypatch):
    engine, runtime, batches, host = backend

    def rejects(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> bool:
        batches.append(len(dsts))
        raise cuda_ipc.CudaError(1, "CUDA_ERROR_INVALID_VALUE", "cuMemcpyBatchAsync (entry 0 of 6)")

    monkeypatch.setattr(cuda_ipc, "memcpy_batch_async", rejects)
    opened = engine.open(memory())
    engine.run(opened, STORE, ENTRIES, 0, 1.0)  # no GpuUnavailable: the entries went one by one
    copies = [c for c in runtime.calls if c[0] == "memcpy"]
    assert copies == [("memcpy", host + l1, BASE + dev, size, DEVICE_TO_HOST, opened.streams[STORE])
                      for dev, l1, size in ENTRIES]
    assert [c for c in runtime.calls if c[0] != "stream"][0] == ("wait", opened.streams[STORE], 0xE0)
    engine.run(opened, LOAD, ENTRIES, 0, 1.0)
    assert batches == [6]  # the verdict is kept: the second copy did not try the batch again
    assert len([c for c in runtime.calls if c[0] == "memcpy"]) == 2 * len(ENTRIES)


def test_a_driver_that_takes_the_batch_gets_one_call_for_many_entries_and_none_for_few(backend):
    engine, runtime, batches, _ = backend
    opened = engine.open(memory())
    engine.run(opened, STORE, ENTRIES, 0, 1.0)
    engine.run(opened, STORE, ENTRIES[:2], 0, 1.0)
    assert batches == [6]
    assert len([c for c in runtime.calls if c[0] == "memcpy"]) == 2


def test_a_failed_size_query_keeps_the_registered_size_and_a_short_mapping_is_still_refused(backend, monkeypatch):
    engine, runtime, _, _ = backend

    def fails(ptr: int) -> tuple[int, int]:
        raise cuda_ipc.CudaError(1, "CUDA_ERROR_INVALID_VALUE", "cuMemGetAddressRange_v2")

    monkeypatch.setattr(cuda_ipc, "address_range", fails)
    opened = engine.open(memory())
    assert opened.base == BASE and set(opened.streams) == {STORE, LOAD}
    monkeypatch.setattr(cuda_ipc, "address_range", lambda ptr: (ptr, ALLOC // 2))
    with pytest.raises(GpuUnavailable) as refused:
        engine.open(memory())
    assert refused.value.reason == IPC_REFUSED and runtime.calls[-1] == ("close", BASE)
