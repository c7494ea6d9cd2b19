"""Admin API security (docs/security.md): the `Guard` ASGI middleware (token check for mutating methods
before the body is read, a hard limit on the body size, request counting) and the `authorized` dependency
that repeats the token check on every mutating route. Both compare the raw header bytes with
kvtier.server.tokens.token_matches."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from kvtier.server.tokens import token_matches

MAX_BODY_BYTES = 1 << 20
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
ROUTES = frozenset(
    {"/healthz", "/status", "/metrics", "/cache/clear", "/cache/pin", "/cache/unpin", "/cache/lookup",
     "/reconfigure", "/openapi.json"}
)


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
