"""Read-only routes: GET /healthz (readiness), /status (capacity, usage, tenants, namespaces, clients, policy) and
/metrics (Prometheus text format). No token needed."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from importlib import metadata
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from kvtier.admin_api.deps import CacheDep, DaemonDep
from kvtier.server import cache_status
from kvtier.shm.segment import list_segments
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter()


def version() -> str:
    try:
        return metadata.version("kvtier")
    except metadata.PackageNotFoundError:
        return "unknown"


@router.get("/healthz", summary="readiness: L1 mapped, L2 usable (a remote tier that is down: degraded, ready)")
async def healthz(cache: CacheDep, daemon: DaemonDep) -> JSONResponse:
    checks = {"l1_mapped": not daemon.segment.buf.closed}
    reasons = {"l1_mapped": "the L1 segment is not mapped"}
    tier_checks, tier_reasons, degraded = cache.health()
    checks.update(tier_checks)
    reasons.update(tier_reasons)
    ready = all(checks.values())
    body: dict[str, Any] = {"ok": ready, "checks": checks}
    if not ready:
        body["reasons"] = {name: reasons[name] for name, ok in checks.items() if not ok}
    if degraded:
        body["degraded"] = degraded
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/status", summary="capacity, usage, namespaces, clients and policy")
async def status(request: Request, cache: CacheDep, daemon: DaemonDep) -> dict:
    store, holds, l2, remote = cache.store, cache.holds, cache.tier("l2"), cache.tier("remote")
    return {
        "version": version(),
        "uptime_s": round(time.monotonic() - request.app.state.started, 3),
        "server_id": daemon.handler.server_id,
        "endpoints": daemon.config.endpoints,
        "policy": store.policy.name,
        "log_level": logging.getLevelName(logging.getLogger().level).lower(),
        "l1": {**cache_status.l1_status(cache), "shm_name": daemon.segment.name, "shm_dir": daemon.segment.directory,
               "tenants": store.tenants.rows()},
        "l2": l2.stats() if l2 is not None else {"l2_enabled": False},
        "remote": remote.stats() if remote is not None else {"remote_enabled": False},
        "tiers": [{"name": tier.name, **tier.stats()} for tier in cache.tiers],  # lookup order, any tier
        "shm_others": _others(daemon.segment.directory, daemon.segment.name),
        "namespaces": cache_status.namespace_stats(cache),
        "clients": cache_status.client_stats(cache),
        "gpu": daemon.gpu.status(),
        "ttl": {"lease_s": holds.lease_ttl_s, "reservation_s": holds.reservation_ttl_s,
                "client_timeout_s": holds.client_timeout_s},
    }


def _others(directory: str, own: str) -> dict:
    """What the node holds in --shm-dir beyond this server's segment: other servers' segments, live or left
    by a server that stopped (`kvtier segments --remove-unused` removes those)."""
    others = [asdict(f) for f in list_segments(directory) if f.name != own]
    return {"segments": others, "held_bytes": sum(f["held"] for f in others),
            "unused_bytes": sum(f["held"] for f in others if not f["live"])}


@router.get("/metrics", summary="Prometheus text format", response_class=Response)
async def metrics(daemon: DaemonDep) -> Response:
    return Response(generate_latest(daemon.metrics.registry), media_type=CONTENT_TYPE_LATEST)
