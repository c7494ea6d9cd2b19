"""The device check: kvtier's GPU data path settled in one run (tests/gpu/run.sh starts it on a GPU machine).

Phases, each written to the JSON summary (--out) as soon as it ends, then a one-screen table:
1. environment: versions, GPU, PCIe link (nvidia-smi), /dev/shm size (remounted larger when too small);
2. primitives: CUDA IPC between two processes (tests/gpu/primitives.py); skipped in rehearsal;
3. end_to_end: a real `kvtier server` and its copier process, a worker registered through
   connector/gpu_transfers.py, over each layout vLLM 0.32 produces (tests/gpu/layouts.json, made by vLLM's own
   allocation code): whole and partial chunks stored from scattered blocks, checked in L1 as a CPU engine
   reads them, loaded bit-exact into other blocks, from inside a chunk, the partial chunk alone and one block
   alone (on the two-layer layout: the copier's per-entry path; every other op: its batched one); a
   kernel-split layout regrouped bit-exact or refused; then the copier SIGKILLed during a large load, with canary pattern in every other block; then a
   worker idle past the server's client timeout;
4. performance: stores (D2H), loads (H2D) and both at once against one plain copy of the same bytes between
   the same memories in the same run (cudaMemcpyAsync; in rehearsal a numpy copy), µs per entry, p50/p99 ms
   of one-chunk ops.
Rehearsal (--rehearse, automatic without CUDA): the same on CPU with `kvtier server --gpu-fake-engine` (its
copier runs server/transfer/fake.py) and the layouts' small size; every figure is the CPU stand-in's.

    python tests/gpu/check.py [--rehearse] [--out summary.json] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from kv import KV, CudaKV, FakeKV, Layout
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.connector.gpu_transfers import Finished, GpuTransfers
from kvtier.connector.results import ReadChunk
from kvtier.server.keys import Namespace

HERE = Path(__file__).resolve().parent
MIN_SHM = 16 << 30  # /dev/shm smaller than this is remounted (GPU run: 8 GiB of L1 and the check's maps)
CLIENT_TIMEOUT_S = 2.0  # the server retires clients silent this long: the idle worker sleeps past it
REPS = 3  # timed repetitions of each throughput op
SHM_PREFIX = f"kvtier-gpu-check-{os.getpid()}"  # of every /dev/shm file the run makes (run.sh removes them)
LATENCY_REPS = 30


class Mode:
    """What differs between the GPU run and its CPU rehearsal."""

    def __init__(self, rehearse: bool) -> None:
        self.rehearse = rehearse
        self.size = "rehearse" if rehearse else "gpu"
        self.l1_gb = 0.25 if rehearse else 8.0
        fake = ["--gpu-fake-engine", "--gpu-pin-piece-mb", "4", "--page-size-kb", "16"] if rehearse else []
        self.daemon_flags = ["--http-port", "0", "--l1-size-gb", str(self.l1_gb), "--client-timeout-s",
                             str(CLIENT_TIMEOUT_S), "--gpu-op-timeout-s", "30", *fake]
        self.max_chunks = 64  # of one exactness or throughput op: 2 GiB of Llama-8B KV on the GPU

    def kv(self, layout: Layout) -> KV:
        return FakeKV(layout, SHM_PREFIX) if self.rehearse else CudaKV(layout)

    def chunk_blocks(self, layout: Layout) -> int:
        return 4 if self.rehearse else max(4, 256 // layout.block_tokens)

    def sync(self) -> None:
        if not self.rehearse:
            import torch

            torch.cuda.synchronize()


def prompt(seed: int, tokens: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, tokens).tolist()


def percentiles(seconds: list[float]) -> dict[str, float]:
    return {"p50_ms": round(float(np.percentile(seconds, 50)) * 1e3, 3),
            "p99_ms": round(float(np.percentile(seconds, 99)) * 1e3, 3)}


class Daemon:
    def __init__(self, work: Path, mode: Mode) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.segment_path = Path("/dev/shm") / f"{SHM_PREFIX}-l1"
        self.log_path = work / "daemon.log"
        command = [sys.executable, "-m", "kvtier.server.cli", "server", "--port", str(self.port), "--shm-name",
                   self.segment_path.name, "--no-l1-adopt", *mode.daemon_flags]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        # should this process die first, run.sh ends the daemon's process group and removes the /dev/shm files
        (work / "daemon.pid").write_text(str(self.proc.pid))
        (work / "shm_prefix").write_text(SHM_PREFIX)
        deadline = time.monotonic() + 60
        while "kvtier server ready" not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not start:\n{self.tail()}")
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def copier_pids(self, device: str) -> list[int]:
        """The daemon's copier processes of `device` (children running kvtier.server.transfer.copier)."""
        pids = []
        for proc in Path("/proc").iterdir():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
                if (b"kvtier.server.transfer.copier" in argv and device.encode() in argv
                        and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == self.proc.pid):
                    pids.append(int(proc.name))
            except (OSError, IndexError, ValueError):
                continue
        return pids

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class Worker:
    """A GPU worker on one layout: its KV, registered through GpuTransfers' keeper thread (which heartbeats)."""

    def __init__(self, url: str, mode: Mode, layout: Layout) -> None:
        self.mode = mode
        self.kv = mode.kv(layout)
        self.chunk_blocks = mode.chunk_blocks(layout)
        self.client = KVTierClient(ClientConfig(url=url, connect_timeout_s=10.0, request_timeout_s=60.0,
                                                retry_backoff_s=0.2))
        if not self.client.connect():
            raise RuntimeError(f"cannot reach the daemon at {url}")
        self.transfers = GpuTransfers(self.client, self.kv.memory, self.kv.events)
        self.transfers.start()
        deadline = time.monotonic() + 120
        while not self.transfers.registered:
            if time.monotonic() > deadline:
                raise RuntimeError(f"not registered: {self.transfers.unavailable or 'no reply'}")
            time.sleep(0.05)
        self.ns = Namespace(model=f"gpu-check-{layout.case}", dtype=layout.dtype, num_layers=len(layout.layer_offsets),
                            kv_heads=layout.kv_heads, head_size=layout.head_size, block_size=layout.block_tokens,
                            layout=f"vllm-{self.kv.memory.engine}-{layout.layout}",
                            chunk_size=self.chunk_blocks * layout.block_tokens)

    def tokens(self, seed: int, blocks: int) -> list[int]:
        return prompt(seed, blocks * self.kv.layout.block_tokens)

    def send(self, kind: str, tokens: list[int], block_ids: list[int], first: int = 0, end: int = 0) -> None:
        if kind == "store":
            sent = self.transfers.store(kind, self.ns, tokens, block_ids)
        else:
            sent = self.transfers.load(kind, self.ns, tokens, block_ids, first, end)
        if sent is None:
            raise RuntimeError(f"{kind} not sent: {self.transfers.unavailable or 'the daemon is unreachable'}")

    def run(self, *ops: tuple[Any, ...]) -> tuple[float, list[Finished]]:
        """Send ("store", tokens, block_ids) and ("load", tokens, block_ids, first, end) ops without waiting,
        then wait for every reply: the seconds it took and the outcomes, in order."""
        start = time.perf_counter()
        for op in ops:
            self.send(*op)
        done = self.transfers.poll(wait=True)
        return time.perf_counter() - start, done

    def until_ok(self, *op: Any, timeout_s: float = 180.0) -> Finished:
        """One op, sent again while the copier is still page-locking L1 (not_pinned)."""
        start = time.monotonic()
        while True:
            _, (done,) = self.run(op)
            if done.ok or done.reason != "not_pinned" or time.monotonic() - start > timeout_s:
                return done
            time.sleep(0.2)

    def timed(self, *ops: tuple[Any, ...]) -> float:
        """Seconds of ops that must all succeed, with nothing else queued."""
        self.mode.sync()
        seconds, done = self.run(*ops)
        if failed := [d for d in done if not d.ok]:
            raise RuntimeError(f"operations failed: {failed}")
        return seconds

    def l1_as_vllm_lays_it(self, tokens: list[int], block_ids: list[int], chunks: list[int]) -> bool:
        """Whether stored `chunks` (indices) of `tokens` hold, as a CPU engine reads them from L1, the pages of
        `block_ids` as vLLM's views place them: layer-major (block-major for block-outer layouts), the
        order every engine of the namespace must share."""
        got: dict[int, np.ndarray] = {}

        def read(rc: ReadChunk) -> None:
            buf = np.empty(rc.span.size, np.uint8)
            rc.span.read(0, buf)
            got[rc.chunk.start_token // self.ns.chunk_size] = buf

        self.client.read_prefix(self.ns, tokens, read)  # acquire, as a load does (no lookup)
        layers, cb = range(len(self.kv.layout.layer_offsets)), self.chunk_blocks
        for c in chunks:
            ids = block_ids[c * cb: (c + 1) * cb]
            order = ([(layer, b) for b in ids for layer in layers] if self.kv.layout.layout.startswith("B")
                     else [(layer, b) for layer in layers for b in ids])
            pages = [self.kv.page(layer, b) for layer, b in order]
            if c not in got or not np.array_equal(got[c], np.concatenate(pages)):
                return False
        return True

    def close(self) -> None:
        self.transfers.close()
        self.client.close()
        self.kv.close()


def environment(mode: Mode) -> dict[str, Any]:
    out: dict[str, Any] = {"python": sys.version.split()[0], "numpy": np.__version__}
    shm = shutil.disk_usage("/dev/shm").total
    if shm < MIN_SHM and not mode.rehearse:
        done = subprocess.run(["mount", "-o", f"remount,size={MIN_SHM >> 30}G", "/dev/shm"], capture_output=True,
                              text=True)
        out["shm_remount"] = done.returncode == 0 or done.stderr.strip()
        shm = shutil.disk_usage("/dev/shm").total
    out["shm_gib"] = round(shm / 2**30, 1)
    if mode.rehearse:
        return out
    import cupy
    import torch

    out.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cupy=cupy.__version__,
               gpu=torch.cuda.get_device_name(0))
    if shutil.which("nvidia-smi"):
        query = "driver_version,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max"
        done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                              text=True)
        out["nvidia_smi"] = done.stdout.strip().splitlines()[0] if done.returncode == 0 else done.stderr.strip()
    return out


def exactness(w: Worker, seed: int, max_chunks: int) -> dict[str, Any]:
    """Whole chunks and a partial one stored from scattered blocks, loaded into other blocks; then from inside a
    chunk, and the partial chunk alone. True where every byte is where vLLM's views say it must be."""
    cb, blocks = w.chunk_blocks, w.kv.layout.num_blocks
    part, spare_need = cb // 2 + 1, cb + 1 + cb // 2 + 1 + 1
    chunks = min(max_chunks, (blocks - spare_need - 2 * part) // (2 * cb))
    if chunks < 3:
        raise RuntimeError(f"{blocks} blocks are too few for 3 chunks of {cb} twice")
    n = chunks * cb + part
    ids = np.random.default_rng(seed).permutation(blocks).tolist()
    src, dst, spare = ids[:n], ids[n: 2 * n], ids[2 * n:]
    tokens = w.tokens(seed, n)
    w.kv.fill(src, seed)  # no synchronize: the copy must wait for the event recorded after these writes
    stored = w.until_ok("store", tokens, src)
    w.mode.sync()
    in_l1 = stored.ok and w.l1_as_vllm_lays_it(tokens, src, [0, chunks])  # the first and the partial chunk
    w.kv.scramble(src + dst)
    _, (loaded,) = w.run(("load", tokens, dst, 0, n))
    lo, hi = cb + 1, 2 * cb + 2  # from inside chunk 1 to inside chunk 2
    inner = [0] * lo + spare[: hi - lo]
    _, (inside,) = w.run(("load", tokens, inner, lo, hi))
    tail = [0] * (n - part) + spare[hi - lo: hi - lo + part]
    _, (partial,) = w.run(("load", tokens, tail, n - part, n))
    one = [0] * (n - 1) + [spare[hi - lo + part]]  # one copy entry per layer: per-entry below 4 (cuda.py)
    _, (single,) = w.run(("load", tokens, one, n - 1, n))
    w.mode.sync()
    # a fact, not a verdict: lookups answer misses until the server has heard that the copier pinned L1
    promised = sum(w.client.lookup(w.ns, tokens).matches)
    return {"blocks": n, "lookup_promised": promised, "stored": stored.ok, "l1_as_vllm_lays_it": in_l1,
            "loaded": loaded.ok and w.kv.holds(dst, seed, list(range(n))),
            "inside_a_chunk": inside.ok and w.kv.holds(inner[lo:], seed, list(range(lo, hi))),
            "partial_chunk": partial.ok and w.kv.holds(tail[n - part:], seed, list(range(n - part, n))),
            "one_block": single.ok and w.kv.holds(one[n - 1:], seed, [n - 1])}


def copier_killed(daemon: Daemon, w: Worker, seed: int, max_chunks: int) -> dict[str, Any]:
    """The copier SIGKILLed while a large load is under way: every block outside the load keeps its canary;
    the load is either reported failed or bit-exact; a load after the copier's replacement is bit-exact."""
    cb, blocks = w.chunk_blocks, w.kv.layout.num_blocks
    n = min(max_chunks, blocks // (2 * cb)) * cb
    ids = np.random.default_rng(seed).permutation(blocks).tolist()
    src, dst = ids[:n], ids[n: 2 * n]
    others = sorted(set(range(blocks)) - set(dst))
    tokens = w.tokens(seed, n)
    w.kv.fill(src, seed)
    stored = w.until_ok("store", tokens, src)
    w.kv.fill(others, seed + 1, positions=others)  # each block its own canary
    w.kv.scramble(dst)
    (copier,) = daemon.copier_pids(w.kv.memory.device)
    w.mode.sync()
    w.send("load", tokens, dst, 0, n)
    time.sleep(0 if w.mode.rehearse else 0.005)  # a 2 GiB load takes ~50 ms on an H200
    os.kill(copier, signal.SIGKILL)
    (during,) = w.transfers.poll(wait=True)
    w.mode.sync()
    canaries = w.kv.holds(others, seed + 1, others)
    during_exact = w.kv.holds(dst, seed, list(range(n)))
    w.kv.scramble(dst)
    after = w.until_ok("load", tokens, dst, 0, n)
    w.mode.sync()
    return {"blocks": n, "stored": stored.ok, "load_during_kill": "ok" if during.ok else during.reason,
            "consistent": during_exact if during.ok else True, "canaries_intact": canaries,
            "copier_replaced": daemon.copier_pids(w.kv.memory.device) not in ([], [copier]),
            "load_after_exact": after.ok and w.kv.holds(dst, seed, list(range(n)))}


def idle_worker(w: Worker, seed: int) -> dict[str, Any]:
    """A registered worker idle past the server's client timeout loads bit-exact at once."""
    cb = w.chunk_blocks
    src, dst = list(range(cb)), list(range(cb, 2 * cb))
    tokens = w.tokens(seed, cb)
    w.kv.fill(src, seed)
    stored = w.until_ok("store", tokens, src)
    time.sleep(CLIENT_TIMEOUT_S * 1.75)
    _, (loaded,) = w.run(("load", tokens, dst, 0, cb))
    w.mode.sync()
    return {"idle_s": CLIENT_TIMEOUT_S * 1.75, "stored": stored.ok, "load": "ok" if loaded.ok else loaded.reason,
            "exact": loaded.ok and w.kv.holds(dst, seed, list(range(cb)))}


def reference(daemon: Daemon, w: Worker, nbytes: int) -> dict[str, float]:
    """Seconds of one plain copy of `nbytes` each way and both at once between the KV allocation and the tail of
    the L1 segment (written over: run after every kvtier op of the run)."""
    size = daemon.segment_path.stat().st_size
    fd = os.open(daemon.segment_path, os.O_RDWR)
    try:
        mapped = mmap.mmap(fd, 2 * nbytes, offset=(size - 2 * nbytes) // mmap.ALLOCATIONGRANULARITY
                           * mmap.ALLOCATIONGRANULARITY)
    finally:
        os.close(fd)
    if w.mode.rehearse:
        host = np.frombuffer(mapped, np.uint8)
        device = w.kv.device.data[: 2 * nbytes]

        def copies(*pairs: tuple[Any, Any]) -> float:
            start = time.perf_counter()
            for dst, src in pairs:
                np.copyto(dst, src)
            return time.perf_counter() - start

        return _best(copies, host, device, nbytes)
    import torch

    host = torch.frombuffer(mapped, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    status = cudart.cudaHostRegister(host.data_ptr(), host.nbytes, 0)
    if int(getattr(status, "value", status)):
        raise RuntimeError(f"cudaHostRegister of the L1 segment: {status}")
    device = w.kv.raw[: 2 * nbytes]
    streams = torch.cuda.Stream(), torch.cuda.Stream()

    def cuda_copies(*pairs: tuple[Any, Any]) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for (dst, src), stream in zip(pairs, streams, strict=False):
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    try:
        return _best(cuda_copies, host, device, nbytes)
    finally:
        cudart.cudaHostUnregister(host.data_ptr())


def _best(copies: Callable[..., float], host: Any, device: Any, nbytes: int) -> dict[str, float]:
    """Median seconds of REPS runs of each direction and both at once."""
    d2h = (host[:nbytes], device[:nbytes])
    h2d = (device[nbytes:], host[nbytes:])
    return {name: float(np.median([copies(*pairs) for _ in range(REPS)]))
            for name, pairs in (("d2h", [d2h]), ("h2d", [h2d]), ("both", [d2h, h2d]))}


def performance(daemon: Daemon, w: Worker, seed: int, max_chunks: int) -> dict[str, Any]:
    cb, blocks, layout = w.chunk_blocks, w.kv.layout.num_blocks, w.kv.layout
    n = min(max_chunks, blocks // (2 * cb)) * cb
    nbytes = n * len(layout.layer_offsets) * layout.page_bytes
    entries = n * len(layout.layer_offsets) * w.kv.memory.runs  # before the server merges adjacent ones
    ids = np.random.default_rng(seed).permutation(blocks).tolist()
    src, dst = ids[:n], ids[n: 2 * n]
    stored = [w.tokens(seed + i, n) for i in range(2 * REPS)]
    w.until_ok("store", stored[0], src)
    d2h = [w.timed(("store", tokens, src)) for tokens in stored[1: REPS + 1]]
    h2d = [w.timed(("load", stored[REPS], dst, 0, n)) for _ in range(REPS)]
    # the load first, so that the store's room-making cannot evict what it is about to read
    both = [w.timed(("load", stored[REPS], dst, 0, n), ("store", tokens, src)) for tokens in stored[REPS + 1:]]
    one = [w.tokens(seed + 100 + i, cb) for i in range(LATENCY_REPS)]
    store_s = [w.timed(("store", tokens, src[:cb])) for tokens in one]
    load_s = [w.timed(("load", one[-1], dst[:cb], 0, cb)) for _ in one]
    plain = reference(daemon, w, nbytes)
    out: dict[str, Any] = {"case": layout.case, "mib_per_op": round(nbytes / 2**20, 1), "entries_per_op": entries}
    for name, seconds, moved in (("d2h", d2h, nbytes), ("h2d", h2d, nbytes), ("both", both, 2 * nbytes)):
        median = float(np.median(seconds))
        out[name] = {"kvtier_gbps": round(moved / median / 1e9, 2), "plain_gbps": round(moved / plain[name] / 1e9, 2),
                     "ratio": round(plain[name] / median, 3),
                     "us_per_entry": round(median * 1e6 / (entries * (2 if name == "both" else 1)), 3)}
    out["one_chunk"] = {"store": percentiles(store_s), "load": percentiles(load_s)}
    return out


def end_to_end(daemon: Daemon, mode: Mode, layouts: dict[str, Layout], workers: dict[str, Worker]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for seed, (case, layout) in enumerate(layouts.items(), start=1):
        try:
            workers[case] = Worker(daemon.url, mode, layout)
        except ValueError as exc:  # kvtier refuses these views
            out[case] = {"refused": str(exc)[:160]}
            continue
        out[case] = exactness(workers[case], seed, mode.max_chunks)
        if case != "nhd":  # nhd's worker serves the phases after this one
            workers.pop(case).close()
    nhd = workers["nhd"]
    out["copier_killed"] = copier_killed(daemon, nhd, 50, mode.max_chunks)
    idle = Worker(daemon.url, mode, layouts["fp8"])
    try:
        out["idle_worker"] = idle_worker(idle, 60)
    finally:
        idle.close()
    return out


def e2e_ok(result: dict[str, Any]) -> bool:
    """Every round trip bit-exact; a split case regrouped bit-exact or refused; nothing else refused."""
    for case, checks in result.items():
        if case == "copier_killed":
            keys = ("stored", "consistent", "canaries_intact", "copier_replaced", "load_after_exact")
        elif case == "idle_worker":
            keys = ("stored", "exact")
        elif "refused" in checks:
            if not case.startswith("split"):
                return False
            continue
        else:
            keys = ("stored", "l1_as_vllm_lays_it", "loaded", "inside_a_chunk", "partial_chunk", "one_block")
        if not all(checks[k] is True for k in keys):
            return False
    return True


def table(summary: dict[str, Any]) -> str:
    """One screen: each phase's verdict, each layout's round trips, throughput against the plain copy."""
    label = "CPU REHEARSAL (fake engine; figures are not a GPU's)" if summary["rehearse"] else summary["env"].get("gpu")
    lines = [f"kvtier device check: {label}", f"{'phase':<14}{'verdict':<10}detail"]
    env = summary.get("env", {})
    lines.append(f"{'environment':<14}{'ok' if 'env' in summary else 'FAILED':<10}shm {env.get('shm_gib')} GiB "
                 f"{env.get('nvidia_smi', '')}")
    prim = summary.get("primitives", {})
    failed = [k for k, v in prim.get("verdicts", {}).items() if not v]
    pins = [prim.get(k, {}).get("gbps") for k in ("pin_cold", "pin_prefaulted")]
    lines.append(f"{'primitives':<14}{_verdict(summary, 'primitives'):<10}"
                 + (f"{len(prim['verdicts']) - len(failed)}/{len(prim['verdicts'])} ok "
                    f"{'FAILED: ' + ','.join(failed) if failed else ''} pin GB/s cold/prefaulted {pins}"[:66]
                    if prim else ""))
    if prim:
        lines.append(f"  killed exporter's pending event: {prim['pending'].get('ended')}; MADV_REMOVE: GPU reads "
                     f"{'new' if prim['punch'].get('gpu_reads_new_bytes') else 'old/other'} bytes")
    lines.append(f"{'end_to_end':<14}{_verdict(summary, 'end_to_end'):<10}")
    for case, checks in summary.get("end_to_end", {}).items():
        verdicts = {k: v for k, v in checks.items() if isinstance(v, bool)}
        failed = [k for k, v in verdicts.items() if not v]
        facts = " ".join(f"{k}={v}" for k, v in checks.items() if not isinstance(v, bool))
        shown = ("refused (kvtier's verdict): " + checks["refused"] if "refused" in checks else
                 f"{len(verdicts) - len(failed)}/{len(verdicts)} bit-exact/ok"
                 f"{' FAILED: ' + ','.join(failed) if failed else ''} {facts}")
        lines.append(f"  {case:<14}{shown[:64]}")
    lines.append(f"{'performance':<14}{_verdict(summary, 'performance'):<10}")
    perf = summary.get("performance", {})
    if perf:
        lines.append(f"  {perf['mib_per_op']} MiB/op, {perf['entries_per_op']} entries; GB/s kvtier / plain copy")
        for name in ("d2h", "h2d", "both"):
            r = perf[name]
            lines.append(f"  {name:<6}{r['kvtier_gbps']:>9} / {r['plain_gbps']:<9} ratio {r['ratio']:<7} "
                         f"{r['us_per_entry']} us/entry")
        for kind, p in perf["one_chunk"].items():
            lines.append(f"  1-chunk {kind:<6} p50 {p['p50_ms']} ms  p99 {p['p99_ms']} ms")
    lines.append(f"ok={summary['ok']}  {summary['seconds']} s  errors: {', '.join(summary['errors']) or 'none'}")
    return "\n".join(lines)


def _verdict(summary: dict[str, Any], phase: str) -> str:
    if phase in summary["errors"]:
        return "FAILED"
    if phase not in summary:
        return "skipped" if phase == "primitives" and summary["rehearse"] else "not run"
    return "ok" if summary.get(f"{phase}_ok", True) else "FAILED"


def check(mode: Mode, work: Path, out: Path) -> dict[str, Any]:
    spec = json.loads((HERE / "layouts.json").read_text())
    layouts = {case: Layout.of(case, sizes[mode.size]) for case, sizes in spec["layouts"].items()}
    summary: dict[str, Any] = {"rehearse": mode.rehearse, "vllm_layouts": spec["vllm"], "errors": {}}
    started = time.perf_counter()

    def phase(name: str, fn: Callable[[], Any]) -> None:
        try:
            summary[name] = fn()
        except Exception:
            summary["errors"][name] = traceback.format_exc(limit=8)[-2000:]
        summary["seconds"] = round(time.perf_counter() - started, 1)
        out.write_text(json.dumps(summary, indent=1))

    phase("env", lambda: environment(mode))
    if not mode.rehearse:
        import primitives

        phase("primitives", lambda: primitives.run(SHM_PREFIX))
        summary["primitives_ok"] = all(v is True for v in summary.get("primitives", {}).get("verdicts", {}).values())
    daemon = Daemon(work, mode)
    workers: dict[str, Worker] = {}
    try:
        phase("end_to_end", lambda: end_to_end(daemon, mode, layouts, workers))
        summary["end_to_end_ok"] = e2e_ok(summary.get("end_to_end", {}))
        if "nhd" in workers:
            phase("performance", lambda: performance(daemon, workers["nhd"], 100, mode.max_chunks))
    finally:
        for w in workers.values():
            w.close()
        daemon.stop()
    summary["ok"] = (not summary["errors"] and summary["end_to_end_ok"] and summary.get("primitives_ok", True)
                     and "performance" in summary)
    if summary["errors"]:
        summary["daemon_log_tail"] = daemon.tail()
    summary["seconds"] = round(time.perf_counter() - started, 1)
    out.write_text(json.dumps(summary, indent=1))
    return summary


def cuda_present() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rehearse", action="store_true", help="the CPU rehearsal (automatic without CUDA)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/kvtier-gpu-check"), help="for the daemon's log")
    parser.add_argument("--out", type=Path, help="the JSON summary, rewritten after every phase "
                        "(default: WORK/summary.json)")
    args = parser.parse_args()
    mode = Mode(args.rehearse or not cuda_present())
    args.work.mkdir(parents=True, exist_ok=True)
    summary = check(mode, args.work, args.out or args.work / "summary.json")
    print(table(summary), flush=True)
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
