"""Mutating cache routes (token required): POST /cache/clear, /cache/pin and /cache/unpin (the read-only
POST /cache/lookup is in lookup_route). A tenant's scope is each of its registered namespaces (L1's
TenantBook knows which tenant a namespace belongs to)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, HTTPException
from kvtier.admin_api.auth import authorized
from kvtier.admin_api.deps import CacheDep
from kvtier.admin_api.models import ClearRequest, PinRequest
from kvtier.server.cache import Cache
from kvtier.server.l1.store import L1Store
from kvtier.server.metrics import L1

log = logging.getLogger("kvtier.admin")

router = APIRouter()


@router.post("/cache/clear", dependencies=[Depends(authorized)],
             summary="remove all chunks, a namespace's, or a tier's")
async def clear(body: ClearRequest, cache: CacheDep) -> dict:
    store = cache.store
    fp = bytes.fromhex(body.namespace) if body.namespace is not None else None
    if body.scope == "tier" and body.tier != L1 and cache.tier(body.tier) is None:
        raise HTTPException(404, f"tier {body.tier} is not configured on this server")
    if fp is not None and fp not in store.namespaces and not cache.tiers:
        raise HTTPException(404, f"namespace {body.namespace.lower()} is not registered")
    if body.tenant is not None:
        done = await clear_tenant(cache, body.tenant)
    else:
        scoped = body.scope == "tier"
        result = await cache.clear(fp, l1=not scoped or body.tier == L1, lower=[body.tier] if scoped else None)
        if result.unknown:
            raise HTTPException(404, f"namespace {body.namespace.lower()} is neither registered nor in a lower tier")
        done = result.tiers
    entries, nbytes = sum(t["entries"] for t in done.values()), sum(t["bytes"] for t in done.values())
    log.info("admin: cleared %d chunks (%d bytes), scope %s", entries, nbytes, body.scope)
    return {"cleared_entries": entries, "cleared_bytes": nbytes, "tiers": done,
            "used_bytes": store.pool.used_pages * store.pool.page_size}


def tenant_namespaces(store: L1Store, tenant: str) -> list[bytes]:
    """The registered namespaces of a tenant of the quota table (or `*`); 404 for a name the table lacks."""
    book = store.tenants
    if tenant not in book.limits:
        named = ", ".join(sorted(book.limits))
        raise HTTPException(404, f"tenant {tenant!r} is not in the L1 quota table (tenants: {named})")
    return book.namespaces_of(tenant)


async def clear_tenant(cache: Cache, tenant: str) -> dict[str, dict[str, int]]:
    """Clear each namespace of the tenant from every tier; the per-tier counts added up."""
    done: dict[str, dict[str, int]] = {L1: {"entries": 0, "bytes": 0}}
    for fp in tenant_namespaces(cache.store, tenant):
        result = await cache.clear(fp)
        for tier, counts in result.tiers.items():
            total = done.setdefault(tier, dict.fromkeys(counts, 0))
            for field, n in counts.items():
                total[field] = total.get(field, 0) + n
    return done


def namespace_fp(store: L1Store, hex_fp: str) -> bytes:
    fp = bytes.fromhex(hex_fp)
    if fp not in store.namespaces:
        raise HTTPException(404, f"namespace {hex_fp.lower()} is not registered")
    return fp


def pin(cache: Cache, body: PinRequest, delta: int) -> dict:
    store = cache.store
    if body.keys is not None:
        keys = [bytes.fromhex(k) for k in body.keys]
    elif body.tenant is not None:
        assert body.token_ids is not None
        keys = [k for fp in tenant_namespaces(store, body.tenant) for k in cache.prefix_keys(fp, body.token_ids)]
    else:
        assert body.namespace is not None and body.token_ids is not None
        keys = cache.prefix_keys(namespace_fp(store, body.namespace), body.token_ids)
    found, missing, changed = store.pin_keys(keys, delta)
    return {"entries": changed, "found": [k.hex() for k in found], "missing": [k.hex() for k in missing],
            "pinned_bytes": store.pinned_pages * store.pool.page_size}


@router.post("/cache/pin", dependencies=[Depends(authorized)], summary="pin chunks so eviction never takes them")
async def pin_route(body: PinRequest, cache: CacheDep) -> dict:
    return pin(cache, body, 1)


@router.post("/cache/unpin", dependencies=[Depends(authorized)], summary="drop one pin from chunks")
async def unpin_route(body: PinRequest, cache: CacheDep) -> dict:
    return pin(cache, body, -1)
