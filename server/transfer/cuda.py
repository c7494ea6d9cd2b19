"""The CUDA DeviceBackend (cupy): the driver work of one GPU's copier process. Not yet run on a GPU.

It page-locks the mapped L1 segment in pieces (cudaHostRegister), opens an engine's raw cudaIpcMemHandle
(LazyEnablePeerAccess) and interprocess events, and gives each registration one stream per direction. A copy
makes its stream wait on the engine's event (cudaStreamWaitEvent), enqueues the DMA entries (one
cuMemcpyBatchAsync when the driver has it and there are BATCH_MIN or more, else one cudaMemcpyAsync each)
and polls the stream until it is idle or `timeout_s` passed. A driver that has cuMemcpyBatchAsync but rejects
a call gets that copy's entries again one by one, and every later copy of this process goes per entry. When
the size of the opened mapping cannot be queried, the registered size stands (every entry is still checked
against it by plan.py). Only cupy.cuda.runtime calls present in both cupy-cuda12x (13.x) and cupy-cuda13x
(14.x) are used; the driver calls cupy lacks are in shm/cuda_ipc.py.

Failures as server/transfer/fake.py reports them: an unknown GPU is NO_DEVICE, handles that do not open (or
open memory of another GPU, or less than registered) are IPC_REFUSED or NO_DEVICE, an event that never fires
is a TimeoutError. A call that fails while a copy is enqueued is COPIER_FAILED once the stream is idle again
(nothing enqueued touches the memory after the reply); an error the stream itself reports afterwards (a
sticky one, which poisons the context) is raised as is, so that the copier is replaced.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import cupy
import numpy as np
from kvtier.server.protocol import COPIER_FAILED, IPC_REFUSED, NO_DEVICE, GpuMemory
from kvtier.server.transfer.base import LOAD, STORE, DeviceBackend, Entry, GpuUnavailable
from kvtier.shm import cuda_ipc

log = logging.getLogger("kvtier.server.transfer")
runtime = cupy.cuda.runtime
BATCH_MIN = 4  # entries from which one batch call beats a cudaMemcpyAsync each (~0.6 us vs several per entry)
MAX_PAUSE_S = 200e-6  # longest sleep between two polls of a busy stream
_HOST_TO_DEVICE, _DEVICE_TO_HOST = 1, 2  # cudaMemcpyKind
_NOT_READY = 600  # cudaErrorNotReady
_NON_BLOCKING = 1  # cudaStreamNonBlocking: no implicit sync with the legacy default stream
_ERRORS = (runtime.CUDARuntimeError, cuda_ipc.CudaError, ValueError)


@contextlib.contextmanager
def _failing(reason: str, what: str) -> Iterator[None]:
    try:
        yield
    except _ERRORS as exc:
        raise GpuUnavailable(reason, f"{what}: {exc}") from exc


@dataclass
class CudaOpened:
    base: int  # the engine's allocation, mapped into this process
    events: list[int] = field(default_factory=list)  # the engine's events, imported
    streams: dict[str, int] = field(default_factory=dict)  # STORE, LOAD -> cudaStream_t


class CudaBackend(DeviceBackend):
    def __init__(self, device: str) -> None:
        """The copier of the GPU whose UUID is `device`: NO_DEVICE unless this process sees it."""
        with _failing(NO_DEVICE, "no usable CUDA device"):
            uuids = [cuda_ipc.device_uuid(i) for i in range(runtime.getDeviceCount())]
        if device not in uuids:
            raise GpuUnavailable(NO_DEVICE, f"{device} is not among this process's GPUs {uuids} "
                                 "(CUDA_VISIBLE_DEVICES, container device list)")
        self._ordinal = uuids.index(device)
        self._segment = np.empty(0, np.uint8)
        self._host = 0  # the mapped segment's address
        self._batch = True  # until the driver lacks or rejects cuMemcpyBatchAsync: then one call per entry

    def _use(self) -> None:
        """Make the GPU current on the calling thread (the copier calls from several)."""
        runtime.setDevice(self._ordinal)

    def pin(self, segment: memoryview, piece_bytes: int, progress: Callable[[int], None]) -> None:
        self._segment = np.frombuffer(segment, np.uint8)
        self._host = self._segment.ctypes.data
        self._use()
        for start in range(0, len(self._segment), piece_bytes):
            size = min(piece_bytes, len(self._segment) - start)
            try:
                runtime.hostRegister(self._host + start, size, 0)
            except runtime.CUDARuntimeError as exc:
                raise OSError(f"cudaHostRegister of L1 bytes {start}..{start + size}: {exc}") from exc
            progress(start + size)

    def open(self, memory: GpuMemory) -> CudaOpened:
        self._use()
        with _failing(IPC_REFUSED, "cudaIpcOpenMemHandle"):
            if len(memory.handle) != cuda_ipc.HANDLE_BYTES:
                raise ValueError(f"a CUDA memory handle is {cuda_ipc.HANDLE_BYTES} bytes, not {len(memory.handle)}")
            opened = CudaOpened(runtime.ipcOpenMemHandle(memory.handle))
        try:
            with _failing(IPC_REFUSED, "the opened memory"):
                owner = runtime.pointerGetAttributes(opened.base).device
            try:
                _, size = cuda_ipc.address_range(opened.base)
            except (cuda_ipc.CudaError, OSError, AttributeError) as exc:
                log.warning("the size of %s's opened memory is unknown (%s): the registered %d bytes stand",
                            memory.device, exc, memory.alloc_size)
                size = memory.alloc_size
            if owner != self._ordinal:
                raise GpuUnavailable(NO_DEVICE, f"the handle maps memory of device {owner}, registered for "
                                     f"{memory.device} (device {self._ordinal})")
            if size < memory.alloc_size:
                raise GpuUnavailable(IPC_REFUSED, f"the handle maps {size} bytes, registration claims "
                                     f"{memory.alloc_size}")
            for i, handle in enumerate(memory.events):
                with _failing(IPC_REFUSED, f"cudaIpcOpenEventHandle of event {i}"):
                    if len(handle) != cuda_ipc.HANDLE_BYTES:
                        raise ValueError(f"an event handle is {cuda_ipc.HANDLE_BYTES} bytes, not {len(handle)}")
                    opened.events.append(runtime.ipcOpenEventHandle(handle))
            with _failing(COPIER_FAILED, "cudaStreamCreateWithFlags"):
                for direction in (STORE, LOAD):
                    opened.streams[direction] = runtime.streamCreateWithFlags(_NON_BLOCKING)
        except BaseException:
            with contextlib.suppress(GpuUnavailable):
                self.close(opened)
            raise
        return opened

    def close(self, opened: CudaOpened) -> None:
        self._use()
        calls = [*((runtime.streamDestroy, s) for s in opened.streams.values()),
                 *((runtime.eventDestroy, e) for e in opened.events), (runtime.ipcCloseMemHandle, opened.base)]
        errors = []
        for call, arg in calls:
            try:
                call(arg)
            except runtime.CUDARuntimeError as exc:
                errors.append(f"{call.__name__}: {exc}")
        if errors:
            raise GpuUnavailable(COPIER_FAILED, "; ".join(errors))

    def run(self, opened: CudaOpened, direction: str, entries: Sequence[Entry], event: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            waited = opened.events[event]
        except IndexError as exc:
            raise GpuUnavailable(COPIER_FAILED, f"event {event} of {len(opened.events)}") from exc
        self._use()
        stream = opened.streams[direction]
        table = np.asarray(entries, dtype=np.uint64).reshape(-1, 3)
        device, host, sizes = np.uint64(opened.base) + table[:, 0], np.uint64(self._host) + table[:, 1], table[:, 2]
        dsts, srcs, kind = (host, device, _DEVICE_TO_HOST) if direction == STORE else (device, host, _HOST_TO_DEVICE)
        failure = None
        try:
            runtime.streamWaitEvent(stream, waited, 0)
            if not self._batched(dsts, srcs, sizes, stream):
                for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
                    runtime.memcpyAsync(dst, src, size, kind, stream)
        except _ERRORS as exc:
            failure = GpuUnavailable(COPIER_FAILED, f"{direction} of {len(table)} entries: {exc}")
        self._drain(stream, deadline, event, timeout_s)
        if failure is not None:
            raise failure

    def _batched(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> bool:
        """Enqueue every entry as one cuMemcpyBatchAsync; False when they go one by one: fewer than BATCH_MIN,
        or a driver without the call or that rejected one (remembered). Entries a rejected batch did enqueue
        are copied again in stream order, which writes the same bytes."""
        if len(dsts) < BATCH_MIN or not self._batch:
            return False
        try:
            if cuda_ipc.memcpy_batch_async(dsts, srcs, sizes, stream):
                return True
            log.warning("this driver has no cuMemcpyBatchAsync: one cudaMemcpyAsync per entry")
        except cuda_ipc.CudaError as exc:
            log.warning("cuMemcpyBatchAsync refused a copy (%s): one cudaMemcpyAsync per entry from now on", exc)
        self._batch = False
        return False

    @staticmethod
    def _drain(stream: int, deadline: float, event: int, timeout_s: float) -> None:
        """Until the stream is idle; TimeoutError past the deadline (its event never fired)."""
        pause = 20e-6
        while (status := runtime.streamQuery(stream)) == _NOT_READY:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"event {event} and its copies did not finish within {timeout_s} s")
            time.sleep(pause)
            pause = min(pause * 2, MAX_PAUSE_S)
        if status:
            raise runtime.CUDARuntimeError(status)
