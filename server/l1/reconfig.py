"""Run-time changes to L1 that re-order or re-assign every entry: another eviction policy, another tenant quota
table (the admin API's /reconfigure; the journal's snapshot at a clean stop drains the policy too)."""

from __future__ import annotations

from kvtier.server.eviction.base import EvictionPolicy
from kvtier.server.l1.store import L1Store
from kvtier.server.tenants import QuotaTable


def set_policy(store: L1Store, policy: EvictionPolicy) -> int:
    """Swap the eviction policy, re-inserting entries in the old policy's eviction order (next victim first, so
    it stays the coldest; entries kept by a hint stay out of it); returns the entries moved."""
    order = drain_policy(store)
    for key in order:
        entry = store.entries[key]
        if not entry.kept:
            policy.insert(key, entry.size)
    store.policy = policy
    return len(order)


def drain_policy(store: L1Store) -> list[bytes]:
    """Every entry's key in the policy's eviction order (next victim first; entries outside it, kept by a hint,
    last), emptying the policy: for a new policy, or the journal's last snapshot at a clean stop."""
    store.flush_touches()
    old = store.policy
    order: list[bytes] = []
    seen: set[bytes] = set()
    for _ in range(len(store.entries) + 1):
        key = old.pick_victim(lambda _k: True)
        if key is None or key in seen:
            break
        old.remove(key)
        seen.add(key)
        if key in store.entries:
            order.append(key)
    return order + [k for k in store.entries if k not in seen]


def set_quotas(store: L1Store, table: QuotaTable | None) -> dict:
    """Apply a tenant quota table at once (None: none): a tenant now over its maximum sheds its own chunks
    (reason `quota`). ValueError when its guarantees exceed L1 (nothing changes then)."""
    store.flush_touches()
    book = store.tenants
    book.set_table(table, lambda: list(store.entries.values()))
    evicted = freed = 0
    for tenant in list(book.usage):
        n, b = store.evict_while(lambda t=tenant: book.over_max(t, 0), "quota", book.own(tenant))
        evicted, freed = evicted + n, freed + b
    return {"table": table.text() if table is not None else "", "evicted_entries": evicted, "evicted_bytes": freed}
