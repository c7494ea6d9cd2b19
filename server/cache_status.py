"""What /status shows of L1 beside the `stats` summary (Cache.status): L1's usage, the registered namespaces,
the clients."""

from __future__ import annotations

from kvtier.server.cache import Cache


def l1_status(cache: Cache) -> dict:
    """L1's part of `/status`."""
    store, holds, pool = cache.store, cache.holds, cache.store.pool
    ps = pool.page_size
    return {
        "capacity_bytes": pool.num_pages * ps,
        "segment_bytes": pool.segment_pages * ps,
        "used_bytes": pool.used_pages * ps,
        "free_bytes": max(0, pool.free_pages) * ps,
        "page_size": ps,
        "entries": len(store.entries),
        "pinned_bytes": store.pinned_pages * ps,
        "kept_bytes": store.kept_pages * ps,
        "tenant_quotas": store.tenants.table.text() if store.tenants.table is not None else "",
        "sessions": len(holds.retention.sessions),
        "evictable_bytes": store.evictable_pages * ps,
        "held_bytes": store.held_pages() * ps,
        "reserved_bytes": holds.reserved_pages() * ps,
        "leases": len(holds.leases),
        "reservations": len(holds.reservations),
    }


def namespace_stats(cache: Cache) -> list[dict]:
    """Per registered namespace: its fingerprint, identity and usage (entries, bytes, pinned bytes)."""
    store = cache.store
    pinned: dict[bytes, int] = {}
    for e in store.entries.values():
        if e.pins:
            pinned[e.ns] = pinned.get(e.ns, 0) + e.size
    out = []
    for fp, ns in store.namespaces.items():
        entries, nbytes = store.ns_usage.get(fp, (0, 0))
        out.append({"fingerprint": fp.hex(), **ns.to_dict(), "entries": entries, "bytes": nbytes,
                    "pinned_bytes": pinned.get(fp, 0)})
    return out


def client_stats(cache: Cache) -> list[dict]:
    """Registered clients, then retired ones that still hold pages back (state "retired")."""
    holds = cache.holds
    now, ps = holds.clock(), cache.store.pool.page_size
    held = holds.held_back()
    return [
        {"instance": c.instance, "pid": c.pid, "state": state, "last_seen_s_ago": round(now - c.last_seen, 3),
         "leases": len(c.leases), "reservations": len(c.reservations),
         "held_back_bytes": held.get(id(c), 0) * ps}
        for state, clients in (("registered", holds.clients.values()), ("retired", holds.retired.values()))
        for c in clients
    ]
