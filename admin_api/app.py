"""The admin HTTP API (FastAPI): health, status, Prometheus metrics and cache operations. See docs/admin-api.md.

Every handler is `async def`: it runs on the daemon's event loop, between ZeroMQ requests, so it sees and
changes the ChunkStore without locks (a plain `def` handler would run in a thread pool and race it).
Security (docs/security.md): with an admin token set, every mutating request needs
`Authorization: Bearer <token>` (checked in `Guard` before the body is read); no route runs code, reads
files or shows the environment, and request bodies are limited to MAX_BODY_BYTES.
"""

from __future__ import annotations

import logging
import mmap
import time
from importlib import metadata
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from kvtier.server.chunk_store import L1, ResizeRefused
from kvtier.server.daemon import Daemon
from kvtier.server.eviction import POLICIES, make_policy
from kvtier.server.tokens import token_matches
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

log = logging.getLogger("kvtier.admin")

MAX_BODY_BYTES = 1 << 20
MAX_KEYS = 65536
MAX_TOKENS = 1 << 20
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
ROUTES = frozenset(
    {"/healthz", "/status", "/metrics", "/cache/clear", "/cache/pin", "/cache/unpin", "/reconfigure", "/openapi.json"}
)
LOG_LEVELS = ("debug", "info", "warning", "error")
TIERS = ("l1", "l2")


def version() -> str:
    try:
        return metadata.version("kvtier")
    except metadata.PackageNotFoundError:
        return "unknown"


# -- request bodies -------------------------------------------------------------------------------

HexKey = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{32}$")]
TokenId = Annotated[int, Field(ge=0, le=0xFFFFFFFF)]
_STRICT = ConfigDict(extra="forbid", strict=True)


class ClearRequest(BaseModel):
    """Remove every chunk (`all`), those of one namespace, or those of one tier."""

    model_config = _STRICT
    scope: Literal["all", "namespace", "tier"]
    namespace: HexKey | None = Field(None, description="namespace fingerprint (hex), for scope=namespace")
    tier: Literal[TIERS] | None = Field(None, description="tier, for scope=tier")

    @model_validator(mode="after")
    def _consistent(self) -> ClearRequest:
        if (self.scope == "namespace") != (self.namespace is not None):
            raise ValueError("namespace is required with scope=namespace and not allowed otherwise")
        if (self.scope == "tier") != (self.tier is not None):
            raise ValueError("tier is required with scope=tier and not allowed otherwise")
        return self


class PinRequest(BaseModel):
    """Chunks to (un)pin: by chunk keys, or by namespace + token ids (every full and partial chunk of the prefix)."""

    model_config = _STRICT
    keys: list[HexKey] | None = Field(None, max_length=MAX_KEYS, description="chunk or block-prefix keys (hex)")
    namespace: HexKey | None = Field(None, description="namespace fingerprint (hex)")
    token_ids: list[TokenId] | None = Field(None, max_length=MAX_TOKENS, description="the prefix's token ids")

    @model_validator(mode="after")
    def _one_form(self) -> PinRequest:
        by_keys = self.keys is not None
        by_tokens = self.namespace is not None or self.token_ids is not None
        if by_keys == by_tokens:
            raise ValueError("give either keys, or namespace and token_ids")
        if by_tokens and (self.namespace is None or self.token_ids is None):
            raise ValueError("namespace and token_ids go together")
        return self


class ReconfigureRequest(BaseModel):
    """Live changes; omitted fields stay as they are."""

    model_config = _STRICT
    eviction_policy: Literal[tuple(sorted(POLICIES))] | None = None
    l1_size_bytes: int | None = Field(None, gt=0, le=1 << 50, description="new L1 budget (rounded down to pages)")
    l1_size_gb: float | None = Field(None, gt=0, le=1 << 20, allow_inf_nan=False, description="same, in GiB")
    release_memory: bool = Field(True, description="on a shrink, return free pages' memory to the OS")
    log_level: Literal[LOG_LEVELS] | None = None

    @model_validator(mode="after")
    def _something(self) -> ReconfigureRequest:
        if self.l1_size_bytes is not None and self.l1_size_gb is not None:
            raise ValueError("give l1_size_bytes or l1_size_gb, not both")
        if self.eviction_policy is None and self.log_level is None and self.l1_size_bytes is None \
                and self.l1_size_gb is None:
            raise ValueError("nothing to change: give eviction_policy, l1_size_bytes/l1_size_gb or log_level")
        return self


# -- guard: auth, body size, request counting ----------------------------------------------------------


class _TooLarge(HTTPException):
    def __init__(self) -> None:
        super().__init__(413, f"request body over {MAX_BODY_BYTES} bytes")


class Guard:
    """ASGI middleware: token check for mutating methods, then a hard limit on the body size."""

    def __init__(self, app: Any, token: str, counter: Any, max_body: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.token = token.encode()
        self.counter = counter
        self.max_body = max_body

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"
        status = [500]

        async def counted_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, counted_send)
                return
            received = 0

            async def limited_receive() -> dict:
                nonlocal received
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > self.max_body:
                        raise _TooLarge()
                return message

            await self.app(scope, limited_receive, counted_send)
        finally:
            self.counter.labels(route, str(status[0])).inc()

    def _refusal(self, scope: dict) -> Response | None:
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if self.token and scope["method"] not in SAFE_METHODS:
            error = check_token(headers.get(b"authorization", b""), self.token)
            if error is not None:
                return _error(*error)
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return _error(400, "bad Content-Length")
            if int(length) > self.max_body:
                return _error(413, f"request body over {self.max_body} bytes")
        return None


def check_token(header: bytes, token: bytes) -> tuple[int, str] | None:
    """None when `header` carries the bearer token; else (401, why) when missing, (403, why) when wrong."""
    scheme, _, value = header.partition(b" ")
    if scheme.lower() != b"bearer" or not value.strip():
        return 401, "missing bearer token: send 'Authorization: Bearer <admin token>'"
    if not token_matches(value.strip(), token):
        return 403, "wrong admin token"
    return None


def _error(status: int, detail: str) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


_bearer = HTTPBearer(auto_error=False, description="the server's --admin-token (when it has one)")


async def authorized(request: Request, _cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
                     ) -> None:
    """Guard already refused bad tokens; this repeats the check, on the same raw header bytes, so no
    mutating route runs without it (`_cred` only documents the scheme in the OpenAPI schema)."""
    token = request.app.state.admin_token
    if token:
        header = dict(request.scope["headers"]).get(b"authorization", b"")
        error = check_token(header, token)
        if error is not None:
            raise HTTPException(*error)


# -- the app ---------------------------------------------------------------------------------------


def create_app(daemon: Daemon) -> FastAPI:
    app = FastAPI(
        title="kvtier admin", version=version(), docs_url=None, redoc_url=None,
        description="Admin API of a kvtier server. Mutating routes need `Authorization: Bearer <token>` "
                    "when the server has an admin token.",
    )
    started = time.monotonic()
    store = daemon.store
    token = daemon.config.admin_token.encode()
    daemon.metrics.l1_segment.set(store.pool.segment_pages * store.pool.page_size)
    daemon.metrics.info.labels(version()).set(1)
    app.add_middleware(Guard, token=daemon.config.admin_token, counter=daemon.metrics.admin_requests)
    app.state.admin_token = token

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # The default handler echoes the input back, which fails on NaN and repeats whatever was sent.
        errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
                  for e in exc.errors()[:20]]
        return JSONResponse({"detail": errors}, status_code=422)
    mutating = [Depends(authorized)]

    def namespace_fp(hex_fp: str) -> bytes:
        fp = bytes.fromhex(hex_fp)
        if fp not in store.namespaces:
            raise HTTPException(404, f"namespace {hex_fp.lower()} is not registered")
        return fp

    @app.get("/healthz", summary="readiness: L1 mapped, L2 usable")
    async def healthz() -> JSONResponse:
        checks = {"l1_mapped": not daemon.segment.buf.closed}
        reasons = {"l1_mapped": "the L1 segment is not mapped"}
        if daemon.l2 is not None:
            checks["l2"], reasons["l2"] = daemon.l2.health()
        ready = all(checks.values())
        body: dict[str, Any] = {"ok": ready, "checks": checks}
        if not ready:
            body["reasons"] = {name: reasons[name] for name, ok in checks.items() if not ok}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/status", summary="capacity, usage, namespaces, clients and policy")
    async def status() -> dict:
        ps = store.pool.page_size
        pool = store.pool
        return {
            "version": version(),
            "uptime_s": round(time.monotonic() - started, 3),
            "server_id": daemon.handler.server_id,
            "endpoints": daemon.config.endpoints,
            "policy": store.policy.name,
            "log_level": logging.getLevelName(logging.getLogger().level).lower(),
            "l1": {
                "capacity_bytes": pool.num_pages * ps,
                "segment_bytes": pool.segment_pages * ps,
                "used_bytes": pool.used_pages * ps,
                "free_bytes": max(0, pool.free_pages) * ps,
                "page_size": ps,
                "entries": len(store.entries),
                "pinned_bytes": store.pinned_pages * ps,
                "evictable_bytes": store.evictable_pages * ps,
                "held_bytes": store.held_pages() * ps,
                "reserved_bytes": store.reserved_pages() * ps,
                "leases": len(store.leases),
                "reservations": len(store.reservations),
                "shm_name": daemon.segment.name,
                "shm_dir": daemon.segment.directory,
            },
            "l2": daemon.l2.stats() if daemon.l2 is not None else {"l2_enabled": False},
            "namespaces": store.namespace_stats(),
            "clients": store.client_stats(),
            "ttl": {"lease_s": store.lease_ttl_s, "reservation_s": store.reservation_ttl_s,
                    "client_timeout_s": store.client_timeout_s},
        }

    @app.get("/metrics", summary="Prometheus text format", response_class=Response)
    async def metrics() -> Response:
        return Response(generate_latest(daemon.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/cache/clear", dependencies=mutating, summary="remove all chunks, a namespace's, or a tier's")
    async def clear(body: ClearRequest) -> dict:
        l2 = daemon.l2
        fp = bytes.fromhex(body.namespace) if body.namespace is not None else None
        tiers = {L1: body.scope != "tier" or body.tier == L1, "l2": body.scope != "tier" or body.tier == "l2"}
        if body.scope == "tier" and body.tier == "l2" and l2 is None:
            raise HTTPException(404, "tier l2 is not configured on this server")
        registered = fp is None or fp in store.namespaces
        if not registered and l2 is None:
            raise HTTPException(404, f"namespace {body.namespace.lower()} is not registered")
        done: dict[str, dict[str, int]] = {}
        if tiers[L1]:
            n, b = store.clear(fp) if registered else (0, 0)
            done[L1] = {"entries": n, "bytes": b}
        if l2 is not None and tiers["l2"]:
            c = await l2.clear(fp)
            # `failed`: files it could not remove (their chunks are forgotten: never served again)
            done["l2"] = {"entries": c.entries, "bytes": c.nbytes, "failed": c.failed}
            if not registered and c.entries == 0:
                raise HTTPException(404, f"namespace {body.namespace.lower()} is neither registered nor in L2")
        entries, nbytes = sum(t["entries"] for t in done.values()), sum(t["bytes"] for t in done.values())
        log.info("admin: cleared %d chunks (%d bytes), scope %s", entries, nbytes, body.scope)
        return {"cleared_entries": entries, "cleared_bytes": nbytes, "tiers": done,
                "used_bytes": store.pool.used_pages * store.pool.page_size}

    def pin(body: PinRequest, delta: int) -> dict:
        if body.keys is not None:
            keys = [bytes.fromhex(k) for k in body.keys]
        else:
            assert body.namespace is not None and body.token_ids is not None
            keys = store.prefix_keys(namespace_fp(body.namespace), body.token_ids)
        found, missing, changed = store.pin_keys(keys, delta)
        return {"entries": changed, "found": [k.hex() for k in found], "missing": [k.hex() for k in missing],
                "pinned_bytes": store.pinned_pages * store.pool.page_size}

    @app.post("/cache/pin", dependencies=mutating, summary="pin chunks so eviction never takes them")
    async def pin_route(body: PinRequest) -> dict:
        return pin(body, 1)

    @app.post("/cache/unpin", dependencies=mutating, summary="drop one pin from chunks")
    async def unpin_route(body: PinRequest) -> dict:
        return pin(body, -1)

    @app.post("/reconfigure", dependencies=mutating, summary="eviction policy, L1 size, log level")
    async def reconfigure(body: ReconfigureRequest) -> dict:
        out: dict[str, Any] = {}
        pool = store.pool
        size = body.l1_size_bytes if body.l1_size_gb is None else int(body.l1_size_gb * (1 << 30))
        if size is not None:
            pages = size // pool.page_size
            if not 0 < pages <= pool.segment_pages:
                raise HTTPException(
                    422, f"L1 size must be {pool.page_size}..{pool.segment_pages * pool.page_size} bytes "
                         "(one page up to the shared-memory segment)",
                )
            try:
                result = store.resize(pages)
            except ResizeRefused as exc:
                raise HTTPException(409, str(exc)) from None
            if body.release_memory and pages * pool.page_size < result["old_capacity_bytes"]:
                result["released_bytes"] = release_free_memory(daemon)
            out["l1"] = result
            log.info("admin: L1 resized to %d bytes (%d chunks evicted)", result["capacity_bytes"],
                     result["evicted_entries"])
        if body.eviction_policy is not None and body.eviction_policy != store.policy.name:
            old = store.policy.name
            moved = store.set_policy(make_policy(body.eviction_policy))
            daemon.config.eviction_policy = body.eviction_policy
            out["eviction_policy"] = {"old": old, "new": body.eviction_policy, "entries": moved}
            log.info("admin: eviction policy %s -> %s (%d entries)", old, body.eviction_policy, moved)
        if body.log_level is not None:
            level = body.log_level.upper()
            logging.getLogger().setLevel(level)
            logging.getLogger("kvtier").setLevel(level)
            daemon.config.log_level = body.log_level
            out["log_level"] = body.log_level
        return out

    return app


def release_free_memory(daemon: Daemon) -> int:
    """Give the memory of every free L1 page back to the OS (MADV_REMOVE punches a hole in the tmpfs file)."""
    pool, buf = daemon.store.pool, daemon.segment.buf
    ps, os_page = pool.page_size, mmap.PAGESIZE
    extents = pool.free_extents()
    released = 0
    try:
        for i in range(0, len(extents), 2):
            start = -(-extents[i] * ps // os_page) * os_page
            end = (extents[i] + extents[i + 1]) * ps // os_page * os_page
            if end > start:
                buf.madvise(mmap.MADV_REMOVE, start, end - start)
                released += end - start
    except OSError as exc:  # not fatal: the pages stay free, only their memory is not returned
        log.warning("could not return free L1 memory to the OS: %s", exc)
    return released
