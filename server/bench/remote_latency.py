"""The latency part of `kvtier bench remote` (remote.py's docstring says what is measured): stores and L1 hits
of a server with the remote tier, with its Redis running and then SIGSTOPped, against a server without one."""

from __future__ import annotations

import os
import signal
import time
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
from kvtier.server.bench import common as bc

if TYPE_CHECKING:
    from kvtier.connector.client import KVTierClient
    from kvtier.server.keys import Namespace

CHUNKS = 2  # chunks per prompt
TOKENS = 256  # tokens per chunk
WARMUP = 5  # iterations per phase not counted
SIDES = ("remote", "no_remote")
PHASES = ("up", "stopped", "stopped_open")
BREAKER_WAIT_S = 30.0
STAT_KEYS = ("remote_timeouts", "remote_rejected_calls", "remote_errors", "remote_breakers_open", "remote_written")


def _connect(url: str) -> KVTierClient:
    from kvtier.connector.client import ClientConfig, KVTierClient

    c = KVTierClient(ClientConfig(url=url, strict=True, request_timeout_s=60.0))
    c.connect()
    return c


def _remote_stats(c: KVTierClient) -> dict[str, Any]:
    stats = c.stats() or {}
    return {k: stats.get(k) for k in STAT_KEYS}


def _iteration(c: KVTierClient, ns: Namespace, tokens: np.ndarray, payload: np.ndarray,
               buf: np.ndarray) -> tuple[float, float]:
    """Store a new prompt, then read it back as an L1 hit (lookup, acquire, copy out, release): their seconds."""
    size = len(payload)
    t0 = time.perf_counter()
    res = c.store(ns, tokens, lambda _c: size, lambda _ch, span: span.write(0, payload))
    t1 = time.perf_counter()
    found = c.lookup(ns, tokens)
    got = c.retrieve_chunks(ns, found.hits, lambda rc: rc.span.read(0, buf[:rc.span.size]))
    t2 = time.perf_counter()
    if res.stored != CHUNKS or found.tiers != ["l1"] * CHUNKS or got != CHUNKS * TOKENS // ns.block_size:
        raise RuntimeError(f"store {res} / L1 hit {found.tiers}, {got} blocks: not a whole store and hit")
    return t1 - t0, t2 - t1


def _phase(clients: dict[str, KVTierClient], ns: Namespace, prompts: int, payload: np.ndarray,
           rng: np.random.Generator) -> dict[str, dict[str, dict[str, float]]]:
    """`prompts` iterations (after WARMUP) on each server, alternating which goes first."""
    buf = np.empty(len(payload), dtype=np.uint8)
    samples: dict[str, dict[str, list[float]]] = {s: {"store": [], "l1_hit": []} for s in SIDES}
    for i in range(WARMUP + prompts):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            tokens = rng.integers(0, 1 << 31, CHUNKS * TOKENS, dtype=np.int64)
            store, hit = _iteration(clients[side], ns, tokens, payload, buf)
            if i >= WARMUP:
                samples[side]["store"].append(store)
                samples[side]["l1_hit"].append(hit)
    return {side: {op: bc.percentiles(v) for op, v in ops.items()} for side, ops in samples.items()}


def bench_latency(url: str, pid: int, prompts: int, size: int) -> dict[str, Any]:
    """See remote.py's docstring. `pid`: the redis-server behind `url` (remote.check_pid checked it)."""
    from kvtier.server.keys import Namespace
    from kvtier.server.tiers.remote.tier import RemoteTier

    ns = Namespace(model="kvtier-bench-remote", dtype="bfloat16", num_layers=32, kv_heads=8, head_size=128,
                   block_size=16, layout=f"bench-remote-{size}", chunk_size=TOKENS)
    l1_gb = max(0.25, 4 * (WARMUP + prompts) * CHUNKS * size / (1 << 30))  # three phases, nothing evicted
    prefix = f"kvtier-bench-{uuid.uuid4().hex[:12]}"
    rng = np.random.default_rng(1)
    payload = rng.integers(0, 256, size, dtype=np.uint8)
    servers = {"remote": bc.start_server(l1_gb, ["--remote-url", url, "--remote-prefix", prefix]),
               "no_remote": bc.start_server(l1_gb)}
    out: dict[str, Any] = {"chunk_bytes": size, "chunks_per_prompt": CHUNKS, "prompts": prompts, "prefix": prefix}
    try:
        clients = {side: _connect(s.url) for side, s in servers.items()}
        out["up"] = _phase(clients, ns, prompts, payload, rng)
        os.kill(pid, signal.SIGSTOP)
        try:  # at once (the writer's calls time out, the breaker still closed), then once it opened
            out["stopped"] = _phase(clients, ns, prompts, payload, rng)
            out["stats_stopped"] = _remote_stats(clients["remote"])
            deadline = time.monotonic() + BREAKER_WAIT_S
            while not _remote_stats(clients["remote"])["remote_breakers_open"]:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the breaker did not open within {BREAKER_WAIT_S} s of SIGSTOP")
                time.sleep(0.05)
            out["stopped_open"] = _phase(clients, ns, prompts, payload, rng)
            out["stats_stopped_open"] = _remote_stats(clients["remote"])
        finally:
            os.kill(pid, signal.SIGCONT)
        for c in clients.values():
            c.close()
    finally:
        for s in servers.values():
            s.stop()
        tier = RemoteTier(url, prefix=prefix)
        tier.clear(None)
        tier.close()
    out["ratios"] = {f"{op}_{phase}": out[phase]["remote"][op]["p50_us"] / out[phase]["no_remote"][op]["p50_us"]
                     for phase in PHASES[1:] for op in ("store", "l1_hit")}
    return out


def text(lat: dict[str, Any]) -> str:
    lines = [f"latency, {lat['prompts']} prompts of {lat['chunks_per_prompt']} x {lat['chunk_bytes'] / (1 << 20):g} "
             f"MiB chunks per phase (p50 / p99 us): a new prompt stored, then read as an L1 hit (lookup + acquire "
             f"+ copy + release)",
             f"  {'phase':>14} {'server':>10} {'store p50':>10} {'p99':>8} {'L1 hit p50':>11} {'p99':>8}"]
    titles = {"up": "Redis up", "stopped": "SIGSTOP", "stopped_open": "breaker open"}
    for phase in PHASES:
        for side in SIDES:
            x = lat[phase][side]
            lines.append(f"  {titles[phase]:>14} {side:>10} {x['store']['p50_us']:10.0f} {x['store']['p99_us']:8.0f} "
                         f"{x['l1_hit']['p50_us']:11.0f} {x['l1_hit']['p99_us']:8.0f}")
    for phase in PHASES[1:]:
        s = lat[f"stats_{phase}"]
        lines.append(f"  after {titles[phase]}: remote timeouts {s['remote_timeouts']}, rejected calls "
                     f"{s['remote_rejected_calls']}, breakers open {s['remote_breakers_open']}; p50 with remote / "
                     f"without: store {lat['ratios'][f'store_{phase}']:.2f}x, L1 hit {lat['ratios'][f'l1_hit_{phase}']:.2f}x")
    return "\n".join(lines)
