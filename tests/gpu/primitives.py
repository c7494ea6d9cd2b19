"""The device check's primitives phase: the CUDA calls kvtier's GPU path rests on, between two processes, as
they are used (check.py runs it on a GPU; the rehearsal skips it). Never run on a GPU yet.

This process is the exporter, as a vLLM worker is (torch, connector/vllm/gpu_memory.py's shm/cuda_ipc.py
calls); a child process (`primitives.py importer`, cupy, as the copier is) answers one JSON request a line:
- open: one allocation's handle opened twice, bytes read at a non-zero offset into it through both mappings;
- order: a copy queued behind the exporter's event waits for a long kernel before it, storing (D2H: it must
  read the bytes written after the kernel) and loading (H2D: its bytes must land after the kernel's writes);
- pending: the exporter process SIGKILLed while the event the importer waits on is still pending (how the wait
  ends, if it does; the importer's other streams must stay usable);
- batch: cuMemcpyBatchAsync by both ABIs (12.8's, with failIdx; 13.0's, without) against the pattern, and a
  copy straddling two separately page-locked pieces of one mapping, one call and batched;
- pin: cudaHostRegister GB/s of a /dev/shm file cold and prefaulted, and of two processes at once;
- punch: MADV_REMOVE on a page-locked /dev/shm range, then CPU writes: which bytes a H2D copy reads.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

MIB = 1 << 20
OFFSET = 3 * MIB + 4096 + 96  # into the allocation: not its base, not page-aligned
SPAN = 8 * MIB
SLEEP_CYCLES = 1_000_000_000  # torch.cuda._sleep: ~0.5 s on an H200
PIN_BYTES = 4 << 30
_BATCH_13 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def pattern(n: int, seed: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 7_919 + seed * 104_729) % 251).astype(np.uint8)


def _map(path: str, size: int) -> tuple[mmap.mmap, np.ndarray]:
    """A shared mapping of a /dev/shm file, as L1 is mapped, and its bytes."""
    fd = os.open(path, os.O_RDWR)
    try:
        mapped = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return mapped, np.frombuffer(mapped, np.uint8)


# -- the importer (a child process, cupy) ----------------------------------------------------------------------


class Importer:
    def __init__(self) -> None:
        import cupy

        self.rt = cupy.cuda.runtime
        self.rt.setDevice(0)
        self.stream = self.rt.streamCreateWithFlags(1)  # non-blocking, as the copier's streams

    def host(self, n: int) -> tuple[np.ndarray, int]:
        """A page-locked host buffer of n bytes (caller unregisters)."""
        buf = np.zeros(n, np.uint8)
        self.rt.hostRegister(buf.ctypes.data, n, 0)
        return buf, buf.ctypes.data

    def d2h(self, src: int, n: int) -> np.ndarray:
        buf, ptr = self.host(n)
        try:
            self.rt.memcpyAsync(ptr, src, n, 2, self.stream)
            self.rt.streamSynchronize(self.stream)
            return buf.copy()
        finally:
            self.rt.hostUnregister(ptr)

    def open(self, handle: str, offset: int, n: int, seed: int) -> dict[str, Any]:
        first = self.rt.ipcOpenMemHandle(bytes.fromhex(handle))
        try:
            exact = bool(np.array_equal(self.d2h(first + offset, n), pattern(n, seed)))
            try:
                second = self.rt.ipcOpenMemHandle(bytes.fromhex(handle))
            except Exception as exc:  # noqa: BLE001 - the answer is what this driver does
                return {"exact": exact, "second_open": f"refused: {exc}"}
            again = bool(np.array_equal(self.d2h(second + offset, n), pattern(n, seed)))
            if second != first:
                self.rt.ipcCloseMemHandle(second)
            return {"exact": exact and again, "second_open": "same pointer" if second == first else "new pointer"}
        finally:
            self.rt.ipcCloseMemHandle(first)

    def order(self, handle: str, event: str, offset: int, n: int, value: int, direction: str) -> dict[str, Any]:
        """Behind the exporter's event: read the bytes (store) or write `value` (load)."""
        base = self.rt.ipcOpenMemHandle(bytes.fromhex(handle))
        ev = self.rt.ipcOpenEventHandle(bytes.fromhex(event))
        buf, ptr = self.host(n)
        try:
            if direction == "load":
                buf[:] = value
            self.rt.streamWaitEvent(self.stream, ev, 0)
            start = time.perf_counter()
            self.rt.memcpyAsync(*((ptr, base + offset) if direction == "store" else (base + offset, ptr)), n,
                                2 if direction == "store" else 1, self.stream)
            self.rt.streamSynchronize(self.stream)
            waited = time.perf_counter() - start
            return {"waited_s": round(waited, 3), "read_after": bool((buf == value).all()) if direction == "store"
                    else None}
        finally:
            self.rt.hostUnregister(ptr)
            self.rt.eventDestroy(ev)
            self.rt.ipcCloseMemHandle(base)

    def pending(self, event: str, timeout_s: float) -> dict[str, Any]:
        """Wait, on a stream of its own (it may never drain), for an event whose process is killed meanwhile."""
        ev = self.rt.ipcOpenEventHandle(bytes.fromhex(event))
        stream = self.rt.streamCreateWithFlags(1)
        self.rt.streamWaitEvent(stream, ev, 0)
        start, ended = time.perf_counter(), "timeout"
        while time.perf_counter() - start < timeout_s:
            try:
                if self.rt.streamQuery(stream) == 0:
                    ended = "completed"
                    break
            except Exception as exc:  # noqa: BLE001 - the answer is what this driver does
                ended = f"error: {exc}"
                break
            time.sleep(0.005)
        seconds = round(time.perf_counter() - start, 3)
        self.rt.eventDestroy(ev)
        scratch = self.rt.malloc(MIB)
        try:
            usable = bool(np.array_equal(self.d2h(scratch, 16), self.d2h(scratch, 16)))
        finally:
            self.rt.free(scratch)
        return {"ended": ended, "seconds": seconds, "usable_after": usable}

    def batch(self, n_entries: int, piece: int) -> dict[str, Any]:
        """Scattered entries H2D and back by each ABI, and a copy straddling two page-locked pieces."""
        from kvtier.shm import cuda_ipc

        device = self.rt.malloc(2 * n_entries * piece)
        mapped = mmap.mmap(-1, 2 * n_entries * piece)
        host = np.frombuffer(mapped, np.uint8)
        half = len(host) // 2
        self.rt.hostRegister(host.ctypes.data, half, 0)  # two pieces, as the copier pins L1
        self.rt.hostRegister(host.ctypes.data + half, half, 0)
        out: dict[str, Any] = {}
        try:
            order = np.random.default_rng(1).permutation(2 * n_entries)[:n_entries].astype(np.uint64)
            dev_at = np.uint64(device) + order * np.uint64(piece)
            host_at = np.uint64(host.ctypes.data) + np.arange(n_entries, dtype=np.uint64) * np.uint64(piece)
            sizes = np.full(n_entries, piece, np.uint64)
            for abi in (12080, 13000):
                host[:half] = pattern(half, abi)
                try:
                    call = self._batch_call(cuda_ipc, abi)
                    call(dev_at, host_at, sizes)  # H2D
                    self.rt.streamSynchronize(self.stream)
                    host[:half] = 0
                    call(host_at, dev_at, sizes)  # D2H back
                    self.rt.streamSynchronize(self.stream)
                    out[f"abi_{abi}"] = bool(np.array_equal(host[:half], pattern(half, abi)))
                except Exception as exc:  # noqa: BLE001 - the answer is what this driver does
                    out[f"abi_{abi}"] = f"error: {exc}"[:160]
            host[:] = pattern(len(host), 7)
            at, n = half - piece // 2, piece  # across the two registrations
            self.rt.memcpyAsync(device, host.ctypes.data + at, n, 1, self.stream)
            self.rt.streamSynchronize(self.stream)
            out["straddle_memcpy"] = bool(np.array_equal(self.d2h(device, n), host[at: at + n]))
            self.rt.memset(device, 0, n)
            cuda_ipc.memcpy_batch_async(np.array([device] * 4, np.uint64) + np.arange(4, dtype=np.uint64) * (n // 4),
                                        np.uint64(host.ctypes.data + at) + np.arange(4, dtype=np.uint64) * (n // 4),
                                        np.full(4, n // 4, np.uint64), self.stream)
            self.rt.streamSynchronize(self.stream)
            out["straddle_batch"] = bool(np.array_equal(self.d2h(device, n), host[at: at + n]))
        finally:
            self.rt.hostUnregister(host.ctypes.data)
            self.rt.hostUnregister(host.ctypes.data + half)
            self.rt.free(device)
        return out

    def _batch_call(self, cuda_ipc: Any, abi: int) -> Any:
        fn, status = ctypes.c_void_p(), ctypes.c_int()
        cuda_ipc._drv("cuGetProcAddress_v2", b"cuMemcpyBatchAsync", ctypes.byref(fn), abi, 0, ctypes.byref(status))
        if not fn.value:
            raise RuntimeError(f"no cuMemcpyBatchAsync of ABI {abi}")
        attrs = cuda_ipc._MemcpyAttributes(srcAccessOrder=1)
        stream = self.stream

        def call(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
            first, failed = ctypes.c_size_t(0), ctypes.c_size_t(0)
            if abi == 12080:
                code = cuda_ipc._BATCH(fn.value)(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(dsts),
                                                 ctypes.byref(attrs), ctypes.byref(first), 1, ctypes.byref(failed),
                                                 stream)
            else:
                code = _BATCH_13(fn.value)(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(dsts),
                                           ctypes.byref(attrs), ctypes.byref(first), 1, stream)
            if code:
                raise RuntimeError(f"CUresult {code}")

        return call

    def pin(self, path: str, size: int, prefault: bool) -> dict[str, Any]:
        _, view = _map(path, size)
        if prefault:
            view[::4096] = 1
        start = time.perf_counter()
        self.rt.hostRegister(view.ctypes.data, size, 0)
        seconds = time.perf_counter() - start
        self.rt.hostUnregister(view.ctypes.data)
        return {"gbps": round(size / seconds / 1e9, 2)}

    def punch(self, path: str, size: int) -> dict[str, Any]:
        mapped, view = _map(path, size)
        view[:] = 0x33
        self.rt.hostRegister(view.ctypes.data, size, 0)
        device = self.rt.malloc(size)
        try:
            mapped.madvise(mmap.MADV_REMOVE)
            view[:] = 0x44  # new pages under the CPU's mapping
            self.rt.memcpyAsync(device, view.ctypes.data, size, 1, self.stream)
            self.rt.streamSynchronize(self.stream)
            seen = self.d2h(device, size)
            return {"gpu_reads_new_bytes": bool((seen == 0x44).all()), "gpu_reads_old_bytes": bool((seen == 0x33).all())}
        finally:
            self.rt.hostUnregister(view.ctypes.data)
            self.rt.free(device)


def importer() -> None:
    me = Importer()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = getattr(me, request.pop("op"))(**request)
        except Exception as exc:  # noqa: BLE001 - reported to the exporter, which records it
            reply = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(json.dumps(reply), flush=True)


def killed_exporter() -> None:
    """A worker process whose event stays pending behind a long kernel; it is SIGKILLed meanwhile."""
    import torch
    from kvtier.shm import cuda_ipc

    torch.cuda.set_device(0)
    event = cuda_ipc.create_event()
    torch.cuda._sleep(SLEEP_CYCLES * 10)
    cuda_ipc.record_event(event, torch.cuda.current_stream().cuda_stream)
    print(cuda_ipc.event_handle(event).hex(), flush=True)
    time.sleep(600)


# -- the exporter (this process, torch) ------------------------------------------------------------------------


class Child:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "importer"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def send(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the importer exited ({self.proc.wait()})")
        return json.loads(line)

    def ask(self, op: str, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.reply()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run(prefix: str) -> dict[str, Any]:
    """The phase's results and verdicts; its /dev/shm files are named `prefix`-pin-<i>."""
    import torch
    from kvtier.shm import cuda_ipc

    torch.cuda.set_device(0)
    alloc = torch.zeros(64 * MIB, dtype=torch.uint8, device="cuda")
    base, _ = cuda_ipc.address_range(alloc.data_ptr())
    at = alloc.data_ptr() - base + OFFSET  # from the allocation's base, as GpuMemory's offsets are
    region = alloc[OFFSET: OFFSET + SPAN]
    region.copy_(torch.from_numpy(pattern(SPAN, 3)))
    torch.cuda.synchronize()
    handle = cuda_ipc.mem_handle(base).hex()
    event = cuda_ipc.create_event()
    stream = torch.cuda.current_stream().cuda_stream
    results: dict[str, Any] = {}
    child, second = Child(), Child()
    files = [Path("/dev/shm") / f"{prefix}-pin-{i}" for i in range(2)]  # where L1 lives
    try:
        results["open"] = child.ask("open", handle=handle, offset=at, n=SPAN, seed=3)
        for direction, before, value in (("store", 0x11, 0x11), ("load", 0x11, 0x22)):
            torch.cuda._sleep(SLEEP_CYCLES)
            region.fill_(before)  # after the kernel: a copy that does not wait sees the old bytes, or is overwritten
            cuda_ipc.record_event(event, stream)
            results[f"order_{direction}"] = child.ask("order", handle=handle, event=cuda_ipc.event_handle(event).hex(),
                                                      offset=at, n=SPAN, value=value, direction=direction)
            torch.cuda.synchronize()
            if direction == "load":
                results["order_load"]["landed_after"] = bool((region == value).all().item())
        victim = subprocess.Popen([sys.executable, __file__, "exporter"], stdout=subprocess.PIPE, text=True)
        assert victim.stdout is not None
        pending_event = victim.stdout.readline().strip()
        child.send("pending", event=pending_event, timeout_s=8.0)
        time.sleep(0.3)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        results["pending"] = child.reply()
        results["batch"] = child.ask("batch", n_entries=256, piece=64 << 10)
        for path in files:
            with open(path, "wb") as f:
                f.truncate(PIN_BYTES)
        results["pin_cold"] = child.ask("pin", path=str(files[0]), size=PIN_BYTES, prefault=False)
        results["pin_prefaulted"] = child.ask("pin", path=str(files[0]), size=PIN_BYTES, prefault=True)
        child.send("pin", path=str(files[0]), size=PIN_BYTES, prefault=True)
        second.send("pin", path=str(files[1]), size=PIN_BYTES, prefault=True)
        results["pin_two_at_once"] = [child.reply(), second.reply()]
        results["punch"] = child.ask("punch", path=str(files[1]), size=64 * MIB)
    finally:
        child.close()
        second.close()
        cuda_ipc.destroy_event(event)
        for path in files:
            path.unlink(missing_ok=True)
    store, load = results["order_store"], results["order_load"]
    verdicts = {
        "offset_and_two_opens_exact": results["open"].get("exact") is True,
        "store_waits_for_kernel": store.get("read_after") is True,
        "load_lands_after_kernel": load.get("landed_after") is True,
        "importer_usable_after_kill": results["pending"].get("usable_after") is True,
        "batch_abi_used_by_kvtier_exact": results["batch"].get("abi_12080") is True,
        "straddle_exact": results["batch"].get("straddle_memcpy") is True and
        results["batch"].get("straddle_batch") is True,
    }
    return {"verdicts": verdicts, **results}


if __name__ == "__main__":
    {"importer": importer, "exporter": killed_exporter}[sys.argv[1]]()
