"""The admin HTTP API (FastAPI): health, status, Prometheus metrics and cache operations. See docs/admin-api.md.

Every handler is `async def`: it runs on the daemon's event loop, between ZeroMQ requests, so it sees and
changes the cache without locks (a plain `def` handler would run in a thread pool and race it).
Security (docs/security.md): with an admin token set, every mutating request needs
`Authorization: Bearer <token>` (checked in `Guard` before the body is read); no route runs code, reads
files or shows the environment, and request bodies are limited to MAX_BODY_BYTES.

This module only wires the app; the routes live in one module per group (health, cache_routes,
lookup_route, reconfigure), the request bodies in models, the guard and token checks in auth. Routes read
`app.state.cache` (and `app.state.daemon` for daemon facts) through the dependencies of deps.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kvtier.admin_api import cache_routes, health, lookup_route, reconfigure
from kvtier.admin_api.auth import Guard
from kvtier.admin_api.health import version
from kvtier.server.daemon import Daemon


def create_app(daemon: Daemon) -> FastAPI:
    app = FastAPI(
        title="kvtier admin", version=version(), docs_url=None, redoc_url=None,
        description="Admin API of a kvtier server. Mutating routes need `Authorization: Bearer <token>` "
                    "when the server has an admin token.",
    )
    app.state.daemon = daemon
    app.state.cache = daemon.cache
    app.state.started = time.monotonic()
    app.state.admin_token = daemon.config.admin_token.encode()
    pool = daemon.cache.store.pool
    daemon.metrics.l1_segment.set(pool.segment_pages * pool.page_size)
    daemon.metrics.info.labels(version()).set(1)
    daemon.metrics.watch_tenants(lambda: daemon.cache.store.tenants.rows())
    app.add_middleware(Guard, token=daemon.config.admin_token, counter=daemon.metrics.admin_requests)
    app.add_exception_handler(RequestValidationError, invalid_body)
    for router in (health.router, cache_routes.router, lookup_route.router, reconfigure.router):
        app.include_router(router)
    return app


async def invalid_body(_request: Request, exc: RequestValidationError) -> JSONResponse:
    # The default handler echoes the input back, which fails on NaN and repeats whatever was sent.
    errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
              for e in exc.errors()[:20]]
    return JSONResponse({"detail": errors}, status_code=422)
