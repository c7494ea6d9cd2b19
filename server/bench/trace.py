"""`kvtier bench trace`: replay workloads through the connector's steps with every eviction policy and
Belady's optimum (server/bench/trace_replay.py), and what each policy costs per key; `--workload tenants` and
`--workload agent` measure tenant quotas and session hints (server/bench/trace_tenants.py)."""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc
from dataclasses import asdict, dataclass

from kvtier.server.bench import trace_tenants
from kvtier.server.bench.trace_replay import BELADY, replay
from kvtier.server.bench.trace_tenants import AGENT, TENANTS
from kvtier.server.bench.trace_workloads import (
    WORKLOADS,
    Geometry,
    Trace,
    block_key,
    reread_trace,
    working_set_pages,
)
from kvtier.server.eviction import POLICIES, EvictionPolicy, make_policy

REREAD = "reread"
REREAD_L1_GIB = (0.0526, 0.0427, 0.0311)  # the reread workload at ~1.3x, ~1.6x and ~2.2x L1
COST_KEYS = 50_000


@dataclass(frozen=True)
class Row:
    workload: str
    touched: float  # pages of every document the trace reads / L1 pages (chat: every session it ever runs)
    policy: str
    hit_ratio: float  # looked-up blocks found
    hit_blocks: int
    vs_belady: float
    vs_lru: float | None  # None where LRU gets no hits at all


@dataclass(frozen=True)
class Cost:
    policy: str
    bytes_per_key: float  # policy state per resident key, that of remembered (evicted) keys included
    ns_per_op: float  # one insert, touch or offer, averaged over a mixed sequence


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=["all", *WORKLOADS, REREAD, TENANTS, AGENT], default="all",
                        help="all: the eviction workloads and reread; tenants and agent run only when named")
    parser.add_argument("--capacity", type=int, default=1024, help="L1 size in pages (default 1024)")
    parser.add_argument("--l1-gib", type=float, nargs="+", default=list(REREAD_L1_GIB),
                        help="L1 sizes for the reread workload (default: ~1.3x, ~1.6x, ~2.2x its working set)")
    parser.add_argument("--page-size-kb", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost", action="store_true", help="also measure memory and time per key per policy")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", default="", help="also write a PNG bar chart here (needs matplotlib)")


def measure(workload: str, trace: Trace, capacity: int, geometry: Geometry) -> list[Row]:
    """One row per policy plus Belady, for one trace at one L1 size."""
    outcomes = {name: replay(name, trace, capacity, geometry) for name in [*POLICIES, BELADY]}
    best, lru = outcomes[BELADY].hit_ratio, outcomes["lru"].hit_ratio
    touched = working_set_pages(trace, geometry) / capacity
    return [
        Row(workload, touched, name, o.hit_ratio, o.hit_blocks, o.hit_ratio / best if best else 0.0,
            o.hit_ratio / lru if lru else None)
        for name, o in outcomes.items()
    ]


def reread_rows(l1_gib: list[float], geometry: Geometry) -> list[Row]:
    trace = reread_trace()
    return [row for gib in l1_gib
            for row in measure(f"reread-{gib:g}GiB", trace, int(gib * (1 << 30)) // geometry.page_bytes, geometry)]


def cost(name: str) -> Cost:
    """Policy state and time per key: fill with COST_KEYS keys, then a scan of twice as many new keys
    offered to a full cache, each after a touch of a resident one. Memory and time in separate runs."""
    keys = [block_key(k, 0) for k in range(3 * COST_KEYS)]  # not counted: the cache holds them anyway
    tracemalloc.start()
    policy = make_policy(name)
    _exercise(policy, keys)
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del policy
    started = time.perf_counter()
    ops = _exercise(make_policy(name), keys)
    return Cost(name, used / COST_KEYS, (time.perf_counter() - started) / ops * 1e9)


def _exercise(policy: EvictionPolicy, keys: list[bytes]) -> int:
    for key in keys[:COST_KEYS]:
        policy.insert(key, 1)
    ops = COST_KEYS
    for i, key in enumerate(keys[COST_KEYS:]):
        policy.touch(keys[COST_KEYS + i // 2])  # the scan's keys are touched once more, half a scan later
        if policy.admit(key, 1, _always):
            victim = policy.pick_victim(_always)
            assert victim is not None
            policy.remove(victim)
            policy.insert(key, 1)
        ops += 2
    return ops


def _always(_key: bytes) -> bool:
    return True


def format_table(rows: list[Row]) -> str:
    lines = [f"{'workload':<18} {'read/L1':>7} {'policy':<8} {'hit ratio':>9} {'/belady':>8} {'/lru':>8}"]
    for row in rows:
        vs_lru = "-" if row.vs_lru is None else f"{row.vs_lru:.3f}"
        lines.append(f"{row.workload:<18} {row.touched:>7.2f} {row.policy:<8} {row.hit_ratio:>9.3f} "
                     f"{row.vs_belady:>8.3f} {vs_lru:>8}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.capacity < 1 or args.page_size_kb < 1 or min(args.l1_gib) <= 0:
        print("--capacity, --page-size-kb and --l1-gib must be positive")
        return 2
    geometry = Geometry(page_bytes=args.page_size_kb << 10)
    if args.workload in (TENANTS, AGENT):
        return run_hints(args.workload, args, geometry)
    names = list(WORKLOADS) if args.workload == "all" else [] if args.workload == REREAD else [args.workload]
    rows = [row for name in names
            for row in measure(name, WORKLOADS[name](args.capacity, geometry, args.seed), args.capacity, geometry)]
    if args.workload in ("all", REREAD):
        rows += reread_rows(args.l1_gib, geometry)
    costs = [cost(name) for name in POLICIES] if args.cost else []
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "cost": [asdict(c) for c in costs]}, indent=2))
    else:
        print(format_table(rows))
        for c in costs:
            print(f"cost {c.policy:<8} {c.bytes_per_key:>7.0f} B per key {c.ns_per_op:>7.0f} ns per operation")
    if args.plot:
        plot(rows, args.plot)
    return 0


def run_hints(workload: str, args: argparse.Namespace, geometry: Geometry) -> int:
    """The tenants or agent table: per policy, what the quota table or the session hint keeps."""
    about = trace_tenants.describe(workload, args.capacity, geometry, args.seed)
    if workload == TENANTS:
        rows: list = trace_tenants.tenant_rows(args.capacity, geometry, args.seed)
        table = trace_tenants.format_tenants(rows)
    else:
        rows = trace_tenants.agent_rows(args.capacity, geometry, args.seed)
        table = trace_tenants.format_agent(rows)
    if args.json:
        print(json.dumps({"workload": workload, "trace": about, "rows": [asdict(r) for r in rows]}, indent=2))
    else:
        print(f"{workload}: {about}\n{table}")
    return 0


def plot(rows: list[Row], path: str) -> None:
    """Hit ratio relative to Belady per workload and policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in rows))
    policies = [p for p in dict.fromkeys(r.policy for r in rows) if p != BELADY]
    width = 0.8 / len(policies)
    fig, ax = plt.subplots(figsize=(10, 3.8))
    for i, policy in enumerate(policies):
        values = [next((r.vs_belady for r in rows if r.workload == w and r.policy == policy), 0.0) for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], values, width, label=policy)
    ax.axhline(0.8, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xticks([x + width * (len(policies) - 1) / 2 for x in range(len(workloads))], workloads, rotation=30,
                  ha="right", fontsize=8)
    ax.set_ylabel("hits / Belady's hits")
    ax.set_title("Trace replay through the connector's steps: policies vs Belady (same trace, same L1)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
