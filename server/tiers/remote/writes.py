"""The remote tier's writes (`put`, write-behind threads): parts, then the header with SET NX, then the chunk
added as a holder to its alias keys (APPENDed records, compacted by the writer that grows one); a node that
answers OOM pauses writes with a back-off; `_delete` removes a chunk with GET and UNLINK only."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import glide_sync as glide
from kvtier.server.events import Stored
from kvtier.server.tiers.record import ChunkMeta, encode_header
from kvtier.server.tiers.remote import layout
from kvtier.server.tiers.remote.layout import (
    ALIAS,
    ALIAS_COMPACT_BYTES,
    GEN_BYTES,
    PART_TTL_MARGIN_MS,
    Prepared,
    parts_of,
    pieces,
)
from kvtier.server.tiers.remote.nodes import Unavailable, denied, full

log = logging.getLogger("kvtier.server.remote")

FULL_PAUSE_S = (1.0, 60.0)  # writes to a node that answered OOM pause this long, doubled per OOM retry up to this


class Writes:
    """RemoteTier's write methods (a part of the tier: the state is set by RemoteTier.__init__)."""

    def prepare(self, meta: ChunkMeta, sources: Sequence) -> Prepared:
        split = pieces(sources, meta.size)
        gen = os.urandom(GEN_BYTES)
        header = gen + encode_header(meta, (piece for part in split for piece in part))
        return Prepared(header, [p[0] if len(p) == 1 else b"".join(p) for p in split])

    def put(self, meta: ChunkMeta, payload: Any, keep: Callable[[], bool] | None = None) -> bool:
        """Write a chunk (its bytes, or `prepare`'s result) unless the store has it; False when it was there,
        or the write was dropped (breaker open, timeout, server error: counted) or not sent (its node answered
        OOM less than its back-off ago: counted as skipped, "full"; or its namespace was forgotten before
        the write, so its tenant's keys cannot be named: "namespace")."""
        if not self._learn(meta.ns):
            self.skipped += 1
            self.m.skipped_writes.labels("namespace").inc()
            return False
        if self.contains(meta.key):
            return False
        node = self._node_of(meta.key)
        if self._write_paused(node):
            self.skipped += 1
            self.m.skipped_writes.labels("full").inc()
            return False
        prepared = payload if isinstance(payload, Prepared) else self.prepare(meta, [payload])
        client = self._client(resize=True)
        hkey = self._key(meta.ns, meta.key, "h")
        gen = prepared.header[:GEN_BYTES]
        parts = [self._part_key(meta.ns, meta.key, gen, i) for i in range(len(prepared.parts))]
        start = time.perf_counter()
        try:
            if self._call(node, "put", lambda: client.exists([hkey])):
                self._existing(meta)
                return False
            part_expiry = self._expiry(PART_TTL_MARGIN_MS)

            def fill(batch: Any) -> None:
                for k, v in zip(parts, prepared.parts, strict=True):
                    batch.set(k, v, expiry=part_expiry)

            results = self._call(node, "put", lambda: self._batch(client, fill, meta.size))
            if len(results) != len(parts) or any(isinstance(r, Exception) for r in results):
                self._refused(node, next((r for r in results if isinstance(r, Exception)), "short batch"), parts)
                return False
            won = self._put_header(node, client, meta, hkey, prepared.header)
        except Unavailable:
            return False
        except glide.RequestError as exc:  # the server refused (out of memory, no permission): dropped
            self._refused(node, exc, parts)
            return False
        self._writable(node)
        if not won:  # another node's header went in first: its parts are the chunk's, ours go
            self._unlink(node, parts)
            self._existing(meta)
            return False
        self._bw.add(meta.size, start, time.perf_counter())
        if keep is not None and not keep():  # a clear came meanwhile: take it back
            self._presence.drop(meta, time.monotonic())
            self._delete(meta.ns, meta.key, prepared.header, meta.size)
            return False
        self._presence.add(meta, time.monotonic())
        self.report(Stored(self.name, meta.ns, meta.key, meta.blocks, meta.aliases, meta.size))
        self.written += 1
        self.written_bytes += meta.size
        return True

    def _refused(self, node: str, exc: object, parts: list[str]) -> None:
        """A write the store refused (an error reply; OOM pauses writes to `node`): counted, parts deleted."""
        self._error("put", node, exc)  # type: ignore[arg-type]
        if full(exc):
            self._filled(node)
        self._unlink(node, parts)

    def _write_paused(self, node: str) -> bool:
        """Whether writes to `node` wait: it answered OOM less than its back-off ago."""
        item = self._full.get(node)
        return item is not None and item[0] > time.monotonic()

    def _filled(self, node: str) -> None:
        """`node` answered OOM: writes to it pause FULL_PAUSE_S[0], doubled (up to FULL_PAUSE_S[1]) each
        time the write after a pause is refused again; reads go on. Logged when a full spell starts."""
        now = time.monotonic()
        with self._lock:
            until, last = self._full.get(node, (0.0, 0.0))
            if until > now:  # another thread's write of the same pause
                return
            pause = min(last * 2, FULL_PAUSE_S[1]) if last else FULL_PAUSE_S[0]
            self._full[node] = (now + pause, pause)
        if not last:
            log.warning("remote node %s is full (OOM: maxmemory reached and its policy evicts nothing): writes to "
                        "it pause %.0f s, then retry with a back-off growing to %.0f s; reads go on", node,
                        FULL_PAUSE_S[0], FULL_PAUSE_S[1])

    def _writable(self, node: str) -> None:
        """A write to `node` went in: if it was full, its writes resume (logged)."""
        if node in self._full:
            with self._lock:
                was = self._full.pop(node, None)
            if was is not None:
                log.info("remote node %s takes writes again", node)

    def _existing(self, meta: ChunkMeta) -> None:
        self.existing += 1
        self.m.existing.inc()
        self._presence.add(meta, time.monotonic())

    def _put_header(self, node: str, client: Any, meta: ChunkMeta, hkey: str, header: bytes) -> bool:
        """SET NX the header and add the chunk as a holder to its alias keys (`_add_holder`), those on the
        chunk's node in its pipeline (a holder names the chunk, whichever writer wins), the others after it
        (best effort: a missing holder only loses that partial match). Whether this header went in; a
        failure of the chunk's node raises."""
        nx, expiry = glide.ConditionalChange.ONLY_IF_DOES_NOT_EXIST, self._expiry()
        by_node: dict[str, list[tuple[str, bytes]]] = {node: []}
        for where, items in self._aliases_by_node(meta).items():
            by_node.setdefault(where, []).extend(items)
        append = not self._no_append
        span, at = (3, 1) if append and self.ttl_ms else (1, 0)  # commands per holder added, its APPEND's place
        won = False
        for where, items in by_node.items():
            first = where == node

            def fill(batch: Any, items: list[tuple[str, bytes]] = items, first: bool = first) -> None:
                if first:
                    batch.set(hkey, header, conditional_set=nx, expiry=expiry)
                for k, v in items:
                    self._add_holder(batch, k, v, append)

            try:
                results = self._call(where, "put", lambda fill=fill: self._batch(client, fill, 0))
            except (Unavailable, glide.RequestError):
                if first:
                    raise
                continue
            if first:
                if results and isinstance(results[0], glide.RequestError):
                    raise results[0]  # the server refused the header (out of memory, no permission)
                won = bool(results) and results[0] is not None
                results = results[1:]
            if not append:
                continue
            lengths = results[at::span]  # each APPEND's reply: the value's new length
            if any(denied(n) for n in lengths):
                self._append_denied(next(n for n in lengths if denied(n)))
            grown = [k for (k, _), n in zip(items, lengths, strict=False)
                     if type(n) is int and n > ALIAS_COMPACT_BYTES]
            if grown:
                self._compact(where, client, grown)
        return won

    def _append_denied(self, denied: object) -> None:
        """The store refused APPEND (an ACL without it): aliases are written as before holders, SET NX of the
        first holder (that prefix is lost with it); logged once."""
        if not self._no_append:
            self._no_append = True
            log.warning("remote store %s refused APPEND (%s): a block-prefix alias keeps only its first holder "
                        "(the ACL of docs/remote.md grants it)", self.path, denied)

    def _add_holder(self, batch: Any, key: str, holder: bytes, append: bool) -> None:
        """Queue the commands that add `holder` (ALIAS) at the end of alias key `key`'s value: with a TTL, the
        key made empty with it if missing (so it expires even for a user that may not PEXPIRE), the APPEND,
        the TTL renewed (every holder's write keeps the prefix findable that long); else the APPEND alone.
        Without `append` (the store refused it): SET NX of the holder, the first one kept."""
        if not append:
            batch.set(key, holder, conditional_set=glide.ConditionalChange.ONLY_IF_DOES_NOT_EXIST,
                      expiry=self._expiry())
            return
        if self.ttl_ms:
            batch.set(key, b"", conditional_set=glide.ConditionalChange.ONLY_IF_DOES_NOT_EXIST,
                      expiry=self._expiry())
        batch.append(key, holder)
        if self.ttl_ms:
            batch.pexpire(key, self.ttl_ms)

    def _compact(self, node: str, client: Any, keys: list[str]) -> None:
        """Rewrite alias keys of `node` grown past ALIAS_COMPACT_BYTES with their newest ALIAS_HOLDERS
        distinct holders (GET, then SET with the TTL: a holder another writer appends in between is lost, a
        partial match less, never a wrong one). Best effort."""
        for key in keys:
            with contextlib.suppress(Unavailable, glide.RequestError):
                value = self._call(node, "put", lambda key=key: client.get(key))
                if isinstance(value, bytes):
                    kept = b"".join(reversed(layout.holders(value)))
                    self._call(node, "put", lambda key=key, kept=kept: client.set(key, kept, expiry=self._expiry()))

    def _aliases_by_node(self, meta: ChunkMeta) -> dict[str, list[tuple[str, bytes]]]:
        """The alias keys of `meta` and its holder record in each (the chunk key, the leading blocks), by node."""
        by_node: dict[str, list[tuple[str, bytes]]] = {}
        for j, alias in enumerate(meta.aliases, start=1):
            by_node.setdefault(self._node_of(alias), []).append(
                (self._key(meta.ns, alias, "a"), ALIAS.pack(meta.key, j)))
        return by_node

    def _unlink(self, node: str, keys: list[str]) -> None:
        """Delete keys of one slot, best effort (they expire anyway)."""
        client = self._client()
        with contextlib.suppress(Unavailable, glide.RequestError):
            self._call(node, "put", lambda: client.unlink(keys))

    def _delete(self, ns: bytes, key: bytes, header: bytes, size: int) -> str | None:
        """Remove a chunk from the store whose header value was `header`: with GET and UNLINK only (the
        commands docs/remote.md's ACL grants; no script), the header if it is still that one (a new writer's
        stays; one written between the GET and the UNLINK, after another delete, goes too: a miss, never
        wrong bytes), and that generation's parts (`size` bytes of them; 0: not known, they expire). None
        when done, else why not (counted in kvtier_remote_delete_failures)."""
        node, client = self._node_of(key), self._client(primary=True)  # a replica's header may be an old one
        hkey = self._key(ns, key, "h")
        keys = [self._part_key(ns, key, header[:GEN_BYTES], i) for i in range(parts_of(size))]
        try:
            if self._call(node, "put", lambda: client.get(hkey)) == header:
                keys.append(hkey)
            if keys:
                self._call(node, "put", lambda: client.unlink(keys))
        except (Unavailable, glide.RequestError) as exc:
            self.m.delete_failures.inc()
            return str(exc) or "unavailable"
        return None

