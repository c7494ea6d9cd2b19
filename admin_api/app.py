"""The admin HTTP API (FastAPI): health, status and Prometheus metrics."""

from __future__ import annotations

import time

from fastapi import FastAPI, Response
from kvtier.server.daemon import Daemon
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


def create_app(daemon: Daemon) -> FastAPI:
    app = FastAPI(title="kvtier admin", version="1")
    started = time.time()

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.get("/status")
    def status() -> dict:
        return {"uptime_s": round(time.time() - started, 3), **daemon.store.stats()}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(daemon.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
