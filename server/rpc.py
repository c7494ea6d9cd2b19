"""Request handlers: decode and validate a frame, run it against the Cache, encode the reply.

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
from kvtier.server.cache import Acquired, Cache
from kvtier.server.gpu_ops import GpuOps
from kvtier.server.keys import Namespace
from kvtier.server.metrics import L1
from kvtier.server.pinning import unpinned
from kvtier.server.tokens import token_matches

log = logging.getLogger("kvtier.server")

# A reply, or an awaitable of one when it must wait (an acquire of a chunk still being promoted).
Reply = dict[str, Any] | Awaitable[dict[str, Any]]
Handler = Callable[[bytes, dict[str, Any]], Reply]


class RequestHandler:
    def __init__(
        self, cache: Cache, segment: dict[str, Any], chunk_size: int, heartbeat_s: float, token: str = "",
        gpu: GpuOps | None = None,
    ) -> None:
        self.cache = cache
        self.holds = cache.holds
        self.token = token.encode()  # UTF-8, as the admin API compares it (server/tokens.py)
        self.server_id = uuid.uuid4().hex
        self.segment = segment
        self.chunk_size = chunk_size
        self.heartbeat_s = heartbeat_s
        self.events = ""  # the event feed's PUB address (--events-endpoint) while it runs: told in the hello reply
        self.events_replay = ""  # and its replay address (--events-replay-endpoint)
        self.metrics = cache.metrics
        self.gpu = gpu
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
            "report": self._report,
            "gpu_register": lambda ident, m: self._gpu().register(ident, m),
            "gpu_unregister": lambda ident, m: self._gpu().unregister(ident, m),
            "gpu_store": lambda ident, m: self._gpu().store(ident, m),
            "gpu_load": lambda ident, m: self._gpu().load(ident, m),
            "end_session": self._end_session,
        }
        # each op's metric children, looked up once (a `labels()` call per request costs more than the count)
        self._per_op = {op: (self.metrics.requests.labels(op), self.metrics.request_latency.labels(op))
                        for op in self._ops}

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
            count, latency = self._per_op[op]
            count.inc()
            latency.observe(time.perf_counter() - started)
        return p.pack(reply)

    async def _deferred(self, op: str, rid: int, started: float, pending: Awaitable[dict[str, Any]]) -> bytes:
        try:
            reply = await pending
        except Exception as exc:
            reply = self._error(op, rid, exc)
        count, latency = self._per_op[op]
        count.inc()
        latency.observe(time.perf_counter() - started)
        return p.pack(reply)

    def _error(self, op: str, rid: int, exc: Exception) -> dict[str, Any]:
        """The typed, counted error reply for an exception; a bug is logged (it must not take the daemon
        down)."""
        if isinstance(exc, p.ProtocolError):
            if exc.code in (p.BAD_REQUEST, p.UNKNOWN_OP):
                self.metrics.malformed.inc()
            self.metrics.request_errors.labels(exc.code).inc()
            return p.error(rid, exc.code, exc.message, **exc.fields)
        log.error("internal error handling %s", op, exc_info=exc)
        self.metrics.request_errors.labels(p.INTERNAL).inc()
        return p.error(rid, p.INTERNAL, "internal server error")

    # -- ops -------------------------------------------------------------------------------------

    def _hello(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        """Register the socket; a hello that fails leaves it unregistered, whatever it was before."""
        self.holds.retire(ident)
        version = p.field(m, "version", int)
        if version != p.PROTOCOL_VERSION:
            raise p.ProtocolError(p.VERSION_MISMATCH, f"server speaks protocol {p.PROTOCOL_VERSION}, client {version}")
        if self.token and not token_matches(p.field(m, "token", str, "").encode(), self.token):
            raise p.ProtocolError(p.UNAUTHORIZED, "missing or wrong token")
        instance = p.field(m, "instance", str, "")[:200]
        pid = p.field(m, "pid", int, 0)
        self.holds.hello(ident, instance, pid, p.field(m, "lock", str, ""))
        log.debug("client %s (pid %s) connected", instance, pid)
        return p.ok(
            p.request_id(m),
            version=p.PROTOCOL_VERSION,
            server_id=self.server_id,
            chunk_size=self.chunk_size,
            heartbeat_s=self.heartbeat_s,
            lease_ttl_s=self.holds.lease_ttl_s,
            events=self.events,
            events_replay=self.events_replay,
            **self.segment,
        )

    def _register(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        owner = self.holds.client(ident)
        try:
            namespace = Namespace.from_dict(p.field(m, "namespace", dict))
        except (TypeError, ValueError) as exc:
            raise p.ProtocolError(p.BAD_REQUEST, f"bad namespace: {exc}"[:300]) from None
        return p.ok(p.request_id(m), ns=self.holds.register(namespace, owner))

    def _ns(self, m: dict[str, Any]) -> bytes:
        return p.key_field(p.field(m, "ns", bytes), "ns")

    def _lookup(self, ident: bytes, m: dict[str, Any]) -> Reply:
        self.holds.client(ident)
        fp = self._ns(m)
        chunks = p.key_lists_field(m, "chunks")
        ranks = [(fp, chunks), *self._other_ranks(m, chunks)]
        if self.gpu is not None and any(unpinned(self.gpu, ns) for ns, _ in ranks):
            return p.ok(p.request_id(m), hits=[], tiers=[])  # a copier cannot load them yet (pinning.py)
        count = not p.field(m, "again", bool, False)  # a request asked about again is counted once, at its first
        founds = self.cache.lookup_ranks(ranks, count) if len(ranks) > 1 else [self.cache.lookup(fp, chunks, count)]
        found = founds[0]
        reply = p.ok(p.request_id(m), hits=[match for _, match in found.hits], tiers=found.tiers)
        if found.tiers and found.tiers[-1] != L1:  # lower-tier hits follow the L1 prefix
            reply["bw"] = self.cache.bandwidths()
            reply["rtt"] = self.cache.round_trips()
        if found.pending:
            reply["pending"] = True
        if p.field(m, "acquire", bool, False) and found.hits:
            keys = [chunks[i][match - 1] for i, (_, match) in enumerate(found.hits)]
            return self._leased(ident, fp, keys, reply)
        if p.field(m, "lease", bool, False) and found.hits:
            # The answer is a promise: lease the hits already in L1 now (every rank's), without waiting on
            # promotions (those are leased by a later lookup once in L1, or by the load's own acquire).
            keys = [rank_chunks[i][match - 1] for (_, rank_chunks), rank_found in zip(ranks, founds, strict=True)
                    for i, ((_, match), tier) in enumerate(zip(rank_found.hits, rank_found.tiers, strict=True))
                    if tier == L1]
            lid, _ = self.holds.acquire(self.holds.client(ident), fp, keys, [ns for ns, _ in ranks[1:]])
            if lid:
                reply["lease"] = lid
        return reply

    @staticmethod
    def _other_ranks(m: dict[str, Any], chunks: list[list[bytes]]) -> list[tuple[bytes, list[list[bytes]]]]:
        """A lookup's `ranks`: [ns, chunks] of each other worker of the engine (TP ranks), every chunk list
        cut at the same tokens as `chunks` (so each chunk has as many block keys)."""
        if "ranks" not in m:
            return []
        ranks = []
        shape = list(map(len, chunks))
        for item in p.list_field(m, "ranks", p.MAX_LOOKUP_RANKS):
            if not isinstance(item, list) or len(item) != 2:
                raise p.ProtocolError(p.BAD_REQUEST, "each item of 'ranks' is [ns, chunks]")
            rank_chunks = p.key_lists_field({"chunks": item[1]}, "chunks")
            if list(map(len, rank_chunks)) != shape:
                raise p.ProtocolError(p.BAD_REQUEST, "each rank's chunks must have as many blocks as 'chunks'")
            ranks.append((p.key_field(item[0], "ns"), rank_chunks))
        return ranks

    def _reserve(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        owner = self.holds.client(ident)
        fp = self._ns(m)
        items = [p.StoreItem.from_wire(v) for v in p.list_field(m, "items", p.MAX_STORE_ITEMS)]
        hint = p.Hint.from_wire(m["hint"]) if "hint" in m else p.NO_HINT
        return p.ok(p.request_id(m), results=self.holds.reserve(owner, fp, items, hint=hint))

    def _end_session(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        self.holds.client(ident)
        session = p.field(m, "session", str)
        if not session or len(session) > p.MAX_SESSION_ID:
            raise p.ProtocolError(p.BAD_REQUEST, f"session must be 1..{p.MAX_SESSION_ID} characters")
        return p.ok(p.request_id(m), ended=self.cache.end_session(session))

    def _ids(self, m: dict[str, Any], name: str) -> list[int]:
        ids = p.list_field(m, name)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise p.ProtocolError(p.BAD_REQUEST, f"{name} must be a list of integers")
        return ids

    # commit, abort and release settle what the socket holds back even when it is no longer registered
    # (a client stopped past its timeout), then answer not_registered: that client must say hello again.

    def _commit(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        committed = self.cache.commit(self.holds.caller(ident), self._ids(m, "res"))
        self.holds.client(ident)
        return p.ok(p.request_id(m), committed=committed)

    def _abort(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        aborted = self.holds.abort(self.holds.caller(ident), self._ids(m, "res"))
        self.holds.client(ident)
        return p.ok(p.request_id(m), aborted=aborted)

    def _acquire(self, ident: bytes, m: dict[str, Any]) -> Reply:
        self.holds.client(ident)
        fp = self._ns(m)
        keys = [p.key_field(k) for k in p.list_field(m, "keys")]
        return self._leased(ident, fp, keys, p.ok(p.request_id(m)))

    def _leased(self, ident: bytes, fp: bytes, keys: list[bytes], reply: dict[str, Any]) -> Reply:
        """`reply` with a lease on `keys` (an awaitable of it while the cache waits on promotions)."""
        leased = self.cache.acquire(ident, fp, keys)
        if isinstance(leased, tuple):
            return self._with_lease(reply, leased)
        return self._with_lease_later(reply, leased)

    @staticmethod
    def _with_lease(reply: dict[str, Any], leased: Acquired) -> dict[str, Any]:
        lid, items = leased
        reply["lease"] = lid
        reply["items"] = [item.to_wire() if item else None for item in items]
        return reply

    async def _with_lease_later(self, reply: dict[str, Any], pending: Awaitable[Acquired]) -> dict[str, Any]:
        return self._with_lease(reply, await pending)

    def _release(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        owner = self.holds.caller(ident)
        released = sum(self.holds.release(owner, lid) for lid in self._ids(m, "leases"))
        self.holds.client(ident)
        return p.ok(p.request_id(m), released=released)

    def _heartbeat(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        self.holds.client(ident)
        return p.ok(p.request_id(m), server_id=self.server_id)

    def _stats(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        self.holds.client(ident)
        return p.ok(p.request_id(m), server_id=self.server_id, **self.cache.status())

    def _report(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        """Counts a connector kept since its last report (protocol.py: SKIP_REASONS, UNDELIVERED_REASONS,
        HINT_IGNORED_REASONS; sampled verifications and lookups answered locally of namespace `ns`); every field
        is checked before anything is counted."""
        self.holds.client(ident)
        skipped = _counts(m, "skipped", p.SKIP_REASONS)
        undelivered = _counts(m, "undelivered", p.UNDELIVERED_REASONS)
        hints_ignored = _counts(m, "hints_ignored", p.HINT_IGNORED_REASONS)
        verified = p.int_field(m, "verified", 0, p.MAX_REPORT_COUNT, 0)
        mismatched = p.int_field(m, "mismatched", 0, verified, 0)
        local_lookups = p.int_field(m, "local_lookups", 0, p.MAX_REPORT_COUNT, 0)
        local_blocks = p.int_field(m, "local_blocks", 0, p.MAX_REPORT_COUNT, 0)
        label = ""
        if verified or local_lookups:
            fp = self._ns(m)
            ns = self.cache.store.namespace(fp)  # unknown_namespace unless registered
            label = fp.hex()[:16]
            if local_lookups:  # misses the client's presence filter answered: counted as the server's lookups
                self.cache.count_local_misses(fp, local_lookups, local_blocks, ns.block_size)
        for reason, n in skipped.items():
            self.metrics.identity_skips.labels(reason).inc(n)
        for reason, n in undelivered.items():
            self.metrics.undelivered_tokens.labels(reason).inc(n)
        for reason, n in hints_ignored.items():
            self.metrics.hints_ignored.labels(reason).inc(n)
        if verified:
            self.metrics.verify_checks.labels(label).inc(verified)
            self.metrics.verify_mismatches.labels(label).inc(mismatched)
            if mismatched:
                log.warning("verification: %d of %d sampled hits of namespace %s differ from a recompute",
                            mismatched, verified, label)
        return p.ok(p.request_id(m))

    def _gpu(self) -> GpuOps:
        if self.gpu is None:
            raise p.ProtocolError(p.GPU_UNAVAILABLE, "this server runs no copy engine", reason=p.NO_COPIER)
        return self.gpu

    def _bye(self, ident: bytes, m: dict[str, Any]) -> dict[str, Any]:
        self.holds.drop_client(ident)
        return p.ok(p.request_id(m))


def _counts(m: dict[str, Any], name: str, reasons: tuple[str, ...]) -> dict[str, int]:
    """A map of known reasons to non-negative counts (BAD_REQUEST for anything else)."""
    value = p.field(m, name, dict, {})
    for reason, n in value.items():
        if reason not in reasons:
            raise p.ProtocolError(p.BAD_REQUEST, f"unknown {name} reason {str(reason)[:40]!r}")
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= p.MAX_REPORT_COUNT:
            raise p.ProtocolError(p.BAD_REQUEST, f"{name} counts must be integers in [0, {p.MAX_REPORT_COUNT}]")
    return value
