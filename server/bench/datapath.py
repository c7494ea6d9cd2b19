"""`kvtier bench datapath`: the client's copy path (store / retrieve through shared-memory L1) against a raw
memcpy of the same bytes, measured in the same run.

For each chunk size (256-token chunks of 2, 8 and 32 MiB by default) a fresh server is started (on
`--shm-dir`; it backs L1 with memory first, `--l1-prefault`, and the bench waits for that) and
  * cold stores: the client's first pass over L1 (pages backed by the server, not yet mapped by this
    client; with `--populate` mapped ahead, as a CPU vLLM worker maps them: `Session.populate_l1`); the
    baseline is np.copyto into a fresh, sparse tmpfs mapping (allocation + zeroing + fault);
  * warm stores: later passes reuse evicted pages (already mapped by this client); the baselines are
    np.copyto between two preallocated buffers ("memcpy") and into a warm tmpfs mapping;
  * retrieves of resident chunks (warm), and the first read through a brand-new client mapping
    (what another engine process pays: minor faults) against a first read through a new mapping of a file.
Each is done as one copy of the whole chunk ("chunk") and as per-block pieces ("blocks", e.g. 64 blocks of
512 KiB for 32 MiB, the vLLM CPU layout). "copy" times only the memcpy inside the callbacks; "e2e" times
client.store / client.retrieve including key hashing and the RPCs (reserve+commit, lookup+acquire+release).
The engine-side buffers are page-aligned (see `aligned`).

This module holds the CLI entry and the measurement; datapath_report.py the figures, table, plot and summary.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from kvtier.server.bench import common as bc

MiB = 1 << 20
TOKENS = 256  # chunk size in tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-mib", default="2,8,32", help="chunk sizes in MiB, comma separated (default 2,8,32)")
    parser.add_argument("--block-kib", type=int, default=512, help="per-block piece size in KiB (default 512)")
    parser.add_argument("--request-mib", type=float, default=64.0,
                        help="bytes per store/retrieve request: chunks per request = this / chunk size (default 64)")
    parser.add_argument("--l1-mib", type=int, default=512, help="L1 size of each server started (default 512)")
    parser.add_argument("--warm-passes", type=int, default=3, help="warm store passes over L1 (default 3)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each raw baseline (default 5)")
    parser.add_argument("--url", default="", help="use a running server instead (cold figures then mean little)")
    parser.add_argument("--shm-dir", default="/dev/shm",
                        help="tmpfs directory of the servers' L1 and of the raw shm baselines (default /dev/shm; "
                             "a tmpfs mounted with huge=always or within_size measures L1 on huge pages)")
    parser.add_argument("--populate", action="store_true",
                        help="the client maps all of L1 ahead before its first pass, as a CPU vLLM worker does "
                             "(kvtier.populate_l1): the first pass's stores then meet mapped pages")
    parser.add_argument("--plot", default="", help="write a PNG plot here (needs matplotlib)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


# -- raw baselines ---------------------------------------------------------------------------------


def _copy_pieces(dst: np.ndarray, src: np.ndarray, piece: int) -> float:
    """np.copyto of src into dst in `piece`-byte calls; returns seconds."""
    t = time.perf_counter()
    for off in range(0, src.nbytes, piece):
        np.copyto(dst[off : off + piece], src[off : off + piece])
    return time.perf_counter() - t


class ShmFile:
    """A fresh tmpfs file mapped like the L1 segment (sparse: first writes fault)."""

    def __init__(self, size: int, directory: str) -> None:
        fd, path = tempfile.mkstemp(prefix="kvtier-bench-raw-", dir=directory)
        try:
            os.ftruncate(fd, size)
            self.fd = fd
            self.size = size
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.unlink(path)
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self._fresh: list[tuple[mmap.mmap, np.ndarray]] = []

    def fresh_view(self) -> np.ndarray:
        """A second mapping of the same (now backed) file: its page tables start empty."""
        m = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        view = np.frombuffer(m, dtype=np.uint8)
        self._fresh.append((m, view))
        return view

    def close(self) -> None:
        self.array = None
        for m, _ in self._fresh:
            with contextlib.suppress(BufferError):
                m.close()
        self._fresh.clear()
        with contextlib.suppress(BufferError):  # a view is still referenced somewhere: leave it to the GC
            self.map.close()
        os.close(self.fd)


# -- the copy path through the client --------------------------------------------------------------


class Phase:
    def __init__(self) -> None:
        self.bytes = 0
        self.copy_s = 0.0
        self.e2e_s = 0.0
        self.requests = 0
        self.runs = 0  # contiguous page runs seen by the copies (page splits)
        self.spans = 0
        self.samples: list[float] = []  # per-request copy GB/s

    def add(self, nbytes: int, copy_s: float, e2e_s: float | None = None) -> None:
        self.bytes += nbytes
        self.copy_s += copy_s
        self.e2e_s += copy_s if e2e_s is None else e2e_s
        self.requests += 1
        if nbytes:
            self.samples.append(bc.gbps(nbytes, copy_s))

    def summary(self) -> dict[str, float]:
        return {
            "copy_gbps": bc.gbps(self.bytes, self.copy_s),
            "copy_gbps_median": float(np.median(self.samples)) if self.samples else 0.0,
            "e2e_gbps": bc.gbps(self.bytes, self.e2e_s),
            "bytes": self.bytes,
            "requests": self.requests,
            "runs_per_chunk": self.runs / self.spans if self.spans else 0.0,
        }


def _span_runs(span: Any) -> int:
    return len(getattr(span, "_runs", ())) or 1


MODES = ("chunk", "blocks")
PATH_PHASES = ("store_cold", "store_warm", "retrieve_warm", "retrieve_fresh_map")
RAW_PHASES = ("memcpy", "shm_write_cold", "shm_write_warm", "shm_read_warm", "shm_read_fresh_map")


def _wait_backed(client: Any, populate: bool, timeout: float = 120.0) -> None:
    """Let the server finish backing L1 (--l1-prefault) so that "cold" stores measure what a client sees
    after start-up, not a race with the prefault thread; with `populate`, then let the client map all of it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and client.stats()["l1_prefault"] == "running":
        time.sleep(0.05)
    if populate:
        client.populate_l1()
        while not client.l1_populated:
            if time.monotonic() > deadline:
                raise SystemExit("the client did not map L1 ahead (a kernel before 5.14, or no --l1-prefault)")
            time.sleep(0.05)


def aligned(nbytes: int) -> np.ndarray:
    """A zeroed uint8 buffer whose first byte is page-aligned, like an engine's KV tensor (torch aligns CPU
    tensors to 64 bytes; numpy only to 16, and a copy whose destination is off a cache line by 16 bytes runs
    at half speed here with glibc's `rep movsb`, which would make every baseline and figure a misalignment
    benchmark)."""
    raw = np.zeros(nbytes + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start : start + nbytes]


def _path_calls(b: _SizeBench) -> tuple[Callable[..., None], ...]:
    """write / read: the store and retrieve callbacks, one copy of the whole chunk or per-block pieces
    (cur["mode"]) timed into cur["copy_s"]; store(kind, mode) / retrieve(c, kind, mode, tokens): one timed
    client call into the phase `kind`_`mode` (a stored prompt is kept in b.prompts)."""
    client, ns, rng, size, block, req_chunks, req = b.client, b.ns, b.rng, b.size, b.block, b.req_chunks, b.req
    src, dst, path, cur, prompts = b.src, b.dst, b.path, b.cur, b.prompts
    bpc = size // block
    src_blocks = src.reshape(-1, block)  # per-block pieces (rows), like blocks of an engine's KV tensor
    dst_blocks = dst.reshape(-1, block)

    def write(chunk: Any, span: Any) -> None:
        base = chunk.index * size
        t = time.perf_counter()
        if cur["mode"] == "chunk":
            span.write(0, src[base : base + size])
        else:
            first = chunk.index * bpc
            for j in range(bpc):
                span.write(j * block, src_blocks[first + j])
        cur["copy_s"] += time.perf_counter() - t
        cur["phase"].runs += _span_runs(span)
        cur["phase"].spans += 1

    def read(rc: Any) -> None:
        base = rc.chunk.index * size
        t = time.perf_counter()
        if cur["mode"] == "chunk":
            rc.span.read(0, dst[base : base + size])
        else:
            first = rc.chunk.index * bpc
            for j in range(bpc):
                rc.span.read(j * block, dst_blocks[first + j])
        cur["copy_s"] += time.perf_counter() - t
        cur["phase"].runs += _span_runs(rc.span)
        cur["phase"].spans += 1

    def store(kind: str, mode: str) -> None:
        tokens = rng.integers(0, 1 << 31, req_chunks * TOKENS, dtype=np.int64)
        ph = path[f"{kind}_{mode}"]
        cur.update(phase=ph, mode=mode, copy_s=0.0)
        t = time.perf_counter()
        res = client.store(ns, tokens, lambda c: size, write)
        e2e = time.perf_counter() - t
        if res.stored != req_chunks:
            raise RuntimeError(f"store stored {res.stored} of {req_chunks} chunks: {res}")
        ph.add(req, cur["copy_s"], e2e)
        prompts.append(tokens)

    def retrieve(c: Any, kind: str, mode: str, tokens: np.ndarray) -> None:
        ph = path[f"{kind}_{mode}"]
        cur.update(phase=ph, mode=mode, copy_s=0.0)
        t = time.perf_counter()
        got = c.retrieve(ns, tokens, read)
        e2e = time.perf_counter() - t
        ph.add(got // TOKENS * size, cur["copy_s"], e2e)

    return write, read, store, retrieve


class _SizeBench:
    """One chunk size's run (buffers, phases, client, raw shm file) with one method per phase it measures,
    each sampling its raw baselines between its requests."""

    def __init__(self, url: str, size: int, block: int, req_chunks: int, l1_bytes: int,
                 rng: np.random.Generator, shm_dir: str, populate: bool) -> None:
        from kvtier.connector.client import ClientConfig, KVTierClient
        from kvtier.server.keys import Namespace

        self.size, self.block, self.req_chunks, self.rng = size, block, req_chunks, rng
        self.req = req = size * req_chunks
        self.ns = Namespace(model="kvtier-bench-datapath", dtype="bfloat16", num_layers=32, kv_heads=8,
                            head_size=128, block_size=16, layout=f"bench-{size}", chunk_size=TOKENS)
        self.src = aligned(req)
        self.src[:] = rng.integers(0, 256, req, dtype=np.uint8)
        self.dst = aligned(req)
        self.path = {f"{kind}_{mode}": Phase() for kind in PATH_PHASES for mode in MODES}
        self.raw = {f"{kind}_{mode}": Phase() for kind in RAW_PHASES for mode in MODES}
        self.cur: dict[str, Any] = {}
        self.new_client = lambda: KVTierClient(ClientConfig(url=url, strict=True, request_timeout_s=30.0))
        self.client = self.new_client()
        self.client.connect()
        self.per_pass = per_pass = max(2, l1_bytes // req)
        self.cold = per_pass - per_pass % 2  # alternate modes; never more than L1 holds (every page still fresh)
        self.rawfile = ShmFile(self.cold * req, shm_dir)
        _wait_backed(self.client, populate)
        self.prompts: list[np.ndarray] = []
        self.write, self.read, self.store, self.retrieve = _path_calls(self)

    def region(self, i: int, view: np.ndarray | None = None) -> np.ndarray:
        view = self.rawfile.array if view is None else view
        return view[(i % self.cold) * self.req : (i % self.cold + 1) * self.req]

    def raw_copy(self, name: str, dst: np.ndarray, src: np.ndarray, mode: str) -> None:
        self.raw[f"{name}_{mode}"].add(self.req, _copy_pieces(dst, src, self.size if mode == "chunk" else self.block))

    def cold_stores(self) -> None:
        """Each store into fresh L1 pages is followed by a raw copy into fresh pages of another shm file."""
        for i in range(self.cold):
            mode = MODES[i % 2]
            self.store("store_cold", mode)
            self.raw_copy("shm_write_cold", self.region(i), self.src, mode)

    def warm_stores(self, warm_passes: int) -> None:
        """Pages recycled by eviction; raw samples interleaved request by request."""
        for i in range(warm_passes * self.per_pass):
            mode = MODES[i % 2]
            self.store("store_warm", mode)
            self.raw_copy("shm_write_warm", self.region(i), self.src, mode)
            self.raw_copy("memcpy", self.dst, self.src, mode)

    def fresh_map_retrieves(self, resident: list[np.ndarray]) -> None:
        """The first read of each resident prompt through a brand-new client mapping, against a first read
        through a new mapping of the raw file."""
        fresh_clients = [self.new_client() for _ in MODES]
        fresh_views = [self.rawfile.fresh_view() for _ in MODES]
        for c in fresh_clients:
            c.connect()
        for i, tokens in enumerate(resident):
            mode = MODES[i % 2]
            self.retrieve(fresh_clients[i % 2], "retrieve_fresh_map", mode, tokens)
            if i < self.cold:
                self.raw_copy("shm_read_fresh_map", self.dst, self.region(i, fresh_views[i % 2]), mode)
        for c in fresh_clients:
            c.close()

    def warm_retrieves(self, resident: list[np.ndarray]) -> None:
        """Three rounds over the resident prompts, the raw baselines interleaved request by request."""
        for rnd in range(3):
            for i, tokens in enumerate(resident):
                mode = MODES[(i + rnd) % 2]
                self.retrieve(self.client, "retrieve_warm", mode, tokens)
                self.raw_copy("shm_read_warm", self.dst, self.region(i), mode)
                self.raw_copy("memcpy", self.dst, self.src, mode)

    def finish(self, resident: list[np.ndarray]) -> None:
        """Close the raw file, check the bytes that came back once (outside the timings), close the client."""
        self.rawfile.close()
        if resident:
            self.cur.update(phase=Phase(), mode="blocks", copy_s=0.0)
            self.dst[:] = 0
            tokens = resident[-1]
            if self.client.retrieve(self.ns, tokens, self.read) != len(tokens) or not np.array_equal(self.dst, self.src):
                raise RuntimeError("retrieved bytes differ from the stored bytes")
        self.client.close()


def bench_size(url: str, size: int, block: int, req_chunks: int, l1_bytes: int, warm_passes: int,
               rng: np.random.Generator, shm_dir: str, populate: bool
               ) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The client's copy path for one chunk size, with every raw baseline sampled between its requests."""
    b = _SizeBench(url, size, block, req_chunks, l1_bytes, rng, shm_dir, populate)
    b.cold_stores()
    b.warm_stores(warm_passes)
    # LRU server: the newest prompts are resident; check which, then read them back
    resident = [t for t in b.prompts[-b.per_pass :] if b.client.lookup(b.ns, t).tokens == len(t)]
    b.fresh_map_retrieves(resident)
    b.warm_retrieves(resident)
    b.finish(resident)
    return ({k: v.summary() for k, v in b.path.items()}, {k: v.summary() for k, v in b.raw.items()}, len(resident))


def run(args: argparse.Namespace) -> int:
    from kvtier.server.bench import datapath_report as report

    sizes = [int(float(s) * MiB) for s in args.sizes_mib.split(",") if s.strip()]
    block = args.block_kib * 1024
    rng = np.random.default_rng(0)
    rows: dict[str, Any] = {}
    for size in sizes:
        b = min(block, size)
        if size % b:
            raise SystemExit(f"chunk size {size} is not a multiple of the block piece {b}")
        req_chunks = max(1, int(args.request_mib * MiB) // size)
        l1_bytes = max(args.l1_mib * MiB, 4 * req_chunks * size)
        l1_gb = l1_bytes / (1 << 30)
        with bc.server_or_url(args.url or None, l1_gb,
                              ["--eviction-policy", "lru", "--shm-dir", args.shm_dir]) as server:
            url = args.url or server.url
            t0 = time.perf_counter()
            path, raw, resident = bench_size(url, size, b, req_chunks, l1_bytes, args.warm_passes, rng,
                                             args.shm_dir, args.populate)
            seconds = time.perf_counter() - t0
        label = str(size // MiB) if size % MiB == 0 else f"{size / MiB:g}"
        rows[label] = {
            "chunk_bytes": size, "block_bytes": b, "chunks_per_request": req_chunks, "l1_bytes": l1_bytes,
            "resident_prompts_read": resident, "path": path, "raw": raw, "seconds": seconds,
            "ratios": report.ratios(path, raw),
        }
    result = report.summary(rows)
    if args.plot:
        report.plot(rows, args.plot)
        result["plot"] = args.plot
    bc.emit(result, args.json, report.text(result))
    return 0
