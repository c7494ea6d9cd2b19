"""Acceptance check: the default policy against Belady and LRU on replayed traces (issue check 6)."""

from __future__ import annotations

import argparse
import json

import pytest
from kvtier.server import bench_trace
from kvtier.server.eviction import DEFAULT_POLICY, POLICIES
from kvtier.server.eviction.replay import WORKLOADS, belady, simulate

pytestmark = pytest.mark.unit

CAPACITY = 512
SEED = 0


@pytest.fixture(scope="module")
def ratios() -> dict[str, dict[str, float]]:
    """workload -> policy (and "belady") -> hit ratio."""
    result = {}
    for workload, make_trace in WORKLOADS.items():
        trace = make_trace(CAPACITY, SEED)
        result[workload] = {name: simulate(name, trace, CAPACITY) for name in POLICIES}
        result[workload]["belady"] = belady(trace, CAPACITY)
    return result


@pytest.mark.parametrize("workload", ["cyclic", "zipf"])
def test_default_reaches_80_percent_of_belady(ratios: dict[str, dict[str, float]], workload: str) -> None:
    assert ratios[workload][DEFAULT_POLICY] >= 0.8 * ratios[workload]["belady"]


def test_default_keeps_up_with_lru_on_chat(ratios: dict[str, dict[str, float]]) -> None:
    chat = ratios["chat"]
    assert chat["lru"] > 0.3, "the chat trace must be recency-friendly"
    assert chat[DEFAULT_POLICY] >= 0.95 * chat["lru"]


def test_lru_falls_off_the_cliff_on_a_loop(ratios: dict[str, dict[str, float]]) -> None:
    assert ratios["cyclic"]["lru"] < 0.01


def test_belady_bounds_every_policy(ratios: dict[str, dict[str, float]]) -> None:
    for by_policy in ratios.values():
        assert all(ratio <= by_policy["belady"] + 1e-9 for ratio in by_policy.values())


def test_traces_are_deterministic() -> None:
    for make_trace in WORKLOADS.values():
        assert make_trace(64, 7) == make_trace(64, 7)
        assert make_trace(64, 7) != make_trace(64, 8)


def test_cyclic_working_set_is_185_percent() -> None:
    trace = WORKLOADS["cyclic"](200, 0)
    assert len({key for request in trace for key in request}) == 370


def test_simulate_counts_only_the_hit_prefix() -> None:
    a, b, c = (bytes([i]) * 16 for i in range(3))
    # [a, b] fills the cache; [c, b]: c misses first, so b is present but not a hit; [a]: evicted by c.
    assert simulate("lru", [[a, b], [c, b], [a]], 2) == 0.0
    assert simulate("lru", [[a, b], [a, b]], 2) == 0.5
    assert belady([[a, b], [c, b], [a]], 2) == 0.0


def test_bench_trace_json(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench_trace.add_arguments(parser)
    assert bench_trace.run(parser.parse_args(["--workload", "cyclic", "--capacity", "64", "--json"])) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["policy"] for row in rows} == {*POLICIES, "belady"}
    assert all(row["workload"] == "cyclic" for row in rows)
    assert bench_trace.run(parser.parse_args(["--workload", "zipf", "--capacity", "64"])) == 0
    assert "belady" in capsys.readouterr().out
