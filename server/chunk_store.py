"""The L1 chunk index: entries, write reservations, read leases, pins, and synchronous room-making.

All bookkeeping is O(1) per key. The server never touches chunk bytes here: clients copy into pages
they reserved (reserve -> copy -> commit) and out of pages they leased (acquire -> copy -> release).

Ownership rule (docs/security.md): pages a client may still be touching are never given to anyone else.
A reservation or lease that outlives its TTL, or whose client went silent or said hello again, *lapses*: it
no longer counts (a commit stores nothing, a release reports the read as lost) but its pages stay out of
the free list, "held back", until that client commits, aborts, releases or says bye, or its lock file
(shm/client_lock.py) shows it is dead.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter

from kvtier.server import protocol as p
from kvtier.server.eviction.base import EvictionPolicy
from kvtier.server.keys import Namespace, chunk_keys
from kvtier.server.l1_pool import Extents, PagePool, extent_pages
from kvtier.server.metrics import Metrics
from kvtier.shm.client_lock import LockDirectory

L1 = "l1"


@dataclass(slots=True, eq=False)
class Entry:
    key: bytes
    ns: bytes
    size: int
    blocks: int
    extents: Extents
    aliases: tuple[bytes, ...]
    readers: int = 0
    pins: int = 0
    doomed: bool = False

    @property
    def pages(self) -> int:
        return extent_pages(self.extents)

    @property
    def evictable(self) -> bool:
        return not (self.readers or self.pins or self.doomed)


@dataclass(slots=True, eq=False)
class ClientState:
    ident: bytes
    instance: str
    pid: int
    last_seen: float
    lock: str = ""  # the client's liveness lock file beside the segment ("" = none: it may not hold pages)
    reservations: set[int] = field(default_factory=set)  # live and lapsed
    leases: set[int] = field(default_factory=set)
    namespaces: set[bytes] = field(default_factory=set)  # fingerprints it registered


@dataclass(slots=True)
class Reservation:
    rid: int
    owner: ClientState
    ns: bytes
    item: p.StoreItem
    extents: Extents
    deadline: float
    lapsed: bool = False  # expired or its client retired: not committable, pages held back


@dataclass(slots=True)
class Lease:
    lid: int
    owner: ClientState
    entries: list[Entry]
    deadline: float
    lapsed: bool = False  # expired or its client retired: the read is lost, its entries stay put


@dataclass(frozen=True, slots=True)
class AcquiredChunk:
    """Where a leased chunk's bytes are: `match` leading blocks of its `blocks` are wanted."""

    blocks: int
    match: int
    size: int
    extents: Extents

    def to_wire(self) -> list:
        return [self.blocks, self.match, self.size, list(self.extents)]


TOUCH_BACKLOG_MAX = 1024
MAX_NAMESPACES = 4096  # registered at once, all clients together
MAX_CLIENT_NAMESPACES = 64


class ChunkStore:
    def __init__(
        self,
        pool: PagePool,
        policy: EvictionPolicy,
        metrics: Metrics,
        lease_ttl_s: float = 30.0,
        reservation_ttl_s: float = 30.0,
        client_timeout_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
        locks: LockDirectory | None = None,
        min_block_bytes: int = p.MIN_BLOCK_BYTES,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.metrics = metrics
        self.lease_ttl_s = lease_ttl_s
        self.reservation_ttl_s = reservation_ttl_s
        self.client_timeout_s = client_timeout_s
        self.clock = clock
        self.min_block_bytes = min_block_bytes
        self.locks = locks  # None: no liveness check (nothing is ever known dead; clients need no lock)
        self.namespaces: dict[bytes, Namespace] = {}
        self.ns_usage: dict[bytes, list[int]] = {}  # fingerprint -> [entries, bytes]
        self.entries: dict[bytes, Entry] = {}
        self.index: dict[bytes, tuple[Entry, int]] = {}  # key or alias -> (entry, leading blocks)
        # Aliases another entry also holds (a document followed by different questions): the fallback
        # when the entry the index points to goes, so the shared leading blocks stay findable.
        self.shadowed: dict[bytes, list[tuple[Entry, int]]] = {}
        self.pending: dict[bytes, int] = {}  # key -> reservation id
        self.reservations: dict[int, Reservation] = {}
        self.leases: dict[int, Lease] = {}
        self.clients: dict[bytes, ClientState] = {}
        # Clients gone silent or registered again whose lapsed holdings are held back, by id().
        self.retired: dict[int, ClientState] = {}
        self.evictable_pages = 0
        self.pinned_pages = 0
        self.backed_bytes = 0  # of the segment, known to have memory behind it (the daemon's prefault)
        self.prefault = "off"  # the daemon's L1 prefault: off, running, done or failed
        self._ids = itertools.count(1)
        self.on_commit: Callable[[Entry], None] | None = None  # L2 write-behind hook (server/l2_service.py)
        self._touch_backlog: list[list[tuple[Entry, int]]] = []
        self._m_lookups = metrics.lookups
        self._m_requested_blocks = metrics.requested_blocks
        self._m_requested_tokens = metrics.requested_tokens
        self._m_hit_tokens_l1 = metrics.hit_tokens.labels(L1)
        metrics.l1_capacity.set(pool.num_pages * pool.page_size)

    # -- clients and namespaces ------------------------------------------------------------------

    def hello(self, ident: bytes, instance: str, pid: int, lock: str = "") -> None:
        """Register a client; one that says hello again keeps nothing of its old registration (its
        holdings lapse). A `lock` must name a lock file the client holds."""
        self.retire(ident)
        if lock and (self.locks is None or not self.locks.alive(lock)):
            raise p.ProtocolError(p.BAD_REQUEST, "lock must name a client lock file beside the segment that "
                                  "the client holds (docs/protocol.md)")
        self.clients[ident] = ClientState(ident, instance, pid, self.clock(), lock)
        self._update_gauges()

    def client(self, ident: bytes) -> ClientState:
        state = self.clients.get(ident)
        if state is None:
            raise p.ProtocolError(p.NOT_REGISTERED, "say hello first (the server may have restarted)")
        state.last_seen = self.clock()
        return state

    def caller(self, ident: bytes) -> ClientState:
        """The registered client, or a stand-in with no rights but to settle what `ident` still holds
        back (a commit, abort or release from a client that was retired while it was stopped)."""
        return self.clients.get(ident) or ClientState(ident, "", 0, 0.0)

    def retire(self, ident: bytes) -> None:
        """Unregister a client: its reservations and leases lapse, their pages held back (module doc)."""
        client = self.clients.pop(ident, None)
        if client is None:
            return
        for rid in client.reservations:
            self._lapse_reservation(self.reservations[rid])
        for lid in client.leases:
            self._lapse_lease(self.leases[lid])
        if client.reservations or client.leases:
            self.retired[id(client)] = client
        self._update_gauges()

    def _may_hold_pages(self, owner: ClientState) -> None:
        if self.locks is not None and not owner.lock:
            raise p.ProtocolError(p.BAD_REQUEST, "a client must hold a lock file (hello with `lock`) before it "
                                  "may reserve or acquire pages (docs/protocol.md)")

    def register(self, namespace: Namespace, owner: ClientState | None = None) -> bytes:
        fp = namespace.fingerprint()
        if fp not in self.namespaces and len(self.namespaces) >= MAX_NAMESPACES:
            raise p.ProtocolError(p.BAD_REQUEST, f"the server holds {MAX_NAMESPACES} namespaces already")
        if owner is not None and fp not in owner.namespaces:
            if len(owner.namespaces) >= MAX_CLIENT_NAMESPACES:
                raise p.ProtocolError(p.BAD_REQUEST, f"a client may register at most {MAX_CLIENT_NAMESPACES} "
                                      "namespaces")
            owner.namespaces.add(fp)
        self.namespaces.setdefault(fp, namespace)
        self.ns_usage.setdefault(fp, [0, 0])
        return fp

    def _forget_unused_namespaces(self) -> None:
        """Drop namespaces no registered client names and no chunk or open write is in."""
        named = {fp for c in self.clients.values() for fp in c.namespaces}
        named.update(r.ns for r in self.reservations.values())
        for fp in [fp for fp in self.namespaces if fp not in named and not self.ns_usage.get(fp, (0,))[0]]:
            del self.namespaces[fp]
            self.ns_usage.pop(fp, None)

    def namespace(self, fp: bytes) -> Namespace:
        ns = self.namespaces.get(fp)
        if ns is None:
            raise p.ProtocolError(p.UNKNOWN_NAMESPACE, "namespace not registered (the server may have restarted)")
        return ns

    # -- lookup ----------------------------------------------------------------------------------

    def lookup(self, fp: bytes, chunks: list[list[bytes]]) -> list[tuple[Entry, int]]:
        """The longest stored prefix: per matched chunk, its entry and how many leading blocks match.

        The hits' policy touches are queued, not applied: the serving loop applies them right after the
        reply is sent (`flush_touches`), and every policy decision applies them first, so eviction order is
        the same as if they had been applied here, at no cost to the lookup's latency.
        """
        ns = self.namespace(fp)
        bpc = ns.blocks_per_chunk
        get = self.index.get
        # Whole-list passes, not a per-chunk loop: a whole-chunk hit needs one probe, of its last key.
        found = list(map(get, map(itemgetter(-1), chunks)))
        lengths = list(map(len, chunks))
        n = found.index(None) if None in found else len(found)
        # Keys are chained from the namespace, so keys of another namespace show at both ends of the prefix;
        # a list that mixes chains is filtered here only if an end gives it away, and acquire checks every
        # entry it leases: bytes of another namespace are never handed out.
        if n and (found[0][0].ns != fp or found[n - 1][0].ns != fp):
            found = [f if f is not None and f[0].ns == fp else None for f in found]
            get = self._getter(fp)
            n = found.index(None) if None in found else len(found)
        matches = list(map(itemgetter(1), found[:n]))
        if matches and (min(matches) < bpc or max(lengths) > bpc):  # not all whole: find the first that isn't
            pairs = enumerate(zip(matches, lengths, strict=False))
            n = next((i for i, (m, k) in pairs if m < bpc or m < k), n)
        hits: list[tuple[Entry, int]] = found[:n]
        if n < len(chunks):  # the prefix ends in chunk n: at its longest stored leading run, if any
            last = found[n] or next(filter(None, map(get, reversed(chunks[n][:-1]))), None)
            if last is not None and last[0].ns == fp:
                hits.append(last)
        if hits:
            self._touch_backlog.append(hits)
            if len(self._touch_backlog) > TOUCH_BACKLOG_MAX:  # nobody flushed (no serving loop): bound it
                self.flush_touches()
        requested = sum(lengths)
        self._m_lookups.inc()
        self._m_requested_blocks.inc(requested)
        self._m_requested_tokens.inc(requested * ns.block_size)
        if hits:
            self._m_hit_tokens_l1.inc(sum(map(itemgetter(1), hits)) * ns.block_size)
        return hits

    def _getter(self, fp: bytes) -> Callable[[bytes], tuple[Entry, int] | None]:
        """index.get that sees only entries of namespace `fp`."""
        index = self.index

        def get(key: bytes) -> tuple[Entry, int] | None:
            found = index.get(key)
            return found if found is not None and found[0].ns == fp else None

        return get

    def flush_touches(self) -> None:
        """Apply queued lookup hits to the policy, each prefix back to front: its first chunk becomes the
        most recent, since losing it makes every later chunk of the prefix unreachable."""
        backlog, self._touch_backlog = self._touch_backlog, []
        touch = self.policy.touch
        for hits in backlog:
            for entry, _ in reversed(hits):
                touch(entry.key)

    # -- store -----------------------------------------------------------------------------------

    def reserve(self, owner: ClientState, fp: bytes, items: list[p.StoreItem]) -> list[list]:
        """Per item: [status, reservation id, extents] or [REFUSED, reason] / [EXISTS] / [BUSY]."""
        self._may_hold_pages(owner)
        ns = self.namespace(fp)
        pool = self.pool
        for item in items:
            item.check_fits(ns.blocks_per_chunk, pool.pages_for(item.size) * pool.page_size, self.min_block_bytes)
        now = self.clock()
        results: list[list] = []
        broken = False  # an earlier item was refused: the later ones cannot be found until it is stored
        for item in items:
            found = self.index.get(item.key)
            # A key stored as its own entry is never re-reserved, whatever block count a client claims:
            # committing it again would orphan the old entry's pages.
            if found is not None and (found[1] >= item.blocks or item.key in self.entries):
                if not broken:  # a chunk behind a missing one is not re-used: it keeps aging
                    self.flush_touches()
                    self.policy.touch(found[0].key)
                self.metrics.store_skipped.labels("exists").inc()
                results.append([p.EXISTS])
                continue
            if item.key in self.pending:
                self.metrics.store_skipped.labels("in_progress").inc()
                results.append([p.BUSY])
                continue
            reason = p.PREFIX_REFUSED if broken else self._admit(item)
            if reason:
                broken = True
                self.metrics.refused.labels(reason).inc()
                results.append([p.REFUSED, reason])
                continue
            extents = self.pool.allocate(self.pool.pages_for(item.size))
            assert extents is not None  # _admit made room
            rid = next(self._ids)
            self.reservations[rid] = Reservation(rid, owner, fp, item, extents, now + self.reservation_ttl_s)
            self.pending[item.key] = rid
            owner.reservations.add(rid)
            results.append([p.RESERVED, rid, list(extents)])
        self._update_gauges()
        return results

    def _admit(self, item: p.StoreItem) -> str | None:
        """Pages for `item` (evicting as the policy orders), or the reason it is refused."""
        npages = self.pool.pages_for(item.size)
        self.flush_touches()
        if self.pool.free_pages < npages <= self.pool.num_pages and not self.policy.admit(
                item.key, item.size, self._is_evictable):
            return p.NOT_ADMITTED
        return self._make_room(npages)

    def _make_room(self, npages: int) -> str | None:
        pool = self.pool
        self.flush_touches()
        if npages > pool.num_pages:
            return p.TOO_LARGE
        if pool.free_pages + self.evictable_pages < npages:
            return p.NO_SPACE
        while pool.free_pages < npages:
            key = self.policy.pick_victim(self._is_evictable)
            if key is None:  # only if the evictable count drifted; refuse rather than loop
                return p.NO_SPACE
            self._remove(self.entries[key], "capacity")
        return None

    def _is_evictable(self, key: bytes) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.evictable

    def commit(self, owner: ClientState, rids: Iterable[int]) -> int:
        """Make the owner's reservations visible; a lapsed one stores nothing and frees its pages."""
        done = 0
        for rid in reversed(list(rids)):  # a prefix's first chunk enters the policy last (most recent)
            res = self._own_reservation(owner, rid)
            if res is None:
                continue
            self._finish_reservation(res)
            if res.lapsed:
                self.pool.release(res.extents)
                self.metrics.store_skipped.labels("lapsed").inc()
                continue
            self.metrics.store_seconds.observe(max(0.0, self.clock() - res.deadline + self.reservation_ttl_s))
            item = res.item
            entry = self.insert(Entry(item.key, res.ns, item.size, item.blocks, res.extents, item.aliases))
            self.metrics.stores.inc()
            self.metrics.store_bytes.inc(item.size)
            self.metrics.item_bytes.observe(item.size)
            if self.on_commit is not None:
                self.on_commit(entry)
            done += 1
        self._shed("resize")  # commits after a shrink leave as they commit
        self._update_gauges()
        return done

    def insert(self, entry: Entry) -> Entry:
        """Make a chunk whose bytes are already in its pages visible: a commit, or a promotion from L2."""
        self.flush_touches()
        self.entries[entry.key] = entry
        self.index[entry.key] = (entry, entry.blocks)
        self._supersede_partials(entry.aliases)
        for j, alias in enumerate(entry.aliases, start=1):
            if alias not in self.index:
                self.index[alias] = (entry, j)
            else:
                self.shadowed.setdefault(alias, []).append((entry, j))
        self.policy.insert(entry.key, entry.size)
        self.evictable_pages += entry.pages
        usage = self.ns_usage.setdefault(entry.ns, [0, 0])
        usage[0] += 1
        usage[1] += entry.size
        return entry

    def _supersede_partials(self, aliases: tuple[bytes, ...]) -> None:
        """Drop stored partial chunks that are leading blocks of a chunk being committed: the same key
        means the same tokens, so the longer chunk serves them, and its aliases take their place."""
        for alias in aliases:
            found = self.index.get(alias)
            if found is not None and found[0].key == alias and not found[0].pins:
                self._remove(found[0], "superseded")

    def abort(self, owner: ClientState, rids: Iterable[int]) -> int:
        done = 0
        for rid in rids:
            res = self._own_reservation(owner, rid)
            if res is not None:
                self._finish_reservation(res)
                self.pool.release(res.extents)
                done += 1
        self._update_gauges()
        return done

    def _own_reservation(self, owner: ClientState, rid: int) -> Reservation | None:
        res = self.reservations.get(rid)
        return res if res is not None and res.owner.ident == owner.ident else None

    def _finish_reservation(self, res: Reservation) -> None:
        del self.reservations[res.rid]
        if self.pending.get(res.item.key) == res.rid:
            del self.pending[res.item.key]
        res.owner.reservations.discard(res.rid)
        self._settled(res.owner)

    def _lapse_reservation(self, res: Reservation) -> None:
        if res.lapsed:
            return
        res.lapsed = True
        if self.pending.get(res.item.key) == res.rid:
            del self.pending[res.item.key]  # the key may be stored by someone else, into other pages
        self.metrics.reservations_expired.inc()

    def _lapse_lease(self, lease: Lease) -> None:
        """The read no longer counts; its entries stay put (readers held) until the client releases."""
        if not lease.lapsed:
            lease.lapsed = True
            self.metrics.leases_expired.inc()

    def _settled(self, client: ClientState) -> None:
        if not (client.reservations or client.leases):
            self.retired.pop(id(client), None)

    # -- read ------------------------------------------------------------------------------------

    def acquire(self, owner: ClientState, fp: bytes, keys: Iterable[bytes]
                ) -> tuple[int, list[AcquiredChunk | None]]:
        """Lease the chunks of namespace `fp` found under `keys` so they stay put while the client copies
        them out."""
        self._may_hold_pages(owner)
        self.namespace(fp)
        entries: list[Entry] = []
        out: list[AcquiredChunk | None] = []
        for key in keys:
            found = self.index.get(key)
            if found is None or found[0].ns != fp:
                out.append(None)
                continue
            entry, match = found
            self._add_readers(entry, 1)
            entries.append(entry)
            out.append(AcquiredChunk(entry.blocks, match, entry.size, entry.extents))
            self.metrics.retrieves.inc()
            self.metrics.retrieve_bytes.inc(entry.size)
        if not entries:
            return 0, out
        lid = next(self._ids)
        self.leases[lid] = Lease(lid, owner, entries, self.clock() + self.lease_ttl_s)
        owner.leases.add(lid)
        return lid, out

    def release(self, owner: ClientState, lid: int) -> bool:
        """End a lease; False when it is not the owner's or had lapsed (the bytes read may be wrong)."""
        lease = self.leases.get(lid)
        if lease is None or lease.owner.ident != owner.ident:
            return False
        self.metrics.retrieve_seconds.observe(max(0.0, self.clock() - lease.deadline + self.lease_ttl_s))
        self._end_lease(lease)
        return not lease.lapsed

    def _end_lease(self, lease: Lease) -> None:
        del self.leases[lease.lid]
        lease.owner.leases.discard(lease.lid)
        self._settled(lease.owner)
        for entry in lease.entries:
            self._add_readers(entry, -1)
        self._update_gauges()

    def _add_readers(self, entry: Entry, delta: int) -> None:
        self._change_hold(entry, readers=delta)

    def _change_hold(self, entry: Entry, readers: int = 0, pins: int = 0) -> None:
        """Adjust holds on an entry, keeping the evictable/pinned page counts exact."""
        was_evictable, was_pinned = entry.evictable, entry.pins > 0
        entry.readers += readers
        entry.pins += pins
        if entry.readers < 0 or entry.pins < 0:
            raise RuntimeError("negative hold count: accounting is broken")
        if not entry.doomed:
            self.evictable_pages += entry.pages * (entry.evictable - was_evictable)
            self.pinned_pages += entry.pages * ((entry.pins > 0) - was_pinned)
        elif not (entry.readers or entry.pins):
            self.pool.release(entry.extents)

    # -- pins and removal ------------------------------------------------------------------------

    def pin(self, keys: Iterable[bytes]) -> int:
        return self._pin_many(keys, 1)

    def unpin(self, keys: Iterable[bytes]) -> int:
        return self._pin_many(keys, -1)

    def _pin_many(self, keys: Iterable[bytes], delta: int) -> int:
        n = 0
        for key in keys:
            entry = self.entries.get(key)
            if entry is None or (delta < 0 and entry.pins == 0):
                continue
            self._change_hold(entry, pins=delta)
            n += 1
        self._update_gauges()
        return n

    def clear(self, fp: bytes | None = None) -> tuple[int, int]:
        """Remove every entry (of one namespace); returns (entries, bytes). Leased pages free on release."""
        victims = [e for e in self.entries.values() if fp is None or e.ns == fp]
        for entry in victims:
            self._remove(entry, "clear")
        self._update_gauges()
        return len(victims), sum(e.size for e in victims)

    def _remove(self, entry: Entry, reason: str) -> None:
        del self.entries[entry.key]
        for key in (entry.key, *entry.aliases):
            found = self.index.get(key)
            if found is not None and found[0] is entry:
                del self.index[key]
            others = self.shadowed.get(key)
            if others is None:
                continue
            others[:] = [o for o in others if o[0] is not entry]
            if key not in self.index and others:
                self.index[key] = others.pop()
            if not others:
                del self.shadowed[key]
        self.policy.remove(entry.key)
        if entry.evictable:
            self.evictable_pages -= entry.pages
        if entry.pins:  # removal (clear, corruption) drops pins: they name a chunk that is gone
            self.pinned_pages -= entry.pages
            entry.pins = 0
        usage = self.ns_usage.get(entry.ns)
        if usage is not None:
            usage[0] -= 1
            usage[1] -= entry.size
        self.metrics.evictions.labels(L1, reason).inc()
        if entry.readers:
            entry.doomed = True  # pages return when the last reader releases
        else:
            self.pool.release(entry.extents)

    # -- expiry ----------------------------------------------------------------------------------

    def sweep(self) -> None:
        """Lapse expired leases and reservations and the holdings of clients gone silent; free what dead
        clients held back; forget namespaces nobody uses."""
        self.flush_touches()
        now = self.clock()
        for client in list(self.clients.values()):
            if self._dead(client):
                self.drop_client(client.ident)
                self.metrics.clients_lost.inc()
            elif now - client.last_seen > self.client_timeout_s:
                self.retire(client.ident)
                self.metrics.clients_lost.inc()
        for lease in self.leases.values():
            if lease.deadline < now:
                self._lapse_lease(lease)
        for res in self.reservations.values():
            if res.deadline < now:
                self._lapse_reservation(res)
        for client in [c for c in self.retired.values() if self._dead(c)]:
            self._free_holdings(client)
        self._forget_unused_namespaces()
        self._update_gauges()
        self.metrics.held_back_bytes.set(sum(self.held_back().values()) * self.pool.page_size)

    def _dead(self, client: ClientState) -> bool:
        """Known to be gone: its lock file is no longer locked (a client without one is never known dead)."""
        if self.locks is None or not client.lock or self.locks.alive(client.lock):
            return False
        self.locks.remove(client.lock)
        return True

    def _free_holdings(self, client: ClientState) -> None:
        for lid in list(client.leases):
            self._end_lease(self.leases[lid])
        for rid in list(client.reservations):
            res = self.reservations[rid]
            self._finish_reservation(res)
            self.pool.release(res.extents)
        self.retired.pop(id(client), None)

    def drop_client(self, ident: bytes) -> None:
        """A client that said bye (or died): everything it held, registered or retired, is freed."""
        client = self.clients.pop(ident, None)
        if client is not None:
            self._free_holdings(client)
        for old in [c for c in self.retired.values() if c.ident == ident]:
            self._free_holdings(old)
        self._update_gauges()

    def _shed(self, reason: str) -> tuple[int, int]:
        """Evict (policy order) while L1 uses more pages than its budget; returns (entries, bytes)."""
        pool = self.pool
        self.flush_touches()
        evicted = freed = 0
        while pool.used_pages > pool.num_pages:
            key = self.policy.pick_victim(self._is_evictable)
            if key is None:
                break
            entry = self.entries[key]
            self._remove(entry, reason)
            evicted += 1
            freed += entry.size
        return evicted, freed

    def held_back(self) -> dict[int, int]:
        """Pages held back per retired or registered client (by id()): lapsed reservations, and the entries
        of lapsed leases."""
        out: dict[int, int] = {}
        for res in self.reservations.values():
            if res.lapsed:
                out[id(res.owner)] = out.get(id(res.owner), 0) + extent_pages(res.extents)
        for lease in self.leases.values():
            if lease.lapsed:
                pages = sum(e.pages for e in {id(e): e for e in lease.entries}.values())
                out[id(lease.owner)] = out.get(id(lease.owner), 0) + pages
        return out

    # -- reporting -------------------------------------------------------------------------------

    def _update_gauges(self) -> None:
        m, ps = self.metrics, self.pool.page_size
        m.l1_used.set(self.pool.used_pages * ps)
        m.entries.labels(L1).set(len(self.entries))
        m.pinned_bytes.set(self.pinned_pages * ps)
        m.clients.set(len(self.clients))

    def stats(self) -> dict:
        ps = self.pool.page_size
        return {
            "l1_capacity_bytes": self.pool.num_pages * ps,
            "l1_used_bytes": self.pool.used_pages * ps,
            "l1_free_pages": self.pool.free_pages,
            "l1_backed_bytes": self.backed_bytes,
            "l1_prefault": self.prefault,
            "page_size": ps,
            "entries": len(self.entries),
            "index_keys": len(self.index),
            "reservations": len(self.reservations),
            "leases": len(self.leases),
            "clients": len(self.clients),
            "held_back_bytes": sum(self.held_back().values()) * ps,
            "evictable_bytes": self.evictable_pages * ps,
            "pinned_bytes": self.pinned_pages * ps,
            "policy": self.policy.name,
            "evictions": _total(self.metrics.evictions),
            "malformed": _total(self.metrics.malformed),
        }

    # -- admin operations (admin API) -------------------------------------------------------------

    def resolve(self, key: bytes) -> Entry | None:
        """The stored entry a chunk key (or one of its leading-block prefix keys) names."""
        found = self.index.get(key)
        return found[0] if found is not None else None

    def prefix_keys(self, fp: bytes, token_ids: Sequence[int]) -> list[bytes]:
        """The key of every full and partial chunk of a token prefix (ValueError for bad token ids)."""
        return [c.key for c in chunk_keys(self.namespace(fp), token_ids)]

    def pin_keys(self, keys: Iterable[bytes], delta: int = 1) -> tuple[list[bytes], list[bytes], int]:
        """Pin (delta 1) or unpin (-1) the entries named by `keys` (chunk or prefix keys), once each.

        Returns (keys found, keys not found, entries changed). Unpinning an unpinned entry changes nothing.
        """
        found: list[bytes] = []
        missing: list[bytes] = []
        done: set[int] = set()
        for key in keys:
            entry = self.resolve(key)
            if entry is None:
                missing.append(key)
                continue
            found.append(key)
            if id(entry) in done or (delta < 0 and entry.pins == 0):
                continue
            done.add(id(entry))
            self._change_hold(entry, pins=delta)
        self._update_gauges()
        return found, missing, len(done)

    def held_pages(self) -> int:
        """Pages no eviction can free now: pinned or leased entries, and removed ones still being read."""
        held = {id(e): e for e in self.entries.values() if e.pins or e.readers}
        for lease in self.leases.values():
            for e in lease.entries:
                if e.doomed:
                    held[id(e)] = e
        return sum(e.pages for e in held.values())

    def reserved_pages(self) -> int:
        return sum(extent_pages(r.extents) for r in self.reservations.values())

    def resize(self, num_pages: int) -> dict:
        """Set the L1 page budget; a shrink evicts (policy order) until the pool fits.

        ValueError beyond the segment; ResizeRefused below the pinned and leased pages. Pages of open write
        reservations above the new budget return as those writes finish (reported as `draining_bytes`).
        """
        pool, ps = self.pool, self.pool.page_size
        if not 0 < num_pages <= pool.segment_pages:
            raise ValueError(f"L1 size must be 1..{pool.segment_pages} pages of {ps} bytes (the segment)")
        held = self.held_pages()
        if num_pages < held:
            raise ResizeRefused(
                f"cannot shrink L1 to {num_pages * ps} bytes: {held * ps} bytes are pinned or leased"
            )
        old = pool.num_pages
        pool.set_budget(num_pages)
        evicted, freed = self._shed("resize")
        self.metrics.l1_capacity.set(num_pages * ps)
        self._update_gauges()
        return {
            "old_capacity_bytes": old * ps,
            "capacity_bytes": num_pages * ps,
            "evicted_entries": evicted,
            "evicted_bytes": freed,
            "draining_bytes": max(0, pool.used_pages - num_pages) * ps,
        }

    def set_policy(self, policy: EvictionPolicy) -> int:
        """Swap the eviction policy, re-inserting entries in the old policy's eviction order (next victim
        first, so it stays the coldest); returns the entries moved."""
        self.flush_touches()
        old = self.policy
        order: list[bytes] = []
        seen: set[bytes] = set()
        for _ in range(len(self.entries) + 1):
            key = old.pick_victim(lambda _k: True)
            if key is None or key in seen:
                break
            old.remove(key)
            seen.add(key)
            if key in self.entries:
                order.append(key)
        order += [k for k in self.entries if k not in seen]
        for key in order:
            policy.insert(key, self.entries[key].size)
        self.policy = policy
        return len(order)

    def namespace_stats(self) -> list[dict]:
        """Per registered namespace: its fingerprint, identity and usage (entries, bytes, pinned bytes)."""
        pinned: dict[bytes, int] = {}
        for e in self.entries.values():
            if e.pins:
                pinned[e.ns] = pinned.get(e.ns, 0) + e.size
        out = []
        for fp, ns in self.namespaces.items():
            entries, nbytes = self.ns_usage.get(fp, (0, 0))
            out.append({"fingerprint": fp.hex(), **ns.to_dict(), "entries": entries, "bytes": nbytes,
                        "pinned_bytes": pinned.get(fp, 0)})
        return out

    def client_stats(self) -> list[dict]:
        """Registered clients, then retired ones that still hold pages back (state "retired")."""
        now, ps = self.clock(), self.pool.page_size
        held = self.held_back()
        return [
            {"instance": c.instance, "pid": c.pid, "state": state, "last_seen_s_ago": round(now - c.last_seen, 3),
             "leases": len(c.leases), "reservations": len(c.reservations),
             "held_back_bytes": held.get(id(c), 0) * ps}
            for state, clients in (("registered", self.clients.values()), ("retired", self.retired.values()))
            for c in clients
        ]


def _total(counter) -> int:
    """A counter's value summed over all its label children."""
    return int(sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")))


class ResizeRefused(Exception):
    """A shrink below what pins and leases hold."""
