"""POST /reconfigure (token required): live changes to the L1 size, the eviction policy, the L1 and L2 tenant
quota tables and the log level; and `release_free_memory`, which gives the memory of free L1 pages back to the OS
after a shrink (refused while a GPU copier holds L1 page-locked: server/pinning.py)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Depends, HTTPException
from kvtier.admin_api.auth import authorized
from kvtier.admin_api.deps import CacheDep, DaemonDep
from kvtier.admin_api.models import ReconfigureRequest
from kvtier.server.cache import Cache
from kvtier.server.daemon import Daemon
from kvtier.server.eviction import make_policy
from kvtier.server.l1 import reconfig
from kvtier.server.l1.store import ResizeRefused
from kvtier.server.metrics import L1
from kvtier.server.pinning import lockers
from kvtier.server.tenants import QuotaTable
from kvtier.shm.pages import extent_byte_ranges

log = logging.getLogger("kvtier.admin")

router = APIRouter()


@router.post("/reconfigure", dependencies=[Depends(authorized)],
             summary="eviction policy, L1 size, L1 and L2 tenant quotas, log level")
async def reconfigure(body: ReconfigureRequest, cache: CacheDep, daemon: DaemonDep) -> dict:
    out: dict[str, Any] = {}
    size = body.l1_size_bytes if body.l1_size_gb is None else int(body.l1_size_gb * (1 << 30))
    check_quotas(cache, body.tenant_quotas, size)
    l2_table = check_l2_quotas(cache, body.l2_tenant_quotas)
    if size is not None:
        out["l1"] = resize_l1(cache, daemon, size, body.release_memory)
    if body.tenant_quotas is not None:
        out["tenant_quotas"] = set_quotas(daemon, body.tenant_quotas)
    if body.eviction_policy is not None and body.eviction_policy != cache.store.policy.name:
        out["eviction_policy"] = set_policy(cache, daemon, body.eviction_policy)
    if body.l2_tenant_quotas is not None:
        out["l2_tenant_quotas"] = set_l2_quotas(daemon, l2_table)
    if body.log_level is not None:
        level = body.log_level.upper()
        logging.getLogger().setLevel(level)
        logging.getLogger("kvtier").setLevel(level)
        daemon.config.log_level = body.log_level
        out["log_level"] = body.log_level
    return out


def resize_l1(cache: Cache, daemon: Daemon, size: int, release_memory: bool) -> dict:
    store = cache.store
    pool = store.pool
    pages = size // pool.page_size
    if not 0 < pages <= pool.segment_pages:
        raise HTTPException(
            422, f"L1 size must be {pool.page_size}..{pool.segment_pages * pool.page_size} bytes "
                 "(one page up to the shared-memory segment)",
        )
    if release_memory and pages < pool.num_pages and (gpus := lockers(daemon.gpu)):
        raise HTTPException(
            409, f"cannot give L1 memory back while GPU copiers hold L1 page-locked ({', '.join(gpus)}): the GPUs "
                 "would keep copying to the old pages while the server and CPU engines see new ones. Shrink with "
                 "\"release_memory\": false (the budget shrinks, the memory stays with L1), or restart kvtier with "
                 "a smaller --l1-size-gb",
        )
    try:
        result = store.resize(pages)
    except ResizeRefused as exc:
        raise HTTPException(409, str(exc)) from None
    if release_memory and pages * pool.page_size < result["old_capacity_bytes"]:
        result["released_bytes"] = release_free_memory(daemon)
    log.info("admin: L1 resized to %d bytes (%d chunks evicted)", result["capacity_bytes"],
             result["evicted_entries"])
    return result


def check_quotas(cache: Cache, text: str | None, size: int | None) -> None:
    """Refuse, before anything changes, a bad table (422) and a table whose guarantees would not fit the L1
    budget after this request: the new table against the new size (422), the table in force against a
    shrink (409)."""
    pool = cache.store.pool
    capacity = pool.num_pages * pool.page_size if size is None else size // pool.page_size * pool.page_size
    try:
        table = QuotaTable.parse(text) if text is not None else cache.store.tenants.table
    except ValueError as exc:
        raise HTTPException(422, f"tenant_quotas: {exc}") from None
    if table is None or (text is None and size is None):
        return
    try:
        table.limits(capacity)
    except ValueError as exc:
        if text is not None:
            raise HTTPException(422, f"tenant_quotas: {exc}") from None
        raise HTTPException(409, f"L1 size {capacity} is too small for the tenant quota table in force "
                                 f"({table.text()}): {exc}; change the table first (tenant_quotas)") from None


def set_quotas(daemon: Daemon, text: str) -> dict:
    """Apply the L1 quota table now (a tenant over its new maximum sheds at once), keep it for a warm restart
    (server/tenant_tables.py) and keep the daemon's config in step."""
    try:
        result = daemon.tables.apply(L1, text)
    except ValueError as exc:
        raise HTTPException(422, f"tenant_quotas: {exc}") from None
    daemon.config.l1_tenant_quotas = result["table"]
    log.info("admin: L1 tenant quotas set to %r (%d chunks shed)", result["table"] or "none",
             result["evicted_entries"])
    return result


def check_l2_quotas(cache: Cache, text: str | None) -> str:
    """Refuse, before anything changes, an L2 table when there is no L2 tier (409), and one that does not parse
    or whose guarantees exceed L2 (422); the table's text."""
    if text is None:
        return ""
    l2 = cache.tier("l2")
    if l2 is None:
        raise HTTPException(409, "l2_tenant_quotas: the server has no L2 tier (--l2-path)")
    try:
        QuotaTable.parse(text).limits(l2.tier.capacity_bytes)
    except ValueError as exc:
        raise HTTPException(422, f"l2_tenant_quotas: {exc}") from None
    return text


def set_l2_quotas(daemon: Daemon, text: str) -> dict:
    """Apply the L2 quota table now (a tenant over its new maximum sheds at once: FsTier.set_quotas), keep it
    for a warm restart (server/tenant_tables.py) and keep the daemon's config in step."""
    result = daemon.tables.apply("l2", text)
    daemon.config.l2_tenant_quotas = result["table"]
    log.info("admin: L2 tenant quotas set to %r (%d chunks shed)", result["table"] or "none",
             result["evicted_entries"])
    return result


def set_policy(cache: Cache, daemon: Daemon, name: str) -> dict:
    store = cache.store
    old = store.policy.name
    moved = reconfig.set_policy(store, make_policy(name))
    daemon.config.eviction_policy = name
    log.info("admin: eviction policy %s -> %s (%d entries)", old, name, moved)
    return {"old": old, "new": name, "entries": moved}


def release_free_memory(daemon: Daemon) -> int:
    """Give the memory of every free L1 page back to the OS (MADV_REMOVE punches a hole in the tmpfs file)."""
    pool = daemon.cache.store.pool
    try:
        return daemon.segment.give_back(extent_byte_ranges(pool.free_extents(), pool.page_size))
    except OSError as exc:  # not fatal: the pages stay free, only their memory is not returned
        log.warning("could not return free L1 memory to the OS: %s", exc)
        return 0
