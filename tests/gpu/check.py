"""The GPU check: kvtier's CUDA data path on one GPU, end to end, without vLLM. Not yet run on a GPU.

tests/gpu/run.sh runs it on a machine with an NVIDIA GPU, torch and cupy (an H200 without a package registry).
It starts a real daemon (whose copier process runs server/transfer/cuda.py) and drives the worker side as a
vLLM 0.32 worker would (connector/vllm/gpu_memory.py, connector/gpu_transfers.py) on a Llama-3.1-8B-shaped KV
cache: 32 layers, 8 KV heads of 128, bf16, 16-token blocks (a 64 KiB page per layer and block, 2 MiB a block),
2112 blocks (4.1 GiB) in one int8 allocation viewed per layer as vLLM does. It prints ONE JSON summary:
- exact_<layout>: 64 chunks and a partial one stored from scattered blocks that hold a position-derived
  pattern, the blocks overwritten, the chunks loaded into other blocks and compared bit for bit, also from a
  block inside a chunk and the partial chunk alone; for LBNHC (vLLM's default) and BLHNC (block-major);
- throughput: GB/s of stores (D2H), loads (H2D) and both at once, each against one plain cudaMemcpyAsync of
  the same bytes between the same memories (the KV allocation and the L1 segment) in the same run;
- latency: p50/p99 ms of 1-, 4- and 16-chunk stores and loads;
- killed_worker: a worker process SIGKILLed while registered, and the seconds until its GPU memory is free.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import mmap
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.connector.gpu_transfers import Finished, GpuTransfers
from kvtier.server.keys import Namespace

REPO = Path(__file__).resolve().parents[2]
LAYERS, HEADS, HEAD_SIZE, BLOCK_TOKENS, BLOCKS = 32, 8, 128, 16, 2112
CONTENT = 2 * HEAD_SIZE  # K and V of one head and token, bf16 elements
PAGE_ELEMENTS = HEADS * BLOCK_TOKENS * CONTENT
BLOCK_BYTES = LAYERS * PAGE_ELEMENTS * 2
CHUNK_TOKENS = 256
CHUNK_BLOCKS = CHUNK_TOKENS // BLOCK_TOKENS
CHUNKS = 64  # one store or load of the exactness and throughput checks: 2 GiB
EVENTS = 16
LATENCY_REPS = 40
L1_GB = 8
SLACK = 512 << 20  # free GPU memory back to within this of its level before the killed worker started
DAEMON_FLAGS = ["--http-port", "0", "--l1-size-gb", str(L1_GB), "--client-timeout-s", "3", "--gpu-op-timeout-s", "30"]


def _gpu_memory_module() -> Any:
    """connector/vllm/gpu_memory.py alone: its package's __init__ imports vLLM, which this check does without."""
    spec = importlib.util.spec_from_file_location("kvtier_gpu_memory", REPO / "connector" / "vllm" / "gpu_memory.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_memory = _gpu_memory_module()


def vllm_views(buf: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    """vLLM 0.32's per-layer [B, H, N, C] views of one allocation (v1/kv_cache_interface.py)."""
    shape = {"L": LAYERS, "B": BLOCKS, "H": HEADS, "N": BLOCK_TOKENS, "C": CONTENT * 2}
    strides, step = {}, 1
    for dim in reversed(layout):
        strides[dim] = step
        step *= shape[dim]
    view = torch.as_strided(buf, [shape[d] for d in "LBHNC"], [strides[d] for d in "LBHNC"])
    return {f"model.layers.{layer}.self_attn.attn": view[layer].view(torch.bfloat16) for layer in range(LAYERS)}


def prompt(seed: int, tokens: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, tokens).tolist()


def pattern(seed: int, positions: list[int], layer: int) -> torch.Tensor:
    """int16 pages derived from (seed, block position in the prompt, layer): the same KV wherever it sits; two
    positions or layers differ in every element (odd multipliers modulo 2**16)."""
    pos = torch.tensor(positions, dtype=torch.int64, device="cuda")[:, None]
    index = torch.arange(PAGE_ELEMENTS, dtype=torch.int64, device="cuda")[None, :]
    x = (pos * 1_000_003 + index * 7_919 + (seed * 64 + layer) * 104_729) & 0xFFFF
    return (x - 32768).to(torch.int16).view(len(positions), HEADS, BLOCK_TOKENS, CONTENT)


def percentiles(seconds: list[float]) -> dict[str, float]:
    return {"p50_ms": round(float(np.percentile(seconds, 50)) * 1e3, 3),
            "p99_ms": round(float(np.percentile(seconds, 99)) * 1e3, 3)}


class Daemon:
    def __init__(self, work: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.segment_path = Path("/dev/shm") / f"kvtier-gpu-check-{os.getpid()}"
        self.log_path = work / "daemon.log"
        command = [sys.executable, "-m", "kvtier.server.cli", "server", "--port", str(self.port), "--shm-name",
                   self.segment_path.name, "--no-l1-adopt", *DAEMON_FLAGS]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while "kvtier server ready" not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not start:\n{self.tail()}")
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class Worker:
    """A vLLM-like GPU worker: its KV allocation, registered through GpuTransfers."""

    def __init__(self, url: str, layout: str) -> None:
        self.buf = torch.zeros(BLOCKS * BLOCK_BYTES, dtype=torch.int8, device="cuda")
        kv = vllm_views(self.buf, layout)
        self.pages = [view.view(torch.int16) for view in kv.values()]
        self.memory, self.events = gpu_memory.export(kv, EVENTS, layout)
        self.client = KVTierClient(ClientConfig(url=url, connect_timeout_s=10.0, request_timeout_s=60.0,
                                                retry_backoff_s=0.2))
        if not self.client.connect():
            raise RuntimeError(f"cannot reach the daemon at {url}")
        self.transfers = GpuTransfers(self.client, self.memory, self.events)
        self.ns = Namespace(model="llama-3.1-8b-shape", dtype="bfloat16", num_layers=LAYERS, kv_heads=HEADS,
                            head_size=HEAD_SIZE, block_size=BLOCK_TOKENS, layout=f"vllm-cuda-{layout}",
                            chunk_size=CHUNK_TOKENS)

    def fill(self, block_ids: list[int], seed: int) -> None:
        ids = torch.tensor(block_ids, device="cuda")
        for layer, page in enumerate(self.pages):
            page[ids] = pattern(seed, list(range(len(block_ids))), layer)

    def holds(self, block_ids: list[int], seed: int, positions: range) -> bool:
        ids = torch.tensor([block_ids[i] for i in positions], device="cuda")
        return all(torch.equal(page[ids], pattern(seed, list(positions), layer)) for layer, page in enumerate(self.pages))

    def scramble(self, block_ids: list[int]) -> None:
        ids = torch.tensor(block_ids, device="cuda")
        for page in self.pages:
            page[ids] = -1

    def run(self, *ops: tuple[str, tuple]) -> tuple[float, list[Finished]]:
        """Send ("store", (tokens, block_ids)) and ("load", (tokens, block_ids, first, end)) operations without
        waiting, then wait for every reply: the seconds it took and the outcomes, in order."""
        start = time.perf_counter()
        for kind, args in ops:
            send = self.transfers.store if kind == "store" else self.transfers.load
            if not send(kind, self.ns, *args):
                raise RuntimeError(f"{kind} not sent: {self.transfers.unavailable or 'the daemon is unreachable'}")
        done = self.transfers.poll(wait=True)
        return time.perf_counter() - start, done

    def timed(self, *ops: tuple[str, tuple]) -> float:
        """Seconds of operations that must all succeed, on a GPU with nothing else queued."""
        torch.cuda.synchronize()
        seconds, done = self.run(*ops)
        failed = [d for d in done if not d.ok]
        if failed:
            raise RuntimeError(f"operations failed: {failed}")
        return seconds

    def until_pinned(self, timeout_s: float = 180.0) -> float:
        """Seconds until a first store succeeds (the copier page-locks L1 first: not_pinned until then)."""
        start = time.perf_counter()
        while True:
            _, (done,) = self.run(("store", (prompt(1 << 20, CHUNK_TOKENS), list(range(CHUNK_BLOCKS)))))
            if done.ok:
                return time.perf_counter() - start
            if done.reason != "not_pinned" or time.perf_counter() - start > timeout_s:
                raise RuntimeError(f"the first store failed: {done.reason}")
            time.sleep(0.5)


def exactness(worker: Worker, seed: int) -> dict[str, bool]:
    ids = np.random.default_rng(seed).permutation(BLOCKS).tolist()
    n = CHUNKS * CHUNK_BLOCKS + 5  # 64 whole chunks and a partial one of 5 blocks
    src, dst, spare = ids[:n], ids[n : 2 * n], ids[2 * n :]
    tokens = prompt(seed, n * BLOCK_TOKENS)
    worker.fill(src, seed)  # no synchronize: the copy must wait for the event recorded after these writes
    _, (stored,) = worker.run(("store", (tokens, src)))
    worker.scramble(src)
    worker.scramble(dst)
    _, (loaded,) = worker.run(("load", (tokens, dst, 0, n)))
    lo, hi = 2 * CHUNK_BLOCKS + 5, 3 * CHUNK_BLOCKS + 7  # from inside chunk 2 to inside chunk 3
    inner_ids = [0] * lo + spare[: hi - lo]
    _, (inner,) = worker.run(("load", (tokens, inner_ids, lo, hi)))
    tail_ids = [0] * (n - 5) + spare[hi - lo : hi - lo + 5]
    _, (tail,) = worker.run(("load", (tokens, tail_ids, n - 5, n)))
    return {"stored": stored.ok, "loaded": loaded.ok and worker.holds(dst, seed, range(n)),
            "inside_a_chunk": inner.ok and worker.holds(inner_ids, seed, range(lo, hi)),
            "partial_chunk": tail.ok and worker.holds(tail_ids, seed, range(n - 5, n))}


def raw_copies(worker: Worker, daemon: Daemon, nbytes: int) -> dict[str, float]:
    """GB/s of one cudaMemcpyAsync of `nbytes` each way (and both at once on two streams) between the KV
    allocation and the L1 segment, page-locked in this process for it; run before the checks store anything,
    as it writes into L1 (only the warm-up chunk, never read, may be there). The segment stays mapped here."""
    fd = os.open(daemon.segment_path, os.O_RDWR)
    try:
        host = torch.frombuffer(mmap.mmap(fd, 2 * nbytes), dtype=torch.uint8)
    finally:
        os.close(fd)
    cudart = torch.cuda.cudart()
    status = cudart.cudaHostRegister(host.data_ptr(), host.nbytes, 0)
    if int(getattr(status, "value", status)):
        raise RuntimeError(f"cudaHostRegister of the L1 segment: {status}")
    device = worker.buf.view(torch.uint8)[: 2 * nbytes]
    streams = torch.cuda.Stream(), torch.cuda.Stream()

    def gbps(*copies: tuple[torch.Tensor, torch.Tensor]) -> float:
        seconds = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for (dst, src), stream in zip(copies, streams, strict=False):
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        return len(copies) * nbytes / statistics.median(seconds) / 1e9

    try:
        both = gbps((host[:nbytes], device[:nbytes]), (device[nbytes:], host[nbytes:]))
        return {"d2h": round(gbps((host[:nbytes], device[:nbytes])), 2),
                "h2d": round(gbps((device[:nbytes], host[:nbytes])), 2), "both": round(both, 2)}
    finally:
        cudart.cudaHostUnregister(host.data_ptr())


def throughput(worker: Worker, raw: dict[str, float], seed: int) -> dict[str, dict[str, float]]:
    n = CHUNKS * CHUNK_BLOCKS
    nbytes = n * BLOCK_BYTES
    ids = np.random.default_rng(seed).permutation(BLOCKS).tolist()
    src, dst = ids[:n], ids[n : 2 * n]
    stored = [prompt(seed + i, n * BLOCK_TOKENS) for i in range(6)]
    d2h = [worker.timed(("store", (tokens, src))) for tokens in stored[:3]]
    h2d = [worker.timed(("load", (stored[2], dst, 0, n))) for _ in range(3)]
    # the load first, so that the store's room-making cannot evict what it is about to read
    both = [worker.timed(("load", (stored[2], dst, 0, n)), ("store", (tokens, src))) for tokens in stored[3:]]
    out = {}
    for name, seconds, moved in [("d2h", d2h, nbytes), ("h2d", h2d, nbytes), ("both", both, 2 * nbytes)]:
        kvtier = moved / statistics.median(seconds) / 1e9
        out[name] = {"kvtier_gbps": round(kvtier, 2), "ratio_to_raw": round(kvtier / raw[name], 3)}
    return out


def latency(worker: Worker, seed: int) -> dict[str, dict[str, dict[str, float]]]:
    ids = np.random.default_rng(seed).permutation(BLOCKS).tolist()
    out = {}
    for chunks in (1, 4, 16):
        n = chunks * CHUNK_BLOCKS
        prompts = [prompt(seed + chunks * 1000 + i, n * BLOCK_TOKENS) for i in range(LATENCY_REPS)]
        stores = [worker.timed(("store", (tokens, ids[:n]))) for tokens in prompts]
        loads = [worker.timed(("load", (prompts[-1], ids[n : 2 * n], 0, n))) for _ in prompts]
        out[f"{chunks}_chunks"] = {"store": percentiles(stores), "load": percentiles(loads)}
    return out


def killed_worker(url: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """A worker process registers and stores, then dies by SIGKILL: its memory stays mapped by the copier until
    the daemon drops the silent client and closes the registration."""
    free_before = torch.cuda.mem_get_info()[0]
    victim = subprocess.Popen([sys.executable, __file__, "--victim", url], stdout=subprocess.PIPE, text=True)
    try:
        ready = select.select([victim.stdout], [], [], 120)[0]
        line = victim.stdout.readline() if ready else ""
        if not json.loads(line or "{}").get("stored"):
            raise RuntimeError(f"the worker did not store: {line!r}")
        held = free_before - torch.cuda.mem_get_info()[0]
        victim.kill()
        victim.wait()
        killed = time.perf_counter()
        time.sleep(0.2)
        held_after_kill = free_before - torch.cuda.mem_get_info()[0]
        freed = None
        while freed is None and time.perf_counter() - killed < timeout_s:
            if torch.cuda.mem_get_info()[0] >= free_before - SLACK:
                freed = round(time.perf_counter() - killed, 2)
            time.sleep(0.1)
        return {"held_gib": round(held / 2**30, 2), "held_after_kill_gib": round(held_after_kill / 2**30, 2),
                "freed_after_s": freed}
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()


def victim(url: str) -> None:
    worker = Worker(url, "LBNHC")
    worker.fill(list(range(CHUNK_BLOCKS)), 7)
    _, (done,) = worker.run(("store", (prompt(1 << 21, CHUNK_TOKENS), list(range(CHUNK_BLOCKS)))))
    print(json.dumps({"stored": done.ok, "reason": done.reason}), flush=True)
    time.sleep(600)


def check(work: Path) -> dict[str, Any]:
    summary: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                               "cuda": torch.version.cuda, "errors": {}}
    started = time.perf_counter()
    workers: dict[str, Worker] = {}

    def phase(name: str, fn: Callable[[], Any]) -> None:
        try:
            summary[name] = fn()
        except Exception:
            summary["errors"][name] = traceback.format_exc(limit=6)[-2000:]

    def ready(layout: str) -> float:
        workers[layout] = Worker(daemon.url, layout)
        return round(workers[layout].until_pinned(), 2)

    daemon = Daemon(work)
    try:
        phase("ready_s_LBNHC", lambda: ready("LBNHC"))
        if "LBNHC" in workers:
            a = workers["LBNHC"]
            phase("raw_gbps", lambda: raw_copies(a, daemon, CHUNKS * CHUNK_BLOCKS * BLOCK_BYTES))
            phase("exact_LBNHC", lambda: exactness(a, 1))
            if "raw_gbps" in summary:
                phase("throughput", lambda: throughput(a, summary["raw_gbps"], 100))
            phase("latency", lambda: latency(a, 10_000))
        phase("ready_s_BLHNC", lambda: ready("BLHNC"))
        if "BLHNC" in workers:
            phase("exact_BLHNC", lambda: exactness(workers["BLHNC"], 2))
        phase("killed_worker", lambda: killed_worker(daemon.url))
        if "LBNHC" in workers:
            phase("store_after_kill", lambda: workers["LBNHC"].timed(
                ("store", (prompt(1 << 22, CHUNK_TOKENS), list(range(CHUNK_BLOCKS))))) > 0)
    finally:
        daemon.stop()
        summary["seconds"] = round(time.perf_counter() - started, 1)
    exact = [summary.get(f"exact_{layout}", {}) for layout in ("LBNHC", "BLHNC")]
    summary["ok"] = (not summary["errors"] and all(e and all(e.values()) for e in exact)
                     and summary.get("killed_worker", {}).get("freed_after_s") is not None)
    if summary["errors"]:
        summary["daemon_log_tail"] = daemon.tail()
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="a directory for the daemon's log")
    parser.add_argument("--victim", help="(internal) be the worker that is killed, registered at this url")
    args = parser.parse_args()
    torch.cuda.set_device(0)
    if args.victim:
        victim(args.victim)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    print(json.dumps(check(args.work)), flush=True)


if __name__ == "__main__":
    main()
