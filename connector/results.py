"""What KVTierClient's calls answer: lookup hits, store outcomes, the chunks a read hands its callback."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.server.keys import ChunkKeys
from kvtier.shm.pages import PageSpan

L1_TIER = "l1"


@dataclass(frozen=True)
class ChunkHit:
    chunk: ChunkKeys
    match: int  # leading engine blocks of this chunk that are stored
    tier: str


@dataclass
class LookupResult:
    """The longest stored prefix: per matched chunk, its leading stored blocks and tier. `hits` is built on
    first use: an engine's scheduler usually needs only `tokens`."""

    chunks: list[ChunkKeys]
    matches: list[int]
    tiers: list[str]
    block_size: int
    # Measured read bandwidth (bytes/s) of the lower tiers, sent with lower-tier hits; 0.0 = not measured yet.
    bandwidth: dict[str, float] = field(default_factory=dict)
    # Measured round trip (s) of the network tiers among them (the remote tier).
    rtt: dict[str, float] = field(default_factory=dict)
    # A tier could not answer for the chunk after the hits yet (a remote probe is running): ask again shortly.
    pending: bool = False
    # The lease on the hits found in L1 (a lookup with `lease`); 0 = none. The caller releases it.
    lease: int = 0

    @property
    def all_in_l1(self) -> bool:
        return all(tier == L1_TIER for tier in self.tiers)

    @functools.cached_property
    def hits(self) -> list[ChunkHit]:
        return list(map(ChunkHit, self.chunks, self.matches, self.tiers))

    @property
    def blocks(self) -> int:
        return sum(self.matches)

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    def tokens_faster_than(self, min_bandwidth: float, prefill_tokens_per_s: float = 0.0) -> int:
        """Prefix tokens worth loading rather than recomputing: up to the first chunk in a lower tier whose
        measured read bandwidth is below `min_bandwidth` bytes/s (the break-even: KV bytes per token x the
        engine's prefill rate), and without a trailing run of a network tier's chunks whose tokens prefill
        computes faster than one round trip to that tier (`prefill_tokens_per_s`). A tier not measured yet
        counts as fast; `min_bandwidth` 0 keeps every hit."""
        if min_bandwidth <= 0 or not self.bandwidth:
            return self.tokens
        blocks = 0
        run_tier, run_blocks = "", 0  # the trailing run of one lower tier's chunks
        for match, tier in zip(self.matches, self.tiers, strict=True):
            if tier != L1_TIER and 0.0 < self.bandwidth.get(tier, 0.0) < min_bandwidth:
                break
            run_tier, run_blocks = (tier, run_blocks + match) if tier == run_tier else (tier, match)
            blocks += match
        rtt = self.rtt.get(run_tier, 0.0)
        if rtt and prefill_tokens_per_s > 0 and run_blocks * self.block_size / prefill_tokens_per_s < rtt:
            blocks -= run_blocks
        return blocks * self.block_size


@dataclass
class StoreResult:
    stored: int = 0
    existing: int = 0
    busy: int = 0
    refused: dict[str, int] = field(default_factory=dict)

    @classmethod
    def merged(cls, parts: list[StoreResult]) -> StoreResult:
        out = cls(sum(r.stored for r in parts), sum(r.existing for r in parts), sum(r.busy for r in parts))
        for r in parts:
            for reason, n in r.refused.items():
                out.refused[reason] = out.refused.get(reason, 0) + n
        return out


@dataclass
class ReadOutcome:
    """Engine blocks a read delivered, and why it stopped short ("" when it did not; else one of
    protocol.UNDELIVERED_REASONS)."""

    blocks: int
    reason: str = ""


@dataclass(frozen=True)
class ReadChunk:
    """A leased chunk to copy out: `match` leading blocks of the stored `blocks` are the caller's."""

    chunk: ChunkKeys
    blocks: int
    match: int
    span: PageSpan


WriteFn = Callable[[ChunkKeys, PageSpan], None]
ReadFn = Callable[[ReadChunk], None]
