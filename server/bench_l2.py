"""`kvtier bench l2`: the L2 filesystem tier's write and read path against raw sequential file I/O of the same
bytes on the same disk, in the same run, buffered and with O_DIRECT, plus a lookup that promotes a chunk from
L2 against an L1 hit.

* write: N chunks through `L2Writer` + `FsTier` (the production write-behind path: one copy out of the
  source into a staging buffer with the checksum, temp file, write, fsync, rename, batched directory
  fsync), WRITE_GROUP at a time, each group timed from its first submit until the writer is idle (every
  write synced); baseline: plain writes + fsync of files of the same sizes and bytes, a directory fsync
  after each group; the two alternate group by group (the disk drifts).
* read: `FsTier.get` as the server's promotion threads call it (a prompt's READ_GROUP chunks handed to
  PROMOTE_THREADS threads; the header, payload and checksum of each) against one sequential os.preadv of
  each whole file into an aligned buffer: both on the tier's own files, both reading every file, group by
  group, which goes first alternating by group and between passes (the disk drifts). "cold": the page cache dropped first
  (drop_caches when permitted, otherwise posix_fadvise(DONTNEED) on every file, which evicts clean pages
  without root) and each group's files evicted again before each side reads them; "warm" right after
  (best of 3 passes): from the page cache when buffered, from the disk again with O_DIRECT.
* O_DIRECT: the same with `FsTier(odirect=True)`; the raw baseline then also opens with O_DIRECT and uses
  aligned buffers. Where the directory refuses O_DIRECT (tmpfs) both fall back to buffered, reported as
  `odirect_active: false`.
* lookup: a real server with --l2-path (buffered); chunks stored (one chunk per prompt), the L2 queue
  drained, the server restarted on the same directory; for each prompt, lookup + acquire + release as the
  connector does it, timed with KVTierClient: first while the chunk is only in L2 (the lookup replies at
  once and starts the promotion; the acquire waits for file read, checksum and L1 commit), then again as an
  L1 hit.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import blake3
import numpy as np
from kvtier.connector import bench_common as bc
from kvtier.server.l2_format import fsync_dir

MiB = 1 << 20
TOKENS = 256  # tokens per chunk in the lookup part
MODES = ("buffered", "odirect")
WRITE_GROUP = 16  # chunks written one way before the other way's turn
READ_GROUP = 16  # chunks read one way before the other way's turn: a prompt's worth, promoted together
KINDS = (("write", "write + fsync"), ("read_cold", "read, page cache dropped"), ("read_warm", "read again"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default="", help="directory to benchmark (default: a new temp dir under /var/tmp)")
    parser.add_argument("--chunks", type=int, default=256, help="chunks written and read (default 256)")
    parser.add_argument("--chunk-mb", type=float, default=2.0, help="chunk payload size in MiB (default 2)")
    parser.add_argument("--reps", type=int, default=2,
                        help="repetitions of write+read, alternating which of tier/raw goes first (default 2)")
    parser.add_argument("--lookups", type=int, default=16,
                        help="chunks (one per prompt) for the promotion vs L1-hit lookup timing (default 16)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--plot", default="", help="also write a PNG bar chart here (needs matplotlib)")


# -- helpers ---------------------------------------------------------------------------------------


def _df(path: str) -> dict[str, str]:
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True, timeout=10).stdout.split("\n")
        cols = out[1].split()
        return {"device": cols[0], "fstype": cols[1], "mount": cols[-1]}
    except (OSError, IndexError, subprocess.SubprocessError):
        return {"device": "?", "fstype": "?", "mount": "?"}


def _evict(paths: list[str]) -> bool:
    """posix_fadvise(DONTNEED) on each file: evicts its clean pages from the page cache, no root needed.
    Returns whether every call succeeded."""
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
    return ok


def drop_page_cache(paths: list[str]) -> str:
    """Evict what we can of `paths` from the page cache; returns the method that worked."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    return "fadvise_dontneed" if _evict(paths) else "none (page-cache-warm)"


def _aligned_array(shape: tuple[int, ...]) -> np.ndarray:
    """A zeroed uint8 array on page-aligned anonymous memory (O_DIRECT buffers)."""
    return np.frombuffer(mmap.mmap(-1, int(np.prod(shape))), dtype=np.uint8).reshape(shape)


def _raw_write(directory: str, files: np.ndarray, first: int, odirect: bool) -> list[str]:
    """Write `files` as raw-<index> files (write + fsync each, then the directory's fsync)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if odirect else 0)
    paths = []
    for i in range(files.shape[0]):
        p = os.path.join(directory, f"raw-{first + i:06d}")
        fd = os.open(p, flags, 0o600)
        try:
            view = memoryview(files[i])
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        paths.append(p)
    fsync_dir(directory)
    return paths


def _raw_read(path: str, buf: memoryview, odirect: bool) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if odirect else 0))
    try:
        off = 0
        while off < len(buf):
            n = os.preadv(fd, [buf[off:]], off)
            if n <= 0:
                raise RuntimeError(f"short read of {path}")
            off += n
    finally:
        os.close(fd)


def _alternate(groups: Sequence[range], parity: int, tier: Callable[[range], object],
               raw: Callable[[range], object], before: Callable[[range], object] | None = None) -> tuple[float, float]:
    """Run `tier` and `raw` on each group of chunk indices, which goes first alternating group by group
    (`parity` picks the first group's), so both meet the same disk conditions (a cloud disk's throughput
    drifts by 2x within a minute); `before` runs ahead of each side, untimed. Returns (tier s, raw s)."""
    spent = {tier: 0.0, raw: 0.0}
    for g, group in enumerate(groups):
        for side in (tier, raw) if g % 2 == parity else (raw, tier):
            if before is not None:
                before(group)
            start = time.perf_counter()
            side(group)
            spent[side] += time.perf_counter() - start
    return spent[tier], spent[raw]


def _interleaved_writes(tdir: str, rdir: str, files: np.ndarray, payloads: list[memoryview], metas: list,
                        odirect: bool, parity: int):  # noqa: ANN202
    """Write every chunk both ways, WRITE_GROUP chunks at a time (`_alternate`): through L2Writer + FsTier as
    the server does (submit the group, wait until it is written and synced), and as raw files. Returns
    (tier seconds, raw seconds, tier, raw paths)."""
    from kvtier.server.l2_tier import FsTier
    from kvtier.server.l2_writer import L2Writer, WriteJob

    n = len(payloads)
    tier = FsTier(tdir, capacity_bytes=n * metas[0].file_bytes * 2, odirect=odirect)
    writer = L2Writer(tier, depth=n)
    writer.start()

    def job(i: int) -> WriteJob:
        view, half = payloads[i], len(payloads[i]) // 2
        # as L2Service.on_commit: views of the chunk's L1 extents (two here), written from in place
        return WriteJob(metas[i], lambda: [view[:half], view[half:]], lambda: None)

    jobs = [job(i) for i in range(n)]
    raw_paths: list[str] = []

    def tier_side(group: range) -> None:
        for k in group:
            if not writer.submit(jobs[k]):
                raise RuntimeError("L2 writer queue full")
        if not writer.wait_idle(120):
            raise RuntimeError("L2 writes did not finish")

    def raw_side(group: range) -> None:
        raw_paths.extend(_raw_write(rdir, files[group.start : group.stop], group.start, tier.odirect_active))

    groups = [range(i, min(n, i + WRITE_GROUP)) for i in range(0, n, WRITE_GROUP)]
    t_tier, t_raw = _alternate(groups, parity, tier_side, raw_side)
    writer.stop()
    if writer.done != n or tier.written != n:
        raise RuntimeError(f"L2 writer wrote {writer.done}/{n} chunks ({tier.written} synced)")
    return t_tier, t_raw, tier, raw_paths


def _interleaved_reads(tier: Any, metas: list, paths: list[str], raw_buf: memoryview, odirect: bool, cold: bool,
                       parity: int) -> tuple[float, float, int]:
    """Read every file both ways, READ_GROUP files at a time (`_alternate`; the same files both ways, as the
    host may cache some files and not others): the tier as the server promotes a prompt's chunks,
    `FsTier.get` on PROMOTE_THREADS threads pulling from the group (one buffer per thread, standing for L1
    pages); raw, one whole-file read after the other into one buffer. `cold`: the group's files are evicted
    from the page cache before each way's reads (outside the timing). Returns (tier seconds, raw seconds,
    files each)."""
    from kvtier.server.l2_service import PROMOTE_THREADS

    local = threading.local()

    def get(m: Any) -> None:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = memoryview(_aligned_array((m.size,)))
        if not tier.get(m, [buf]):
            raise RuntimeError(f"FsTier.get failed for {m.key.hex()}")

    size = min(READ_GROUP, len(metas))
    groups = [range(i, i + size) for i in range(0, len(metas) - size + 1, size)]

    def raw_side(group: range) -> None:
        for k in group:
            _raw_read(paths[k], raw_buf, odirect)

    def evict(group: range) -> None:
        _evict(paths[group.start : group.stop])

    with ThreadPoolExecutor(PROMOTE_THREADS) as pool:
        t_tier, t_raw = _alternate(groups, parity, lambda group: list(pool.map(get, metas[group.start : group.stop])),
                                   raw_side, evict if cold else None)
    return t_tier, t_raw, len(groups) * size


# -- the tier vs raw part --------------------------------------------------------------------------


def bench_io(root: str, n: int, size: int, reps: int, rng: np.random.Generator) -> dict[str, Any]:
    from kvtier.server.l2_format import ChunkMeta, file_name, hasher, probe_odirect

    ns = rng.bytes(16)
    metas = [ChunkMeta(rng.bytes(16), ns, 16, (), size) for _ in range(n)]
    file_bytes, off = metas[0].file_bytes, metas[0].data_offset
    files = _aligned_array((n, file_bytes))  # raw files: the tier's file sizes, payload at the same offset
    for i in range(n):
        files[i, off : off + size] = rng.integers(0, 256, size, dtype=np.uint8)
    payloads = [memoryview(files[i, off : off + size]) for i in range(n)]
    buf, raw_buf = _aligned_array((size,)), _aligned_array((file_bytes,))
    t = {(mode, who, kind): 0.0 for mode in MODES for who in ("tier", "raw") for kind, _ in KINDS}
    nbytes = {(mode, kind): 0 for mode in MODES for kind, _ in KINDS}  # bytes each side moved
    active = {"buffered": False, "odirect": probe_odirect(root)}
    drop_methods = set()
    for rep in range(reps):
        for mode in MODES:
            odirect = active[mode]
            tdir, rdir = os.path.join(root, f"tier-{rep}-{mode}"), os.path.join(root, f"raw-{rep}-{mode}")
            os.makedirs(rdir)
            tier_s, raw_s, tier, raw_paths = _interleaved_writes(tdir, rdir, files, payloads, metas,
                                                                 mode == "odirect", rep % 2)
            t[mode, "tier", "write"] += tier_s
            t[mode, "raw", "write"] += raw_s
            nbytes[mode, "write"] += n * file_bytes
            if tier.odirect_active != odirect:
                raise RuntimeError("the tier and the probe disagree on O_DIRECT")
            tier_paths = [os.path.join(tdir, file_name(m.key)) for m in metas]
            # the raw reads read the tier's own files (the same bytes on the same disk blocks), whole
            reads = partial(_interleaved_reads, tier, metas, tier_paths, memoryview(raw_buf), odirect)
            drop_methods.add(drop_page_cache(tier_paths + raw_paths))
            passes = {"read_cold": [reads(True, rep % 2)],
                      # best of 3: the first may meet late readahead
                      "read_warm": [reads(False, (rep + k) % 2) for k in range(3)]}
            for kind, results in passes.items():
                tier_s, raw_s, files_each = min(results, key=lambda r: r[0] + r[1])
                t[mode, "tier", kind] += tier_s
                t[mode, "raw", kind] += raw_s
                nbytes[mode, kind] += files_each * file_bytes
            for i in (0, n - 1):  # bytes check outside the timings (get() verified the checksum already)
                tier.get(metas[i], [memoryview(buf)])
                if not np.array_equal(buf, files[i, off : off + size]):
                    raise RuntimeError("L2 read back different bytes")
            shutil.rmtree(tdir, ignore_errors=True)
            shutil.rmtree(rdir, ignore_errors=True)
    hashes = {}
    for name, new in (("xxh3_128", hasher), ("blake3", blake3.blake3)):
        start = time.perf_counter()
        for p in payloads[:64]:
            new(p).digest()
        hashes[name] = bc.gbps(len(payloads[:64]) * size, time.perf_counter() - start)

    def pair(mode: str, kind: str) -> dict[str, float]:
        tier_s, raw_s = t[mode, "tier", kind], t[mode, "raw", kind]
        fig, base = bc.gbps(nbytes[mode, kind], tier_s), bc.gbps(nbytes[mode, kind], raw_s)
        return {"gbps": fig, "baseline_gbps": base, "ratio": fig / base if base else 0.0,
                "seconds": tier_s, "baseline_seconds": raw_s}

    out: dict[str, Any] = {"file_bytes": file_bytes, "bytes_per_phase": nbytes["buffered", "write"],
                           "cache_drop": sorted(drop_methods),
                           "checksum_gbps": hashes}
    for mode in MODES:
        out[mode] = {"odirect_active": active[mode], **{kind: pair(mode, kind) for kind, _ in KINDS}}
    return out


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
    drop = drop_page_cache(files)
    server = bc.start_server(l1_gb, extra)
    promote, hit, reply, l1_reply = [], [], [], []

    def fetch(tokens: np.ndarray, tier: str) -> float:
        """lookup + acquire (+ release) of the prompt's chunk, as the connector does; the acquire waits for
        a promotion in flight. Returns the time of the lookup reply alone."""
        t0 = time.perf_counter()
        found = c.lookup(ns, tokens)
        t1 = time.perf_counter()
        if [h.tier for h in found.hits] != [tier]:
            raise RuntimeError(f"expected one {tier} hit, got {found.hits}")
        if c.retrieve_chunks(ns, found.hits, lambda _chunk: None) != len(found.hits[0].chunk.block_keys):
            raise RuntimeError(f"acquire after a {tier} hit failed")
        return t1 - t0

    try:
        c = connect(server.url)
        for tokens in prompts:
            t0 = time.perf_counter()
            reply.append(fetch(tokens, "l2"))
            t1 = time.perf_counter()
            l1_reply.append(fetch(tokens, "l1"))
            t2 = time.perf_counter()
            promote.append(t1 - t0)
            hit.append(t2 - t1)
        promoted = (c.stats() or {}).get("l2_promoted", 0)
        c.close()
    finally:
        server.stop()
    p, h = bc.percentiles(promote), bc.percentiles(hit)
    return {"chunks": n, "chunk_bytes": size, "cache_drop": drop, "promoted": promoted,
            "promote_lookup": p, "l1_hit_lookup": h, "l2_lookup_reply": bc.percentiles(reply),
            "l1_lookup_reply": bc.percentiles(l1_reply),
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
    figures, baselines, ratios = {}, {}, {}
    for mode in MODES:
        prefix = "" if mode == "buffered" else "odirect_"
        for kind, _ in KINDS:
            row = io[mode][kind]
            figures[f"{prefix}{kind}_gbps"] = row["gbps"]
            baselines[f"{prefix}{kind}_gbps"] = row["baseline_gbps"]
            ratios[f"{prefix}{kind}"] = row["ratio"]
    figures["promote_lookup_p50_us"] = lk["promote_lookup"]["p50_us"]
    baselines["l1_hit_lookup_p50_us"] = lk["l1_hit_lookup"]["p50_us"]
    result = {
        "bench": "l2",
        "machine": bc.machine(),
        "dir": root,
        "filesystem": filesystem,
        "chunks": n, "chunk_bytes": size, "reps": args.reps,
        "odirect_active": io["odirect"]["odirect_active"],
        "io": io,
        "lookup": lk,
        "figure": {"name": "L2 write GB/s (L2Writer + FsTier: checksum, written from the source, temp file, fsync, rename, dir fsync)",
                   "value": io["buffered"]["write"]["gbps"]},
        "baseline": {"name": "raw os.write + fsync GB/s of files of the same sizes, same disk, same run",
                     "value": io["buffered"]["write"]["baseline_gbps"]},
        "ratio": io["buffered"]["write"]["ratio"],
        "figures": figures,
        "baselines": baselines,
        "ratios": ratios,
    }
    if args.plot:
        _plot(result, args.plot)
        result["plot"] = args.plot
    bc.emit(result, args.json, _text(result))
    return 0


def _text(r: dict[str, Any]) -> str:
    fs, io, lk = r["filesystem"], r["io"], r["lookup"]
    warm_note = "" if any(m != "none (page-cache-warm)" for m in io["cache_drop"]) else \
        " (could not drop the page cache: buffered cold reads are page-cache-warm for both)"
    odirect = "O_DIRECT" if r["odirect_active"] else "O_DIRECT refused here (EINVAL): buffered fallback"
    lines = [
        f"kvtier bench l2: {r['chunks']} x {r['chunk_bytes'] / MiB:g} MiB chunks ({io['file_bytes']} B files), "
        f"{r['reps']} reps, dir {r['dir']} on {fs['fstype']} ({fs['device']}, mounted {fs['mount']})",
        f"GB/s = 1e9 B/s of file bytes. Page cache dropped before cold reads with: "
        f"{', '.join(io['cache_drop'])}{warm_note}",
        f"  {'':40}{'L2 path':>10}{'raw':>10}{'ratio':>9}",
    ]
    for mode, title in (("buffered", "buffered"), ("odirect", odirect)):
        for kind, name in KINDS:
            row = io[mode][kind]
            label = f"{title}: {name}"
            lines.append(f"  {label:40}{row['gbps']:10.2f}{row['baseline_gbps']:10.2f}{row['ratio']:8.2f}x")
    lines.append(f"  checksum of a chunk, one thread: XXH3-128 (the file format's) {io['checksum_gbps']['xxh3_128']:.2f} "
                 f"GB/s, BLAKE3 (format v2's) {io['checksum_gbps']['blake3']:.2f} GB/s")
    lines.append(
        f"lookup + acquire of one {lk['chunk_bytes'] / MiB:g} MiB chunk after a server restart (p50 of "
        f"{lk['chunks']}, page cache: {lk['cache_drop']}; the lookup reply alone: L2 hit "
        f"{lk['l2_lookup_reply']['p50_us']:.0f} us, L1 hit {lk['l1_lookup_reply']['p50_us']:.0f} us): promoting from L2 {lk['promote_lookup']['p50_us']:.0f} us "
        f"(p99 {lk['promote_lookup']['p99_us']:.0f}), L1 hit {lk['l1_hit_lookup']['p50_us']:.0f} us "
        f"(p99 {lk['l1_hit_lookup']['p99_us']:.0f}); promotion costs {lk['promotion_cost_us_p50']:.0f} us "
        f"= {lk['promotion_gbps_p50']:.2f} GB/s")
    lines.append(f"\nFIGURE   {r['figure']['name']}: {r['figure']['value']:.2f} GB/s")
    lines.append(f"BASELINE {r['baseline']['name']}: {r['baseline']['value']:.2f} GB/s")
    q = r["ratios"]
    lines.append(f"RATIO    buffered: write {q['write']:.2f}x, cold read {q['read_cold']:.2f}x, warm read "
                 f"{q['read_warm']:.2f}x; O_DIRECT: write {q['odirect_write']:.2f}x, read {q['odirect_read_cold']:.2f}x"
                 f" / {q['odirect_read_warm']:.2f}x (goal >= 0.8x)")
    if "plot" in r:
        lines.append(f"plot: {r['plot']}")
    return "\n".join(lines)


def _plot(r: dict[str, Any], path: str) -> None:
    """GB/s of the L2 path beside the raw baseline for each row, ratio on top; lookup latencies beside."""
    plt = bc.plotting(path)
    if plt is None:
        return
    io, lk = r["io"], r["lookup"]
    rows = [(f"{'buffered' if mode == 'buffered' else 'O_DIRECT'}\n{name}", io[mode][kind])
            for mode in MODES for kind, name in KINDS]
    fig, (ax, ax_lk) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [3.2, 1]})
    xs = np.arange(len(rows))
    width = 0.38
    ax.bar(xs - width / 2, [row["gbps"] for _, row in rows], width, label="L2 tier (FsTier / L2Writer)")
    ax.bar(xs + width / 2, [row["baseline_gbps"] for _, row in rows], width, label="raw file I/O, same bytes")
    for x, (_, row) in zip(xs, rows, strict=True):
        top = max(row["gbps"], row["baseline_gbps"])
        ax.annotate(f"{row['ratio']:.2f}x", (x, top), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(xs, [label for label, _ in rows], fontsize=8)
    ax.set_ylabel("GB/s (1e9 B/s of file bytes)")
    ax.set_ylim(0, max(max(row["gbps"], row["baseline_gbps"]) for _, row in rows) * 1.15)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"L2 tier vs raw sequential file I/O, same disk, same run "
                 f"({r['chunks']} x {r['chunk_bytes'] / MiB:g} MiB, {r['filesystem']['fstype']})", fontsize=10)
    names = ("promote from L2", "L1 hit")
    p50 = [lk["promote_lookup"]["p50_us"], lk["l1_hit_lookup"]["p50_us"]]
    p99 = [lk["promote_lookup"]["p99_us"], lk["l1_hit_lookup"]["p99_us"]]
    ax_lk.bar(names, p50, 0.6, color=["tab:blue", "tab:orange"], label="p50")
    ax_lk.scatter(names, p99, color="k", marker="_", s=300, label="p99")
    ax_lk.set_ylabel("lookup + acquire, us")
    ax_lk.set_ylim(bottom=0)
    ax_lk.grid(axis="y", alpha=0.3)
    ax_lk.legend(fontsize=8)
    ax_lk.set_title(f"lookup of one {r['chunk_bytes'] / MiB:g} MiB chunk", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
