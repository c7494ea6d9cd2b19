"""Trace replay: a workload driven through what the connector does, against the server's own L1 bookkeeping.

Per read, as the vLLM connector (connector/vllm/) does with its prefix cache reset: look up the whole blocks of all but the
last prompt token (the server's lookup stops at the first missing chunk and touches the hit prefix); then
store the prompt's whole blocks from the first chunk the hit did not cover (chunks that exist answer
"exists" and are touched, the others are reserved, making room through the policy, and committed). The
server side is the server's own `Cache` over L1 in this process (`L1Store` and `Holds` over a page pool
without a segment: only bookkeeping), so the replay sees exactly the server's lookup, index, page and
eviction rules; tests/integration/test_replay_vs_server.py drives the same connector steps through a real server and gets the same hits.

Belady's optimum is a clairvoyant policy under the same rules: the victim is the chunk whose next use
(the next read whose lookup reaches the chunk's first block) is furthest away, and a chunk is not admitted
when its own next use is further than that victim's.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.server import protocol as p
from kvtier.server.bench.trace_workloads import Geometry, Trace, chunks_of, key_position
from kvtier.server.cache import Cache
from kvtier.server.eviction import EvictionPolicy, make_policy
from kvtier.server.keys import ChunkKeys, Namespace
from kvtier.server.l1.holdings import ClientState
from kvtier.server.l1.holds import Holds
from kvtier.server.l1.pool import PagePool
from kvtier.server.l1.reconfig import set_quotas
from kvtier.server.l1.store import L1Store
from kvtier.server.metrics import Metrics
from kvtier.server.tenants import QuotaTable

BELADY = "belady"
NEVER = 1 << 62


class ReplayServer(Protocol):
    """What the connector's steps talk to: a lookup answering matched blocks per hit chunk, and a store."""

    def lookup(self, engine: int, chunks: Sequence[ChunkKeys]) -> list[int]: ...

    def store(self, engine: int, chunks: Sequence[ChunkKeys], sizes: Sequence[int], hint: p.Hint = p.NO_HINT
              ) -> None: ...

    def end_session(self, session: str) -> bool: ...  # called only by traces with sessions


def replay_namespace(geometry: Geometry) -> Namespace:
    return Namespace("trace-replay", "bfloat16", 1, 1, 1, geometry.block_tokens, "replay",
                     geometry.block_tokens * geometry.chunk_blocks)


class InProcessServer:
    """The server's `Cache` over an L1 of `capacity` pages (no lower tier), one registered client per engine,
    called as rpc.py calls it. An engine named in `salts` registers the namespace with that cache salt (a
    tenant's engine, `kvtier.tenant`); `quotas` is the L1's tenant quota table."""

    def __init__(self, policy: EvictionPolicy, capacity: int, geometry: Geometry,
                 salts: Mapping[int, str] | None = None, quotas: QuotaTable | None = None) -> None:
        metrics = Metrics()
        self.l1 = L1Store(PagePool(capacity, geometry.page_bytes), policy, metrics)
        self.holds = Holds(self.l1, metrics)
        self.cache = Cache(self.l1, self.holds, metrics)
        self.ns = replay_namespace(geometry)
        self.fp = self.holds.register(self.ns)
        self.salts = dict(salts or {})
        self.fps: dict[int, bytes] = {}  # engine -> the fingerprint of its namespace
        if quotas is not None:
            set_quotas(self.l1, quotas)

    def _owner(self, engine: int) -> tuple[ClientState, bytes]:
        ident = engine.to_bytes(4, "little")
        if ident not in self.holds.clients:
            self.holds.hello(ident, f"engine-{engine}", 0)
            salt = self.salts.get(engine)
            ns = self.ns if salt is None else dataclasses.replace(self.ns, cache_salt=salt)
            self.fps[engine] = self.holds.register(ns, self.holds.clients[ident])
        return self.holds.client(ident), self.fps[engine]

    def lookup(self, engine: int, chunks: Sequence[ChunkKeys]) -> list[int]:
        fp = self._owner(engine)[1]
        found = self.cache.lookup(fp, [list(c.block_keys) for c in chunks])
        self.l1.flush_touches()  # as the serving loop does right after the reply
        return [match for _, match in found.hits]

    def store(self, engine: int, chunks: Sequence[ChunkKeys], sizes: Sequence[int], hint: p.Hint = p.NO_HINT
              ) -> None:
        owner, fp = self._owner(engine)
        items = [p.StoreItem(c.key, size, len(c.block_keys), c.aliases) for c, size in zip(chunks, sizes, strict=True)]
        results = self.holds.reserve(owner, fp, items, hint=hint)
        self.cache.commit(owner, [r[1] for r in results if r[0] == p.RESERVED])

    def end_session(self, session: str) -> bool:
        return self.cache.end_session(session)


@dataclass
class Outcome:
    """Blocks the lookups asked for and found, per read and in total."""

    hits: list[int] = field(default_factory=list)
    requested: list[int] = field(default_factory=list)

    @property
    def hit_blocks(self) -> int:
        return sum(self.hits)

    @property
    def requested_blocks(self) -> int:
        return sum(self.requested)

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.requested_blocks if self.requested_blocks else 0.0


def drive(server: ReplayServer, trace: Trace, geometry: Geometry,
          before_read: Callable[[int], None] | None = None) -> Outcome:
    """Run `trace` through the connector's steps against `server`."""
    outcome = Outcome()
    cb = geometry.chunk_blocks
    for position, read in enumerate(trace):
        if before_read is not None:
            before_read(position)
        wanted = geometry.lookup_blocks(read.tokens)
        hit = sum(server.lookup(read.engine, chunks_of(read.doc, wanted, cb))) if wanted else 0
        outcome.hits.append(hit)
        outcome.requested.append(wanted)
        whole = geometry.stored_blocks(read.tokens)
        skip = hit // cb  # the connector does not offer again the whole chunks it was just served
        if skip * cb < whole:
            chunks = chunks_of(read.doc, whole, cb)[skip:]
            sizes = [len(c.block_keys) * geometry.block_bytes for c in chunks]
            if read.session:
                server.store(read.engine, chunks, sizes, p.Hint(session=read.session))
            else:
                server.store(read.engine, chunks, sizes)
        if read.end:
            server.end_session(read.session)
    return outcome


def replay(policy: str, trace: Trace, capacity: int, geometry: Geometry, salts: Mapping[int, str] | None = None,
           quotas: QuotaTable | None = None) -> Outcome:
    """`trace` through the connector's steps against an in-process server of `capacity` pages (engines named
    in `salts` in their tenant's namespace, under the quota table `quotas`)."""
    if capacity < 1:
        raise ValueError("capacity must be at least one page")
    if policy == BELADY:
        oracle = BeladyPolicy(trace, geometry)
        return drive(InProcessServer(oracle, capacity, geometry, salts, quotas), trace, geometry, oracle.advance)
    return drive(InProcessServer(make_policy(policy), capacity, geometry, salts, quotas), trace, geometry)


class BeladyPolicy(EvictionPolicy):
    """Clairvoyant victim order and admission for replay keys (`trace_workloads.block_key`), given the trace."""

    name = BELADY

    def __init__(self, trace: Trace, geometry: Geometry) -> None:
        self._chunk_blocks = geometry.chunk_blocks
        self._reads: dict[int, tuple[list[int], list[int]]] = {}  # doc -> (positions, blocks looked up)
        for position, read in enumerate(trace):
            positions, blocks = self._reads.setdefault(read.doc, ([], []))
            positions.append(position)
            blocks.append(geometry.lookup_blocks(read.tokens))
        self._now = 0
        self._next: dict[bytes, int] = {}  # resident key -> position of its next use
        # (-next use, -block, key): among chunks next used together the last of a document goes first, since
        # a chunk is found only through the chunks before it. Stale entries are skipped lazily.
        self._heap: list[tuple[int, int, bytes]] = []

    def advance(self, position: int) -> None:
        self._now = position

    def next_use(self, key: bytes) -> int:
        doc, last_block = key_position(key)
        first_block = last_block // self._chunk_blocks * self._chunk_blocks
        positions, blocks = self._reads.get(doc, ((), ()))
        for i in range(bisect.bisect_right(positions, self._now), len(positions)):
            if blocks[i] > first_block:
                return positions[i]
        return NEVER

    def insert(self, key: bytes, size: int) -> None:
        self.touch_or_insert(key)

    def touch(self, key: bytes) -> None:
        if key in self._next:
            self.touch_or_insert(key)

    def touch_or_insert(self, key: bytes) -> None:
        use = self.next_use(key)
        self._next[key] = use
        heapq.heappush(self._heap, (-use, -key_position(key)[1], key))

    def remove(self, key: bytes) -> None:
        self._next.pop(key, None)

    def _furthest(self, evictable: Callable[[bytes], bool]) -> tuple[int, bytes] | None:
        skipped: list[tuple[int, int, bytes]] = []
        found = None
        while self._heap:
            neg_use, _, key = self._heap[0]
            if self._next.get(key) != -neg_use:
                heapq.heappop(self._heap)
                continue
            if evictable(key):
                found = (-neg_use, key)
                break
            skipped.append(heapq.heappop(self._heap))
        for item in skipped:
            heapq.heappush(self._heap, item)
        return found

    def pick_victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        found = self._furthest(evictable)
        return None if found is None else found[1]

    def admit(self, key: bytes, size: int, evictable: Callable[[bytes], bool]) -> bool:
        found = self._furthest(evictable)
        return found is None or self.next_use(key) < found[0]

    def __len__(self) -> int:
        return len(self._next)

    def __contains__(self, key: object) -> bool:
        return key in self._next
