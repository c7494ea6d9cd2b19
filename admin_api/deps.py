"""FastAPI dependencies that hand a route what `create_app` put on `app.state`: the Cache (every cache
operation) and the Daemon (daemon facts only: config, segment, server id, metrics registry). They are
`async def` so they run on the daemon's event loop like the routes, never in FastAPI's thread pool."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from kvtier.server.cache import Cache
from kvtier.server.daemon import Daemon


async def cache(request: Request) -> Cache:
    return request.app.state.cache


async def daemon(request: Request) -> Daemon:
    return request.app.state.daemon


CacheDep = Annotated[Cache, Depends(cache)]
DaemonDep = Annotated[Daemon, Depends(daemon)]
