"""`kvtier bench datapath`: the client's copy path (store / retrieve through shared-memory L1) against a raw
memcpy of the same bytes, measured in the same run.

For each chunk size (256-token chunks of 2, 8 and 32 MiB by default) a fresh server is started (on
`--shm-dir`; it backs L1 with memory first, `--l1-prefault`, and the bench waits for that) and
  * cold stores: the client's first pass over L1 (pages backed by the server, not yet mapped by this
    client); the baseline is np.copyto into a fresh, sparse tmpfs mapping (allocation + zeroing + fault);
  * warm stores: later passes reuse evicted pages (already mapped by this client); the baselines are
    np.copyto between two preallocated buffers ("memcpy") and into a warm tmpfs mapping;
  * retrieves of resident chunks (warm), and the first read through a brand-new client mapping
    (what another engine process pays: minor faults) against a first read through a new mapping of a file.
Each is done as one copy of the whole chunk ("chunk") and as per-block pieces ("blocks", e.g. 64 blocks of
512 KiB for 32 MiB, the vLLM CPU layout). "copy" times only the memcpy inside the callbacks; "e2e" times
client.store / client.retrieve including key hashing and the RPCs (reserve+commit, lookup+acquire+release).
The engine-side buffers are page-aligned (see `aligned`).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import mmap
import os
import tempfile
import time
from typing import Any

import numpy as np
from kvtier.connector import bench_common as bc

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


def _wait_backed(client: Any, timeout: float = 120.0) -> None:
    """Let the server finish backing L1 (--l1-prefault) so that "cold" stores measure what a client sees
    after start-up, not a race with the prefault thread."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and client.stats()["l1_prefault"] == "running":
        time.sleep(0.05)


def aligned(nbytes: int) -> np.ndarray:
    """A zeroed uint8 buffer whose first byte is page-aligned, like an engine's KV tensor (torch aligns CPU
    tensors to 64 bytes; numpy only to 16, and a copy whose destination is off a cache line by 16 bytes runs
    at half speed here with glibc's `rep movsb`, which would make every baseline and figure a misalignment
    benchmark)."""
    raw = np.zeros(nbytes + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start : start + nbytes]


def bench_size(url: str, size: int, block: int, req_chunks: int, l1_bytes: int, warm_passes: int,
               rng: np.random.Generator, shm_dir: str) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The client's copy path for one chunk size, with every raw baseline sampled between its requests."""
    from kvtier.connector.client import ClientConfig, KVTierClient
    from kvtier.server.keys import Namespace

    req = size * req_chunks
    bpc = size // block
    ns = Namespace(model="kvtier-bench-datapath", dtype="bfloat16", num_layers=32, kv_heads=8, head_size=128,
                   block_size=16, layout=f"bench-{size}", chunk_size=TOKENS)
    src = aligned(req)
    src[:] = rng.integers(0, 256, req, dtype=np.uint8)
    src_blocks = src.reshape(-1, block)  # per-block pieces (rows), like blocks of an engine's KV tensor
    dst = aligned(req)
    dst_blocks = dst.reshape(-1, block)
    path = {f"{kind}_{mode}": Phase() for kind in PATH_PHASES for mode in MODES}
    raw = {f"{kind}_{mode}": Phase() for kind in RAW_PHASES for mode in MODES}
    cur: dict[str, Any] = {}

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

    def piece(mode: str) -> int:
        return size if mode == "chunk" else block

    client = KVTierClient(ClientConfig(url=url, strict=True, request_timeout_s=30.0))
    client.connect()
    per_pass = max(2, l1_bytes // req)
    cold = per_pass - per_pass % 2  # alternate modes; never more than L1 holds (every page still fresh)
    rawfile = ShmFile(cold * req, shm_dir)
    _wait_backed(client)
    prompts: list[np.ndarray] = []

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

    def region(i: int, view: np.ndarray | None = None) -> np.ndarray:
        view = rawfile.array if view is None else view
        return view[(i % cold) * req : (i % cold + 1) * req]

    # cold: each store into fresh L1 pages is followed by a raw copy into fresh pages of another shm file
    for i in range(cold):
        mode = MODES[i % 2]
        store("store_cold", mode)
        raw[f"shm_write_cold_{mode}"].add(req, _copy_pieces(region(i), src, piece(mode)))
    # warm: pages recycled by eviction; raw samples interleaved request by request
    for i in range(warm_passes * per_pass):
        mode = MODES[i % 2]
        store("store_warm", mode)
        raw[f"shm_write_warm_{mode}"].add(req, _copy_pieces(region(i), src, piece(mode)))
        raw[f"memcpy_{mode}"].add(req, _copy_pieces(dst, src, piece(mode)))
    # LRU server: the newest prompts are resident; check which, then read them back
    resident = [t for t in prompts[-per_pass:] if client.lookup(ns, t).tokens == len(t)]
    fresh_clients = [KVTierClient(ClientConfig(url=url, strict=True, request_timeout_s=30.0)) for _ in MODES]
    fresh_views = [rawfile.fresh_view() for _ in MODES]
    for c in fresh_clients:
        c.connect()
    for i, tokens in enumerate(resident):
        mode = MODES[i % 2]
        retrieve(fresh_clients[i % 2], "retrieve_fresh_map", mode, tokens)
        if i < cold:
            raw[f"shm_read_fresh_map_{mode}"].add(req, _copy_pieces(dst, region(i, fresh_views[i % 2]),
                                                                    piece(mode)))
    for c in fresh_clients:
        c.close()
    for rnd in range(3):
        for i, tokens in enumerate(resident):
            mode = MODES[(i + rnd) % 2]
            retrieve(client, "retrieve_warm", mode, tokens)
            raw[f"shm_read_warm_{mode}"].add(req, _copy_pieces(dst, region(i), piece(mode)))
            raw[f"memcpy_{mode}"].add(req, _copy_pieces(dst, src, piece(mode)))
    del fresh_views
    rawfile.close()
    if resident:  # check the bytes that came back once, outside the timings
        cur.update(phase=Phase(), mode="blocks", copy_s=0.0)
        dst[:] = 0
        tokens = resident[-1]
        if client.retrieve(ns, tokens, read) != len(tokens) or not np.array_equal(dst, src):
            raise RuntimeError("retrieved bytes differ from the stored bytes")
    client.close()
    return ({k: v.summary() for k, v in path.items()}, {k: v.summary() for k, v in raw.items()}, len(resident))


def run(args: argparse.Namespace) -> int:
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
                                             args.shm_dir)
            seconds = time.perf_counter() - t0
        label = str(size // MiB) if size % MiB == 0 else f"{size / MiB:g}"
        rows[label] = {
            "chunk_bytes": size, "block_bytes": b, "chunks_per_request": req_chunks, "l1_bytes": l1_bytes,
            "resident_prompts_read": resident, "path": path, "raw": raw, "seconds": seconds,
            "ratios": _ratios(path, raw),
        }
    biggest = rows[max(rows, key=lambda k: rows[k]["chunk_bytes"])]
    result = {
        "bench": "datapath",
        "machine": bc.machine(),
        "sizes": rows,
        "figure": {"name": "store copy GB/s (median per request), warm pages, per-block pieces, largest chunk",
                   "value": biggest["path"]["store_warm_blocks"]["copy_gbps_median"]},
        "baseline": {"name": "raw np.copyto GB/s of the same pieces between two preallocated buffers, "
                             "interleaved with the stores (median)",
                     "value": biggest["raw"]["memcpy_blocks"]["copy_gbps_median"]},
    }
    result["ratio"] = result["figure"]["value"] / result["baseline"]["value"]
    fb = figures(biggest, "blocks")
    result["headline"] = {
        "store copy warm / raw memcpy (same pieces)": fb["store copy, warm"] / fb["raw memcpy"],
        "store copy warm / raw into warm shm (same pieces)": fb["store copy, warm"] / fb["raw into shm, warm"],
        "retrieve copy warm / raw memcpy (same pieces)": fb["retrieve copy, warm"] / fb["raw memcpy"],
        "retrieve copy warm / raw out of warm shm (same pieces)":
            fb["retrieve copy, warm"] / fb["raw out of shm, warm"],
        "store copy cold / raw into cold shm (same pieces)":
            fb["store copy, cold pages"] / fb["raw into shm, cold"],
    }
    if args.plot:
        _plot(rows, args.plot)
        result["plot"] = args.plot
    bc.emit(result, args.json, _text(result))
    return 0


def _v(summary: dict[str, Any], warm: bool, key: str = "copy") -> float:
    """Warm figures are medians of per-request rates; cold ones (one pass each) are byte-weighted."""
    if key == "e2e":
        return summary["e2e_gbps"]
    return summary["copy_gbps_median"] if warm else summary["copy_gbps"]


def figures(row: dict[str, Any], mode: str) -> dict[str, float]:
    p, r = row["path"], row["raw"]
    return {
        "store copy, cold pages": _v(p[f"store_cold_{mode}"], False),
        "store e2e, cold pages": _v(p[f"store_cold_{mode}"], False, "e2e"),
        "store copy, warm": _v(p[f"store_warm_{mode}"], True),
        "store e2e, warm": _v(p[f"store_warm_{mode}"], True, "e2e"),
        "retrieve copy, warm": _v(p[f"retrieve_warm_{mode}"], True),
        "retrieve e2e, warm": _v(p[f"retrieve_warm_{mode}"], True, "e2e"),
        "retrieve copy, new mapping": _v(p[f"retrieve_fresh_map_{mode}"], False),
        "raw memcpy": _v(r[f"memcpy_{mode}"], True),
        "raw into shm, cold": _v(r[f"shm_write_cold_{mode}"], False),
        "raw into shm, warm": _v(r[f"shm_write_warm_{mode}"], True),
        "raw out of shm, warm": _v(r[f"shm_read_warm_{mode}"], True),
        "raw out of shm, new mapping": _v(r[f"shm_read_fresh_map_{mode}"], False),
    }


RATIOS = (
    ("store copy warm / memcpy", "store copy, warm", "raw memcpy"),
    ("store copy warm / raw into shm warm", "store copy, warm", "raw into shm, warm"),
    ("store e2e warm / memcpy", "store e2e, warm", "raw memcpy"),
    ("store copy cold / raw into shm cold", "store copy, cold pages", "raw into shm, cold"),
    ("store e2e cold / raw into shm cold", "store e2e, cold pages", "raw into shm, cold"),
    ("retrieve copy warm / memcpy", "retrieve copy, warm", "raw memcpy"),
    ("retrieve copy warm / raw out of shm warm", "retrieve copy, warm", "raw out of shm, warm"),
    ("retrieve e2e warm / memcpy", "retrieve e2e, warm", "raw memcpy"),
    ("retrieve new mapping / raw new mapping", "retrieve copy, new mapping", "raw out of shm, new mapping"),
)


def _ratios(path: dict[str, Any], raw: dict[str, Any]) -> dict[str, float]:
    out = {}
    for mode in MODES:
        f = figures({"path": path, "raw": raw}, mode)
        for name, a, b in RATIOS:
            out[f"{mode}: {name}"] = f[a] / f[b] if f[b] else math.nan
    return out


def _text(result: dict[str, Any]) -> str:
    lines = ["kvtier bench datapath: GB/s (1e9 B/s). copy = the memcpy inside the callbacks, e2e = the whole "
             "store()/retrieve() call incl. key hashing and RPCs.",
             "warm = median of per-request rates; cold / new mapping = one pass, byte-weighted."]
    for size, row in sorted(result["sizes"].items(), key=lambda kv: kv[1]["chunk_bytes"]):
        lines.append(f"\n== {size} MiB chunks: {row['chunks_per_request']} per request, 'blocks' = pieces of "
                     f"{row['block_bytes'] // 1024} KiB, L1 {row['l1_bytes'] // MiB} MiB, "
                     f"{row['resident_prompts_read']} resident prompts read back")
        fc, fb = figures(row, "chunk"), figures(row, "blocks")
        lines.append(f"  {'':34}{'one copy/chunk':>15}{'per-block':>11}")
        for name in fc:
            lines.append(f"  {name:34}{fc[name]:15.2f}{fb[name]:11.2f}")
        runs = row["path"]["store_warm_chunk"]["runs_per_chunk"]
        lines.append(f"  page runs per chunk (warm stores): {runs:.2f}")
        lines.append("  ratios:")
        for name, _, _ in RATIOS:
            lines.append(f"  {name:44}{row['ratios']['chunk: ' + name]:15.2f}x{row['ratios']['blocks: ' + name]:10.2f}x")
    lines.append(f"\nFIGURE   {result['figure']['name']}: {result['figure']['value']:.2f} GB/s")
    lines.append(f"BASELINE {result['baseline']['name']}: {result['baseline']['value']:.2f} GB/s")
    lines.append(f"RATIO    {result['ratio']:.2f}x (goal >= 0.9x)")
    lines.append("largest chunk, per-block pieces:")
    for name, v in result["headline"].items():
        lines.append(f"  {name:58}{v:6.2f}x")
    return "\n".join(lines)


def _plot(rows: dict[str, Any], path: str) -> None:
    plt = bc.plotting(path)
    if plt is None:
        return
    sizes = sorted(rows, key=lambda k: rows[k]["chunk_bytes"])
    names = ["store copy, warm", "raw into shm, warm", "raw memcpy", "store e2e, warm", "retrieve copy, warm",
             "raw out of shm, warm", "retrieve e2e, warm", "store copy, cold pages", "raw into shm, cold"]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    width = 0.85 / len(names)
    for ax, mode in zip(axes, MODES, strict=True):
        for k, name in enumerate(names):
            xs = [i + (k - len(names) / 2 + 0.5) * width for i in range(len(sizes))]
            ax.bar(xs, [figures(rows[s], mode)[name] for s in sizes], width, label=name,
                   hatch="//" if name.startswith("raw") else None)
        ax.set_xticks(range(len(sizes)), [f"{s} MiB" for s in sizes])
        ax.set_title("one copy per chunk" if mode == "chunk" else f"per-block pieces "
                     f"({rows[sizes[0]]['block_bytes'] // 1024} KiB)")
        ax.set_xlabel("chunk size (256 tokens)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=7, loc="upper right")
    fig.suptitle("kvtier copy path vs raw np.copyto of the same bytes, same run (hatched = raw)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
