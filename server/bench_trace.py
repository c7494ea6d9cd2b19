"""`kvtier bench trace`: replay synthetic workloads with every eviction policy and Belady's optimum."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from .eviction import POLICIES
from .eviction.replay import WORKLOADS, belady, simulate

BELADY = "belady"


@dataclass(frozen=True)
class Row:
    workload: str
    policy: str
    hit_ratio: float
    vs_belady: float
    vs_lru: float | None  # None where LRU gets no hits at all


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=["all", *WORKLOADS], default="all")
    parser.add_argument("--capacity", type=int, default=512, help="cache size in chunks (default 512)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", default="", help="also write a PNG bar chart here (needs matplotlib)")


def measure(workload: str, capacity: int, seed: int) -> list[Row]:
    """One row per policy plus Belady, for one workload."""
    trace = WORKLOADS[workload](capacity, seed)
    ratios = {name: simulate(name, trace, capacity) for name in POLICIES}
    ratios[BELADY] = belady(trace, capacity)
    lru = ratios["lru"]
    return [
        Row(
            workload,
            name,
            ratio,
            ratio / ratios[BELADY] if ratios[BELADY] else 0.0,
            ratio / lru if lru else None,
        )
        for name, ratio in ratios.items()
    ]


def format_table(rows: list[Row]) -> str:
    lines = [f"{'workload':<9} {'policy':<8} {'hit ratio':>9} {'/belady':>8} {'/lru':>8}"]
    for row in rows:
        vs_lru = "-" if row.vs_lru is None else f"{row.vs_lru:.3f}"
        lines.append(
            f"{row.workload:<9} {row.policy:<8} {row.hit_ratio:>9.3f} {row.vs_belady:>8.3f} {vs_lru:>8}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.capacity < 1:
        print("--capacity must be at least 1 chunk")
        return 2
    workloads = list(WORKLOADS) if args.workload == "all" else [args.workload]
    rows = [row for workload in workloads for row in measure(workload, args.capacity, args.seed)]
    if args.json:
        print(json.dumps([asdict(row) for row in rows], indent=2))
    else:
        print(format_table(rows))
    if args.plot:
        plot(rows, args.plot)
    return 0


def plot(rows: list[Row], path: str) -> None:
    """Hit ratio per workload and policy, Belady's optimum beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in rows))
    policies = list(dict.fromkeys(r.policy for r in rows))
    width = 0.8 / len(policies)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, policy in enumerate(policies):
        values = [next((r.hit_ratio for r in rows if r.workload == w and r.policy == policy), 0.0) for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], values, width, label=policy)
    ax.set_xticks([x + width * (len(policies) - 1) / 2 for x in range(len(workloads))], workloads)
    ax.set_ylabel("chunk hit ratio")
    ax.set_title("Trace replay: eviction policies vs Belady (same trace, same capacity)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
