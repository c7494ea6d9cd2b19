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
    return 0
