"""CUDA interprocess handles through ctypes, for both ends of the GPU path; no torch, no cupy. Not yet run on
a GPU.

The vLLM worker (connector/vllm/gpu_memory.py) exports a raw cudaIpcGetMemHandle of its KV allocation's base
(found with cuMemGetAddressRange, so not torch's version-dependent `_share_cuda_` tuple), a pool of
interprocess events and its GPU's UUID; the copier (server/transfer/cuda.py) finds its GPU by that UUID, sizes
the mapping it opened and enqueues many DMA entries as one cuMemcpyBatchAsync.

Nothing is loaded at import, so that the module imports where there is no CUDA. The runtime (libcudart) is
the one the process already mapped (torch's or cupy's), else found by name or in the nvidia/*/lib folders of
site-packages where the CUDA wheels put it; the driver is libcuda.so.1. Every failed call raises CudaError.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys
from collections.abc import Callable

import numpy as np

HANDLE_BYTES = 64  # cudaIpcMemHandle_t and cudaIpcEventHandle_t
EVENT_DISABLE_TIMING = 0x02
EVENT_INTERPROCESS = 0x04
RUNTIME_NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12")
DRIVER_NAME = "libcuda.so.1"
_BATCH_ABI = 12080  # cuMemcpyBatchAsync as CUDA 12.8 declared it (with failIdx); CUDA 13 drivers still serve it
_SRC_ACCESS_ORDER_STREAM = 1  # the sources are read in stream order (after the engine's event)
_INVALID_VALUE = 1  # cudaErrorInvalidValue: what cudaIpcGetMemHandle answers for memory without a legacy handle
_NOT_IPC_MEMORY = (" (this allocation has no legacy CUDA IPC handle: only cudaMalloc memory has one, and vLLM's sleep "
                   "mode (--enable-sleep-mode, its cumem allocator), PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                   "or backend:cudaMallocAsync put the KV cache in VMM memory or a memory pool; run vLLM without them "
                   "to use kvtier's GPU path)")

_void_p, _int, _uint, _size_t, _u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t, ctypes.c_uint64
_ptr = ctypes.POINTER


class CudaError(RuntimeError):
    """A CUDA call failed: `code` is its cudaError_t or CUresult, `name` the code's name."""

    def __init__(self, code: int, name: str, call: str) -> None:
        super().__init__(f"{call}: {name} ({code})")
        self.code = code
        self.name = name
        self.call = call


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", _uint), ("id", _int)]


class _MemcpyAttributes(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("srcAccessOrder", _uint), ("srcLocHint", _Location), ("dstLocHint", _Location), ("flags", _uint)]


_RUNTIME = {  # name: (restype, argtypes)
    "cudaGetErrorName": (ctypes.c_char_p, [_int]),
    "cudaGetLastError": (_int, []),
    "cudaIpcGetMemHandle": (_int, [_ptr(_Handle), _void_p]),
    "cudaEventCreateWithFlags": (_int, [_ptr(_void_p), _uint]),
    "cudaIpcGetEventHandle": (_int, [_ptr(_Handle), _void_p]),
    "cudaEventRecord": (_int, [_void_p, _void_p]),
    "cudaEventDestroy": (_int, [_void_p]),
}
_DRIVER = {
    "cuInit": (_int, [_uint]),
    "cuGetErrorName": (_int, [_int, _ptr(ctypes.c_char_p)]),
    "cuCtxGetCurrent": (_int, [_ptr(_void_p)]),
    "cuMemGetAddressRange_v2": (_int, [_ptr(_u64), _ptr(_size_t), _u64]),
    "cuDeviceGet": (_int, [_ptr(_int), _int]),
    "cuDeviceGetUuid_v2": (_int, [_ptr(ctypes.c_ubyte * 16), _int]),
    "cuGetProcAddress_v2": (_int, [ctypes.c_char_p, _ptr(_void_p), _int, _u64, _ptr(_int)]),
}
_BATCH = ctypes.CFUNCTYPE(_int, _void_p, _void_p, _void_p, _size_t, _void_p, _void_p, _size_t, _void_p, _void_p)


def _mapped_runtime() -> list[str]:
    """The libcudart this process already mapped (torch and cupy load theirs at import)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(maxsplit=5)[-1].strip() for line in f if "libcudart.so" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith("libcudart.so"))


def _open(candidates: list[str], functions: dict[str, tuple]) -> ctypes.CDLL:
    errors = []
    for candidate in dict.fromkeys(candidates):
        try:
            lib = ctypes.CDLL(candidate)
        except OSError as exc:
            errors.append(str(exc))
            continue
        for name, (restype, argtypes) in functions.items():
            fn = getattr(lib, name, None)  # absent from old drivers: calling it raises AttributeError
            if fn is not None:
                fn.restype, fn.argtypes = restype, argtypes
        return lib
    raise OSError("cannot load the CUDA library: " + "; ".join(errors))


@functools.cache
def _runtime() -> ctypes.CDLL:
    wheels = [path for root in sys.path  # nvidia/cuda_runtime/lib (CUDA 12 wheels), nvidia/cu13/lib (CUDA 13)
              for path in sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcudart.so*")))]
    return _open([*_mapped_runtime(), *RUNTIME_NAMES, *wheels], _RUNTIME)


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = _open([DRIVER_NAME], _DRIVER)
    _check_driver(lib, "cuInit", lib.cuInit(0))
    return lib


def _check_runtime(call: str, code: int) -> None:
    if code:
        lib = _runtime()
        lib.cudaGetLastError()  # a failed call leaves its error pending; the next caller would get it
        raise CudaError(code, (lib.cudaGetErrorName(code) or b"cudaErrorUnknown").decode(), call)


def _check_driver(lib: ctypes.CDLL, call: str, code: int) -> None:
    if code:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(code, ctypes.byref(name))
        raise CudaError(code, (name.value or b"CUDA_ERROR_UNKNOWN").decode(), call)


def _rt(call: str, *args: object) -> None:
    _check_runtime(call, getattr(_runtime(), call)(*args))


def _drv(call: str, *args: object) -> None:
    lib = _driver()
    _check_driver(lib, call, getattr(lib, call)(*args))


def address_range(ptr: int) -> tuple[int, int]:
    """(base, bytes) of the device allocation that holds `ptr`, in the context current on this thread."""
    context = _void_p()
    _drv("cuCtxGetCurrent", ctypes.byref(context))
    if not context.value:
        raise CudaError(201, "CUDA_ERROR_INVALID_CONTEXT", "cuCtxGetCurrent (no CUDA context on this thread)")
    base, size = _u64(), _size_t()
    _drv("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ptr)
    return base.value, size.value


def device_uuid(ordinal: int) -> str:
    """The UUID of CUDA device `ordinal` as nvidia-smi writes it: "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"."""
    device, raw = _int(), (ctypes.c_ubyte * 16)()
    _drv("cuDeviceGet", ctypes.byref(device), ordinal)
    _drv("cuDeviceGetUuid_v2", ctypes.byref(raw), device)
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def mem_handle(base: int) -> bytes:
    """The cudaIpcMemHandle_t of the allocation starting at device pointer `base`."""
    handle = _Handle()
    code = _runtime().cudaIpcGetMemHandle(ctypes.byref(handle), base)
    _check_runtime("cudaIpcGetMemHandle" + (_NOT_IPC_MEMORY if code == _INVALID_VALUE else ""), code)
    return bytes(handle)


def create_event() -> int:
    """An interprocess event of the current device (timing disabled, as interprocess events must be)."""
    event = _void_p()
    _rt("cudaEventCreateWithFlags", ctypes.byref(event), EVENT_DISABLE_TIMING | EVENT_INTERPROCESS)
    return event.value or 0


def event_handle(event: int) -> bytes:
    handle = _Handle()
    _rt("cudaIpcGetEventHandle", ctypes.byref(handle), event)
    return bytes(handle)


def record_event(event: int, stream: int) -> None:
    """Record `event` on `stream` (a cudaStream_t; 0 is the legacy default stream)."""
    _rt("cudaEventRecord", event, stream)


def destroy_event(event: int) -> None:
    _rt("cudaEventDestroy", event)


@functools.cache
def _batch() -> Callable[..., int] | None:
    fn, status = _void_p(), _int()
    try:
        _drv("cuGetProcAddress_v2", b"cuMemcpyBatchAsync", ctypes.byref(fn), _BATCH_ABI, 0, ctypes.byref(status))
    except (CudaError, AttributeError):
        return None
    return _BATCH(fn.value) if fn.value else None


def memcpy_batch_async(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> bool:
    """Enqueue the copies srcs[i] -> dsts[i] of sizes[i] bytes (pointers of one address space) on `stream`
    (not the legacy default stream) as one cuMemcpyBatchAsync, sources read in stream order; False, with
    nothing enqueued, when the driver has no such call (older than CUDA 12.8)."""
    fn = _batch()
    if fn is None:
        return False
    dsts, srcs, sizes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
    attrs = _MemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM)
    first, failed = _size_t(0), _size_t(0)
    code = fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(dsts), ctypes.byref(attrs),
              ctypes.byref(first), 1, ctypes.byref(failed), stream)
    _check_driver(_driver(), f"cuMemcpyBatchAsync (entry {failed.value} of {len(dsts)})", code)
    return True
