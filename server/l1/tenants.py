"""Tenants in L1: what each holds and did, its quota in pages, and which chunks a store may evict
(docs/tenants.md).

Without a quota table every namespace is in the default tenant `*` and the store makes room exactly as the
policy orders. With one, a store by tenant T evicts only chunks `may_evict` allows: T's own, or another
tenant's while that tenant stays at or above its guarantee; while the store keeps T within its guarantee, T
takes the room from those others first and its own chunks only after, so T grows into its share instead of
evicting its own chunks in the policy's order (a loop that fits its share is kept). The policy's walk is
bounded (server/tenants.py's `bounded_pick`, shared with L2): after WALK_BOUND protected chunks the victim comes
from the per-tenant insertion order instead (`fallback`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.server.eviction.base import EvictionPolicy
from kvtier.server.l1.entry import Entry
from kvtier.server.tenants import (
    DEFAULT_TENANT,
    WALK_BOUND,
    Bounded,
    Limits,
    QuotaTable,
    bounded_pick,
    tenant_of,
)

HIGH = 2  # protocol.PRIORITIES.index("high")
LOW = 0


@dataclass
class TenantUsage:
    """One tenant's counters in L1 (plain numbers, exported at scrape time)."""

    pages: int = 0
    entries: int = 0
    stored_tokens: int = 0
    requested_tokens: int = 0
    hit_tokens: int = 0
    evictions: dict[str, int] = field(default_factory=dict)  # reason -> chunks
    refused: dict[str, int] = field(default_factory=dict)  # reason -> stores


class TenantBook:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.table: QuotaTable | None = None
        self.page_size = page_size
        self.num_pages = num_pages
        self.limits: dict[str, Limits] = {DEFAULT_TENANT: Limits(0, num_pages * page_size)}
        self.usage: dict[str, TenantUsage] = {DEFAULT_TENANT: TenantUsage()}
        self.salts: dict[bytes, str] = {}  # namespace -> its cache salt
        self.ns_tenant: dict[bytes, str] = {}
        self.order: dict[str, dict[bytes, Entry]] = {DEFAULT_TENANT: {}}  # evictable-order fallback, oldest first
        self.low: dict[bytes, Entry] = {}  # low-priority entries, oldest first: evicted before the policy's order
        self.high = 0  # high-priority entries in the policy's order
        self._writes: dict[bytes, tuple[str, int]] = {}  # key being written -> (tenant, pages): counted at once
        self._writing_pages: dict[str, int] = {}

    # -- tenants and limits ----------------------------------------------------------------------

    def register(self, fp: bytes, cache_salt: str) -> None:
        self.salts[fp] = cache_salt
        self.ns_tenant[fp] = tenant_of(cache_salt, self.limits) if self.table is not None else DEFAULT_TENANT

    def forget(self, fp: bytes) -> None:
        self.salts.pop(fp, None)
        self.ns_tenant.pop(fp, None)

    def tenant(self, fp: bytes) -> str:
        return self.ns_tenant.get(fp, DEFAULT_TENANT)

    def namespaces_of(self, tenant: str) -> list[bytes]:
        return [fp for fp, t in self.ns_tenant.items() if t == tenant]

    def set_table(self, table: QuotaTable | None, entries: Callable[[], list[Entry]]) -> None:
        """Another table (None: none), every namespace and entry re-assigned; ValueError if its guarantees exceed
        L1 (nothing changes then)."""
        limits = table.limits(self.num_pages * self.page_size) if table is not None \
            else {DEFAULT_TENANT: Limits(0, self.num_pages * self.page_size)}
        self.table, self.limits = table, limits
        self.usage = {name: self.usage.get(name) or TenantUsage() for name in limits}
        for row in self.usage.values():
            row.pages = row.entries = 0
        self.ns_tenant = {fp: tenant_of(salt, limits) if table is not None else DEFAULT_TENANT
                          for fp, salt in self.salts.items()}
        self.order = {name: {} for name in limits}
        for entry in entries():
            entry.tenant = self.tenant(entry.ns)
            self._count(entry, 1)
            if not entry.kept:
                self.order[entry.tenant][entry.key] = entry

    def resize(self, num_pages: int) -> None:
        """L1's budget changed: shares are of the new size (a table whose byte guarantees no longer fit keeps
        its old limits; /reconfigure refuses such a shrink before it happens)."""
        self.num_pages = num_pages
        if self.table is None:
            self.limits = {DEFAULT_TENANT: Limits(0, num_pages * self.page_size)}
            return
        with contextlib.suppress(ValueError):
            self.limits = self.table.limits(num_pages * self.page_size)

    def guaranteed_pages(self, tenant: str) -> int:
        return self.limits[tenant].guaranteed // self.page_size

    def max_pages(self, tenant: str) -> int:
        return self.limits[tenant].maximum // self.page_size

    # -- what happens to entries -----------------------------------------------------------------

    def added(self, entry: Entry, tokens: int) -> None:
        entry.tenant = tenant = self.tenant(entry.ns)
        self._count(entry, 1)
        self.usage[tenant].stored_tokens += tokens
        self.shown(entry)

    def removed(self, entry: Entry, reason: str) -> None:
        row = self.usage[entry.tenant]
        self._count(entry, -1)
        row.evictions[reason] = row.evictions.get(reason, 0) + 1
        if not entry.kept:  # a kept entry left the order when it was kept
            self.hidden(entry)

    def shown(self, entry: Entry) -> None:
        """The entry is in the eviction order (stored, or no longer kept by a hint). The per-tenant order is
        kept only while a table names tenants (set_table builds it)."""
        if self.table is not None:
            self.order[entry.tenant][entry.key] = entry
        if entry.priority == LOW:
            self.low[entry.key] = entry
        elif entry.priority == HIGH:
            self.high += 1

    def hidden(self, entry: Entry) -> None:
        """The entry left the eviction order (removed, or kept by a hint): once for each `shown`."""
        if self.table is not None:
            self.order[entry.tenant].pop(entry.key, None)
        if entry.priority == LOW:
            self.low.pop(entry.key, None)
        elif entry.priority == HIGH:
            self.high -= 1

    def _count(self, entry: Entry, sign: int) -> None:
        row = self.usage[entry.tenant]
        row.pages += sign * entry.pages
        row.entries += sign

    def refused(self, fp: bytes, reason: str) -> None:
        row = self.usage[self.tenant(fp)]
        row.refused[reason] = row.refused.get(reason, 0) + 1

    def looked_up(self, fp: bytes, requested: int, hit: int) -> None:
        row = self.usage[self.tenant(fp)]
        row.requested_tokens += requested
        row.hit_tokens += hit

    # -- victims ---------------------------------------------------------------------------------

    def writing(self, key: bytes, write: tuple[str, int] | None) -> None:
        """A tenant's chunk is being written into `pages` (None: its write ended): its maximum counts it from
        the reserve on, so that one request's items cannot take the tenant past it before they commit."""
        if write is not None:
            self._writes[key] = write
            tenant, pages = write
        elif (ended := self._writes.pop(key, None)) is not None:
            tenant, pages = ended[0], -ended[1]
        else:
            return
        self._writing_pages[tenant] = self._writing_pages.get(tenant, 0) + pages

    def over_max(self, tenant: str, npages: int) -> bool:
        return self.usage[tenant].pages + self._writing_pages.get(tenant, 0) + npages > self.max_pages(tenant)

    def may_evict(self, tenant: str | None, own: bool = True) -> Callable[[Entry], bool] | None:
        """Which chunks a store by `tenant` may evict (None: any, as the policy orders): other tenants' that stay
        at or above their guarantee, and (if `own`) its own."""
        if self.table is None or tenant is None:
            return None
        usage, limits, ps = self.usage, self.limits, self.page_size

        def allowed(entry: Entry) -> bool:
            owner = entry.tenant
            if owner == tenant:
                return own
            return (usage[owner].pages - entry.pages) * ps >= limits[owner].guaranteed
        return allowed

    def within_guarantee(self, tenant: str, npages: int) -> bool:
        """Whether a store of `npages` keeps `tenant` within its guaranteed share."""
        return (self.usage[tenant].pages + npages) * self.page_size <= self.limits[tenant].guaranteed

    def own(self, tenant: str) -> Callable[[Entry], bool]:
        return lambda entry: entry.tenant == tenant

    def victim(self, policy: EvictionPolicy, entries: dict[bytes, Entry], allowed: Callable[[Entry], bool] | None
               ) -> Entry | None:
        """The next victim within `allowed`: a low-priority entry first, then the policy's order (high-priority
        entries last); the per-tenant order when the policy's walk passes too many protected entries."""
        if self.low and (entry := self.first_low(allowed)) is not None:
            return entry
        def evictable(key: bytes) -> Entry | None:
            entry = entries.get(key)
            return entry if entry is not None and entry.evictable else None

        for high in (False, True) if self.high else (True,):
            try:
                key = bounded_pick(policy, evictable, lambda e, high=high: (allowed is None or allowed(e))
                                   and (high or e.priority != HIGH))
            except Bounded:
                break
            if key is not None:
                return entries[key]
        return self.fallback(allowed)

    def first_low(self, allowed: Callable[[Entry], bool] | None) -> Entry | None:
        """The oldest evictable low-priority entry a store may evict (a bounded look)."""
        for n, entry in enumerate(self.low.values()):
            if n > WALK_BOUND:
                break
            if entry.evictable and (allowed is None or allowed(entry)):
                return entry
        return None

    def fallback(self, allowed: Callable[[Entry], bool] | None) -> Entry | None:
        """The oldest evictable allowed entry of the tenant furthest over its guarantee that has one."""
        ranked = sorted(self.usage, key=lambda t: self.usage[t].pages * self.page_size - self.limits[t].guaranteed,
                        reverse=True)
        for tenant in ranked:
            for entry in self.order[tenant].values():
                if entry.evictable:
                    if allowed is None or allowed(entry):
                        return entry
                    break  # allowed depends on the tenant and the entry's size: the next one is no likelier
        return None

    # -- reporting -------------------------------------------------------------------------------

    def rows(self) -> list[dict]:
        ps = self.page_size
        return [{"tenant": name, "used_bytes": row.pages * ps, "entries": row.entries,
                 "guaranteed_bytes": self.limits[name].guaranteed, "max_bytes": self.limits[name].maximum,
                 "stored_tokens": row.stored_tokens, "requested_tokens": row.requested_tokens,
                 "hit_tokens": row.hit_tokens, "evictions": dict(row.evictions), "refused": dict(row.refused)}
                for name, row in self.usage.items()]
