"""The host DeviceBackend: a CPU engine's KV cache is private memory of its worker process, and the copier reads
a store's blocks out of it with process_vm_readv(2), so that the worker's store is one message instead of its
own copy under its own GIL (docs/vllm.md, "Server-side stores on CPU engines").

The registration's handle is (allocation base, token address, token): `open` reads the 16-byte token at that
address of the registering pid and refuses the registration unless it holds exactly those bytes (the pid is
that worker's, in this PID namespace, and not a reused one), and unless the process runs under this copier's
user id. Only stores: the copier never writes into an engine's memory (a CPU worker loads by itself).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from kvtier.server.protocol import COPIER_FAILED, IPC_REFUSED, NO_COPIER, GpuMemory
from kvtier.server.transfer.base import STORE, DeviceBackend, Entry, GpuUnavailable

IOV_MAX = 1024  # iovecs per process_vm_readv call (Linux UIO_MAXIOV)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@dataclass(frozen=True)
class HostOpened:
    pid: int
    base: int
    token_at: int
    token: bytes


class HostBackend(DeviceBackend):
    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            self._readv = libc.process_vm_readv
        except AttributeError as exc:
            raise GpuUnavailable(NO_COPIER, "this C library has no process_vm_readv (Linux only)") from exc
        self._readv.restype = ctypes.c_ssize_t
        self._readv.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(_Iovec),
            ctypes.c_ulong,
            ctypes.POINTER(_Iovec),
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        self._segment_at = 0
        self._segment = np.empty(0, np.uint8)  # keeps the mapping's buffer referenced

    def pin(self, segment: memoryview, piece_bytes: int, progress: Callable[[int], None]) -> None:
        """Nothing to page-lock: the kernel copies straight into the mapped segment."""
        self._segment = np.frombuffer(segment, np.uint8)
        self._segment_at = self._segment.ctypes.data
        progress(len(segment))

    def _read(self, pid: int, pieces: Sequence[tuple[int, int, int]]) -> None:
        """(remote address, local address, bytes) pieces, IOV_MAX per call; OSError on any short read."""
        for start in range(0, len(pieces), IOV_MAX):
            batch = pieces[start : start + IOV_MAX]
            local = (_Iovec * len(batch))(*[_Iovec(at, size) for _, at, size in batch])
            remote = (_Iovec * len(batch))(*[_Iovec(at, size) for at, _, size in batch])
            want = sum(size for _, _, size in batch)
            got = self._readv(pid, local, len(batch), remote, len(batch), 0)
            if got != want:
                code = ctypes.get_errno() if got < 0 else errno.EFAULT
                raise OSError(
                    code, f"process_vm_readv of pid {pid}: {got} of {want} bytes ({os.strerror(code)})"
                )

    def open(self, memory: GpuMemory) -> HostOpened:
        try:
            base, token_at, token = GpuMemory.HOST.unpack(memory.handle)
        except struct.error as exc:
            raise GpuUnavailable(
                IPC_REFUSED, f"a host handle is {GpuMemory.HOST.size} bytes, not {len(memory.handle)}"
            ) from exc
        try:
            with open(f"/proc/{memory.pid}/status", encoding="ascii") as status:
                uid = next(int(line.split()[1]) for line in status if line.startswith("Uid:"))
        except (OSError, StopIteration, ValueError) as exc:
            raise GpuUnavailable(
                IPC_REFUSED, f"no process {memory.pid} in this PID namespace: {exc}"
            ) from exc
        if uid != os.geteuid():
            raise GpuUnavailable(
                IPC_REFUSED, f"process {memory.pid} runs as uid {uid}, the server as {os.geteuid()}"
            )
        opened = HostOpened(memory.pid, base, token_at, token)
        try:
            held = self._holds_token(opened)
        except OSError as exc:
            raise GpuUnavailable(
                IPC_REFUSED,
                f"cannot read process {memory.pid} (same PID namespace, ptrace "
                f"permission: Yama ptrace_scope, CAP_SYS_PTRACE, seccomp): {exc}",
            ) from exc
        if not held:
            raise GpuUnavailable(IPC_REFUSED, f"process {memory.pid} does not hold the registration's token")
        return opened

    def _holds_token(self, opened: HostOpened) -> bool:
        """Whether the process at `opened.pid` holds the registration's token where it said (OSError when it
        cannot be read)."""
        held = np.zeros(len(opened.token), np.uint8)
        self._read(opened.pid, [(opened.token_at, held.ctypes.data, len(opened.token))])
        return held.tobytes() == opened.token

    def close(self, opened: HostOpened) -> None:
        """Nothing is mapped: the worker's memory is only read while a copy runs."""

    def run(
        self, opened: HostOpened, direction: str, entries: Sequence[Entry], event: int, timeout_s: float
    ) -> None:
        """Read `entries` now: the worker sends a store only after the step's forward wrote its blocks (a CPU
        forward is synchronous), so there is no event to wait for. The token is read again afterwards: a worker
        that exited meanwhile, and any process that took its pid, fail the copy (nothing is committed) instead of
        storing bytes that are not its KV."""
        if direction != STORE:
            raise GpuUnavailable(COPIER_FAILED, "host engines load by themselves; the server only stores")
        try:
            self._read(
                opened.pid,
                [(opened.base + at, self._segment_at + segment_at, size) for at, segment_at, size in entries],
            )
            held = self._holds_token(opened)
        except OSError as exc:
            raise GpuUnavailable(COPIER_FAILED, str(exc)) from exc
        if not held:
            raise GpuUnavailable(COPIER_FAILED, f"process {opened.pid} no longer holds the registration's token")
