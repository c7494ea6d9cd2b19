"""Cache: the one facade rpc.py and the admin API call, with or without lower tiers.

Where a lookup is decided: `Cache.lookup` asks L1 (l1/store.py) for the longest stored prefix, then each
lower tier in order (`LowerTier.find_prefix`, non-blocking) for the chunks after it, starting their
promotion into L1 (tiers/promotion.py); a hit reports its tier. `acquire` waits for promotions of the chunks
it leases. Each chunk L1 commits is handed to every lower tier's write-behind (after a warm restart, each
adopted chunk a tier lacks too: `write_behind_again`). `status` is the one summary
the `stats` op, `/status` and `kvtier status` show.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from kvtier.server import events
from kvtier.server.keys import chunk_keys
from kvtier.server.l1.holds import AcquiredChunk, ClientState, Holds
from kvtier.server.l1.reporter import L1Reporter
from kvtier.server.l1.store import Entry, L1Store
from kvtier.server.metrics import L1, Metrics
from kvtier.server.tiers.attached import AttachedTier

Acquired = tuple[int, list[AcquiredChunk | None]]

log = logging.getLogger("kvtier.server")


def continues(match: int, block_keys: Sequence[bytes], blocks_per_chunk: int) -> bool:
    """Whether a prefix that matched `match` leading blocks of this chunk goes on into the next chunk."""
    return match >= blocks_per_chunk and match >= len(block_keys)


@dataclass
class Found:
    """A lookup's answer: per chunk of the longest stored prefix its entry (a lower-tier hit's may still be
    in flight) and matched blocks, and the tier it was found in."""

    hits: list[tuple[Entry, int]]
    tiers: list[str] = field(default_factory=list)
    pending: bool = False  # a tier could not say yet whether it holds the next chunk (its probe is running)


@dataclass
class Peeked:
    """A peek's answer: matched blocks per chunk of the longest stored prefix, the tier each was found in."""

    blocks: list[int] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)
    pending: bool = False  # as Found.pending: the prefix may go on in a tier that is still asking its server


def _cut(found: Found, blocks: int) -> None:
    """Cut `found` to its first `blocks` matched blocks."""
    for i, (entry, match) in enumerate(found.hits):
        if match >= blocks:
            found.hits[i:] = [(entry, blocks)] if blocks else []
            del found.tiers[len(found.hits):]
            return
        blocks -= match


@dataclass
class Cleared:
    """What a clear removed, per tier: {"entries", "bytes"} (and "failed" for a lower tier)."""

    tiers: dict[str, dict[str, int]]
    unknown: bool  # the namespace is not registered and no lower tier searched had a chunk of it


class Cache:
    def __init__(self, store: L1Store, holds: Holds, metrics: Metrics, tiers: Sequence[AttachedTier] = ()) -> None:
        self.store = store
        self.holds = holds
        self.metrics = metrics
        self._l1_hits = metrics.hit_tokens.labels(L1)  # counted on every lookup that hits
        self.tiers = list(tiers)
        self.bus = events.Bus()  # what every tier stores and removes (server/events.py)
        store.listeners.append(L1Reporter(self.bus))
        for tier in self.tiers:
            tier.tier.report = self.bus.post  # type: ignore[method-assign]

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self) -> None:
        for tier in self.tiers:
            tier.open()

    def attach_loop(self, loop: Any) -> None:
        for tier in self.tiers:
            tier.attach_loop(loop)

    def close(self, timeout: float = 5.0) -> None:
        for tier in self.tiers:
            tier.close(timeout)

    def tier(self, name: str) -> AttachedTier | None:
        return next((t for t in self.tiers if t.name == name), None)

    # -- lookup ----------------------------------------------------------------------------------

    def lookup(self, fp: bytes, chunks: list[list[bytes]], count: bool = True) -> Found:
        """`count`: whether the lookup goes into the metrics (False for a request asked about again)."""
        found = self._find(fp, chunks)
        if count:
            self._count(fp, found, chunks, self.store.namespace(fp).block_size)
        return found

    def lookup_ranks(self, ranks: Sequence[tuple[bytes, list[list[bytes]]]], count: bool = True) -> list[Found]:
        """The prefix that every one of `ranks` holds: (namespace, chunks) per worker of one engine (tensor
        parallel ranks store their own KV of the same tokens, under their own keys, and each rank's chunks are
        evicted on their own), every chunk list cut by the same token boundaries. Each rank's answer is cut to
        the fewest blocks any rank holds; a chunk's tier is L1 only where every rank has it in L1 (else the
        first lower tier a rank found it in); pending when a rank that holds the fewest may still find more.
        Counted once, as the first rank's lookup."""
        founds = [self._find(fp, chunks) for fp, chunks in ranks]
        held = [sum(match for _, match in found.hits) for found in founds]
        least = min(held)
        pending = any(found.pending for found, blocks in zip(founds, held, strict=True) if blocks == least)
        for found in founds:
            _cut(found, least)
        per_chunk = zip(*(found.tiers for found in founds), strict=True)  # cut alike: as many chunks each
        tiers = [next((t for t in chunk_tiers if t != L1), L1) for chunk_tiers in per_chunk]
        for found in founds:
            found.tiers, found.pending = list(tiers), pending
        fp, chunks = ranks[0]
        if count:
            self._count(fp, founds[0], chunks, self.store.namespace(fp).block_size)
        return founds

    def _find(self, fp: bytes, chunks: list[list[bytes]]) -> Found:
        found = Found(self.store.lookup(fp, chunks))
        found.tiers = [L1] * len(found.hits)
        ns = self.store.namespace(fp)
        for tier in self.tiers:
            if len(found.hits) >= len(chunks) or tier.promotions.fenced(fp):
                break
            if found.hits and not continues(found.hits[-1][1], chunks[len(found.hits) - 1], ns.blocks_per_chunk):
                break  # the prefix ended inside a chunk
            self._extend(tier, fp, chunks, found, ns.blocks_per_chunk)  # or none: the next tier may have it
            if found.pending:
                break
        return found

    def peek(self, fp: bytes, chunks: list[list[bytes]]) -> Peeked:
        """What a lookup of `chunks` would find now, read-only: no policy touch in L1 or L2, no promotion,
        nothing held, leased or counted. A chunk L1 has is reported in L1 (also when a lower tier has it
        too); the prefix goes on in the lower tiers in order, as in `lookup`. A remote tier that does not
        know a chunk yet starts its background probe (reads only) and the answer is pending."""
        l1 = [match for _, match in self.store.peek(fp, chunks)]
        out = Peeked(l1, [L1] * len(l1))
        bpc = self.store.namespace(fp).blocks_per_chunk
        for tier in self.tiers:
            n = len(out.blocks)
            if n >= len(chunks) or tier.promotions.fenced(fp):
                break
            if n and not continues(out.blocks[-1], chunks[n - 1], bpc):
                break  # the prefix ended inside a chunk
            records = tier.tier.find_prefix(chunks[n:], fp)
            if records is None:
                out.pending = True
                break
            for (meta, match), block_keys in zip(records, chunks[n:], strict=False):
                if meta.ns != fp:
                    break
                out.blocks.append(match)
                out.tiers.append(L1 if meta.key in self.store.entries else tier.name)
                if not continues(match, block_keys, bpc):
                    break
        return out

    def count_local_misses(self, fp: bytes, lookups: int, blocks: int, block_size: int) -> None:
        """Lookups a client's presence filter answered as misses (the `report` op): counted as this server's."""
        self._requested(fp, lookups, blocks, block_size, [])

    def _requested(self, fp: bytes, lookups: int, blocks: int, block_size: int, hits: list[tuple[Any, int]]) -> None:
        m = self.metrics
        m.lookups.inc(lookups)
        m.requested_blocks.inc(blocks)
        m.requested_tokens.inc(blocks * block_size)
        if self.store.tenants.table is not None:  # per tenant only when tenants are named: off the plain path
            self.store.tenants.looked_up(fp, blocks * block_size, sum(map(itemgetter(1), hits)) * block_size)

    def _count(self, fp: bytes, found: Found, chunks: list[list[bytes]], block_size: int) -> None:
        """The lookup's metrics: requested blocks and tokens, hit tokens by the tier that had them."""
        m = self.metrics
        self._requested(fp, 1, sum(map(len, chunks)), block_size, found.hits)
        if not found.hits:
            return
        if found.tiers[-1] == L1:  # the common case (lower-tier hits follow the L1 prefix): one sum
            self._l1_hits.inc(sum(map(itemgetter(1), found.hits)) * block_size)
            return
        per_tier: dict[str, int] = {}
        for (_, match), tier in zip(found.hits, found.tiers, strict=True):
            per_tier[tier] = per_tier.get(tier, 0) + match
        for tier, blocks in per_tier.items():
            m.hit_tokens.labels(tier).inc(blocks * block_size)

    def _extend(self, tier: AttachedTier, fp: bytes, chunks: list[list[bytes]], found: Found, bpc: int) -> None:
        """Continue the prefix with `tier`'s chunks, starting their promotion; what is found so far is held
        meanwhile, so room made for promotions cannot evict it."""
        store, promotions = self.store, tier.promotions
        rest = chunks[len(found.hits):]
        records = tier.tier.find_prefix(rest, fp)
        if records is None:
            found.pending = True
            return
        held = [entry for entry, _ in found.hits]
        for entry in held:
            store.hold(entry)
        try:
            for (meta, match), block_keys in zip(records, rest, strict=False):
                if meta.ns != fp:
                    break
                where, promo = tier.name, promotions.get(meta.key)
                if promo is not None:
                    entry = promo.entry
                elif meta.key in store.entries:  # promoted meanwhile (reads finish in any order)
                    entry, where = store.entries[meta.key], L1
                elif meta.key in store.busy:  # a client is storing it
                    break
                else:
                    promo = promotions.start(meta)
                    if promo is None or promo.ok is False:
                        break
                    entry = promo.entry
                if store.entries.get(entry.key) is entry:  # indexed: hold it like the prefix before it
                    store.hold(entry)
                    held.append(entry)
                found.hits.append((entry, match))
                found.tiers.append(where)
                if not continues(match, block_keys, bpc):
                    break
        finally:
            for entry in held:
                store.unhold(entry)

    def bandwidths(self) -> dict[str, float]:
        """Measured read bandwidth per lower tier, bytes/s (0.0: not measured yet), for lookup replies."""
        return {t.name: t.read_bw.bytes_per_s for t in self.tiers}

    def round_trips(self) -> dict[str, float]:
        """Measured round trip per lower tier that has one (a network tier), seconds, for lookup replies."""
        return {t.name: t.tier.rtt_s for t in self.tiers if t.tier.rtt_s}

    # -- store and read --------------------------------------------------------------------------

    def commit(self, owner: ClientState, rids: Iterable[int]) -> int:
        return self.holds.commit(owner, rids, self._committed if self.tiers else None)

    def _committed(self, entry: Entry) -> None:
        for tier in self.tiers:
            tier.write_behind(entry)

    def write_behind_again(self, entries: Sequence[Entry]) -> Awaitable[None]:
        """Warm restart: hand adopted chunks (`entries`, oldest first) to each lower tier's write-behind again,
        as a coroutine to run beside serving. The old daemon's queue died with it, so a chunk it committed and
        had not written behind (or dropped from a full queue) would otherwise live only in L1. Newest first
        (those are the ones the queue had not reached); a chunk the tier has (`contains`: L2's index after its
        scan; the remote tier's presence cache, and its put asks the store before writing) or that left L1 is
        skipped; a clear of the tier (or the chunk's namespace in it) since this call skips the rest. Never
        fills more than half a writer's queue (waits for room), so new commits' write-behind is not dropped
        for it. Called before serving starts: the epochs taken here precede any clear."""
        epochs = [{ns: tier.writer.epochs(ns) for ns in {e.ns for e in entries}} for tier in self.tiers]
        return asyncio.gather(*(tier.write_behind_again(entries[::-1], before, self.store.entries)
                                for tier, before in zip(self.tiers, epochs, strict=True)))

    def acquire(self, ident: bytes, fp: bytes, keys: list[bytes]) -> Acquired | Awaitable[Acquired]:
        """Lease `keys`; an awaitable of the lease while any of them is still being promoted from a lower
        tier (a promotion that fails leaves a miss, None, for its key)."""
        owner = self.holds.client(ident)
        for tier in self.tiers:
            waits = tier.promotions.waits(keys)
            if waits is not None:
                return self._acquire_later(ident, fp, keys, waits)
        return self.holds.acquire(owner, fp, keys)

    async def _acquire_later(self, ident: bytes, fp: bytes, keys: list[bytes], waits: Awaitable[Any]) -> Acquired:
        await waits
        leased = self.acquire(ident, fp, keys)  # not_registered if the client was dropped meanwhile
        return leased if isinstance(leased, tuple) else await leased

    def end_session(self, session: str) -> bool:
        """A request hint's session ended (docs/hints.md): its chunks go back to the eviction order."""
        return self.holds.retention.end(session)

    # -- admin -----------------------------------------------------------------------------------

    async def clear(self, fp: bytes | None, l1: bool = True, lower: Iterable[str] | None = None) -> Cleared:
        """Remove every chunk (of namespace `fp`) from L1 (if `l1`) and from the lower tiers named in
        `lower` (None: all of them)."""
        registered = fp is None or fp in self.store.namespaces
        done: dict[str, dict[str, int]] = {}
        if l1:
            n, b = self.store.clear(fp) if registered else (0, 0)
            done[L1] = {"entries": n, "bytes": b}
            self.bus.post(events.Cleared(L1, fp))
        below = [t for t in self.tiers if lower is None or t.name in lower]
        for tier in below:
            c = await tier.clear(fp)
            # `failed`: chunks it could not remove (forgotten all the same: never served again)
            done[tier.name] = {"entries": c.entries, "bytes": c.nbytes, "failed": c.failed}
        found_below = sum(done[t.name]["entries"] for t in below)
        return Cleared(done, not registered and bool(below) and found_below == 0)

    def held(self) -> list[events.Stored]:
        """Serving loop: every chunk L1 and the local lower tiers hold now (the event feed's snapshot)."""
        out = [events.Stored(L1, e.ns, e.key, e.blocks, e.aliases, e.size, e.tokens, e.parent)
               for e in self.store.entries.values()]
        for tier in self.tiers:
            out += tier.tier.held()
        return out

    def health(self) -> tuple[dict[str, bool], dict[str, str], dict[str, str]]:
        """Per tier needed for readiness: (ok, why not); and the tiers that are down but do not make the server
        unready (a shared network tier), with why: the degraded ones."""
        checks: dict[str, bool] = {}
        reasons: dict[str, str] = {}
        degraded: dict[str, str] = {}
        for tier in self.tiers:
            ok, why = tier.health()
            if tier.tier.required_for_readiness:
                checks[tier.name], reasons[tier.name] = ok, why
            elif not ok:
                degraded[tier.name] = why
        return checks, reasons, degraded

    # -- status ----------------------------------------------------------------------------------

    def status(self) -> dict:
        """The flat summary of the `stats` op (docs/protocol.md); `/status` nests the same facts."""
        store, holds, ps = self.store, self.holds, self.store.pool.page_size
        out = {
            "l1_capacity_bytes": store.pool.num_pages * ps,
            "l1_used_bytes": store.pool.used_pages * ps,
            "l1_free_pages": store.pool.free_pages,
            "l1_backed_bytes": store.backed_bytes,
            "l1_prefault": store.prefault,
            "page_size": ps,
            "entries": len(store.entries),
            "index_keys": len(store.index),
            "reservations": len(holds.reservations),
            "leases": len(holds.leases),
            "clients": len(holds.clients),
            "held_back_bytes": sum(holds.held_back().values()) * ps,
            "evictable_bytes": store.evictable_pages * ps,
            "pinned_bytes": store.pinned_pages * ps,
            "policy": store.policy.name,
            "evictions": _total(self.metrics.evictions),
            "malformed": _total(self.metrics.malformed),
        }
        for tier in self.tiers:
            out.update(tier.stats())
        return out

    def prefix_keys(self, fp: bytes, token_ids: Sequence[int]) -> list[bytes]:
        """The key of every full and partial chunk of a token prefix (ValueError for bad token ids)."""
        return [c.key for c in chunk_keys(self.store.namespace(fp), token_ids)]


def _total(counter: Any) -> int:
    """A counter's value summed over all its label children."""
    return int(sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")))

