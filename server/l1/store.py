"""L1's chunks: entries, their prefix index, namespaces, holds on entries, room-making and the one eviction loop.

All bookkeeping is O(1) per key. The server never touches chunk bytes here: clients copy into pages they
reserved and out of pages they leased (l1/holds.py), promotions read lower-tier chunks into pages they got
from `begin_insert` (tiers/promotion.py). The public surface is what the cache, the holds and promotions
need: lookup, hold/unhold, make room, begin/complete/abandon an insert, busy, remove, clear, resize.
Listeners (`L1Listener`) are told of every commit, removal and pin count before it happens: the journal of a
journaled L1 (l1/journal.py, warm restart; always first) and the event reporter (l1/reporter.py); an adopted L1
keeps the pages its predecessor's writers may still touch in quarantine a while.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import chain
from operator import itemgetter

from kvtier.server import protocol as p
from kvtier.server.eviction.base import EvictionPolicy
from kvtier.server.index import IndexObserver, PrefixIndex
from kvtier.server.keys import Namespace
from kvtier.server.l1.entry import Entry, L1Listener, key_of
from kvtier.server.l1.journal import L1Journal
from kvtier.server.l1.journal_records import Unheld
from kvtier.server.l1.pool import Extents, PagePool, extent_pages
from kvtier.server.l1.tenants import TenantBook
from kvtier.server.metrics import L1, Metrics

TOUCH_BACKLOG_MAX = 1024
MAX_NAMESPACES = 4096  # registered at once, all clients together


class ResizeRefused(Exception):
    """A shrink below what pins and leases hold."""


class L1Store:
    def __init__(self, pool: PagePool, policy: EvictionPolicy, metrics: Metrics,
                 min_block_bytes: int = p.MIN_BLOCK_BYTES, index_observer: IndexObserver | None = None) -> None:
        self.pool = pool
        self.policy = policy
        self.metrics = metrics
        self.min_block_bytes = min_block_bytes
        self.namespaces: dict[bytes, Namespace] = {}
        self.ns_usage: dict[bytes, list[int]] = {}  # fingerprint -> [entries, bytes]
        self.entries: dict[bytes, Entry] = {}
        # key or alias -> (entry, leading blocks); the observer: L1's region of the presence filter
        self.index: PrefixIndex[Entry] = PrefixIndex(index_observer)
        self.busy: dict[bytes, object] = {}  # key -> who is inserting it (a reservation, a promotion)
        self.doomed: dict[int, Entry] = {}  # removed entries still held, by id()
        self.evictable_pages = 0
        self.pinned_pages = 0
        self.kept_pages = 0  # kept by request hints (l1/retention.py)
        self.tenants = TenantBook(pool.num_pages, pool.page_size)
        self.backed_bytes = 0  # of the segment, known to have memory behind it (the daemon's prefault)
        self.prefault = "off"  # the daemon's L1 prefault: off, running, done or failed
        self.journal: L1Journal | None = None  # the first listener (and, at the pool, the log of pages)
        self.listeners: list[L1Listener] = []
        self.quarantine: list[Unheld] = []  # pages an earlier daemon's writers may still touch (adopted L1)
        self.quarantine_until = 0.0  # when the groups no client writes leave it
        self._touch_backlog: list[list[tuple[Entry, int]]] = []
        # L1's gauges are read when scraped, not set on every change: no work on the serving loop for them
        ps = pool.page_size
        metrics.l1_capacity.set_function(lambda: self.pool.num_pages * ps)
        metrics.l1_used.set_function(lambda: self.pool.used_pages * ps)
        metrics.entries.labels(L1).set_function(lambda: len(self.entries))
        metrics.pinned_bytes.set_function(lambda: self.pinned_pages * ps)
        metrics.kept_bytes.set_function(lambda: self.kept_pages * ps)

    def attach_journal(self, journal: L1Journal) -> None:
        """Journal from now on: commits and removals here (before any other listener hears of them), pages at
        the pool."""
        self.journal = journal
        self.pool.log = journal
        self.listeners.insert(0, journal)

    # -- namespaces ------------------------------------------------------------------------------

    def register_namespace(self, namespace: Namespace) -> bytes:
        fp = namespace.fingerprint()
        if fp not in self.namespaces and len(self.namespaces) >= MAX_NAMESPACES:
            raise p.ProtocolError(p.BAD_REQUEST, f"the server holds {MAX_NAMESPACES} namespaces already")
        if fp not in self.namespaces:
            self.namespaces[fp] = namespace
            self.tenants.register(fp, namespace.cache_salt)
        self.ns_usage.setdefault(fp, [0, 0])
        return fp

    def namespace(self, fp: bytes) -> Namespace:
        ns = self.namespaces.get(fp)
        if ns is None:
            raise p.ProtocolError(p.UNKNOWN_NAMESPACE, "namespace not registered (the server may have restarted)")
        return ns

    def forget_namespaces(self, named: set[bytes]) -> None:
        """Drop the namespaces not in `named` that hold no chunk."""
        for fp in [fp for fp in self.namespaces if fp not in named and not self.ns_usage.get(fp, (0,))[0]]:
            del self.namespaces[fp]
            self.ns_usage.pop(fp, None)
            self.tenants.forget(fp)

    # -- lookup ----------------------------------------------------------------------------------

    def lookup(self, fp: bytes, chunks: list[list[bytes]]) -> list[tuple[Entry, int]]:
        """The longest stored prefix: per matched chunk, its entry and how many leading blocks match.

        The hits' policy touches are queued, not applied: the serving loop applies them right after the
        reply is sent (`flush_touches`), and every policy decision applies them first, so eviction order is
        the same as if they had been applied here, at no cost to the lookup's latency.
        """
        hits = self.peek(fp, chunks)
        if hits:
            self._touch_backlog.append(hits)
            if len(self._touch_backlog) > TOUCH_BACKLOG_MAX:  # nobody flushed (no serving loop): bound it
                self.flush_touches()
        return hits

    def peek(self, fp: bytes, chunks: list[list[bytes]]) -> list[tuple[Entry, int]]:
        """`lookup` without touching the policy: what a read-only question (the admin lookup) may ask."""
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
            n = found.index(None) if None in found else len(found)
        matches = list(map(itemgetter(1), found[:n]))
        if matches and (min(matches) < bpc or max(lengths) > bpc):  # not all whole: find the first that isn't
            pairs = enumerate(zip(matches, lengths, strict=False))
            n = next((i for i, (m, k) in pairs if m < bpc or m < k), n)
        hits: list[tuple[Entry, int]] = found[:n]
        if n < len(chunks):  # the prefix ends in chunk n: at its longest stored leading run, if any
            last = found[n] or self.index.longest(chunks[n][:-1])
            if last is not None and last[0].ns == fp:
                hits.append(last)
        return hits

    def flush_touches(self) -> None:
        """Apply queued lookup hits to the policy, each prefix back to front: its first chunk becomes the
        most recent, since losing it makes every later chunk of the prefix unreachable."""
        backlog, self._touch_backlog = self._touch_backlog, []
        touch = self.policy.touch
        for hits in backlog:
            for entry, _ in reversed(hits):
                touch(entry.key)

    def touch(self, entry: Entry) -> None:
        self.flush_touches()
        self.policy.touch(entry.key)

    def resolve(self, key: bytes) -> Entry | None:
        """The stored entry a chunk key (or one of its leading-block prefix keys) names."""
        found = self.index.get(key)
        return found[0] if found is not None else None

    # -- holds -----------------------------------------------------------------------------------

    def hold(self, entry: Entry, readers: int = 1, pins: int = 0) -> None:
        """Adjust holds on an entry (negative to drop them), keeping the evictable/pinned counts exact; a
        removed entry's pages return with its last hold."""
        if pins and not entry.doomed and entry.pins + pins >= 0:
            for listener in self.listeners:  # the journal first: a restart keeps the pins
                listener.pinned(entry.key, entry.pins + pins)
        was_evictable, was_pinned = entry.evictable, entry.pins > 0
        entry.readers += readers
        entry.pins += pins
        if entry.readers < 0 or entry.pins < 0:
            raise RuntimeError("negative hold count: accounting is broken")
        if not entry.doomed:
            self.evictable_pages += entry.pages * (entry.evictable - was_evictable)
            self.pinned_pages += entry.pages * ((entry.pins > 0) - was_pinned)
        elif not (entry.readers or entry.pins):
            self.doomed.pop(id(entry), None)
            self.pool.release(entry.extents)

    def unhold(self, entry: Entry) -> None:
        self.hold(entry, -1)

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
            self.hold(entry, 0, pins=delta)
        return found, missing, len(done)

    def held_pages(self) -> int:
        """Pages no eviction can free now: pinned, held or kept entries, and removed ones still held."""
        held = {id(e): e for e in self.entries.values() if e.pins or e.readers or e.kept}
        held.update(self.doomed)
        return sum(e.pages for e in held.values())

    # -- inserts ---------------------------------------------------------------------------------

    def begin_insert(self, key: bytes, size: int, token: object, admit: bool = True, fp: bytes = b""
                     ) -> Extents | str:
        """Pages for a chunk of namespace `fp` about to be written (evicting as the policy orders, within the
        tenants' quotas; asking the policy's admission first when `admit` and L1 is full but eviction could
        make the room, unless the tenant is within its guarantee), `key` marked busy for `token`; or the
        reason it is refused."""
        pool, book = self.pool, self.tenants
        npages = pool.pages_for(size)
        self.flush_touches()
        tenant = book.tenant(fp) if book.table is not None and fp else None
        could = pool.free_pages < npages <= min(pool.num_pages, pool.free_pages + self.evictable_pages)
        if admit and could and not (tenant is not None and book.within_guarantee(tenant, npages)) \
                and not self.policy.admit(key, size, self._is_evictable):
            return p.NOT_ADMITTED
        reason = self.make_room(npages, tenant)
        if reason:
            if fp:
                book.refused(fp, reason)
            return reason
        extents = self.pool.allocate(npages)
        assert extents is not None  # make_room guaranteed the pages
        self.busy[key] = token
        if tenant is not None:
            book.writing(key, (tenant, npages))
        return extents

    def end_busy(self, key: bytes, token: object) -> None:
        """`token`'s insert of `key` is over (committed, aborted or lapsed): another may start one."""
        if self.busy.get(key) is token:
            del self.busy[key]
            self.tenants.writing(key, None)

    def insert(self, entry: Entry) -> Entry:
        """Make a chunk whose bytes are in its pages visible (a commit, or a promotion from a lower tier)."""
        self.flush_touches()
        for listener in self.listeners:
            listener.committed(entry, self.namespaces.get(entry.ns))
        self.entries[entry.key] = entry
        for partial in self.index.superseded(entry.aliases, key_of):
            if not partial.pins:  # the longer chunk serves the same leading blocks
                self.remove(partial, "superseded")
        self.index.add(entry, entry.key, entry.blocks, entry.aliases)
        self.policy.insert(entry.key, entry.size)
        self.evictable_pages += entry.pages
        ns = self.namespaces.get(entry.ns)
        self.tenants.added(entry, entry.blocks * ns.block_size if ns is not None else 0)
        usage = self.ns_usage.setdefault(entry.ns, [0, 0])
        usage[0] += 1
        usage[1] += entry.size
        return entry

    def remove(self, entry: Entry, reason: str) -> None:
        for listener in self.listeners:  # the journal's record before any of its pages can go back to the pool
            listener.removed(entry, reason)
        del self.entries[entry.key]
        self.index.remove(entry, entry.key, entry.aliases)
        self.policy.remove(entry.key)
        self.tenants.removed(entry, reason)
        if entry.evictable:
            self.evictable_pages -= entry.pages
        if entry.kept:  # its hint's hold ends with it
            self.kept_pages -= entry.pages
            entry.kept = False
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
            self.doomed[id(entry)] = entry
        else:
            self.pool.release(entry.extents)

    @property
    def quarantined(self) -> Extents:
        return tuple(chain.from_iterable(group.extents for group in self.quarantine))

    def keep_quarantined(self, groups: list[Unheld], until: float) -> None:
        """Keep `groups` (allocated) from reuse until the holds end them (`until`: the sweep's clock when those
        no client writes may go)."""
        self.quarantine, self.quarantine_until = list(groups), until
        self.metrics.l1_quarantined.set(extent_pages(self.quarantined) * self.pool.page_size)

    def end_quarantine(self, ended: Callable[[Unheld], bool]) -> int:
        """Free the quarantined groups `ended` says are over; returns how many pages were freed."""
        verdicts = [(group, ended(group)) for group in self.quarantine]
        over = [group for group, end in verdicts if end]
        if not over:
            return 0
        self.quarantine = [group for group, end in verdicts if not end]
        for group in over:
            self.pool.release(group.extents)
        self.metrics.l1_quarantined.set(extent_pages(self.quarantined) * self.pool.page_size)
        return sum(extent_pages(group.extents) for group in over)

    def clear(self, fp: bytes | None = None) -> tuple[int, int]:
        """Remove every entry (of one namespace); returns (entries, bytes). Held pages free on release."""
        victims = [e for e in self.entries.values() if fp is None or e.ns == fp]
        for entry in victims:
            self.remove(entry, "clear")
        return len(victims), sum(e.size for e in victims)

    # -- room and eviction -----------------------------------------------------------------------

    def make_room(self, npages: int, tenant: str | None = None) -> str | None:
        """Evict until `npages` are free for a store by `tenant` (None: no quota applies), or the reason that
        cannot be. A tenant at its maximum makes room from its own chunks first (`quota`)."""
        pool, book = self.pool, self.tenants
        self.flush_touches()
        if npages > pool.num_pages:
            return p.TOO_LARGE
        if tenant is not None and book.over_max(tenant, npages):
            self.evict_while(lambda: book.over_max(tenant, npages), "quota", book.own(tenant))
            if book.over_max(tenant, npages):
                return p.RETAINED if self.kept_pages else p.TENANT_MAX
        if pool.free_pages + self.evictable_pages < npages:
            return p.RETAINED if pool.free_pages + self.evictable_pages + self.kept_pages >= npages else p.NO_SPACE
        if tenant is not None and book.within_guarantee(tenant, npages):  # grows into it: others' room first
            self.evict_while(lambda: pool.free_pages < npages, "capacity", book.may_evict(tenant, own=False))
        self.evict_while(lambda: pool.free_pages < npages, "capacity", book.may_evict(tenant))
        if pool.free_pages >= npages:
            return None
        return p.TENANT_GUARANTEE if tenant is not None else p.NO_SPACE  # or the evictable count drifted

    def shed(self, reason: str) -> tuple[int, int]:
        """Evict while L1 uses more pages than its budget (after a shrink); returns (entries, bytes)."""
        self.flush_touches()
        return self.evict_while(lambda: self.pool.used_pages > self.pool.num_pages, reason)

    def evict_while(self, needed: Callable[[], bool], reason: str,
                     allowed: Callable[[Entry], bool] | None = None) -> tuple[int, int]:
        """The eviction loop: victims while `needed()` (only entries `allowed` names, when given); returns
        (entries, bytes) evicted."""
        evicted = freed = 0
        while needed():
            entry = self._victim(allowed)
            if entry is None:
                break
            self.remove(entry, reason)
            evicted += 1
            freed += entry.size
        return evicted, freed

    def _victim(self, allowed: Callable[[Entry], bool] | None) -> Entry | None:
        if allowed is None and not self.tenants.high and not self.tenants.low:  # the policy's order as it is
            key = self.policy.pick_victim(self._is_evictable)
            return None if key is None else self.entries[key]
        return self.tenants.victim(self.policy, self.entries, allowed)

    def keep(self, entry: Entry, on: bool) -> None:
        """Keep an entry out of eviction for a request hint (on), or give it back to the policy (off)."""
        if entry.kept == on or entry.doomed:
            return
        was_evictable = entry.evictable
        entry.kept = on
        self.evictable_pages += entry.pages * (entry.evictable - was_evictable)
        self.kept_pages += entry.pages if on else -entry.pages
        if on:
            self.policy.remove(entry.key)
            self.tenants.hidden(entry)
        else:
            self.policy.insert(entry.key, entry.size)
            self.tenants.shown(entry)

    def _is_evictable(self, key: bytes) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.evictable

    def resize(self, num_pages: int) -> dict:
        """Set the L1 page budget; a shrink evicts (policy order) until the pool fits.

        ValueError beyond the segment; ResizeRefused below the pinned and held pages. Pages of open writes
        above the new budget return as those writes commit (reported as `draining_bytes`).
        """
        pool, ps = self.pool, self.pool.page_size
        if not 0 < num_pages <= pool.segment_pages:
            raise ValueError(f"L1 size must be 1..{pool.segment_pages} pages of {ps} bytes (the segment)")
        held = self.held_pages()
        if num_pages < held:
            raise ResizeRefused(f"cannot shrink L1 to {num_pages * ps} bytes: {held * ps} bytes are pinned, leased or kept by request hints")
        old = pool.num_pages
        pool.set_budget(num_pages)
        self.tenants.resize(num_pages)
        evicted, freed = self.shed("resize")
        return {"old_capacity_bytes": old * ps, "capacity_bytes": num_pages * ps, "evicted_entries": evicted,
                "evicted_bytes": freed, "draining_bytes": max(0, pool.used_pages - num_pages) * ps}

