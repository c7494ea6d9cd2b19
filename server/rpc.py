"""Request handlers: decode and validate a frame, run it against the ChunkStore, encode the reply.

Anything a client sends ends in a reply: malformed input is answered with a typed error and counted,
never raised into the serving loop.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from kvtier.server import protocol as p
from kvtier.server.chunk_store import L1, ChunkStore, ClientState
from kvtier.server.keys import Namespace
from kvtier.server.tokens import token_matches

log = logging.getLogger("kvtier.server")

# A reply, or an awaitable of one when it must wait (an acquire of a chunk still being promoted).
Reply = dict[str, Any] | Awaitable[dict[str, Any]]
Handler = Callable[[bytes, dict[str, Any]], Reply]


class RequestHandler:
    def __init__(
        self, store: ChunkStore, segment: dict[str, Any], chunk_size: int, heartbeat_s: float, token: str = ""
    ) -> None:
        self.store = store
        self.token = token.encode()  # UTF-8, as the admin API compares it (server/tokens.py)
        self.server_id = uuid.uuid4().hex
        self.segment = segment
        self.chunk_size = chunk_size
        self.heartbeat_s = heartbeat_s
        self.metrics = store.metrics
        self.lower_tier: Any = None  # extends lookups past L1 and adds to stats (server/l2_service.py)
        self._ops: dict[str, Handler] = {
            "hello": self._hello,
            "register": self._register,
            "lookup": self._lookup,
            "reserve": self._reserve,
            "commit": self._commit,
            "abort": self._abort,
            "acquire": self._acquire,
            "release": self._release,
            "heartbeat": self._heartbeat,
            "stats": self._stats,
            "bye": self._bye,
        }

    def handle(self, ident: bytes, frame: bytes) -> bytes | Awaitable[bytes]:
        """One request frame in, one reply frame out; or an awaitable of the reply frame when the op must
        wait, which the serving loop awaits in a task while it serves other requests."""
        rid = 0
        op = "?"
        started = time.perf_counter()
        try:
            message = p.unpack(frame)
            rid = p.request_id(message)
            op_value = message.get("op")
            if not isinstance(op_value, str) or op_value not in self._ops:
                raise p.ProtocolError(p.UNKNOWN_OP, f"unknown op {op_value!r}"[:200])
            op = op_value
            reply = self._ops[op](ident, message)
            if not isinstance(reply, dict):
                return self._deferred(op, rid, started, reply)
        except Exception as exc:
            reply = self._error(op, rid, exc)
        if op != "?":
            self.metrics.requests.labels(op).inc()
            self.metrics.request_latency.labels(op).observe(time.perf_counter() - started)
        return p.pack(reply)

    async def _deferred(self, op: str, rid: int, started: float, pending: Awaitable[dict[str, Any]]) -> bytes:
        try:
            reply = await pending
        except Exception as exc:
            reply = self._error(op, rid, exc)
        self.metrics.requests.labels(op).inc()
        self.metrics.request_latency.labels(op).observe(time.perf_counter() - started)
        return p.pack(reply)

    def _error(self, op: str, rid: int, exc: Exception) -> dict[str, Any]:
        """The typed, counted error reply for an exception; a bug is logged (it must not take the daemon
        down)."""
        if isinstance(exc, p.ProtocolError):
            if exc.code in (p.BAD_REQUEST, p.UNKNOWN_OP):
                self.metrics.malformed.inc()
            self.metrics.request_errors.labels(exc.code).inc()
            return p.error(rid, exc.code, exc.message)
        log.error("internal error handling %s", op, exc_info=exc)
        self.metrics.request_errors.labels(p.INTERNAL).inc()
        return p.error(rid, p.INTERNAL, "internal server error")

    # -- ops -------------------------------------------------------------------------------------

    def _hello(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        """Register the socket; a hello that fails leaves it unregistered, whatever it was before."""
        self.store.retire(ident)
        version = p.field(m, "version", int)
        if version != p.PROTOCOL_VERSION:
            raise p.ProtocolError(p.VERSION_MISMATCH, f"server speaks protocol {p.PROTOCOL_VERSION}, client {version}")
        if self.token and not token_matches(p.field(m, "token", str, "").encode(), self.token):
            raise p.ProtocolError(p.UNAUTHORIZED, "missing or wrong token")
        instance = p.field(m, "instance", str, "")[:200]
        pid = p.field(m, "pid", int, 0)
        self.store.hello(ident, instance, pid, p.field(m, "lock", str, ""))
        log.debug("client %s (pid %s) connected", instance, pid)
        return p.ok(
            p.request_id(m),
            version=p.PROTOCOL_VERSION,
            server_id=self.server_id,
            chunk_size=self.chunk_size,
            heartbeat_s=self.heartbeat_s,
            lease_ttl_s=self.store.lease_ttl_s,
            **self.segment,
        )

    def _register(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        owner = self.store.client(ident)
        try:
            namespace = Namespace.from_dict(p.field(m, "namespace", dict))
        except (TypeError, ValueError) as exc:
            raise p.ProtocolError(p.BAD_REQUEST, f"bad namespace: {exc}"[:300]) from None
        return p.ok(p.request_id(m), ns=self.store.register(namespace, owner))

    def _ns(self, m: dict[str, Any]) -> bytes:
        return p.key_field(p.field(m, "ns", bytes), "ns")

    def _lookup(self, ident: bytes, m: dict[str, Any]) -> Reply:
        owner = self.store.client(ident)
        fp = self._ns(m)
        chunks = p.key_lists_field(m, "chunks")
        hits = self.store.lookup(fp, chunks)
        tiers = [L1] * len(hits)
        lower = self.lower_tier is not None and len(hits) < len(chunks)
        if lower:
            hits, tiers = self.lower_tier.extend_lookup(fp, chunks, hits)
        reply = p.ok(p.request_id(m), hits=[match for _, match in hits], tiers=tiers)
        if lower and tiers and tiers[-1] != L1:  # lower-tier hits follow the L1 prefix
            reply["bw"] = self.lower_tier.bandwidths()
        if p.field(m, "acquire", bool, False) and hits:
            keys = [chunks[i][match - 1] for i, (_, match) in enumerate(hits)]
            return self._leased(ident, owner, fp, keys, reply)
        return reply

    def _reserve(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        owner = self.store.client(ident)
        fp = self._ns(m)
        items = [p.StoreItem.from_wire(v) for v in p.list_field(m, "items", p.MAX_STORE_ITEMS)]
        return p.ok(p.request_id(m), results=self.store.reserve(owner, fp, items))

    def _ids(self, m: dict[str, Any], name: str) -> list[int]:
        ids = p.list_field(m, name)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise p.ProtocolError(p.BAD_REQUEST, f"{name} must be a list of integers")
        return ids

    # commit, abort and release settle what the socket holds back even when it is no longer registered
    # (a client stopped past its timeout), then answer not_registered: that client must say hello again.

    def _commit(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        committed = self.store.commit(self.store.caller(ident), self._ids(m, "res"))
        self.store.client(ident)
        return p.ok(p.request_id(m), committed=committed)

    def _abort(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        aborted = self.store.abort(self.store.caller(ident), self._ids(m, "res"))
        self.store.client(ident)
        return p.ok(p.request_id(m), aborted=aborted)

    def _acquire(self, ident: bytes, m: dict[str, Any]) -> Reply:
        owner = self.store.client(ident)
        fp = self._ns(m)
        keys = [p.key_field(k) for k in p.list_field(m, "keys")]
        return self._leased(ident, owner, fp, keys, p.ok(p.request_id(m)))

    def _leased(self, ident: bytes, owner: ClientState, fp: bytes, keys: list[bytes], reply: dict[str, Any]
                ) -> Reply:
        """`reply` with a lease on `keys`; an awaitable of it while any of them is still being promoted from
        a lower tier (a promotion that fails leaves a miss, `None`, for its key)."""
        pending = self.lower_tier.promotions(keys) if self.lower_tier is not None else None
        if pending is not None:
            return self._leased_later(ident, fp, keys, reply, pending)
        lid, items = self.store.acquire(owner, fp, keys)
        reply["lease"] = lid
        reply["items"] = [item.to_wire() if item else None for item in items]
        return reply

    async def _leased_later(self, ident: bytes, fp: bytes, keys: list[bytes], reply: dict[str, Any],
                            pending: Awaitable[Any]) -> dict[str, Any]:
        await pending
        owner = self.store.client(ident)  # not_registered if the client was dropped meanwhile
        leased = self._leased(ident, owner, fp, keys, reply)
        return leased if isinstance(leased, dict) else await leased

    def _release(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        owner = self.store.caller(ident)
        released = sum(self.store.release(owner, lid) for lid in self._ids(m, "leases"))
        self.store.client(ident)
        return p.ok(p.request_id(m), released=released)

    def _heartbeat(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        self.store.client(ident)
        return p.ok(p.request_id(m), server_id=self.server_id)

    def _stats(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        self.store.client(ident)
        extra = self.lower_tier.stats() if self.lower_tier is not None else {}
        return p.ok(p.request_id(m), server_id=self.server_id, **self.store.stats(), **extra)

    def _bye(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        self.store.drop_client(ident)
        return p.ok(p.request_id(m))
