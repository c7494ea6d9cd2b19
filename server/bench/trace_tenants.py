"""The replay's tenant and agent workloads (`kvtier bench trace --workload tenants|agent`): what tenant quotas
and session hints keep, measured through the connector's steps against the server's own L1 (trace_replay.py).

- `tenants`: tenant A scans one-off documents totalling ~10x L1, interleaved with tenant B's loop of documents
  that fits in ~60 % of L1. Each tenant is its own engine whose namespace carries the tenant's cache salt. B's
  loop is measured alone, next to A with no quota table, and next to A under the table `A=30%,B=70%`.
- `agent`: long agent sessions (8 at a time, 16 in all, 20-40 turns each); a turn re-reads the session's whole
  history and appends to it, and between two turns of a session (its think time) the other sessions run and
  one-off documents totalling ~1.5x L1 pass through. Appends are sized from L1 (a 1:4 range, as 200-800
  tokens are) so that the histories live at one time stay under L1 (~0.6-0.7x at their peak; ~1.7x L1 over
  the trace): a policy that knew the sessions could keep them all. The history
  hit ratio is measured with each turn storing under `Hint(session=...)` (the last turn ends the session) and
  without the hint.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from dataclasses import dataclass

from kvtier.server.bench.trace_replay import BELADY, Outcome, replay
from kvtier.server.bench.trace_workloads import DOC_TOKENS, Geometry, Read, Trace
from kvtier.server.eviction import POLICIES
from kvtier.server.tenants import QuotaTable

TENANTS, AGENT = "tenants", "agent"
ENGINE_A, ENGINE_B = 0, 1
SALTS = {ENGINE_A: "A", ENGINE_B: "B"}  # each tenant's engine names its cache salt
QUOTAS = "A=30%,B=70%"
LOOP_SHARE, LOOP_PASSES = 0.6, 10  # B's loop: documents filling ~60 % of L1, read 10 times
SCAN_FACTOR = 10.0  # A's one-off documents together, x L1
SCAN_DOC0 = 1 << 32  # A's document ids, apart from B's
AGENT_LIVE, AGENT_SESSIONS, AGENT_TURNS = 8, 16, (20, 40)
AGENT_APPEND_SHARE = 0.9  # 8 sessions of 30 mean appends ~ this share of L1: sets the append size
ONE_OFF_PER_GAP = 1.5  # one-off documents passing between two turns of a session, x L1
ONE_OFF_DOC0 = 1 << 40


def documents(rng: random.Random, geometry: Geometry, pages: float) -> list[int]:
    """Token lengths of 700-3,500-token documents whose pages together stay under `pages` (at least one)."""
    lengths: list[int] = []
    total = 0
    while True:
        tokens = rng.randint(*DOC_TOKENS)
        if total + geometry.pages(tokens) > pages and lengths:
            return lengths
        lengths.append(tokens)
        total += geometry.pages(tokens)


def tenants_trace(capacity: int, geometry: Geometry, seed: int = 0) -> Trace:
    """B's loop (engine ENGINE_B) with A's scan (engine ENGINE_A) spread evenly between its reads."""
    rng = random.Random(seed)
    loop = documents(rng, geometry, LOOP_SHARE * capacity)
    scan = documents(rng, geometry, SCAN_FACTOR * capacity)
    reads = [Read(ENGINE_B, d, loop[d]) for _ in range(LOOP_PASSES) for d in range(len(loop))]
    trace: Trace = []
    for i, read in enumerate(reads):
        trace.append(read)
        trace += [Read(ENGINE_A, SCAN_DOC0 + a, scan[a])
                  for a in range(i * len(scan) // len(reads), (i + 1) * len(scan) // len(reads))]
    return trace


def agent_trace(capacity: int, geometry: Geometry, seed: int = 0) -> Trace:
    """Agent sessions in turns, each ready again after a random think time (in turns of the others), with
    one-off documents after every turn; the last turn of a session carries `end`."""
    rng = random.Random(seed)
    pages = AGENT_APPEND_SHARE * capacity / (AGENT_LIVE * sum(AGENT_TURNS) / 2)
    mean = max(5, round(pages * geometry.page_bytes / geometry.block_bytes * geometry.block_tokens))
    appends = (mean * 2 // 5, mean * 8 // 5)  # a 1:4 range around the mean, as 200-800 tokens
    ready: list[tuple[float, int]] = []  # (time, session)
    state: dict[int, tuple[int, int]] = {}  # session -> (tokens so far, turns left)
    started = one_offs = 0
    budget = 0.0  # pages of one-off documents owed
    trace: Trace = []

    def start(now: float) -> None:
        nonlocal started
        state[started] = (0, rng.randint(*AGENT_TURNS))
        heapq.heappush(ready, (now + rng.random(), started))
        started += 1

    while started < AGENT_LIVE:
        start(0.0)
    while ready:
        now, session = heapq.heappop(ready)
        tokens, left = state.pop(session)
        tokens += rng.randint(*appends)
        trace.append(Read(session % 2, session, tokens, session=f"agent-{session}", end=left == 1))
        if left > 1:
            state[session] = (tokens, left - 1)
            heapq.heappush(ready, (now + rng.uniform(0.5, 1.5) * AGENT_LIVE, session))
        elif started < AGENT_SESSIONS:
            start(now)
        budget += ONE_OFF_PER_GAP * capacity / AGENT_LIVE
        while budget > 0:
            length = rng.randint(*DOC_TOKENS)
            trace.append(Read(one_offs % 2, ONE_OFF_DOC0 + one_offs, length))
            one_offs += 1
            budget -= geometry.pages(length)
    return trace


def without_sessions(trace: Trace) -> Trace:
    return [dataclasses.replace(read, session="", end=False) for read in trace]


def live_history_pages(trace: Trace, geometry: Geometry) -> tuple[int, int]:
    """(the most pages the histories of live sessions take at one time, every session's history in all)."""
    live: dict[str, int] = {}
    final: dict[str, int] = {}
    peak = 0
    for read in trace:
        if read.session:
            live[read.session] = final[read.session] = geometry.pages(read.tokens)
            peak = max(peak, sum(live.values()))
            if read.end:
                del live[read.session]
    return peak, sum(final.values())


def ratio_of(trace: Trace, outcome: Outcome, engine: int) -> float:
    """Hit ratio of the reads of one engine (a tenant)."""
    hit = sum(h for r, h in zip(trace, outcome.hits, strict=True) if r.engine == engine)
    wanted = sum(w for r, w in zip(trace, outcome.requested, strict=True) if r.engine == engine)
    return hit / wanted if wanted else 0.0


def history_ratio(trace: Trace, outcome: Outcome, geometry: Geometry) -> float:
    """Blocks found of those a session's earlier turns stored (every turn after a session's first)."""
    stored: dict[int, int] = {}  # session -> whole blocks its last turn stored
    hit = wanted = 0
    for read, found in zip(trace, outcome.hits, strict=True):
        if read.doc >= ONE_OFF_DOC0:
            continue
        if read.doc in stored:
            hit += found
            wanted += min(stored[read.doc], geometry.lookup_blocks(read.tokens))
        stored[read.doc] = geometry.stored_blocks(read.tokens)
    return hit / wanted if wanted else 0.0


@dataclass(frozen=True)
class TenantRow:
    """B's loop hit ratio for one policy: alone, next to A's scan without quotas, and with the quota table."""

    policy: str
    alone: float
    shared: float
    quotas: float

    @property
    def kept(self) -> float:
        return self.quotas / self.alone if self.alone else 0.0


@dataclass(frozen=True)
class AgentRow:
    """The history hit ratio for one policy with the session hint and without it."""

    policy: str
    sessions: float
    without: float


def tenant_rows(capacity: int, geometry: Geometry, seed: int = 0) -> list[TenantRow]:
    trace = tenants_trace(capacity, geometry, seed)
    alone = [read for read in trace if read.engine == ENGINE_B]
    table = QuotaTable.parse(QUOTAS)
    rows = []
    for name in [*POLICIES, BELADY]:
        rows.append(TenantRow(
            name,
            ratio_of(alone, replay(name, alone, capacity, geometry, SALTS), ENGINE_B),
            ratio_of(trace, replay(name, trace, capacity, geometry, SALTS), ENGINE_B),
            ratio_of(trace, replay(name, trace, capacity, geometry, SALTS, table), ENGINE_B)))
    return rows


def agent_rows(capacity: int, geometry: Geometry, seed: int = 0) -> list[AgentRow]:
    trace = agent_trace(capacity, geometry, seed)
    plain = without_sessions(trace)
    return [AgentRow(name, history_ratio(trace, replay(name, trace, capacity, geometry), geometry),
                     history_ratio(plain, replay(name, plain, capacity, geometry), geometry))
            for name in [*POLICIES, BELADY]]


def describe(workload: str, capacity: int, geometry: Geometry, seed: int) -> str:
    """The sizes of the workload's trace, relative to L1."""
    if workload == TENANTS:
        trace = tenants_trace(capacity, geometry, seed)
        loop = {r.doc: r.tokens for r in trace if r.engine == ENGINE_B}
        scan = {r.doc: r.tokens for r in trace if r.engine == ENGINE_A}
        return (f"B's loop {sum(map(geometry.pages, loop.values())) / capacity:.2f}x L1 ({len(loop)} documents, "
                f"{LOOP_PASSES} passes); A's scan {sum(map(geometry.pages, scan.values())) / capacity:.2f}x L1 "
                f"({len(scan)} documents); table {QUOTAS}")
    trace = agent_trace(capacity, geometry, seed)
    peak, total = live_history_pages(trace, geometry)
    one_off = sum(geometry.pages(r.tokens) for r in trace if not r.session)
    return (f"{AGENT_SESSIONS} sessions, {AGENT_LIVE} at a time, {sum(1 for r in trace if r.session)} turns; "
            f"live histories at most {peak / capacity:.2f}x L1, {total / capacity:.2f}x L1 in all; one-off "
            f"documents {one_off / capacity:.1f}x L1")


def format_tenants(rows: list[TenantRow]) -> str:
    lines = [f"{'policy':<8} {'B alone':>8} {'B + A, no table':>16} {'B + A, ' + QUOTAS:>20} {'table/alone':>12}"]
    lines += [f"{r.policy:<8} {r.alone:>8.3f} {r.shared:>16.3f} {r.quotas:>20.3f} {r.kept:>12.3f}" for r in rows]
    return "\n".join(lines)


def format_agent(rows: list[AgentRow]) -> str:
    lines = [f"{'policy':<8} {'history, sessions':>18} {'history, no hint':>17}"]
    lines += [f"{r.policy:<8} {r.sessions:>18.3f} {r.without:>17.3f}" for r in rows]
    return "\n".join(lines)
