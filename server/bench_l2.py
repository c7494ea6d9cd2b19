"""`kvtier bench l2`: the L2 filesystem tier's write and read path against raw sequential file I/O of the same
bytes on the same disk, in the same run, plus a lookup that promotes a chunk from L2 against an L1 hit.

* write: N chunks through `L2Writer` + `FsTier` (the production write-behind path: copy out of the source
  buffer, header + BLAKE3 checksum, temp file, fsync, rename, batched directory fsync), timed from the first
  submit until `inflight == 0`; baseline: plain os.write + fsync of files of the same sizes (one directory
  fsync at the end).
* read: `FsTier.get` into a preallocated buffer (header check + BLAKE3 verification) against os.preadv of
  the same files into a buffer of the same size. "cold" after dropping the page cache (drop_caches when
  permitted, otherwise posix_fadvise(DONTNEED) on every file, which evicts clean pages without root);
  "warm" right after, from the page cache (best of 3 passes each).
* lookup: a real server with --l2-path; chunks stored (one chunk per prompt), the L2 queue drained, the
  server restarted on the same directory; for each prompt the first lookup (promotes from L2: file read,
  checksum, L1 commit) and the second (L1 hit) are timed with KVTierClient.

`--l2-odirect` is accepted by the server but not implemented: every figure here is buffered I/O.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

import blake3
import numpy as np
from kvtier.connector import bench_common as bc

MiB = 1 << 20
TOKENS = 256  # tokens per chunk in the lookup part
ODIRECT_NOTE = "O_DIRECT is accepted (--l2-odirect) but not implemented: all I/O here is buffered"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default="", help="directory to benchmark (default: a new temp dir under /var/tmp)")
    parser.add_argument("--chunks", type=int, default=256, help="chunks written and read (default 256)")
    parser.add_argument("--chunk-mb", type=float, default=2.0, help="chunk payload size in MiB (default 2)")
    parser.add_argument("--reps", type=int, default=2,
                        help="repetitions of write+read, alternating which of tier/raw goes first (default 2)")
    parser.add_argument("--lookups", type=int, default=16,
                        help="chunks (one per prompt) for the promotion vs L1-hit lookup timing (default 16)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


# -- helpers ---------------------------------------------------------------------------------------


def _df(path: str) -> dict[str, str]:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True, timeout=10).stdout.split("\n")
        cols = out[1].split()
        return {"device": cols[0], "fstype": cols[1], "mount": cols[-1]}
    except (OSError, IndexError, subprocess.SubprocessError):
        return {"device": "?", "fstype": "?", "mount": "?"}


def _drop_cache(paths: list[str]) -> str:
    """Evict what we can of `paths` from the page cache; returns the method that worked."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    ok = True
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (OSError, AttributeError):
            ok = False
        finally:
            os.close(fd)
    return "fadvise_dontneed" if ok else "none (page-cache-warm)"


def _read_into(path: str, view: memoryview) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        off = 0
        while off < len(view):
            n = os.preadv(fd, [view[off:]], off)
            if n <= 0:
                break
            off += n
    finally:
        os.close(fd)
    return off


def _raw_write(directory: str, payloads: np.ndarray, file_bytes: int, header: bytes) -> tuple[float, list[str]]:
    paths = []
    t = time.perf_counter()
    for i in range(payloads.shape[0]):
        p = os.path.join(directory, f"raw-{i:06d}")
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for piece in (memoryview(header), memoryview(payloads[i])):
                while piece:
                    piece = piece[os.write(fd, piece):]
            os.fsync(fd)
        finally:
            os.close(fd)
        paths.append(p)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)
    os.close(dfd)
    dt = time.perf_counter() - t
    assert os.path.getsize(paths[0]) == file_bytes
    return dt, paths


def _raw_read(paths: list[str], buf: memoryview) -> float:
    t = time.perf_counter()
    for p in paths:
        if _read_into(p, buf) != len(buf):
            raise RuntimeError(f"short read of {p}")
    return time.perf_counter() - t


def _tier_write(directory: str, payloads: np.ndarray, rng: np.random.Generator):  # noqa: ANN202
    from kvtier.server.l2_format import ChunkMeta
    from kvtier.server.l2_tier import FsTier
    from kvtier.server.l2_writer import L2Writer, WriteJob

    n, size = payloads.shape
    ns = rng.bytes(16)
    metas = [ChunkMeta(rng.bytes(16), ns, 16, (), size) for _ in range(n)]
    tier = FsTier(directory, capacity_bytes=n * metas[0].file_bytes * 2)
    writer = L2Writer(tier, depth=n)
    writer.start()

    def job(i: int) -> WriteJob:
        view = memoryview(payloads[i])
        # L2Service._copy_out: the worker copies the chunk out of the L1 pages before writing it
        return WriteJob(metas[i], lambda: b"".join([bytes(view)]), lambda: None)

    jobs = [job(i) for i in range(n)]
    t = time.perf_counter()
    for j in jobs:
        if not writer.submit(j):
            raise RuntimeError("L2 writer queue full")
    while writer.inflight:
        time.sleep(0.0002)
    dt = time.perf_counter() - t
    writer.stop()
    if writer.done != n or tier.written != n:
        raise RuntimeError(f"L2 writer wrote {writer.done}/{n} chunks ({tier.written} synced)")
    return dt, tier, metas


def _tier_read(tier: Any, metas: list, buf: memoryview) -> float:
    t = time.perf_counter()
    for m in metas:
        if not tier.get(m, [buf]):
            raise RuntimeError(f"FsTier.get failed for {m.key.hex()}")
    return time.perf_counter() - t


# -- the tier vs raw part --------------------------------------------------------------------------


def bench_io(root: str, n: int, size: int, reps: int, rng: np.random.Generator) -> dict[str, Any]:
    from kvtier.server.l2_format import ChunkMeta, file_name

    payloads = rng.integers(0, 256, (n, size), dtype=np.uint8)
    file_bytes = ChunkMeta(b"\0" * 16, b"\0" * 16, 16, (), size).file_bytes
    header = bytes(file_bytes - size)
    buf = np.empty(size, dtype=np.uint8)
    raw_buf = np.empty(file_bytes, dtype=np.uint8)
    t = {k: 0.0 for k in ("tier_write", "raw_write", "tier_read_cold", "raw_read_cold", "tier_read_warm",
                          "raw_read_warm")}
    drop_methods = set()
    for rep in range(reps):
        tdir, rdir = os.path.join(root, f"tier-{rep}"), os.path.join(root, f"raw-{rep}")
        os.makedirs(rdir)
        order = ("tier", "raw") if rep % 2 == 0 else ("raw", "tier")
        for which in order:
            if which == "tier":
                dt, tier, metas = _tier_write(tdir, payloads, rng)
                t["tier_write"] += dt
            else:
                dt, raw_paths = _raw_write(rdir, payloads, file_bytes, header)
                t["raw_write"] += dt
        tier_paths = [os.path.join(tdir, file_name(m.key)) for m in metas]
        drop_methods.add(_drop_cache(tier_paths + raw_paths))
        for which in order:
            if which == "tier":
                t["tier_read_cold"] += _tier_read(tier, metas, memoryview(buf))
            else:
                t["raw_read_cold"] += _raw_read(raw_paths, memoryview(raw_buf))
        warm = {"tier": [], "raw": []}  # best of 3 passes each: the first may still meet late readahead
        for _ in range(3):
            for which in order:
                if which == "tier":
                    warm["tier"].append(_tier_read(tier, metas, memoryview(buf)))
                else:
                    warm["raw"].append(_raw_read(raw_paths, memoryview(raw_buf)))
        t["tier_read_warm"] += min(warm["tier"])
        t["raw_read_warm"] += min(warm["raw"])
        # bytes check outside the timings (get() verified the checksum already)
        for i in (0, n - 1):
            tier.get(metas[i], [memoryview(buf)])
            if not np.array_equal(buf, payloads[i]):
                raise RuntimeError("L2 read back different bytes")
        shutil.rmtree(tdir, ignore_errors=True)
        shutil.rmtree(rdir, ignore_errors=True)
    total = reps * n * file_bytes
    hash_t = time.perf_counter()
    for i in range(min(n, 64)):
        blake3.blake3(payloads[i]).digest()
    hash_gbps = bc.gbps(min(n, 64) * size, time.perf_counter() - hash_t)

    def pair(kind: str) -> dict[str, float]:
        fig, base = bc.gbps(total, t[f"tier_{kind}"]), bc.gbps(total, t[f"raw_{kind}"])
        return {"gbps": fig, "baseline_gbps": base, "ratio": fig / base if base else 0.0,
                "seconds": t[f"tier_{kind}"], "baseline_seconds": t[f"raw_{kind}"]}

    return {"file_bytes": file_bytes, "bytes_per_phase": total, "cache_drop": sorted(drop_methods),
            "write": pair("write"), "read_cold": pair("read_cold"), "read_warm": pair("read_warm"),
            "blake3_single_thread_gbps": hash_gbps}


# -- promotion vs L1 hit ---------------------------------------------------------------------------


def bench_lookup(root: str, n: int, size: int, rng: np.random.Generator) -> dict[str, Any]:
    from kvtier.connector.client import ClientConfig, KVTierClient
    from kvtier.server.keys import Namespace

    ns = Namespace(model="kvtier-bench-l2", dtype="bfloat16", num_layers=32, kv_heads=8, head_size=128,
                   block_size=16, layout=f"bench-l2-{size}", chunk_size=TOKENS)
    l2dir = os.path.join(root, "server-l2")
    l1_gb = max(0.25, 2.5 * n * size / (1 << 30))
    extra = ["--l2-path", l2dir, "--l2-size-gb", repr(max(1.0, 2 * n * size / (1 << 30))),
             "--l2-queue-depth", str(max(64, 2 * n)), "--eviction-policy", "lru"]
    payload = rng.integers(0, 256, size, dtype=np.uint8)
    prompts = [rng.integers(0, 1 << 31, TOKENS, dtype=np.int64) for _ in range(n)]

    def connect(url: str) -> KVTierClient:
        c = KVTierClient(ClientConfig(url=url, strict=True, request_timeout_s=60.0))
        c.connect()
        return c

    server = bc.start_server(l1_gb, extra)
    try:
        c = connect(server.url)
        for tokens in prompts:
            res = c.store(ns, tokens, lambda _c: size, lambda _ch, span: span.write(0, payload))
            if res.stored != 1:
                raise RuntimeError(f"store failed: {res}")
        deadline = time.monotonic() + 120
        while (c.stats() or {}).get("l2_inflight", 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        s = c.stats() or {}
        if s.get("l2_inflight") or s.get("l2_written", 0) < n:
            raise RuntimeError(f"L2 writes did not drain: {s}")
        c.close()
    finally:
        server.stop()
    files = [e.path for e in os.scandir(l2dir) if e.name.endswith(".kv")]
    drop = _drop_cache(files)
    server = bc.start_server(l1_gb, extra)
    promote, hit = [], []
    try:
        c = connect(server.url)
        for tokens in prompts:
            t0 = time.perf_counter()
            first = c.lookup(ns, tokens)
            t1 = time.perf_counter()
            second = c.lookup(ns, tokens)
            t2 = time.perf_counter()
            if [h.tier for h in first.hits] != ["l2"] or [h.tier for h in second.hits] != ["l1"]:
                raise RuntimeError(f"unexpected tiers: {first.hits} then {second.hits}")
            promote.append(t1 - t0)
            hit.append(t2 - t1)
        promoted = (c.stats() or {}).get("l2_promoted", 0)
        c.close()
    finally:
        server.stop()
    p, h = bc.percentiles(promote), bc.percentiles(hit)
    return {"chunks": n, "chunk_bytes": size, "cache_drop": drop, "promoted": promoted,
            "promote_lookup": p, "l1_hit_lookup": h,
            "promotion_cost_us_p50": p["p50_us"] - h["p50_us"],
            "promotion_gbps_p50": size / ((p["p50_us"] - h["p50_us"]) * 1e3) if p["p50_us"] > h["p50_us"] else 0.0}


# -- entry point -----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    n, size = args.chunks, int(args.chunk_mb * MiB)
    if n < 1 or size < 1 or args.reps < 1 or args.lookups < 1:
        raise SystemExit("--chunks, --chunk-mb, --reps and --lookups must be positive")
    own = not args.dir
    root = tempfile.mkdtemp(prefix="kvtier-bench-l2-", dir="/var/tmp") if own else args.dir
    work = tempfile.mkdtemp(prefix="run-", dir=root)
    rng = np.random.default_rng(0)
    filesystem = _df(root)
    try:
        io = bench_io(work, n, size, args.reps, rng)
        lk = bench_lookup(work, args.lookups, size, rng)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if own:
            with contextlib.suppress(OSError):
                os.rmdir(root)
    result = {
        "bench": "l2",
        "machine": bc.machine(),
        "dir": root,
        "filesystem": filesystem,
        "chunks": n, "chunk_bytes": size, "reps": args.reps,
        "odirect": ODIRECT_NOTE,
        "io": io,
        "lookup": lk,
        "figure": {"name": "L2 write GB/s (L2Writer + FsTier: copy, checksum, temp file, fsync, rename, dir fsync)",
                   "value": io["write"]["gbps"]},
        "baseline": {"name": "raw os.write + fsync GB/s of files of the same sizes, same disk, same run",
                     "value": io["write"]["baseline_gbps"]},
        "figures": {
            "write_gbps": io["write"]["gbps"], "read_cold_gbps": io["read_cold"]["gbps"],
            "read_warm_gbps": io["read_warm"]["gbps"],
            "promote_lookup_p50_us": lk["promote_lookup"]["p50_us"],
        },
        "baselines": {
            "write_gbps": io["write"]["baseline_gbps"], "read_cold_gbps": io["read_cold"]["baseline_gbps"],
            "read_warm_gbps": io["read_warm"]["baseline_gbps"],
            "l1_hit_lookup_p50_us": lk["l1_hit_lookup"]["p50_us"],
        },
    }
    result["ratio"] = io["write"]["ratio"]
    result["ratios"] = {"write": io["write"]["ratio"], "read_cold": io["read_cold"]["ratio"],
                        "read_warm": io["read_warm"]["ratio"]}
    bc.emit(result, args.json, _text(result))
    return 0


def _text(r: dict[str, Any]) -> str:
    fs, io, lk = r["filesystem"], r["io"], r["lookup"]
    warm_note = "" if any(m != "none (page-cache-warm)" for m in io["cache_drop"]) else \
        " (could not drop the page cache: cold reads are page-cache-warm for both)"
    lines = [
        f"kvtier bench l2: {r['chunks']} x {r['chunk_bytes'] / MiB:g} MiB chunks ({io['file_bytes']} B files), "
        f"{r['reps']} reps, dir {r['dir']} on {fs['fstype']} ({fs['device']}, mounted {fs['mount']})",
        f"GB/s = 1e9 B/s of file bytes. Page cache dropped before cold reads with: "
        f"{', '.join(io['cache_drop'])}{warm_note}",
        f"NOTE: {r['odirect']}",
        f"  {'':34}{'L2 path':>10}{'raw':>10}{'ratio':>9}",
    ]
    for key, name in (("write", "write + fsync"), ("read_cold", "read, page cache dropped"),
                      ("read_warm", "read, page-cache warm")):
        row = io[key]
        lines.append(f"  {name:34}{row['gbps']:10.2f}{row['baseline_gbps']:10.2f}{row['ratio']:8.2f}x")
    lines.append(f"  BLAKE3 single-thread hash of a chunk (the read path's verification): "
                 f"{io['blake3_single_thread_gbps']:.2f} GB/s")
    lines.append(
        f"lookup of one {lk['chunk_bytes'] / MiB:g} MiB chunk after a server restart (p50 of {lk['chunks']}, "
        f"page cache: {lk['cache_drop']}): promoting from L2 {lk['promote_lookup']['p50_us']:.0f} us "
        f"(p99 {lk['promote_lookup']['p99_us']:.0f}), L1 hit {lk['l1_hit_lookup']['p50_us']:.0f} us "
        f"(p99 {lk['l1_hit_lookup']['p99_us']:.0f}); promotion costs {lk['promotion_cost_us_p50']:.0f} us "
        f"= {lk['promotion_gbps_p50']:.2f} GB/s")
    lines.append(f"\nFIGURE   {r['figure']['name']}: {r['figure']['value']:.2f} GB/s")
    lines.append(f"BASELINE {r['baseline']['name']}: {r['baseline']['value']:.2f} GB/s")
    lines.append(f"RATIO    write {r['ratios']['write']:.2f}x, cold read {r['ratios']['read_cold']:.2f}x, "
                 f"warm read {r['ratios']['read_warm']:.2f}x (goal >= 0.8x)")
    return "\n".join(lines)
