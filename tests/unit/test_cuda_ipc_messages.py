"""shm/cuda_ipc.py's errors say why on CPU, with the CUDA runtime replaced by a stand-in that answers as the
driver does: KV cache memory from the VMM API or a memory pool (vLLM's sleep mode, expandable segments,
cudaMallocAsync) has no legacy IPC handle, and cudaIpcGetMemHandle answers cudaErrorInvalidValue for it."""

from __future__ import annotations

import ctypes

import pytest
from kvtier.shm import cuda_ipc

pytestmark = pytest.mark.unit

NAMES = {1: b"cudaErrorInvalidValue", 101: b"cudaErrorInvalidDevice"}


class Runtime:
    """The libcudart calls mem_handle makes; `code` is what cudaIpcGetMemHandle answers."""

    def __init__(self, code: int) -> None:
        self.code = code
        self.pending = code  # the error a failed call leaves for cudaGetLastError

    def cudaIpcGetMemHandle(self, handle: object, base: int) -> int:  # noqa: N802 - the C name
        if not self.code:
            ctypes.memmove(handle, b"\x07" * cuda_ipc.HANDLE_BYTES, cuda_ipc.HANDLE_BYTES)
        return self.code

    def cudaGetLastError(self) -> int:  # noqa: N802
        pending, self.pending = self.pending, 0
        return pending

    def cudaGetErrorName(self, code: int) -> bytes:  # noqa: N802
        return NAMES[code]


def use(monkeypatch: pytest.MonkeyPatch, code: int) -> Runtime:
    runtime = Runtime(code)
    monkeypatch.setattr(cuda_ipc, "_runtime", lambda: runtime)
    return runtime


def test_memory_without_a_legacy_ipc_handle_is_refused_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = use(monkeypatch, 1)
    with pytest.raises(cuda_ipc.CudaError) as refused:
        cuda_ipc.mem_handle(0x7F0000000000)
    message = str(refused.value)
    assert (refused.value.code, refused.value.name) == (1, "cudaErrorInvalidValue")
    assert message.startswith("cudaIpcGetMemHandle (this allocation has no legacy CUDA IPC handle")
    for cause in ("sleep mode", "expandable_segments:True", "cudaMallocAsync", "VMM"):
        assert cause in message
    assert message.endswith(": cudaErrorInvalidValue (1)")
    assert runtime.pending == 0  # the failed call's error does not linger for the next caller


def test_other_failures_and_success_are_reported_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    use(monkeypatch, 101)
    with pytest.raises(cuda_ipc.CudaError, match=r"^cudaIpcGetMemHandle: cudaErrorInvalidDevice \(101\)$"):
        cuda_ipc.mem_handle(0x7F0000000000)
    use(monkeypatch, 0)
    assert cuda_ipc.mem_handle(0x7F0000000000) == b"\x07" * cuda_ipc.HANDLE_BYTES
