"""KVTierClient: the Python API an engine integration uses to talk to a local kvtier server.

Stores and retrieves copy directly between caller buffers and the server's shared-memory L1 (one
memcpy per direction); the server only does bookkeeping. The cache operations live here; the connection
they run over is the session's (session.py: hello, reconnect, namespaces) and the transport's (transport.py:
the socket, many requests in flight from several threads).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from kvtier.connector.results import (
    L1_TIER,
    ChunkHit,
    LookupResult,
    ReadChunk,
    ReadFn,
    ReadOutcome,
    StoreResult,
    WriteFn,
)
from kvtier.connector.session import DEFAULT_URL, ClientConfig, Pending, Session
from kvtier.connector.transport import KVTierError, KVTierUnavailable, Link
from kvtier.server import protocol as p
from kvtier.server.keys import PLAIN, ChunkKeys, Namespace, RequestIdentity, chunk_keys
from kvtier.shm.pages import PageSpan

log = logging.getLogger("kvtier.client")

__all__ = ["DEFAULT_URL", "ClientConfig", "KVTierClient", "KVTierError", "KVTierUnavailable", "Pending"]


class KVTierClient(Session):
    """The cache operations (lookup, store, retrieve, leases) over a session with one server.

    Thread-safe: requests from several threads may be in flight on the one socket at once."""

    # -- lookup ----------------------------------------------------------------------------------

    def may_hold(self, key: bytes) -> bool:
        """Whether the server may hold the block `key` (a 16-byte block key: a chunk's own key or one of its
        block-prefix aliases), answered locally from its presence filter (shm/presence.py), no round trip.
        False means certainly not held (a lookup of a prefix starting there would miss); True means maybe,
        and is the answer whenever no filter is mapped: not connected, or a server whose filter is not
        authoritative (a remote tier) or that sent none, and when the filter is closed (its server stopped)."""
        presence = self._presence
        return presence is None or not self.server_id or presence.may_hold(key)

    def lookup(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray, identity: RequestIdentity = PLAIN,
               lease: bool = False, ranks: Sequence[Namespace] = (), again: bool = False) -> LookupResult:
        """Longest stored prefix of `token_ids` at engine-block granularity. With `lease`, the hits found in L1
        are leased to this client (`LookupResult.lease`; `release` it) so that nothing evicts them before the
        engine loads them: a lookup's answer is a promise. `ranks`: the namespaces of the engine's other
        workers (tensor-parallel ranks), each of which stores its own KV of these tokens: the answer is then
        the prefix every one of them holds, and the lease covers all of them. `again`: the same request asked
        about again (after a `pending` answer): not counted in the server's lookup metrics a second time."""
        chunks = chunk_keys(ns, token_ids, identity)
        return self.lookup_chunks(ns, chunks, lease, [(other, chunk_keys(other, token_ids, identity))
                                                      for other in ranks], again)

    def lookup_chunks(self, ns: Namespace, chunks: list[ChunkKeys], lease: bool = False,
                      ranks: Sequence[tuple[Namespace, list[ChunkKeys]]] = (), again: bool = False) -> LookupResult:
        if not chunks:
            return LookupResult([], [], [], ns.block_size)
        # msgpack packs the key tuples as arrays: no per-chunk list copies
        message: dict[str, Any] = {"op": "lookup", "chunks": [c.block_keys for c in chunks]}
        if lease:
            message["lease"] = True
        if again:
            message["again"] = True
        if ranks:  # their namespaces are registered and named by fingerprint when sent (submit)
            message["ranks"] = [(other, [c.block_keys for c in other_chunks]) for other, other_chunks in ranks]
        reply = self.request(message, ns)
        if reply is None:
            return LookupResult([], [], [], ns.block_size)
        return LookupResult(chunks, reply["hits"], reply["tiers"], ns.block_size, reply.get("bw") or {},
                            reply.get("rtt") or {}, bool(reply.get("pending", False)), reply.get("lease", 0))

    def release(self, leases: Sequence[int], wait: bool = True) -> int:
        """End leases this client holds (a lookup's); how many the server confirmed held to the end. Without
        `wait` the request is only sent (0 is returned): a lookup's lease needs no confirmation, and a server
        that died meanwhile must not stall the caller for a timeout."""
        if not leases:
            return 0
        if not wait:
            self.submit({"op": "release", "leases": list(leases)})
            return 0
        reply = self.request({"op": "release", "leases": list(leases)})
        return int(reply["released"]) if reply else 0

    def report(self, counts: dict[str, Any], ns: Namespace | None = None) -> bool:
        """Send a connector's counts (the `report` op: skipped requests, undelivered tokens, verifications).
        False, sending nothing, while not connected: a background sender never says hello itself, since a hello
        that fails (a server restarting) would put the engine's own requests into the unreachable backoff."""
        return self.connected and self.request({"op": "report", **counts}, ns) is not None

    def end_session(self, session: str) -> bool:
        """End a request-hint session (docs/hints.md): its chunks are kept no longer for it. Whether the server
        ended one (False: unknown or ended already, or no answer); a failure is logged, never raised."""
        try:
            reply = self.request({"op": "end_session", "session": session})
        except Exception as exc:  # a session left open only ends later, when the server finds it idle
            log.warning("kvtier: ending session %r failed: %s", session[:40], exc)
            return False
        return bool(reply and reply.get("ended"))

    # -- store -----------------------------------------------------------------------------------

    def store(
        self, ns: Namespace, token_ids: Sequence[int] | np.ndarray, sizes: Callable[[ChunkKeys], int],
        write: WriteFn, skip_chunks: int = 0, identity: RequestIdentity = PLAIN, hint: p.Hint = p.NO_HINT,
    ) -> StoreResult:
        """Store every chunk of `token_ids` from chunk `skip_chunks` on: reserve pages, let `write`
        copy the chunk's bytes into them, commit. Chunks already stored (or being stored) are skipped.
        `hint`: what the request asked of its chunks (retention, priority, session; docs/hints.md)."""
        chunks = chunk_keys(ns, token_ids, identity)[skip_chunks:]
        return self.store_chunks(ns, chunks, sizes, write, hint)

    def store_chunks(self, ns: Namespace, chunks: list[ChunkKeys], sizes: Callable[[ChunkKeys], int],
                     write: WriteFn, hint: p.Hint = p.NO_HINT) -> StoreResult:
        if len(chunks) > p.MAX_STORE_ITEMS:  # one reserve holds at most MAX_STORE_ITEMS items
            parts = [self.store_chunks(ns, chunks[i:i + p.MAX_STORE_ITEMS], sizes, write, hint)
                     for i in range(0, len(chunks), p.MAX_STORE_ITEMS)]
            return StoreResult.merged(parts)
        result = StoreResult()
        if not chunks:
            return result
        feed = bool(self.events_endpoint)
        items = [p.StoreItem(c.key, sizes(c), len(c.block_keys), c.aliases, c.tokens if feed else b"", c.parent)
                 for c in chunks]
        message: dict[str, Any] = {"op": "reserve", "items": [i.to_wire() for i in items]}
        if hint != p.NO_HINT:
            message["hint"] = hint.to_wire()
        got = self._exchange(message, ns)
        if got is None:
            result.refused["unreachable"] = len(chunks)
            return result
        reply, conn = got
        done: list[int] = []
        try:
            for chunk, item, status in zip(chunks, items, reply["results"], strict=True):
                if status[0] == p.RESERVED:
                    rid, extents = status[1], status[2]
                    span = self._span(conn, extents, item.size)
                    if span is None:  # the connection was reset meanwhile: the rest is aborted
                        break
                    write(chunk, span)
                    done.append(rid)
                elif status[0] == p.EXISTS:
                    result.existing += 1
                elif status[0] == p.BUSY:
                    result.busy += 1
                else:
                    reason = status[1] if len(status) > 1 else "unknown"
                    result.refused[reason] = result.refused.get(reason, 0) + 1
        finally:
            written = set(done)
            pending = [s[1] for s in reply["results"] if s[0] == p.RESERVED and s[1] not in written]
            if pending:
                self.request({"op": "abort", "res": pending})
            if done:
                committed = self.request({"op": "commit", "res": done})
                result.stored = committed["committed"] if committed else 0
                if result.stored < len(done):  # reservations that expired (TTL) or a server that went away
                    result.refused["not_committed"] = len(done) - result.stored
        return result

    @staticmethod
    def _span(conn: Link, extents: Sequence[int], size: int) -> PageSpan | None:
        array = conn.array
        return PageSpan(array, extents, conn.page_size, size) if array is not None else None

    # -- retrieve --------------------------------------------------------------------------------

    def retrieve(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray, read: ReadFn,
                 max_blocks: int | None = None, identity: RequestIdentity = PLAIN) -> int:
        """Copy out the longest stored prefix of `token_ids` (lookup, lease, `read` each chunk, release).

        Returns the number of prefix tokens whose bytes `read` received; 0 on a miss or an error, and 0
        when the server could not confirm the lease held to the end (the bytes read may be another chunk's:
        the caller must treat them as a load error).
        """
        chunks = chunk_keys(ns, token_ids, identity)
        if not chunks:
            return 0
        got = self._exchange({"op": "lookup", "chunks": [c.block_keys for c in chunks], "acquire": True}, ns)
        if got is None or not got[0]["hits"]:
            return 0
        return self._read_leased(chunks, *got, read, max_blocks) * ns.block_size

    def retrieve_prefix(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray, read: ReadFn,
                        identity: RequestIdentity = PLAIN) -> int:
        """Copy out exactly the whole blocks of `token_ids` that an earlier lookup found, without a second
        lookup (so hit metrics count the request once). Returns the prefix tokens `read` received."""
        return self.read_prefix(ns, token_ids, read, identity).blocks * ns.block_size

    def read_prefix(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray, read: ReadFn,
                    identity: RequestIdentity = PLAIN) -> ReadOutcome:
        """`retrieve_prefix` that also says why it stopped short (ReadOutcome.reason)."""
        hits = [ChunkHit(c, len(c.block_keys), L1_TIER) for c in chunk_keys(ns, token_ids, identity)]
        return self._retrieve(ns, hits, read)

    def retrieve_chunks(self, ns: Namespace, hits: list[ChunkHit], read: ReadFn) -> int:
        """Copy out chunks a previous lookup found (each at its matched length); returns blocks read."""
        return self._retrieve(ns, hits, read).blocks

    def _retrieve(self, ns: Namespace, hits: list[ChunkHit], read: ReadFn) -> ReadOutcome:
        if not hits:
            return ReadOutcome(0)
        keys = [h.chunk.block_keys[h.match - 1] for h in hits]
        got = self._exchange({"op": "acquire", "keys": keys}, ns)
        if got is None:
            return ReadOutcome(0, p.UNDELIVERED_UNREACHABLE)
        outcome = ReadOutcome(0)
        outcome.blocks = self._read_leased([h.chunk for h in hits], *got, read, None, outcome)
        return outcome

    def _read_leased(self, chunks: list[ChunkKeys], reply: dict[str, Any], conn: Link, read: ReadFn,
                     max_blocks: int | None, outcome: ReadOutcome | None = None) -> int:
        """Blocks read under the reply's lease, or 0 unless the release confirms the lease held; `outcome`
        learns why fewer blocks than asked were read."""
        blocks = 0
        why = ""
        try:
            for chunk, item in zip(chunks, reply["items"], strict=False):
                if item is None:
                    why = p.UNDELIVERED_MISSING
                    break
                stored, match, size, extents = item
                if max_blocks is not None:
                    match = min(match, max_blocks - blocks)
                span = self._span(conn, extents, size)
                if match <= 0 or span is None:
                    why = p.UNDELIVERED_UNREACHABLE if span is None else why
                    break
                read(ReadChunk(chunk, stored, match, span))
                blocks += match
                if match < len(chunk.block_keys):
                    why = p.UNDELIVERED_MISSING
                    break
        except Exception:
            why = p.UNDELIVERED_FAILED
            raise
        finally:
            released = self.request({"op": "release", "leases": [reply["lease"]]}) if reply.get("lease") else None
            if outcome is not None:
                outcome.reason = why
        if blocks and not (released and released.get("released") == 1):
            log.warning("kvtier: a read outlived its lease (or the server went away): %d blocks dropped", blocks)
            if outcome is not None:
                outcome.reason = p.UNDELIVERED_LEASE_LOST if released else p.UNDELIVERED_UNREACHABLE
            return 0
        return blocks
