"""The remote tier's lookups (`find_prefix`, the serving loop, never waiting): answered from the presence
cache (networked/presence.py); a chunk it does not know starts a probe on the prober's thread (an MGET of
header and alias keys, rounds until the run is decided) and the lookup answers None ("pending"). Also
`remove`, whose delete runs on the prober's thread."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence

import glide_sync as glide
from kvtier.server.events import Removed
from kvtier.server.tiers.networked.presence import UNKNOWN, Found
from kvtier.server.tiers.record import ChunkMeta, CorruptChunk, decode_header
from kvtier.server.tiers.remote import layout
from kvtier.server.tiers.remote.layout import ALIAS, GEN_BYTES
from kvtier.server.tiers.remote.nodes import Unavailable
from kvtier.server.tiers.remote.reads import BAD_TTL_S

log = logging.getLogger("kvtier.server.remote")

NAMESPACES_MAX = 8  # namespaces remembered for lookups that do not name theirs
PROBE_MAX_KEYS = 2048  # block keys one probe round asks about
PROBE_ROUNDS = 3  # chunk headers, then the aliases of the chunk where the run ends, then their chunks


class Lookups:
    """RemoteTier's lookup methods (a part of the tier: the state is set by RemoteTier.__init__)."""

    def contains(self, key: bytes) -> bool:
        return self._presence.get(key, time.monotonic()) not in (UNKNOWN, None)

    def find_prefix(self, chunks: Sequence[Sequence[bytes]],
                    ns: bytes | None = None) -> list[tuple[ChunkMeta, int]] | None:
        """From the presence cache: the run of `chunks` the store holds, as FsTier.find_prefix; None (pending)
        when the run reaches a chunk it does not know, after starting a probe for the rest of the run.
        `ns`: the lookup's namespace (its keys' names need it); without it, the namespaces this tier saw."""
        now = time.monotonic()
        if ns is not None and not self._learn(ns):
            return []  # its keys cannot be named (not registered here): a miss
        with self._lock:
            namespaces = [ns] if ns is not None else list(self._namespaces)
        out: list[tuple[ChunkMeta, int]] = []
        for i, keys in enumerate(chunks):
            found = self._longest(keys, now)
            if found is UNKNOWN:
                if not namespaces:  # no name for its keys: a miss
                    break
                self._start_probe(namespaces, chunks[i:])
                self.pending += 1
                self.m.pending.inc()
                return None
            if found is None:
                break
            out.append(found)  # type: ignore[arg-type]
            if found[1] < len(keys):  # type: ignore[index]
                break
        return out

    def _longest(self, keys: Sequence[bytes], now: float) -> Found | None | object:
        """The presence cache's longest leading run of a chunk's block keys: a hit, None (known missing, or
        on a node whose breaker is open) or UNKNOWN (a key before any hit is not known)."""
        for key in reversed(keys):
            found = self._presence.get(key, now)
            if found is UNKNOWN and self._available(self._node_of(key)):
                return UNKNOWN
            if found is not UNKNOWN and found is not None:
                return found
        return None

    def _start_probe(self, namespaces: list[bytes], chunks: Sequence[Sequence[bytes]]) -> None:
        """Queue a probe of the run from `chunks[0]` (one per first key at a time; none when the queue is full)."""
        snapshot = [list(keys) for keys in chunks]
        self._prober.probe(chunks[0][-1], lambda: self._probe(namespaces, snapshot))

    def _probe(self, namespaces: list[bytes], chunks: list[list[bytes]]) -> None:
        """Probe thread: ask the store about the keys that decide the run, a round at a time."""
        namespaces = [ns for ns in namespaces if self.tenancy.known(ns)]
        for _ in range(PROBE_ROUNDS):
            keys = self._undecided(chunks)
            if not keys:
                return
            self._fetch(namespaces, keys)

    def _undecided(self, chunks: list[list[bytes]]) -> list[bytes]:
        """The keys whose answers decide the run next: at the first chunk not known, every unknown last key
        from there on (its header, or its own alias); if its last key is known missing, its unknown aliases."""
        now = time.monotonic()
        for i, keys in enumerate(chunks):
            found = self._longest(keys, now)
            if found is UNKNOWN:
                if self._presence.get(keys[-1], now) is UNKNOWN:
                    rest = (k[-1] for k in chunks[i:])
                    return [k for k in rest if self._presence.get(k, now) is UNKNOWN][:PROBE_MAX_KEYS]
                return [k for k in keys if self._presence.get(k, now) is UNKNOWN][:PROBE_MAX_KEYS]
            if found is None or found[1] < len(keys):  # type: ignore[index]
                return []
        return []

    def _fetch(self, namespaces: list[bytes], keys: list[bytes]) -> None:
        """GET the header and alias keys of `keys` (each namespace's), one pipeline per node; record what
        was found, then the chunks that aliases point to; anything unanswered counts as missing."""
        now = time.monotonic()
        headers, pointers = self._get_many([(ns, k, suffix) for ns in namespaces for k in keys for suffix in "ha"])
        found: dict[bytes, Found] = {}
        for (ns, key, _), value in headers.items():
            meta = self._decode(ns, key, value)
            if meta is not None:
                self._remember_gen(key, value)
                self._presence.add(meta, now)
                found[key] = (meta, meta.blocks)
        wanted: dict[bytes, list[tuple[bytes, bytes, int]]] = {}  # alias -> its holders, newest first
        for (ns, key, _), value in pointers.items():
            if key not in found:
                wanted.setdefault(key, []).extend((ns, *ALIAS.unpack(record)) for record in layout.holders(value))
        if wanted:
            chunks = dict.fromkeys((ns, chunk) for holders in wanted.values() for ns, chunk, _ in holders)
            targets, _ = self._get_many([(ns, chunk, "h") for ns, chunk in chunks])
            metas: dict[tuple[bytes, bytes], ChunkMeta] = {}
            for ns, chunk in chunks:
                value = targets.get((ns, chunk, "h"))
                meta = self._decode(ns, chunk, value) if value is not None else None
                if meta is not None:
                    self._remember_gen(chunk, value)  # type: ignore[arg-type]
                    self._presence.add(meta, now)
                    metas[ns, chunk] = meta
            for key, holders in wanted.items():  # the newest holder still there that holds this prefix
                for ns, chunk, lead in holders:
                    meta = metas.get((ns, chunk))
                    if meta is not None and 0 < lead <= len(meta.aliases) and meta.aliases[lead - 1] == key:
                        found[key] = (meta, lead)
                        break
        for key, hit in found.items():
            self._presence.found(key, hit, now)
        self._presence.missing([k for k in keys if k not in found and self._presence.get(k, now) is UNKNOWN], now)

    def _get_many(self, items: list[tuple[bytes, bytes, str]]) -> tuple[dict, dict]:
        """GET (namespace, key, "h" or "a") items with MGET: (the header values, the alias values) found, by
        item. On a Cluster, one MGET covers every node whose breaker is closed (glide splits it by slot and
        asks the masters at once); if it fails, one per node, each under that node's breaker. A node that
        fails or is unavailable answers nothing. MGET, not a batch: after a batch to a stalled master timed
        out, glide-sync 2.6 timed out later batches to healthy masters too, plain commands not
        (docs/performance.md)."""
        by_node: dict[str, list[tuple[bytes, bytes, str]]] = {}
        for item in items:
            by_node.setdefault(self._node_of(item[1]), []).append(item)
        values: dict = {}
        client = self._client()
        live = [node for node in by_node if self._available(node)]
        if len(live) > 1:
            together = [item for node in live for item in by_node[node]]
            with contextlib.suppress(glide.GlideError):  # then node by node: each failure to its own breaker
                values.update(zip(together, client.mget([self._key(*item) for item in together]), strict=True))
                by_node = {node: its for node, its in by_node.items() if node not in live}
        for node, node_items in by_node.items():
            names = [self._key(*item) for item in node_items]
            try:
                values.update(zip(node_items, self._call(node, "probe", lambda names=names: client.mget(names)),
                                  strict=True))
            except (Unavailable, glide.RequestError) as exc:
                if isinstance(exc, glide.RequestError):
                    self._error("probe", node, exc)
        headers: dict = {}
        aliases: dict = {}
        for item, value in values.items():
            if isinstance(value, bytes):
                (headers if item[2] == "h" else aliases)[item] = value
        return headers, aliases

    def _decode(self, ns: bytes, key: bytes, value: bytes) -> ChunkMeta | None:
        """The record of a header value read by a probe; None if it is a generation found bad before, or
        corrupt or not that chunk's (then counted once and deleted)."""
        if self._is_bad(key, value):
            return None
        try:
            meta = decode_header(value[GEN_BYTES:])[0]
        except CorruptChunk:
            meta = None
        if meta is None or meta.key != key or meta.ns != ns:
            self._mark_bad(key, value)
            self.report(Removed(self.name, ns, key, "corrupt"))
            self.corrupt += 1
            self.m.corrupt.inc()
            failed = self._delete(ns, key, value, meta.size if meta is not None else 0)
            log.warning("remote chunk %s has a corrupt header: %s", key.hex(),
                        "removed" if failed is None else f"its delete failed ({failed}); ignored here for "
                        f"{BAD_TTL_S:.0f} s")
            return None
        return meta

    def remove(self, key: bytes, reason: str = "removed") -> bool:
        """Forget chunk `key` and delete it from the store on the probe thread (if its record is known)."""
        found = self._presence.get(key, time.monotonic())
        if found is UNKNOWN or found is None or found[0].key != key:  # type: ignore[index]
            return False
        meta = found[0]  # type: ignore[index]
        self._presence.drop(meta, time.monotonic())
        self.report(Removed(self.name, meta.ns, key, reason))

        def delete() -> None:
            if not self.tenancy.known(meta.ns):  # forgotten meanwhile: it expires
                return
            node, client = self._node_of(key), self._client(primary=True)
            try:
                header = self._call(node, "put", lambda: client.get(self._key(meta.ns, key, "h")))
            except (Unavailable, glide.RequestError):
                return
            if header is not None:
                self._delete(meta.ns, key, header, meta.size)

        self._prober.submit(delete)  # not queued (full): it expires
        return True


    def _learn(self, ns: bytes) -> bool:
        """Remember namespace `ns` for lookups that do not name theirs; False (not remembered) when its keys
        cannot be named (its tenant cannot be told: tenancy.py)."""
        if not self.tenancy.known(ns):
            return False
        with self._lock:
            self._namespaces[ns] = None
            self._namespaces.move_to_end(ns)
            while len(self._namespaces) > NAMESPACES_MAX:
                self._namespaces.popitem(last=False)
        return True

