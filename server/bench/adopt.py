"""`kvtier bench adopt`: a warm restart of a full L1, and what the journal costs the store path.

* restart: a real server with an L1 of `--l1-gb` filled with chunks of `--chunk-mb` (16 blocks each, stored
  as prompts of 16 chunks), stopped with SIGTERM (a last snapshot) and restarted, then SIGKILLed (the log is
  replayed) and restarted: the time from starting the process to its ready line and to the first hit (a
  client connects, looks a chunk up, leases it, copies it out, checks its bytes and releases it), the
  adoption's own time from its log line; against a cold start of the same L1 (`--l1-discard`).
* store path: reserve + commit of one-page chunks (no bytes copied: the bookkeeping alone) in batches of 256
  through KVTierClient, past L1's capacity so that stores evict, on a server with the journal
  (`--l1-adopt`) and one without (`--no-l1-adopt`), rounds alternating; microseconds per chunk.
* in process: compaction and adoption (replay and rebuild of index, pool and policy) of an L1 of the same
  size holding `--l1-gb` / `--chunk-mb` chunks and, the most an L1 of that size can hold, one chunk per page.
  Compaction both ways, in the same run: on the loop (`L1Journal.compact`, what every compaction did before
  the worker: the loop waits for the whole snapshot) and off it (`L1Journal.stage`: the loop captures the
  live records, then goes on storing chunks, one evicting another, while the worker writes the snapshot;
  the store that finds it written switches). Reported: the longest the loop was held per compaction (the
  capture, the slowest store while the worker ran, the store that switched) against the slowest store of as
  many with no compaction running (the baseline: the GIL and this machine's noise). A store inside which the
  garbage collector made a full pass (a pause of every Python object's, not the journal's) is counted apart.
  `--compaction-only` runs this part alone, without adoption: for L1 sizes this machine cannot serve.
"""

from __future__ import annotations

import argparse
import gc
import re
import signal
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server.bench import common as bc
from kvtier.server.eviction import make_policy
from kvtier.server.keys import ChunkKeys, Namespace, chunk_keys
from kvtier.server.l1.adopt import L1Files, OpenedL1, open_l1
from kvtier.server.l1.entry import Entry
from kvtier.server.l1.journal import L1Journal
from kvtier.server.l1.store import L1Store
from kvtier.server.metrics import Metrics
from kvtier.shm.segment import SHM_DIR

MiB = 1 << 20
PROMPT_CHUNKS = 16
NS = Namespace(model="bench/adopt", dtype="bfloat16", num_layers=32, kv_heads=8, head_size=128, block_size=16,
               layout="NHD", chunk_size=256)
STORE_NS = Namespace(model="bench/adopt-store", dtype="bfloat16", num_layers=1, kv_heads=1, head_size=8,
                     block_size=16, layout="NHD", chunk_size=16)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--l1-gb", type=float, default=8.0, help="L1 size in GiB (default 8)")
    parser.add_argument("--chunk-mb", type=float, default=1.0, help="chunk size in MiB (default 1)")
    parser.add_argument("--page-size-kb", type=int, default=64, help="L1 page size (default 64)")
    parser.add_argument("--store-chunks", type=int, default=50_000,
                        help="one-page chunks stored per store-path round (default 50,000, past a 1 GiB L1)")
    parser.add_argument("--rounds", type=int, default=3, help="store-path rounds per mode (default 3)")
    parser.add_argument("--compaction-only", action="store_true",
                        help="only the in-process compaction stall, old vs new (no server, no adoption)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    chunk = int(args.chunk_mb * MiB)
    l1 = int(args.l1_gb * (1 << 30))
    if chunk < args.page_size_kb * 1024 or l1 < 2 * chunk:
        raise SystemExit("--chunk-mb must hold a page and --l1-gb two chunks")
    result: dict[str, Any] = {"bench": "adopt", "machine": bc.machine(), "l1_gb": args.l1_gb,
                              "chunk_mb": args.chunk_mb, "page_size_kb": args.page_size_kb}
    if not args.compaction_only:
        result["restart"] = restarts(args, chunk)
        result["store_path"] = store_path(args)
    result["in_process"] = in_process(args, l1, chunk, adopt=not args.compaction_only)
    bc.emit(result, args.json, _text(result))
    return 0


# -- restarts of a real server --------------------------------------------------------------------


def restarts(args: argparse.Namespace, chunk: int) -> dict[str, Any]:
    port = bc.free_port()
    flags = ["--page-size-kb", str(args.page_size_kb), "--l1-adopt"]
    srv = bc.start_server(args.l1_gb, flags, port=port)
    try:
        payload = np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8)
        prompts = (int(args.l1_gb * (1 << 30)) // chunk - 1) // PROMPT_CHUNKS
        started = time.perf_counter()
        stored = fill(srv.url, prompts, chunk, payload)
        out: dict[str, Any] = {"chunks": stored, "fill_s": round(time.perf_counter() - started, 2)}
        for mode, sig in (("sigterm", signal.SIGTERM), ("sigkill", signal.SIGKILL)):
            srv.proc.send_signal(sig)
            srv.proc.wait(60)
            started = time.perf_counter()
            srv = bc.start_server(args.l1_gb, flags, port=port)
            first_hit = first_hit_s(srv.url, chunk, payload) + time.perf_counter() - started - srv.startup_s
            line = next(x for x in srv.log if "L1 adopted" in x)
            out[mode] = {"ready_s": round(srv.startup_s, 3), "first_hit_s": round(srv.startup_s + first_hit, 3),
                         "adopted": int(re.search(r": (\d+) chunks", line)[1]),
                         "adoption_s": float(re.search(r"replayed in ([\d.]+) s", line)[1])}
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(60)
        srv = bc.start_server(args.l1_gb, [*flags, "--l1-discard"], port=port)  # frees the L1 it would adopt
        out["cold"] = {"ready_s": round(srv.startup_s, 3)}
        srv.stop()
        srv = bc.start_server(args.l1_gb, flags, port=port)  # nothing to adopt, nothing to free
        out["cold"]["ready_nothing_to_remove_s"] = round(srv.startup_s, 3)
    finally:
        srv.stop()  # and its L1 removed
    return out


def fill(url: str, prompts: int, chunk: int, payload: np.ndarray) -> int:
    client = KVTierClient(ClientConfig(url=url, strict=True, request_timeout_s=60.0))
    rng = np.random.default_rng(1)
    stored = 0

    def write(c: ChunkKeys, span: Any) -> None:
        span.write(0, payload)
        span.write(0, np.frombuffer(c.key, dtype=np.uint8))  # each chunk's bytes start with its key

    for _ in range(prompts):
        tokens = rng.integers(0, 50_000, PROMPT_CHUNKS * NS.chunk_size)
        stored += client.store(NS, tokens, lambda _c: chunk, write).stored
    client.close()
    return stored


def first_hit_s(url: str, chunk: int, payload: np.ndarray) -> float:
    """Seconds until a new client has read the first stored chunk back, bit-exact."""
    started = time.perf_counter()
    tokens = np.random.default_rng(1).integers(0, 50_000, PROMPT_CHUNKS * NS.chunk_size)[: NS.chunk_size]
    key = chunk_keys(NS, tokens)[0].key
    expected = payload.copy()
    expected[:16] = np.frombuffer(key, dtype=np.uint8)
    client = KVTierClient(ClientConfig(url=url, strict=True))
    got = np.empty(chunk, dtype=np.uint8)
    assert client.retrieve(NS, tokens, lambda rc: rc.span.read(0, got)) == NS.chunk_size, "no hit"
    elapsed = time.perf_counter() - started
    client.close()
    assert np.array_equal(got, expected), "the adopted chunk's bytes differ"
    return elapsed


# -- the store path, with and without the journal -------------------------------------------------


def store_path(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(2)
    times: dict[str, list[float]] = {"journal": [], "no_journal": []}
    page = args.page_size_kb * 1024
    for _ in range(args.rounds):
        for mode, flag in (("journal", "--l1-adopt"), ("no_journal", "--no-l1-adopt")):
            srv = bc.start_server(1.0, ["--page-size-kb", str(args.page_size_kb), "--no-l1-prefault",
                                        "--eviction-policy", "lru", flag])
            client = KVTierClient(ClientConfig(url=srv.url, strict=True, request_timeout_s=60.0))
            keys = [bytes(k) for k in rng.integers(0, 256, (args.store_chunks, 16), dtype=np.uint8)]
            chunks = [ChunkKeys(i, 0, 1, (k,)) for i, k in enumerate(keys)]
            started = time.perf_counter()
            for i in range(0, len(chunks), 256):
                result = client.store_chunks(STORE_NS, chunks[i : i + 256], lambda _c: page, lambda _c, _s: None)
                assert result.stored == len(chunks[i : i + 256]), result
            times[mode].append((time.perf_counter() - started) / len(chunks) * 1e6)
            client.close()
            srv.stop()
    med = {mode: round(statistics.median(t), 2) for mode, t in times.items()}
    return {"us_per_chunk": med, "rounds_us": {m: [round(x, 2) for x in t] for m, t in times.items()},
            "ratio": round(med["journal"] / med["no_journal"], 3), "chunks_per_round": args.store_chunks}


# -- compaction and adoption in process -----------------------------------------------------------


def in_process(args: argparse.Namespace, l1: int, chunk: int, adopt: bool = True) -> dict[str, Any]:
    page = args.page_size_kb * 1024
    pages = l1 // page
    out = {}
    for label, per_chunk in (("chunks", chunk // page), ("one_page_chunks", 1)):
        files = L1Files(f"kvtier-bench-adopt-{uuid.uuid4().hex[:8]}", SHM_DIR, 0o600)
        opened = open_l1(files, pages, page, make_policy("lru"), Metrics(), adopt=True)
        store, ns = opened.store, NS.fingerprint()
        store.register_namespace(NS)
        rng = np.random.default_rng(3)
        n = pages // per_chunk
        blocks = NS.blocks_per_chunk if per_chunk > 1 else 1  # (one-page chunks: the entry count, not aliases)
        for _ in range(n):
            _store_one(store, ns, [bytes(k) for k in rng.integers(0, 256, (blocks, 16), dtype=np.uint8)],
                       per_chunk * page)
        m: dict[str, Any] = {"entries": n}
        m.update(compaction_stall(opened, ns, blocks, per_chunk * page, rng))
        if adopt:
            opened.abandon()
            started = time.perf_counter()
            again = open_l1(files, pages, page, make_policy("lru"), Metrics(), adopt=True)
            m["adoption_s"] = round(time.perf_counter() - started, 3)
            assert again.adopted == n, again.outcome
            opened = again
        opened.store.clear()
        opened.close()  # empty: both files removed
        out[label] = m
    return out


def _store_one(store: L1Store, ns: bytes, keys: list[bytes], size: int) -> None:
    """What a commit does to L1 (and its journal): pages (evicting the policy's victim when full), the entry."""
    extents = store.begin_insert(keys[-1], size, None)
    assert not isinstance(extents, str), extents
    store.end_busy(keys[-1], None)
    store.insert(Entry(keys[-1], ns, size, len(keys), extents, tuple(keys[:-1])))


class _FullCollections:
    """Counts the cyclic garbage collector's full passes: a pause of their own (of every Python object), not
    the journal's, reported apart from the stores they landed in."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            self.count += 1


def compaction_stall(opened: OpenedL1, ns: bytes, blocks: int, size: int, rng: np.random.Generator) -> dict:
    """Milliseconds the serving loop is held by a compaction of a full L1, on the loop and off it."""
    writer = opened.journal
    assert writer is not None
    full = _FullCollections()
    gc.callbacks.append(full)
    try:
        out = _stall_rounds(opened, writer, ns, blocks, size, rng, full, 0.0)
        out["paced"] = _stall_rounds(opened, writer, ns, blocks, size, rng, full, PACE_S)
        return out
    finally:
        gc.callbacks.remove(full)


PACE_S = 100e-6  # the paced rounds' wait between stores: a loop busy about half the time, as between requests


def _stall_rounds(opened: OpenedL1, writer: L1Journal, ns: bytes, blocks: int, size: int,
                  rng: np.random.Generator, full: _FullCollections, pace_s: float) -> dict:
    """Three compactions on the loop, then three off it with stores `pace_s` apart (0: back to back)."""
    def timed(fn: Callable[[], object]) -> tuple[float, bool]:
        """Seconds `fn` took, and whether a full collection ran inside it."""
        count, started = full.count, time.perf_counter()
        fn()
        return time.perf_counter() - started, full.count != count

    def store() -> None:
        keys = [bytes(k) for k in rng.integers(0, 256, (blocks, 16), dtype=np.uint8)]
        _store_one(opened.store, ns, keys, size)  # (the keys' cost is in the timing: baseline and during alike)

    on_loop = [timed(writer.compact) for _ in range(3)]
    snapshot_bytes = writer.journal.length
    # every compaction below starts from a fresh snapshot: the stores that follow stay below the log's limit
    rounds: list[dict[str, Any]] = []
    for _ in range(3):
        writer.compact()
        baseline = [timed(store) for _ in range(2000)]
        compactions = writer.compactions
        capture = timed(writer.stage)
        started = time.perf_counter()
        during = []
        while writer.compactions == compactions:
            if pace_s:
                time.sleep(pace_s)  # (the loop waiting for a request: the GIL is free)
            during.append(timed(store))
        rounds.append({"capture": capture, "during": during[:-1], "switch": during[-1], "baseline": baseline,
                       "until_switch": time.perf_counter() - started})

    def ms(x: float) -> float:
        return round(x * 1e3, 2)

    def slowest(stores: list[tuple[float, bool]]) -> float:
        return ms(max((t for t, gc_pass in stores if not gc_pass), default=0.0))

    held = [slowest([r["capture"], *r["during"], r["switch"]]) for r in rounds]
    gc_stores = [t for r in rounds for t, gc_pass in [*r["during"], r["switch"], *r["baseline"]] if gc_pass]
    return {"snapshot_bytes": snapshot_bytes,
            "on_loop_ms": [ms(t) for t, _ in on_loop], "off_loop_held_ms": held,
            "off_loop_capture_ms": [ms(r["capture"][0]) for r in rounds],
            "off_loop_slowest_store_ms": [slowest(r["during"]) for r in rounds],
            "off_loop_switch_store_ms": [ms(r["switch"][0]) for r in rounds],
            "off_loop_until_switch_ms": [ms(r["until_switch"]) for r in rounds],
            "stores_during": [len(r["during"]) + 1 for r in rounds],
            "baseline_slowest_store_ms": [slowest(r["baseline"]) for r in rounds],
            "baseline_p99_store_ms": [ms(float(np.percentile([t for t, _ in r["baseline"]], 99))) for r in rounds],
            "stores_with_a_full_gc_pass": len(gc_stores), "full_gc_store_ms": ms(max(gc_stores, default=0.0)),
            "ratio_held_on_vs_off": round(max(ms(t) for t, _ in on_loop) / max(max(held), 0.01), 1)}


def _text(r: dict[str, Any]) -> str:
    ip = r["in_process"]
    lines = [f"kvtier bench adopt: L1 {r['l1_gb']} GiB of {r['chunk_mb']} MiB chunks, {r['page_size_kb']} KiB pages"]
    if "restart" in r:
        rs, sp = r["restart"], r["store_path"]
        lines[0] += f" ({rs['chunks']} stored in {rs['fill_s']} s)"
        for mode in ("sigterm", "sigkill"):
            m = rs[mode]
            lines.append(f"  restart after {mode}: ready {m['ready_s']} s, first hit {m['first_hit_s']} s, "
                         f"{m['adopted']} chunks adopted in {m['adoption_s']} s")
        lines.append(f"  cold start: ready {rs['cold']['ready_s']} s with --l1-discard (the old L1 freed first), "
                     f"{rs['cold']['ready_nothing_to_remove_s']} s with nothing left to free")
        us = sp["us_per_chunk"]
        lines.append(f"  store path (reserve + commit, 1-page chunks, evicting): {us['journal']} us/chunk with the "
                     f"journal, {us['no_journal']} without: {sp['ratio']}x")
    for label, m in ip.items():
        line = (f"  in process, {m['entries']} {label.replace('_', ' ')} ({m['snapshot_bytes'] / MiB:.1f} MiB "
                f"snapshot): compaction holds the loop {m['on_loop_ms']} ms on it, {m['off_loop_held_ms']} ms "
                f"off it (capture {m['off_loop_capture_ms']}, slowest store meanwhile "
                f"{m['off_loop_slowest_store_ms']}, switch {m['off_loop_switch_store_ms']}; switched after "
                f"{m['off_loop_until_switch_ms']} ms; slowest store without compaction {m['baseline_slowest_store_ms']}; "
                f"{m['stores_with_a_full_gc_pass']} stores with a full GC pass, apart: up to {m['full_gc_store_ms']} ms)")
        if "adoption_s" in m:
            line += f", adoption {m['adoption_s']} s"
        p = m["paced"]
        lines += [line, f"    paced ({PACE_S * 1e6:g} us between stores): {p['on_loop_ms']} ms on the loop, "
                        f"{p['off_loop_held_ms']} ms off it (switch {p['off_loop_switch_store_ms']}; switched after "
                        f"{p['off_loop_until_switch_ms']} ms)"]
    return "\n".join(lines)
