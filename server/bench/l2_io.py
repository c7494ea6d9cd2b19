"""The file I/O part of `kvtier bench l2` (the write, read and O_DIRECT items of l2.py's docstring, which says
what is measured and how): the L2 tier's write and read path (L2Writer + FsTier) against raw sequential file
I/O of the same bytes on the same disk, in the same run, and the page-cache and raw-file helpers it uses
(`drop_page_cache` also serves the lookup part, l2_lookup.py)."""

from __future__ import annotations

import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import blake3
import numpy as np
from kvtier.server.bench import common as bc
from kvtier.server.tiers.fs_io import fsync_dir

MODES = ("buffered", "odirect")
WRITE_GROUP = 16  # chunks written one way before the other way's turn
READ_GROUP = 16  # chunks read one way before the other way's turn: a prompt's worth, promoted together
KINDS = (("write", "write + fsync"), ("read_cold", "read, page cache dropped"), ("read_warm", "read again"))


# -- helpers ---------------------------------------------------------------------------------------


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
    from kvtier.server.tiers.fs import FsTier
    from kvtier.server.tiers.writer import L2Writer, WriteJob

    n = len(payloads)
    tier = FsTier(tdir, capacity_bytes=n * metas[0].file_bytes * 2, odirect=odirect)
    writer = L2Writer(tier, depth=n)
    writer.start()

    def job(i: int) -> WriteJob:
        view, half = payloads[i], len(payloads[i]) // 2
        # as AttachedTier.write_behind: views of the chunk's L1 extents (two here), written from in place
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
    from kvtier.server.tiers.promotion import PROMOTE_THREADS

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


class _IoBench:
    """The chunks (metas, the raw files' bytes with each payload at the tier's data offset, the payloads) and
    the seconds and bytes of every (mode, tier/raw, kind), with one method per phase measured."""

    def __init__(self, root: str, n: int, size: int, rng: np.random.Generator) -> None:
        from kvtier.server.tiers.fs_io import probe_odirect
        from kvtier.server.tiers.record import ChunkMeta

        self.root, self.n, self.size = root, n, size
        ns = rng.bytes(16)
        self.metas = metas = [ChunkMeta(rng.bytes(16), ns, 16, (), size) for _ in range(n)]
        self.file_bytes, self.off = file_bytes, off = metas[0].file_bytes, metas[0].data_offset
        # raw files: the tier's file sizes, payload at the same offset
        self.files = files = _aligned_array((n, file_bytes))
        for i in range(n):
            files[i, off : off + size] = rng.integers(0, 256, size, dtype=np.uint8)
        self.payloads = [memoryview(files[i, off : off + size]) for i in range(n)]
        self.buf, self.raw_buf = _aligned_array((size,)), _aligned_array((file_bytes,))
        self.t = {(mode, who, kind): 0.0 for mode in MODES for who in ("tier", "raw") for kind, _ in KINDS}
        self.nbytes = {(mode, kind): 0 for mode in MODES for kind, _ in KINDS}  # bytes each side moved
        self.active = {"buffered": False, "odirect": probe_odirect(root)}
        self.drop_methods: set[str] = set()

    def round(self, rep: int, mode: str) -> None:
        """One rep of one mode: the writes, then cold and warm reads of the tier's files, bytes checked."""
        from kvtier.server.tiers.fs_io import file_name

        root = self.root
        tdir, rdir = os.path.join(root, f"tier-{rep}-{mode}"), os.path.join(root, f"raw-{rep}-{mode}")
        os.makedirs(rdir)
        tier, raw_paths = self.writes(tdir, rdir, rep, mode)
        if tier.odirect_active != self.active[mode]:
            raise RuntimeError("the tier and the probe disagree on O_DIRECT")
        tier_paths = [os.path.join(tdir, file_name(m.key)) for m in self.metas]
        self.reads(tier, tier_paths, raw_paths, rep, mode)
        self.check(tier)
        shutil.rmtree(tdir, ignore_errors=True)
        shutil.rmtree(rdir, ignore_errors=True)

    def writes(self, tdir: str, rdir: str, rep: int, mode: str) -> tuple[Any, list[str]]:
        """Every chunk written both ways (`_interleaved_writes`); returns the tier and the raw files."""
        tier_s, raw_s, tier, raw_paths = _interleaved_writes(tdir, rdir, self.files, self.payloads, self.metas,
                                                             mode == "odirect", rep % 2)
        self.t[mode, "tier", "write"] += tier_s
        self.t[mode, "raw", "write"] += raw_s
        self.nbytes[mode, "write"] += self.n * self.file_bytes
        return tier, raw_paths

    def reads(self, tier: Any, tier_paths: list[str], raw_paths: list[str], rep: int, mode: str) -> None:
        """The page cache dropped, one cold pass, then the best of 3 warm passes (`_interleaved_reads`)."""
        # the raw reads read the tier's own files (the same bytes on the same disk blocks), whole
        reads = partial(_interleaved_reads, tier, self.metas, tier_paths, memoryview(self.raw_buf),
                        self.active[mode])
        self.drop_methods.add(drop_page_cache(tier_paths + raw_paths))
        passes = {"read_cold": [reads(True, rep % 2)],
                  # best of 3: the first may meet late readahead
                  "read_warm": [reads(False, (rep + k) % 2) for k in range(3)]}
        for kind, results in passes.items():
            tier_s, raw_s, files_each = min(results, key=lambda r: r[0] + r[1])
            self.t[mode, "tier", kind] += tier_s
            self.t[mode, "raw", kind] += raw_s
            self.nbytes[mode, kind] += files_each * self.file_bytes

    def check(self, tier: Any) -> None:
        """Bytes check outside the timings (get() verified the checksum already)."""
        buf, files, off, size = self.buf, self.files, self.off, self.size
        for i in (0, self.n - 1):
            tier.get(self.metas[i], [memoryview(buf)])
            if not np.array_equal(buf, files[i, off : off + size]):
                raise RuntimeError("L2 read back different bytes")

    def checksum_rates(self) -> dict[str, float]:
        """GB/s of each checksum over (up to) 64 payloads, one thread."""
        from kvtier.server.tiers.record import hasher

        payloads, size = self.payloads, self.size
        hashes = {}
        for name, new in (("xxh3_128", hasher), ("blake3", blake3.blake3)):
            start = time.perf_counter()
            for p in payloads[:64]:
                new(p).digest()
            hashes[name] = bc.gbps(len(payloads[:64]) * size, time.perf_counter() - start)
        return hashes

    def result(self, hashes: dict[str, float]) -> dict[str, Any]:
        t, nbytes = self.t, self.nbytes

        def pair(mode: str, kind: str) -> dict[str, float]:
            tier_s, raw_s = t[mode, "tier", kind], t[mode, "raw", kind]
            fig, base = bc.gbps(nbytes[mode, kind], tier_s), bc.gbps(nbytes[mode, kind], raw_s)
            return {"gbps": fig, "baseline_gbps": base, "ratio": fig / base if base else 0.0,
                    "seconds": tier_s, "baseline_seconds": raw_s}

        out: dict[str, Any] = {"file_bytes": self.file_bytes, "bytes_per_phase": nbytes["buffered", "write"],
                               "cache_drop": sorted(self.drop_methods),
                               "checksum_gbps": hashes}
        for mode in MODES:
            out[mode] = {"odirect_active": self.active[mode], **{kind: pair(mode, kind) for kind, _ in KINDS}}
        return out


def bench_io(root: str, n: int, size: int, reps: int, rng: np.random.Generator) -> dict[str, Any]:
    """Every rep, each mode: the tier and raw files written, read cold and warm; then the checksums' rates."""
    b = _IoBench(root, n, size, rng)
    for rep in range(reps):
        for mode in MODES:
            b.round(rep, mode)
    return b.result(b.checksum_rates())
