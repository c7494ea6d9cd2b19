"""The eviction targets on the connector-faithful replay (docs/performance.md), and the replay's own rules."""

from __future__ import annotations

import argparse
import json

import pytest
from kvtier.server.bench import trace as bench_trace
from kvtier.server.bench.trace_replay import BELADY, BeladyPolicy, InProcessServer, drive, replay
from kvtier.server.bench.trace_workloads import (
    CYCLIC_RATIOS,
    WORKLOADS,
    Geometry,
    Read,
    block_key,
    chunks_of,
    reread_trace,
    working_set_pages,
)
from kvtier.server.eviction import DEFAULT_POLICY, POLICIES

pytestmark = pytest.mark.unit

CAPACITY = 1024  # pages: the bench's default
SEED = 0
GEOMETRY = Geometry()
CYCLIC = [f"cyclic-{r:.1f}x" for r in CYCLIC_RATIOS]


@pytest.fixture(scope="module")
def ratios() -> dict[str, dict[str, float]]:
    """workload -> policy (lru, the default, belady) -> hit ratio."""
    result = {}
    for workload, make_trace in WORKLOADS.items():
        trace = make_trace(CAPACITY, GEOMETRY, SEED)
        result[workload] = {name: replay(name, trace, CAPACITY, GEOMETRY).hit_ratio
                            for name in {"lru", DEFAULT_POLICY, BELADY}}
    return result


@pytest.mark.parametrize("workload", [*CYCLIC, "zipf"])
def test_default_reaches_80_percent_of_belady(ratios: dict[str, dict[str, float]], workload: str) -> None:
    assert ratios[workload][BELADY] > 0.2
    assert ratios[workload][DEFAULT_POLICY] >= 0.8 * ratios[workload][BELADY]


def test_default_keeps_up_with_lru_on_chat(ratios: dict[str, dict[str, float]]) -> None:
    chat = ratios["chat"]
    assert chat["lru"] > 0.3, "the chat trace must be recency-friendly"
    assert chat[DEFAULT_POLICY] >= 0.95 * chat["lru"]


@pytest.mark.parametrize("workload", CYCLIC[1:])
def test_lru_falls_off_the_cliff_on_a_loop(ratios: dict[str, dict[str, float]], workload: str) -> None:
    assert ratios[workload]["lru"] < 0.01


@pytest.mark.parametrize("gib", bench_trace.REREAD_L1_GIB)
def test_default_holds_the_vllm_reread(gib: float) -> None:
    capacity = int(gib * (1 << 30)) // GEOMETRY.page_bytes
    trace = reread_trace()
    best = replay(BELADY, trace, capacity, GEOMETRY).hit_ratio
    assert 1.25 <= working_set_pages(trace, GEOMETRY) / capacity <= 2.25
    assert replay(DEFAULT_POLICY, trace, capacity, GEOMETRY).hit_ratio >= 0.8 * best > 0.2


def test_cyclic_working_sets_are_as_named() -> None:
    for ratio in CYCLIC_RATIOS:
        trace = WORKLOADS[f"cyclic-{ratio:.1f}x"](CAPACITY, GEOMETRY, SEED)
        assert ratio - 0.1 <= working_set_pages(trace, GEOMETRY) / CAPACITY <= ratio


def test_traces_are_deterministic() -> None:
    for make_trace in WORKLOADS.values():
        assert make_trace(256, GEOMETRY, 7) == make_trace(256, GEOMETRY, 7)
        assert make_trace(256, GEOMETRY, 7) != make_trace(256, GEOMETRY, 8)


# -- the connector's steps -------------------------------------------------------------------------

def test_geometry_of_a_1020_token_document() -> None:
    # 7 whole 128-token blocks: chunks of 2, 2, 2 and 1 blocks; 8 + 8 + 8 + 4 pages of 64 KiB
    assert GEOMETRY.lookup_blocks(1020) == GEOMETRY.stored_blocks(1020) == 7
    assert GEOMETRY.pages(1020) == 28
    assert [len(c.block_keys) for c in chunks_of(0, 7, 2)] == [2, 2, 2, 1]
    assert GEOMETRY.lookup_blocks(1024) == 7 and GEOMETRY.stored_blocks(1024) == 8  # one token stays


class Recorder(InProcessServer):
    """The in-process server, recording what the connector's steps send it."""

    def __init__(self, capacity: int) -> None:
        super().__init__(POLICIES["lru"](), capacity, GEOMETRY)
        self.calls: list[tuple[str, int, list[bytes]]] = []

    def lookup(self, engine, chunks):  # type: ignore[no-untyped-def]
        self.calls.append(("lookup", engine, [c.key for c in chunks]))
        return super().lookup(engine, chunks)

    def store(self, engine, chunks, sizes):  # type: ignore[no-untyped-def]
        self.calls.append(("store", engine, [c.key for c in chunks]))
        super().store(engine, chunks, sizes)


def test_a_miss_stores_the_whole_missed_suffix_and_a_hit_offers_only_its_partial_chunk() -> None:
    server = Recorder(capacity=64)
    outcome = drive(server, [Read(0, 1, 1020), Read(1, 1, 1020)], GEOMETRY)
    keys = [block_key(1, b) for b in (1, 3, 5, 6)]
    # the connector skips the whole chunks it was served (896 // 256 = 3): the partial one is offered again
    assert server.calls == [("lookup", 0, keys), ("store", 0, keys), ("lookup", 1, keys), ("store", 1, keys[3:])]
    assert outcome.hits == [0, 7] and outcome.requested == [7, 7]
    assert len(server.l1.entries) == 4


def test_the_lookup_stops_at_the_first_missing_chunk() -> None:
    server = Recorder(capacity=64)
    drive(server, [Read(0, 1, 1020)], GEOMETRY)
    first = server.l1.entries[block_key(1, 1)]
    server.l1.clear()
    drive(server, [Read(0, 1, 600)], GEOMETRY)  # stores chunks 0-1 (4 blocks) again
    server.l1.remove(server.l1.entries[block_key(1, 1)], "test")  # chunk 0 gone, chunk 1 stays
    assert first.key == block_key(1, 1)
    outcome = drive(server, [Read(0, 1, 1020)], GEOMETRY)
    assert outcome.hits == [0]  # chunk 1 is present but unreachable
    assert server.calls[-1] == ("store", 0, [block_key(1, b) for b in (1, 3, 5, 6)])


def test_belady_refuses_what_comes_back_later_than_everything_it_holds() -> None:
    # 8 pages hold one 2-block chunk; doc 2 is read again before doc 1 is, so doc 1 is never admitted over it
    trace = [Read(0, 2, 300), Read(0, 1, 300), Read(0, 2, 300), Read(0, 1, 300)]
    policy = BeladyPolicy(trace, GEOMETRY)
    outcome = drive(InProcessServer(policy, 8, GEOMETRY), trace, GEOMETRY, policy.advance)
    assert outcome.hits == [0, 0, 2, 0]
    assert replay("lru", trace, 8, GEOMETRY).hits == [0, 0, 0, 0]


def test_bench_trace_json(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench_trace.add_arguments(parser)
    assert bench_trace.run(parser.parse_args(["--workload", "cyclic-1.6x", "--capacity", "256", "--json"])) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {row["policy"] for row in rows} == {*POLICIES, BELADY}
    assert {row["workload"] for row in rows} == {"cyclic-1.6x"}
    assert bench_trace.run(parser.parse_args(["--workload", "reread", "--l1-gib", "0.05"])) == 0
    assert "reread-0.05GiB" in capsys.readouterr().out
    assert bench_trace.run(parser.parse_args(["--capacity", "0"])) == 2
