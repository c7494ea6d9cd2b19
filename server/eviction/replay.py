"""Trace replay: synthetic KV-cache workloads, a simulator for any policy, and Belady's optimum as reference.

A request is one document read: the list of its chunk keys. Keys are prefix-chained, so a chunk only helps if
every chunk before it hits: a request's hits are the longest present prefix. All chunks have the same size and
the capacity is counted in chunks. Simulating a request: the hit prefix is touched, then each later chunk is
touched if present or inserted (after evicting victims until there is room) if not; every store is admitted.
"""

from __future__ import annotations

import heapq
import random
import struct
from collections.abc import Callable, Sequence

from . import make_policy
from .base import EvictionPolicy

Request = list[bytes]
Trace = list[Request]

CYCLIC_WORKING_SET = 1.85  # x capacity: a loop just too big for the cache, where LRU gets 0 %
ZIPF_S = 1.1
ZIPF_DOCS = 20
ZIPF_CACHED_FRACTION = 0.45  # the cache holds ~45 % of the 20 documents


def _key(doc: int, chunk: int) -> bytes:
    """An opaque 16-byte key for chunk `chunk` of document (or session) `doc`."""
    return struct.pack("<QQ", doc, chunk)


def _doc(doc: int, chunks: int) -> Request:
    return [_key(doc, i) for i in range(chunks)]


def cyclic_trace(capacity: int, seed: int = 0, passes: int = 6) -> Trace:
    """Documents of 8-24 chunks read in a fixed order, `passes` times; working set = 1.85 x capacity."""
    rng = random.Random(seed)
    docs: Trace = []
    remaining = round(CYCLIC_WORKING_SET * capacity)
    while remaining > 0:
        chunks = min(remaining, rng.randint(8, 24))
        docs.append(_doc(len(docs), chunks))
        remaining -= chunks
    return [doc for _ in range(passes) for doc in docs]


def zipf_trace(capacity: int, seed: int = 0, requests: int = 1500) -> Trace:
    """Reads of 20 equal documents with Zipf(1.1) popularity; the cache holds ~45 % of them."""
    rng = random.Random(seed)
    chunks = max(1, round(capacity / (ZIPF_CACHED_FRACTION * ZIPF_DOCS)))
    docs = [_doc(d, chunks) for d in range(ZIPF_DOCS)]
    order = list(range(ZIPF_DOCS))
    rng.shuffle(order)  # popularity rank is unrelated to document id
    weights = [1.0 / (rank + 1) ** ZIPF_S for rank in range(ZIPF_DOCS)]
    return [docs[order[rank]] for rank in rng.choices(range(ZIPF_DOCS), weights, k=requests)]


def chat_trace(capacity: int, seed: int = 0, sessions: int = 400, active: int | None = None) -> Trace:
    """Interleaved multi-round chats: each round re-reads the session's whole history and appends 1-4 chunks.

    `active` sessions run at once (by default sized so their histories together are ~1.5x the cache); a
    session lasts 3-12 rounds and a new one arrives when one ends, so recency is what predicts re-use.
    """
    rng = random.Random(seed)
    active = active or max(2, round(1.5 * capacity / 18))  # a mid-life history is ~18 chunks
    histories: dict[int, tuple[int, int]] = {}  # session -> (chunks so far, rounds left)
    started = 0
    trace: Trace = []
    while histories or started < sessions:
        while len(histories) < active and started < sessions:
            histories[started] = (0, rng.randint(3, 12))
            started += 1
        session = rng.choice(list(histories))
        length, rounds_left = histories[session]
        length += rng.randint(1, 4)
        trace.append(_doc(session, length))
        if rounds_left > 1:
            histories[session] = (length, rounds_left - 1)
        else:
            del histories[session]
    return trace


WORKLOADS: dict[str, Callable[[int, int], Trace]] = {
    "cyclic": cyclic_trace,
    "zipf": zipf_trace,
    "chat": chat_trace,
}


def _always(_key: bytes) -> bool:
    return True


def simulate(policy: str | EvictionPolicy, trace: Sequence[Request], capacity: int) -> float:
    """Hit ratio (hit chunks / requested chunks) of `policy` (a name or a fresh instance) on `trace`."""
    if capacity < 1:
        raise ValueError("capacity must be at least one chunk")
    policy = make_policy(policy) if isinstance(policy, str) else policy
    present: set[bytes] = set()
    hits = requested = 0
    for request in trace:
        prefix = _present_prefix(request, present)
        hits += prefix
        requested += len(request)
        for key in request[:prefix]:
            policy.touch(key)
        for key in request[prefix:]:
            if key in present:
                policy.touch(key)
                continue
            while len(present) >= capacity:
                victim = policy.pick_victim(_always)
                assert victim is not None, "a full cache with nothing pinned must have a victim"
                present.remove(victim)
                policy.remove(victim)
            policy.insert(key, 1)
            present.add(key)
    return hits / requested if requested else 0.0


def belady(trace: Sequence[Request], capacity: int) -> float:
    """Hit ratio of Belady's OPT (evict the present key re-used furthest in the future) under the same rules."""
    if capacity < 1:
        raise ValueError("capacity must be at least one chunk")
    next_use = _next_uses(trace)
    present: dict[bytes, int] = {}  # key -> position of its next use
    heap: list[tuple[int, bytes]] = []  # (-next use, key), stale entries skipped lazily
    hits = requested = 0
    position = 0
    for request in trace:
        prefix = _present_prefix(request, present)
        hits += prefix
        requested += len(request)
        for key in request:
            if key not in present:
                while len(present) >= capacity:
                    neg_use, victim = heapq.heappop(heap)
                    if present.get(victim) == -neg_use:
                        del present[victim]
            present[key] = next_use[position]
            heapq.heappush(heap, (-next_use[position], key))
            position += 1
    return hits / requested if requested else 0.0


def _present_prefix(request: Request, present: set[bytes] | dict[bytes, int]) -> int:
    for i, key in enumerate(request):
        if key not in present:
            return i
    return len(request)


def _next_uses(trace: Sequence[Request]) -> list[int]:
    """For each access (in trace order), the position of the next access to the same key (never: a sentinel)."""
    accesses = [key for request in trace for key in request]
    never = len(accesses)
    following: dict[bytes, int] = {}
    result = [never] * len(accesses)
    for position in range(len(accesses) - 1, -1, -1):
        key = accesses[position]
        result[position] = following.get(key, never)
        following[key] = position
    return result
