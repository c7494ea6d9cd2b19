"""Synthetic KV-cache workloads as the connector issues them: which engine reads how many tokens of which
document (or chat session), in what order.

A read of `tokens` prompt tokens is what vLLM hands the connector: it looks up the whole blocks of all but
the last token and, after the prefill, stores the whole blocks of the prompt (`trace_replay.py` does both,
as the vLLM connector in connector/vllm/ does). Block `i` of document `doc` has the opaque key (doc, i);
keys are prefix-chained in the server's sense (a chunk is found only through the chunks before it) because every chunk of a
document is only ever looked up after the chunks before it. Sizes are counted in L1 pages of the geometry.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from kvtier.server.keys import ChunkKeys

DOC_TOKENS = (700, 3500)  # document lengths of the cyclic and Zipf traces
ZIPF_S = 1.1
ZIPF_DOCS = 20
ZIPF_CACHED_FRACTION = 0.45  # L1 holds ~45 % of the Zipf documents
CHAT_ACTIVE_FACTOR = 1.5  # active chat histories together ~1.5x L1
REREAD_DOCS, REREAD_TOKENS, REREAD_PASSES = 40, 1020, 4  # the vLLM reread workload (docs/performance.md)


@dataclass(frozen=True)
class Geometry:
    """What sizes a read takes on the server. Defaults: vLLM's CPU build serving the project's tiny Llama
    (128-token blocks of 256 KiB for all layers), 256-token chunks and kvtier's default 64 KiB pages."""

    block_tokens: int = 128
    chunk_blocks: int = 2
    block_bytes: int = 256 << 10
    page_bytes: int = 64 << 10

    def lookup_blocks(self, tokens: int) -> int:
        """Whole blocks the connector looks up: at least one prompt token always stays to compute."""
        return max(tokens - 1, 0) // self.block_tokens

    def stored_blocks(self, tokens: int) -> int:
        return tokens // self.block_tokens

    def chunk_pages(self, blocks: int) -> int:
        return math.ceil(blocks * self.block_bytes / self.page_bytes)

    def pages(self, tokens: int) -> int:
        """L1 pages a stored read takes (its last chunk may be partial)."""
        blocks = self.stored_blocks(tokens)
        whole, rest = divmod(blocks, self.chunk_blocks)
        return whole * self.chunk_pages(self.chunk_blocks) + (self.chunk_pages(rest) if rest else 0)

    def tokens_for_pages(self, pages: float) -> int:
        return max(self.block_tokens, round(pages * self.page_bytes / self.block_bytes * self.block_tokens))


@dataclass(frozen=True)
class Read:
    """One request: engine `engine` sends the first `tokens` tokens of document (or session) `doc`; a turn of
    an agent session stores with the hint `session` and the session's last turn (`end`) ends it."""

    engine: int
    doc: int
    tokens: int
    session: str = ""
    end: bool = False


Trace = list[Read]


def block_key(doc: int, block: int) -> bytes:
    return struct.pack("<QQ", doc, block)


def key_position(key: bytes) -> tuple[int, int]:
    """(doc, block) of a key built by `block_key`."""
    doc, block = struct.unpack("<QQ", key)
    return doc, block


@lru_cache(maxsize=65536)
def chunks_of(doc: int, blocks: int, chunk_blocks: int) -> tuple[ChunkKeys, ...]:
    """The chunk keys of the first `blocks` blocks of `doc`, as `keys.chunk_keys` cuts a prompt."""
    return tuple(
        ChunkKeys(i, start, chunk_blocks, tuple(block_key(doc, b) for b in range(start, min(start + chunk_blocks, blocks))))
        for i, start in enumerate(range(0, blocks, chunk_blocks))
    )


def working_set_pages(trace: Trace, geometry: Geometry) -> int:
    longest: dict[int, int] = {}
    for read in trace:
        longest[read.doc] = max(longest.get(read.doc, 0), read.tokens)
    return sum(geometry.pages(tokens) for tokens in longest.values())


def cyclic_trace(capacity: int, geometry: Geometry, ratio: float, seed: int = 0, passes: int = 4,
                 engines: int = 2) -> Trace:
    """Documents of 700-3,500 tokens read in a fixed order `passes` times by `engines` engines in turn; the
    documents' pages together are `ratio` x `capacity` (as close as whole documents allow)."""
    rng = random.Random(seed)
    lengths: list[int] = []
    total = 0
    while True:
        tokens = rng.randint(*DOC_TOKENS)
        pages = geometry.pages(tokens)
        if total + pages > ratio * capacity and lengths:
            break
        lengths.append(tokens)
        total += pages
    n = len(lengths)
    return [Read((p * n + d) % engines, d, lengths[d]) for p in range(passes) for d in range(n)]


def reread_trace(docs: int = REREAD_DOCS, tokens: int = REREAD_TOKENS, passes: int = REREAD_PASSES) -> Trace:
    """The vLLM reread workload: `docs` documents of `tokens` tokens read in order `passes` times, one engine."""
    return [Read(0, d, tokens) for _ in range(passes) for d in range(docs)]


def zipf_trace(capacity: int, geometry: Geometry, seed: int = 0, requests: int = 1500, engines: int = 2) -> Trace:
    """Reads of 20 documents with Zipf(1.1) popularity; L1 holds ~45 % of their pages."""
    rng = random.Random(seed)
    mean_tokens = geometry.tokens_for_pages(capacity / (ZIPF_CACHED_FRACTION * ZIPF_DOCS))
    lengths = [rng.randint(mean_tokens // 2, mean_tokens * 3 // 2) for _ in range(ZIPF_DOCS)]
    order = list(range(ZIPF_DOCS))
    rng.shuffle(order)  # popularity rank is unrelated to document id
    weights = [1.0 / (rank + 1) ** ZIPF_S for rank in range(ZIPF_DOCS)]
    picks = rng.choices(range(ZIPF_DOCS), weights, k=requests)
    return [Read(rng.randrange(engines), order[rank], lengths[order[rank]]) for rank in picks]


def chat_trace(capacity: int, geometry: Geometry, seed: int = 0, sessions: int = 400, engines: int = 2) -> Trace:
    """Interleaved multi-round chats: each round re-reads the session's history and appends 64-640 tokens.

    Sessions run on a fixed engine and last 3-12 rounds; a new one starts when one ends; the active
    histories together are ~1.5x L1, so recency is what predicts re-use.
    """
    rng = random.Random(seed)
    mid_life_pages = geometry.pages(7 * 352)  # ~7 rounds of ~352 tokens
    active = max(2, round(CHAT_ACTIVE_FACTOR * capacity / max(1, mid_life_pages)))
    histories: dict[int, tuple[int, int]] = {}  # session -> (tokens so far, rounds left)
    started = 0
    trace: Trace = []
    while histories or started < sessions:
        while len(histories) < active and started < sessions:
            histories[started] = (0, rng.randint(3, 12))
            started += 1
        session = rng.choice(list(histories))
        tokens, rounds_left = histories[session]
        tokens += rng.randint(64, 640)
        trace.append(Read(session % engines, session, tokens))
        if rounds_left > 1:
            histories[session] = (tokens, rounds_left - 1)
        else:
            del histories[session]
    return trace


CYCLIC_RATIOS = (1.0, 1.3, 1.6, 2.0, 2.5)
WORKLOADS: dict[str, Callable[[int, Geometry, int], Trace]] = {
    **{f"cyclic-{r:.1f}x": (lambda c, g, s, r=r: cyclic_trace(c, g, r, s)) for r in CYCLIC_RATIOS},
    "zipf": zipf_trace,
    "chat": chat_trace,
}
