"""Tenant quotas and session hints on the connector-faithful replay (docs/performance.md): the quota table keeps
a quiet tenant's loop next to a noisy tenant's scan, and session hints keep agent histories between turns."""

from __future__ import annotations

import argparse
import json
from collections import Counter

import pytest
from kvtier.server.bench import trace as bench_trace
from kvtier.server.bench.trace_replay import BELADY, InProcessServer, drive, replay
from kvtier.server.bench.trace_tenants import (
    AGENT_LIVE,
    AGENT_SESSIONS,
    AGENT_TURNS,
    ENGINE_A,
    ENGINE_B,
    QUOTAS,
    SALTS,
    AgentRow,
    TenantRow,
    agent_rows,
    agent_trace,
    history_ratio,
    live_history_pages,
    ratio_of,
    tenant_rows,
    tenants_trace,
    without_sessions,
)
from kvtier.server.bench.trace_workloads import Geometry, Read
from kvtier.server.eviction import DEFAULT_POLICY, POLICIES, make_policy
from kvtier.server.tenants import QuotaTable

pytestmark = pytest.mark.unit

CAPACITY = 1024  # pages: the bench's default
SEED = 0
GEOMETRY = Geometry()
EVERY = [*POLICIES, BELADY]


@pytest.fixture(scope="module")
def tenants() -> dict[str, TenantRow]:
    return {row.policy: row for row in tenant_rows(CAPACITY, GEOMETRY, SEED)}


@pytest.fixture(scope="module")
def agent() -> dict[str, AgentRow]:
    return {row.policy: row for row in agent_rows(CAPACITY, GEOMETRY, SEED)}


# -- tenants -------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", EVERY)
def test_the_quota_table_keeps_b_s_loop_next_to_a_s_scan(tenants: dict[str, TenantRow], policy: str) -> None:
    row = tenants[policy]
    assert row.alone > 0.8, "alone, B's loop fits in L1 and is found after its first pass"
    assert row.quotas >= 0.95 * row.alone


@pytest.mark.parametrize("policy", ["lru", DEFAULT_POLICY])
def test_without_a_table_a_s_scan_takes_b_s_loop(tenants: dict[str, TenantRow], policy: str) -> None:
    assert tenants[policy].shared < 0.2 * tenants[policy].alone


def test_the_tenants_trace_is_a_loop_in_60_percent_of_l1_and_a_scan_of_10x() -> None:
    trace = tenants_trace(CAPACITY, GEOMETRY, SEED)
    loop = {r.doc: r.tokens for r in trace if r.engine == ENGINE_B}
    scan = Counter(r.doc for r in trace if r.engine == ENGINE_A)
    assert 0.5 <= sum(map(GEOMETRY.pages, loop.values())) / CAPACITY <= 0.6
    assert set(scan.values()) == {1}, "A reads each of its documents once"
    pages = {r.doc: GEOMETRY.pages(r.tokens) for r in trace if r.engine == ENGINE_A}
    assert 9.5 <= sum(pages.values()) / CAPACITY <= 10
    assert not set(loop) & set(scan)
    # the scan is spread over the loop: no run of A's reads between two of B's is over 0.3x L1
    run = longest = 0
    for read in trace:
        run = run + GEOMETRY.pages(read.tokens) if read.engine == ENGINE_A else 0
        longest = max(longest, run)
    assert longest <= 0.3 * CAPACITY
    assert trace == tenants_trace(CAPACITY, GEOMETRY, SEED) != tenants_trace(CAPACITY, GEOMETRY, SEED + 1)


def test_each_tenant_s_engine_stores_in_its_tenant() -> None:
    trace = tenants_trace(256, GEOMETRY, SEED)[:40]
    server = InProcessServer(make_policy("lru"), 256, GEOMETRY, SALTS, QuotaTable.parse(QUOTAS))
    drive(server, trace, GEOMETRY)
    book = server.l1.tenants
    assert {engine: book.tenant(fp) for engine, fp in server.fps.items()} == {ENGINE_A: "A", ENGINE_B: "B"}
    assert book.usage["A"].pages > 0 and book.usage["B"].pages > 0
    assert book.usage["A"].pages + book.usage["B"].pages == server.l1.pool.used_pages


# -- agent sessions ------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", EVERY)
def test_session_hints_keep_every_live_history(agent: dict[str, AgentRow], policy: str) -> None:
    assert agent[policy].sessions >= 0.99


@pytest.mark.parametrize("policy", ["lru", DEFAULT_POLICY])
def test_without_the_hint_most_history_is_lost(agent: dict[str, AgentRow], policy: str) -> None:
    assert agent[policy].without < 0.3


def test_the_agent_trace_has_long_sessions_with_one_off_traffic_between_turns() -> None:
    trace = agent_trace(CAPACITY, GEOMETRY, SEED)
    turns = Counter(r.session for r in trace if r.session)
    assert len(turns) == AGENT_SESSIONS
    assert all(AGENT_TURNS[0] <= n <= AGENT_TURNS[1] for n in turns.values())
    ends = [r.session for r in trace if r.end]
    assert sorted(ends) == sorted(turns), "each session ends once"
    last: dict[str, int] = {}
    live: set[str] = set()
    for read in trace:
        if read.session:
            assert read.tokens > last.get(read.session, 0), "a session's history grows, and no turn follows its end"
            live.add(read.session)
            assert len(live) <= AGENT_LIVE
            last[read.session] = read.tokens if not read.end else 1 << 30
            if read.end:
                live.discard(read.session)
    peak, total = live_history_pages(trace, GEOMETRY)
    assert peak <= 0.8 * CAPACITY, "the live histories fit in L1: a session hint can keep them all"
    assert 1.5 <= total / CAPACITY <= 2.0
    assert sum(GEOMETRY.pages(r.tokens) for r in trace if not r.session) > 50 * CAPACITY
    assert trace == agent_trace(CAPACITY, GEOMETRY, SEED) != agent_trace(CAPACITY, GEOMETRY, SEED + 1)
    assert not any(r.session or r.end for r in without_sessions(trace))


def test_the_history_ratio_is_one_when_nothing_is_evicted() -> None:
    trace = without_sessions(agent_trace(256, GEOMETRY, SEED))
    assert history_ratio(trace, replay("lru", trace, 1 << 20, GEOMETRY), GEOMETRY) == 1.0


def test_the_store_carries_the_session_and_the_last_turn_ends_it() -> None:
    server = InProcessServer(make_policy("lru"), 64, GEOMETRY)
    drive(server, [Read(0, 1, 600, session="s")], GEOMETRY)
    assert server.end_session("s") is True
    drive(server, [Read(0, 2, 600, session="t"), Read(0, 2, 900, session="t", end=True)], GEOMETRY)
    assert server.end_session("t") is False, "the last turn ended it"


def test_ratio_of_counts_one_engine() -> None:
    trace = [Read(ENGINE_B, 1, 600), Read(ENGINE_A, 2, 600), Read(ENGINE_B, 1, 600)]
    outcome = replay("lru", trace, 64, GEOMETRY, SALTS)
    assert ratio_of(trace, outcome, ENGINE_B) == 0.5 and ratio_of(trace, outcome, ENGINE_A) == 0.0


def test_bench_trace_tenants_and_agent_json(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench_trace.add_arguments(parser)
    for workload in ("tenants", "agent"):
        assert bench_trace.run(parser.parse_args(["--workload", workload, "--capacity", "256", "--json"])) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["workload"] == workload and {row["policy"] for row in out["rows"]} == set(EVERY)
    assert bench_trace.run(parser.parse_args(["--workload", "agent", "--capacity", "256"])) == 0
    assert "history, sessions" in capsys.readouterr().out
