"""Runs the admin FastAPI app with uvicorn on the daemon's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn
from kvtier.admin_api.app import create_app
from kvtier.server.daemon import Daemon

log = logging.getLogger("kvtier.admin")


class AdminService:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        config = uvicorn.Config(
            create_app(daemon),
            host=daemon.config.http_host,
            port=daemon.config.http_port,
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
        self._server = uvicorn.Server(config)
        # The daemon owns SIGTERM/SIGINT: uvicorn must neither install handlers nor re-raise signals.
        self._server.install_signal_handlers = lambda: None
        self._server.capture_signals = contextlib.nullcontext
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # re-raise the bind error
                raise RuntimeError("admin API exited during start-up")
            await asyncio.sleep(0.01)
        log.info("admin API on http://%s:%d", self.daemon.config.http_host, self.daemon.config.http_port)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, timeout=5)
