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

This module holds the CLI entry (`add_arguments`, `run`), the result and its report (text, plot); the file
I/O part is in l2_io.py, the lookup part in l2_lookup.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import tempfile
from typing import Any

import numpy as np
from kvtier.server.bench import common as bc
from kvtier.server.bench.l2_io import KINDS, MODES, bench_io
from kvtier.server.bench.l2_io import drop_page_cache as drop_page_cache  # re-exported: tests/e2e use it here
from kvtier.server.bench.l2_lookup import bench_lookup

MiB = 1 << 20


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
