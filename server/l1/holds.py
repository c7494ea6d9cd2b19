"""Who holds what in L1: registered clients, their write reservations and read leases, and their expiry.

Ownership rule (docs/security.md): pages a client may still be touching are never given to anyone else.
A reservation or lease that outlives its TTL, or whose client went silent or said hello again, *lapses*: it
no longer counts (a commit stores nothing, a release reports the read as lost) but its pages stay out of
the free list, "held back", until that client commits, aborts, releases or says bye, or its lock file
(shm/client_lock.py) shows it is dead. An adopted L1's quarantine (a previous daemon's reservations, l1/adopt.py)
follows the same rule across the restart: the pages a client was writing stay until it settles that
reservation (a commit or abort naming it, refused) or its lock file shows it dead; pages no client writes stay
`reservation_ttl_s`.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Collection, Iterable

from kvtier.server import protocol as p
from kvtier.server.keys import Namespace
from kvtier.server.l1.entry import Entry
from kvtier.server.l1.holdings import (
    CLIENT_ID_DIGITS,
    MAX_CLIENT_NAMESPACES,
    AcquiredChunk,
    ClientState,
    Lease,
    Reservation,
)
from kvtier.server.l1.journal_records import Unheld
from kvtier.server.l1.pool import Extents, extent_pages
from kvtier.server.l1.retention import DEFAULT_BOUNDS, HintBounds, Retention
from kvtier.server.l1.store import L1Store
from kvtier.server.metrics import Metrics
from kvtier.shm.client_lock import LOCK_INFIX, LockDirectory


class Holds:
    def __init__(self, store: L1Store, metrics: Metrics, lease_ttl_s: float = 30.0, reservation_ttl_s: float = 30.0,
                 client_timeout_s: float = 15.0, clock: Callable[[], float] = time.monotonic,
                 locks: LockDirectory | None = None, first_id: int = 1, hints: HintBounds = DEFAULT_BOUNDS) -> None:
        """`first_id`: the first reservation and lease id. A daemon starts its ids where no earlier daemon's
        can be (its start time in microseconds), so a commit or release of a predecessor's id, from a
        client that lived through a restart, never names a holding of this one: it is refused."""
        self.store = store
        self.metrics = metrics
        self.lease_ttl_s = lease_ttl_s
        self.reservation_ttl_s = reservation_ttl_s
        self.client_timeout_s = client_timeout_s
        self.clock = clock
        self.locks = locks  # None: no liveness check (nothing is ever known dead; clients need no lock)
        self.clients: dict[bytes, ClientState] = {}
        # Clients gone silent or registered again whose lapsed holdings are held back, by id().
        self.retired: dict[int, ClientState] = {}
        self.reservations: dict[int, Reservation] = {}
        self.leases: dict[int, Lease] = {}
        self._ids = itertools.count(first_id)
        # Told the ident of every client that is unregistered (retired, dropped, or saying hello again).
        self.on_client_gone: list[Callable[[bytes], None]] = []
        self.retention = Retention(store.keep, lambda e: store.entries.get(e.key) is e, clock, hints,
                                   metrics.hint_sessions_refused.inc)

    # -- clients ---------------------------------------------------------------------------------

    def hello(self, ident: bytes, instance: str, pid: int, lock: str = "") -> None:
        """Register a client; one that says hello again keeps nothing of its old registration (its
        holdings lapse). A `lock` must name a lock file the client holds."""
        self.retire(ident)
        if lock and (self.locks is None or not self.locks.alive(lock)):
            raise p.ProtocolError(p.BAD_REQUEST, "lock must name a client lock file beside the segment that "
                                  "the client holds (docs/protocol.md)")
        self.clients[ident] = ClientState(ident, instance, pid, self.clock(), lock)
        self.update_gauges()

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
        self._gone(ident)
        for rid in client.reservations:
            self._lapse_reservation(self.reservations[rid])
        for lid in client.leases:
            self._lapse_lease(self.leases[lid])
        if client.reservations or client.leases:
            self.retired[id(client)] = client
        self.update_gauges()

    def register(self, namespace: Namespace, owner: ClientState | None = None) -> bytes:
        fp = namespace.fingerprint()
        if owner is not None and fp not in owner.namespaces and len(owner.namespaces) >= MAX_CLIENT_NAMESPACES:
            raise p.ProtocolError(p.BAD_REQUEST, f"a client may register at most {MAX_CLIENT_NAMESPACES} namespaces")
        fp = self.store.register_namespace(namespace)
        if owner is not None:
            owner.namespaces.add(fp)
        return fp

    def _may_hold_pages(self, owner: ClientState) -> None:
        if self.locks is not None and not owner.lock:
            raise p.ProtocolError(p.BAD_REQUEST, "a client must hold a lock file (hello with `lock`) before it "
                                  "may reserve or acquire pages (docs/protocol.md)")

    # -- store -----------------------------------------------------------------------------------

    def reserve(self, owner: ClientState, fp: bytes, items: list[p.StoreItem], client_writes: bool = True,
                hint: p.Hint = p.NO_HINT) -> list[list]:
        """Per item: [status, reservation id, extents] or [REFUSED, reason] / [EXISTS] / [BUSY]. The journal
        names the owner's lock as the pages' writer unless a copier of this daemon writes them (`client_writes`
        False: the copier dies with the daemon). The request's `hint` applies to what it stores and to the
        chunks it offers that exist (l1/retention.py); a store the hint keeps skips the policy's admission."""
        self._may_hold_pages(owner)
        store = self.store
        keeps = hint.retain_s > 0 or bool(hint.session)
        ns, pool = store.namespace(fp), store.pool
        for item in items:
            item.check_fits(ns.blocks_per_chunk, pool.pages_for(item.size) * pool.page_size, store.min_block_bytes)
            item.check_tokens(fp, ns.block_size)
        now = self.clock()
        results: list[list] = []
        broken = False  # an earlier item was refused: the later ones cannot be found until it is stored
        for item in items:
            found = store.index.get(item.key)
            # A key stored as its own entry is never re-reserved, whatever block count a client claims:
            # committing it again would orphan the old entry's pages.
            if found is not None and (found[1] >= item.blocks or item.key in store.entries):
                if not broken:  # a chunk behind a missing one is not re-used: it keeps aging
                    store.touch(found[0])
                    if hint != p.NO_HINT:
                        self.retention.apply(found[0], hint)
                self.metrics.store_skipped.labels("exists").inc()
                results.append([p.EXISTS])
                continue
            if item.key in store.busy:
                self.metrics.store_skipped.labels("in_progress").inc()
                results.append([p.BUSY])
                continue
            res = None if broken else Reservation(next(self._ids), owner, fp, item, (), now + self.reservation_ttl_s,
                                                  hint=hint)
            if res is None:
                got: Extents | str = p.PREFIX_REFUSED
            else:
                with self._writing(owner.lock if client_writes else "", res.rid):
                    got = store.begin_insert(item.key, item.size, res, fp=fp, admit=not keeps)
            if res is None or isinstance(got, str):
                broken = True
                self.metrics.refused.labels(got).inc()
                results.append([p.REFUSED, got])
                continue
            res.extents = got
            self.reservations[res.rid] = res
            owner.reservations.add(res.rid)
            results.append([p.RESERVED, res.rid, list(got)])
        store.update_gauges()
        return results

    def commit(self, owner: ClientState, rids: Iterable[int],
               committed: Callable[[Entry], None] | None = None) -> int:
        """Make the owner's reservations visible (`committed` is told of each new entry at once); a lapsed
        one stores nothing and frees its pages."""
        done = 0
        for rid in reversed(list(rids)):  # a prefix's first chunk enters the policy last (most recent)
            res = self._own_reservation(owner, rid)
            if res is None:
                self._settle_quarantined(rid)
                continue
            self._finish_reservation(res)
            if res.lapsed:
                self.store.pool.release(res.extents)
                self.metrics.store_skipped.labels("lapsed").inc()
                continue
            self.metrics.store_seconds.observe(max(0.0, self.clock() - res.deadline + self.reservation_ttl_s))
            item = res.item
            entry = self.store.insert(Entry(item.key, res.ns, item.size, item.blocks, res.extents, item.aliases,
                                            tokens=item.tokens, parent=item.parent, priority=res.hint.priority))
            if res.hint != p.NO_HINT:
                self.retention.apply(entry, res.hint)
            self.metrics.stores.inc()
            self.metrics.store_bytes.inc(item.size)
            self.metrics.item_bytes.observe(item.size)
            if committed is not None:
                committed(entry)
            done += 1
        self.store.shed("resize")  # commits after a shrink leave as they commit
        self.store.update_gauges()
        return done

    def abort(self, owner: ClientState, rids: Iterable[int]) -> int:
        done = 0
        for rid in rids:
            res = self._own_reservation(owner, rid)
            if res is None:
                self._settle_quarantined(rid)
                continue
            self._finish_reservation(res)
            self.store.pool.release(res.extents)
            done += 1
        self.store.update_gauges()
        return done

    def _writing(self, lock: str, rid: int) -> contextlib.AbstractContextManager[None]:
        """Tell the journal who writes the pages allocated inside: the client holding `lock` ("": none)."""
        journal = self.store.journal
        if journal is None:
            return contextlib.nullcontext()
        return journal.writing(lock[-CLIENT_ID_DIGITS:] if lock else "", rid)

    def _settle_quarantined(self, rid: int) -> None:
        """A commit or abort naming a reservation of the daemon before the restart: its writer is done."""
        if rid and self.store.quarantine:
            self.store.end_quarantine(lambda group: group.rid == rid)

    def _own_reservation(self, owner: ClientState, rid: int) -> Reservation | None:
        res = self.reservations.get(rid)
        return res if res is not None and res.owner.ident == owner.ident else None

    def _finish_reservation(self, res: Reservation) -> None:
        del self.reservations[res.rid]
        self.store.end_busy(res.item.key, res)
        res.owner.reservations.discard(res.rid)
        self._settled(res.owner)

    def _lapse_reservation(self, res: Reservation) -> None:
        if res.lapsed:
            return
        res.lapsed = True
        self.store.end_busy(res.item.key, res)  # the key may be stored by someone else, into other pages
        self.metrics.reservations_expired.inc()

    def reserved_pages(self) -> int:
        return sum(extent_pages(r.extents) for r in self.reservations.values())

    # -- read ------------------------------------------------------------------------------------

    def acquire(self, owner: ClientState, fp: bytes, keys: Iterable[bytes], also: Collection[bytes] = ()
                ) -> tuple[int, list[AcquiredChunk | None]]:
        """Lease the chunks of namespace `fp` (or of the namespaces `also`: a lookup of every TP rank) found
        under `keys` so they stay put while the client copies them out."""
        self._may_hold_pages(owner)
        namespaces = {fp, *also}
        for ns in namespaces:
            self.store.namespace(ns)
        entries: list[Entry] = []
        out: list[AcquiredChunk | None] = []
        for key in keys:
            found = self.store.index.get(key)
            if found is None or found[0].ns not in namespaces:
                out.append(None)
                continue
            entry, match = found
            self.store.hold(entry)
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
            self.store.unhold(entry)
        self.store.update_gauges()

    def _lapse_lease(self, lease: Lease) -> None:
        """The read no longer counts; its entries stay put (readers held) until the client releases."""
        if not lease.lapsed:
            lease.lapsed = True
            self.metrics.leases_expired.inc()

    def _settled(self, client: ClientState) -> None:
        if not (client.reservations or client.leases):
            self.retired.pop(id(client), None)

    # -- expiry ----------------------------------------------------------------------------------

    def sweep(self) -> None:
        """Lapse expired leases and reservations and the holdings of clients gone silent; free what dead
        clients held back and what of an adopted L1's quarantine is over; forget namespaces nobody uses."""
        self.store.flush_touches()
        now = self.clock()
        self.retention.sweep()
        self.store.end_quarantine(lambda group: self._quarantine_over(group, now))
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
        named = {fp for c in self.clients.values() for fp in c.namespaces}
        self.store.forget_namespaces(named | {r.ns for r in self.reservations.values()})
        self.update_gauges()
        self.store.update_gauges()
        self.metrics.held_back_bytes.set(sum(self.held_back().values()) * self.store.pool.page_size)

    def _quarantine_over(self, group: Unheld, now: float) -> bool:
        """Pages a client of the previous daemon wrote: over once its lock file shows it dead (or was never
        one); pages no client writes (or no liveness check): once the quarantine's time is up."""
        if group.client and self.locks is not None:
            lock = f"{self.locks.segment_name}{LOCK_INFIX}{group.client}"
            if self.locks.alive(lock):
                return False
            self.locks.remove(lock)
            return True
        return now >= self.store.quarantine_until

    def _dead(self, client: ClientState) -> bool:
        """Known to be gone: its lock file is no longer locked (a client without one is never known dead)."""
        if self.locks is None or not client.lock or self.locks.alive(client.lock):
            return False
        self.locks.remove(client.lock)
        return True

    def _free_holdings(self, client: ClientState) -> None:
        """Free what the client holds, except what a copier is still copying (that lapses, held back, and
        is settled when the copy ends)."""
        for lid in list(client.leases):
            lease = self.leases[lid]
            if lease.copying:
                self._lapse_lease(lease)
            else:
                self._end_lease(lease)
        for rid in list(client.reservations):
            res = self.reservations[rid]
            if res.copying:
                self._lapse_reservation(res)
                continue
            self._finish_reservation(res)
            self.store.pool.release(res.extents)
        if client.reservations or client.leases:
            self.retired[id(client)] = client
        else:
            self.retired.pop(id(client), None)

    def copying(self, rids: Iterable[int] = (), lid: int = 0, on: bool = True) -> None:
        """Mark reservations `rids` and lease `lid` as being copied by a copier process (or no longer)."""
        for rid in rids:
            if rid in self.reservations:
                self.reservations[rid].copying = on
        if lid in self.leases:
            self.leases[lid].copying = on

    def _gone(self, ident: bytes) -> None:
        for listener in self.on_client_gone:
            listener(ident)

    def drop_client(self, ident: bytes) -> None:
        """A client that said bye (or died): everything it held, registered or retired, is freed."""
        client = self.clients.pop(ident, None)
        if client is not None:
            self._gone(ident)
            self._free_holdings(client)
        for old in [c for c in self.retired.values() if c.ident == ident]:
            self._free_holdings(old)
        self.update_gauges()
        self.store.update_gauges()

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

    def update_gauges(self) -> None:
        self.metrics.clients.set(len(self.clients))
        self.metrics.hint_sessions.set(len(self.retention.sessions))
