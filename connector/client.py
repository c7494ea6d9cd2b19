"""KVTierClient: the Python API an engine integration uses to talk to a local kvtier server.

Stores and retrieves copy directly between caller buffers and the server's shared-memory L1 (one
memcpy per direction); the server only does bookkeeping. An unreachable server is a miss, never an
exception (unless `strict`), and a restarted server is detected and re-registered with transparently.

Several threads may share one client: every request goes out at once on the one socket (`submit` returns
a `Pending`), and each reply is handed to its request by id, whatever order replies come back in.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import math
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
from kvtier.connector.results import (
    L1_TIER,
    ChunkHit,
    LookupResult,
    ReadChunk,
    ReadFn,
    ReadOutcome,
    StoreResult,
    WriteFn,
)
from kvtier.server import protocol as p
from kvtier.server.keys import PLAIN, ChunkKeys, Namespace, RequestIdentity, chunk_keys
from kvtier.shm.client_lock import ClientLock
from kvtier.shm.pages import PageSpan
from kvtier.shm.segment import Segment

log = logging.getLogger("kvtier.client")

DEFAULT_URL = "tcp://127.0.0.1:5555"
_FORGOTTEN = (p.NOT_REGISTERED, p.UNKNOWN_NAMESPACE)  # a server that does not know us: it restarted


class KVTierUnavailable(RuntimeError):
    """The server could not be reached (raised only in strict mode; otherwise it is a miss)."""


class KVTierError(RuntimeError):
    """The server answered with an error (`reason`: the reply's reason field, e.g. of gpu_unavailable)."""

    def __init__(self, code: str, message: str, reason: str = "") -> None:
        super().__init__(f"{code}: {message}" + (f" ({reason})" if reason else ""))
        self.code = code
        self.reason = reason


@dataclass
class ClientConfig:
    url: str = DEFAULT_URL
    connect_timeout_s: float = 1.0
    request_timeout_s: float = 5.0
    retry_backoff_s: float = 1.0
    strict: bool = False
    instance: str = field(default_factory=lambda: f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    token: str = ""


_FORGOTTEN = (p.NOT_REGISTERED, p.UNKNOWN_NAMESPACE)  # the server restarted: say hello (and register) again


class _State(enum.Enum):
    WAITING = "waiting"
    REPLIED = "replied"
    ABANDONED = "abandoned"  # the caller stopped waiting before the request's deadline
    LOST = "lost"  # not sent, its connection was dropped (server restart, reconnect) or no reply by the deadline


class _Connection:
    """One hello's socket and mapped segment; `array` is None once the connection is dropped, so a reply
    read after a reset never hands out spans of a segment this client no longer holds."""

    def __init__(self, sock: zmq.Socket | None = None, poller: zmq.Poller | None = None) -> None:
        self.sock, self.poller = sock, poller
        self.array: np.ndarray | None = None
        self.page_size = 0


class Pending:
    """A request on the wire (`KVTierClient.submit`): `done()` never blocks, `result()` waits for the reply."""

    def __init__(self, client: KVTierClient, link: _Connection, rid: int, deadline: float) -> None:
        self._client = client
        self.link, self.id, self.deadline = link, rid, deadline
        self.state = _State.WAITING
        self.reply: dict[str, Any] | None = None
        self.forgotten = False  # the server answered that it does not know this client (it restarted)
        self.patient = False  # a deadline the caller chose: no reply by then does not make the server unreachable
        self._outcome: tuple[dict[str, Any] | None, BaseException | None] | None = None

    def done(self) -> bool:
        """Whether `result()` would return without waiting (reads replies that arrived; never blocks)."""
        return self._client._poll(self)

    def result(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The reply; None when the server is unreachable, restarted meanwhile, or did not answer within the
        client's request timeout (or within `timeout` seconds, after which this request is given up: a late
        reply is dropped). Raises KVTierError for an error reply; in strict mode raises instead of None."""
        if self._outcome is None:
            self._outcome = self._client._outcome(self, timeout)
        reply, exc = self._outcome
        if exc is not None:
            raise exc
        return reply


class KVTierClient:
    """Thread-safe; requests from several threads may be in flight on the one socket at once.

    Replies are matched to requests by id. There is no I/O thread: a thread waiting for a reply reads the
    socket for everyone while no other thread does (the socket "token", under `_cv`), polling it outside
    the lock; a thread that sends meanwhile queues its frame and wakes the reader through a pipe.
    """

    def __init__(self, config: ClientConfig | None = None) -> None:
        self.config = config or ClientConfig()
        self._ctx = zmq.Context.instance()
        self._link = _Connection()
        self._conn = threading.RLock()  # the connection's lifecycle: hello, reset, namespace registration
        self._cv = threading.Condition()  # the socket token, the pending map and the outbox
        self._pending: weakref.WeakValueDictionary[int, Pending] = weakref.WeakValueDictionary()
        self._outbox: list[bytes] = []
        self._reading = False  # a thread polls the socket outside _cv: only it may touch the socket
        self._wanted = 0  # threads waiting for the reader to hand the socket back (to replace it)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        weakref.finalize(self, _close_fds, self._wake_r, self._wake_w)
        self._ids = itertools.count(1)
        self._segment: Segment | None = None
        self.server_id = ""
        self.hellos = 0  # successful hellos: a server that forgot this client forgot its GPU registrations too
        self.heartbeat_s = 0.0  # how often the server wants a silent client to heartbeat (its hello reply)
        self.events_endpoint = ""  # the server's event feed and its replay socket (its hello reply; "" if none)
        self.events_replay = ""
        self._namespaces: dict[Namespace, bytes] = {}
        self._next_attempt = 0.0
        self._alive: ClientLock | None = None  # liveness lock beside the server's segment (docs/protocol.md)

    # -- connection ------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._link.sock is not None and bool(self.server_id)

    def connect(self) -> bool:
        """Say hello and map the segment. False (or KVTierUnavailable in strict mode) when unreachable."""
        with self._conn:
            try:
                self._hello()
                return True
            except KVTierUnavailable:
                if self.config.strict:
                    raise
                return False

    def close(self) -> None:
        with self._conn:
            if self.connected:
                with contextlib.suppress(KVTierUnavailable, KVTierError):
                    self._call({"op": "bye"}, timeout=0.2)
            self._reset()
            if self._alive is not None:
                self._alive.close()
                self._alive = None

    def _reset(self) -> None:
        """Drop the connection (caller holds `_conn`): every request pending on it resolves to a miss."""
        with self._cv:
            self._wanted += 1
            try:
                self._wake()
                while self._reading:
                    self._cv.wait()
            finally:
                self._wanted -= 1
            for pending in list(self._pending.values()):
                pending.state = _State.LOST
            self._pending.clear()
            self._outbox.clear()
            link, self._link = self._link, _Connection()
            link.array = None
            if link.sock is not None:
                link.sock.close(linger=0)
            self._cv.notify_all()
        self.server_id = ""
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def _hello(self) -> None:
        self._reset()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.config.url)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        with self._cv:
            self._link = link = _Connection(sock, poller)
        hello = {"op": "hello", "version": p.PROTOCOL_VERSION, "instance": self.config.instance,
                 "pid": os.getpid(), "token": self.config.token}
        alive = self._alive
        try:
            reply = self._call({**hello, "lock": alive.name if alive else ""}, timeout=self.config.connect_timeout_s)
        except KVTierError as exc:
            if alive is None or exc.code != p.BAD_REQUEST:
                raise
            # the server cannot see our lock file (removed from under us): hold a new one, as at first contact
            log.warning("kvtier server refused this client's lock file (%s): creating a new one", exc)
            alive.close()
            self._alive = alive = None
            reply = self._call(dict(hello), timeout=self.config.connect_timeout_s)
        if alive is None or (alive.directory, alive.segment_name) != (reply["shm_dir"], reply["shm_name"]):
            # first contact (or a server with another segment): hold a lock file beside its segment, so
            # the server can tell this process is alive while it copies; then register with it
            if alive is not None:
                alive.close()
            try:
                self._alive = alive = ClientLock(reply["shm_dir"], reply["shm_name"])
            except OSError as exc:  # e.g. the segment's directory is not this process's: a miss, not a crash
                raise KVTierUnavailable(f"cannot create a lock file in {reply['shm_dir']}: {exc}") from None
            reply = self._call({**hello, "lock": alive.name}, timeout=self.config.connect_timeout_s)
        segment = Segment.attach(reply["shm_name"], reply["shm_size"], reply["shm_dir"])
        self._segment = segment
        link.array, link.page_size = segment.array(), reply["page_size"]
        self.server_id = reply["server_id"]
        self.heartbeat_s = float(reply.get("heartbeat_s") or 0.0)
        self.events_endpoint = str(reply.get("events") or "")  # the server's event feed: stores name their tokens
        self.events_replay = str(reply.get("events_replay") or "")
        self.hellos += 1
        self._namespaces = {ns: b"" for ns in self._namespaces}
        log.info("connected to kvtier server %s at %s", self.server_id[:8], self.config.url)

    def _unreachable(self, link: _Connection) -> None:
        """The server did not answer on connection `link`: drop it and back off."""
        with self._conn:
            if link is not self._link:
                return  # dropped already (another thread reconnected or reset)
            if link.sock is not None:
                log.warning("kvtier server at %s unreachable: treating as misses", self.config.url)
            self._reset()
            self._next_attempt = time.monotonic() + self.config.retry_backoff_s

    def _forget(self, link: _Connection) -> None:
        """The server behind `link` does not know this client (it restarted): the next request says hello."""
        with self._conn:
            if link is self._link and self.server_id:
                log.info("kvtier server forgot this client (restart?): registering again")
                self.server_id = ""

    # -- requests on the socket ------------------------------------------------------------------

    def _send(self, message: dict[str, Any], timeout: float) -> Pending:
        """Put `message` on the wire (the caller holds `_conn`, so the connection stays); never waits."""
        rid = next(self._ids)
        message["id"] = rid
        frame = p.pack(message)
        with self._cv:
            link = self._link
            pending = Pending(self, link, rid, time.monotonic() + timeout)
            if link.sock is None:
                pending.state = _State.LOST
                return pending
            self._pending[rid] = pending
            if self._reading:  # the reader owns the socket: it sends the frame when the pipe wakes it
                self._outbox.append(frame)
                self._wake()
                return pending
            try:
                link.sock.send(frame, flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.debug("kvtier send failed: %s", exc)
                del self._pending[rid]
                pending.state = _State.LOST
        return pending

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe wakes the reader all the same
            os.write(self._wake_w, b"\0")

    def _read(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for replies and hand them out (caller holds `_cv`; nobody else reads)."""
        sock, poller = self._link.sock, self._link.poller
        if sock is None or poller is None:
            return
        self._reading = True
        try:
            self._cv.release()
            try:
                events = dict(poller.poll(math.ceil(max(timeout_s, 0.0) * 1000)))
            finally:
                self._cv.acquire()
            if self._wake_r in events:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 4096):
                        pass
            for frame in self._outbox:
                sock.send(frame, flags=zmq.NOBLOCK)
            self._outbox.clear()
            if sock in events:
                self._dispatch(sock)
        except zmq.ZMQError as exc:  # requests whose frames are lost time out
            log.debug("kvtier socket error: %s", exc)
            self._outbox.clear()
        finally:
            self._reading = False
            self._cv.notify_all()

    def _dispatch(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frame = sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = p.unpack_reply(frame)
            except p.ProtocolError as exc:
                log.warning("kvtier: dropping an unreadable reply: %s", exc)
                continue
            rid = reply.get("id")
            pending = self._pending.pop(rid, None) if isinstance(rid, int) else None
            if pending is not None:  # else: a reply nobody waits for any more
                pending.reply, pending.state = reply, _State.REPLIED

    def _wait(self, pending: Pending, until: float) -> None:
        """Block until `pending` is answered or lost, or `until` passes; read the socket while nobody does."""
        with self._cv:
            while pending.state is _State.WAITING:
                remaining = until - time.monotonic()
                if remaining <= 0:
                    return
                if self._reading or self._wanted:
                    self._cv.wait(remaining)
                else:
                    self._read(remaining)

    def _poll(self, pending: Pending) -> bool:
        with self._cv:
            if pending.state is _State.WAITING and not self._reading and not self._wanted:
                self._read(0.0)
            return pending.state is not _State.WAITING or time.monotonic() >= pending.deadline

    def _settle(self, pending: Pending, until: float) -> dict[str, Any] | None:
        """Wait for `pending`; its reply (None when lost or not answered by `until`). Raises KVTierError."""
        self._wait(pending, until)
        with self._cv:
            if pending.state is _State.WAITING:  # given up: a late reply is dropped
                self._pending.pop(pending.id, None)
                lost = time.monotonic() >= pending.deadline
                pending.state = _State.LOST if lost else _State.ABANDONED
        reply = pending.reply
        if reply is None:
            return None
        if not reply.get("ok"):
            raise KVTierError(str(reply.get("code")), str(reply.get("error")), str(reply.get("reason") or ""))
        return reply

    def _call(self, message: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """One request/reply without reconnecting (caller holds `_conn`); raises KVTierUnavailable/KVTierError."""
        pending = self._send(message, timeout if timeout is not None else self.config.request_timeout_s)
        reply = self._settle(pending, pending.deadline)
        if reply is None:
            raise KVTierUnavailable(f"no reply from {self.config.url} within the timeout")
        return reply

    # -- requests with reconnect -----------------------------------------------------------------

    def submit(self, message: dict[str, Any], ns: Namespace | None = None, timeout_s: float | None = None) -> Pending:
        """Send one request now (saying hello and registering `ns` first if needed); never waits for its reply.

        `timeout_s` replaces the request timeout for an operation the server may legitimately take longer to
        answer (a GPU copy, a registration that starts a copier): no reply by then is that request's failure
        only, never a reason to treat the server as unreachable.

        While the server is unreachable the request is not sent and resolves to None at once, until the
        backoff passes (so an engine is not slowed down by a dead server). A request whose server restarted
        resolves to None too, and the next request says hello again. Raises KVTierError when the server
        refuses the hello or the registration of `ns`.
        """
        for attempt in range(2):
            with self._conn:
                link = self._link
                if not self.connected and time.monotonic() < self._next_attempt:
                    if self.config.strict:
                        raise KVTierUnavailable("server unreachable; backing off")
                    break
                try:
                    if not self.connected:
                        self._hello()
                        link = self._link
                    wire = dict(message)
                    if ns is not None:
                        wire["ns"] = self._ns_id(ns)
                    if "ranks" in wire:  # a lookup's other namespaces: (Namespace, chunks) pairs
                        wire["ranks"] = [(self._ns_id(other), keys) for other, keys in wire["ranks"]]
                except KVTierError as exc:
                    if exc.code in _FORGOTTEN and attempt == 0:
                        self._forget(link)
                        continue
                    raise
                except KVTierUnavailable:
                    self._unreachable(self._link)
                    if self.config.strict:
                        raise
                    break
                pending = self._send(wire, self.config.request_timeout_s if timeout_s is None else timeout_s)
                pending.patient = timeout_s is not None
                return pending
        pending = Pending(self, _Connection(), 0, 0.0)
        pending.state = _State.LOST
        return pending

    def _outcome(self, pending: Pending, timeout: float | None
                 ) -> tuple[dict[str, Any] | None, BaseException | None]:
        """What `pending.result(timeout)` returns or raises (computed once)."""
        until = pending.deadline if timeout is None else min(pending.deadline, time.monotonic() + timeout)
        try:
            reply = self._settle(pending, until)
        except KVTierError as exc:
            if exc.code not in _FORGOTTEN:
                return None, exc
            pending.forgotten = True
            self._forget(pending.link)
            return None, exc if self.config.strict else None
        if reply is None and pending.state is _State.LOST:
            if pending.id and not pending.patient:  # sent, but no reply by its deadline (or its link dropped)
                self._unreachable(pending.link)
            if self.config.strict:
                return None, KVTierUnavailable(f"no reply from {self.config.url} within the timeout")
        return reply, None

    def _exchange(self, message: dict[str, Any], ns: Namespace | None = None, timeout_s: float | None = None
                  ) -> tuple[dict[str, Any], _Connection] | None:
        """`request`, with the connection that answered (its segment holds the reply's extents)."""
        for attempt in range(2):
            pending = self.submit(message, ns, timeout_s)
            try:
                reply = pending.result()
            except KVTierError:
                if not (pending.forgotten and attempt == 0):
                    raise
                continue
            if reply is not None:
                return reply, pending.link
            if not pending.forgotten:
                return None
        return None

    def request(self, message: dict[str, Any], ns: Namespace | None = None, timeout_s: float | None = None
                ) -> dict[str, Any] | None:
        """One request with reconnect: re-hello and re-register once if the server restarted (`timeout_s`: as
        in `submit`).

        Returns None when the server is unreachable (non-strict), after which further attempts are
        skipped until the backoff passes, so an engine is not slowed down by a dead server.
        """
        got = self._exchange(message, ns, timeout_s)
        return got[0] if got is not None else None

    _request = request

    def _ns_id(self, ns: Namespace) -> bytes:
        with self._conn:
            fp = self._namespaces.get(ns)
            if not fp:
                fp = self._call({"op": "register", "namespace": ns.to_dict()})["ns"]
                self._namespaces[ns] = fp
            return fp

    def register(self, ns: Namespace) -> bool:
        """Announce a namespace (also done lazily by every call that names one)."""
        with self._conn:
            self._namespaces.setdefault(ns, b"")
        return self._request({"op": "heartbeat"}, ns) is not None

    def heartbeat(self) -> bool:
        return self._request({"op": "heartbeat"}) is not None

    def stats(self) -> dict[str, Any] | None:
        return self._request({"op": "stats"})

    # -- lookup ----------------------------------------------------------------------------------

    def lookup(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray, identity: RequestIdentity = PLAIN,
               lease: bool = False, ranks: Sequence[Namespace] = (), again: bool = False) -> LookupResult:
        """Longest stored prefix of `token_ids` at engine-block granularity. With `lease`, the hits found in L1
        are leased to this client (`LookupResult.lease`; `release` it) so that nothing evicts them before the
        engine loads them: a lookup's answer is a promise. `ranks`: the namespaces of the engine's other
        workers (tensor-parallel ranks), each of which stores its own KV of these tokens: the answer is then
        the prefix every one of them holds, and the lease covers all of them. `again`: the same request asked
        about again (after a `pending` answer): not counted in the server's lookup metrics a second time."""
        chunks = chunk_keys(ns, token_ids, identity)
        return self.lookup_chunks(ns, chunks, lease, [(other, chunk_keys(other, token_ids, identity))
                                                      for other in ranks], again)

    def lookup_chunks(self, ns: Namespace, chunks: list[ChunkKeys], lease: bool = False,
                      ranks: Sequence[tuple[Namespace, list[ChunkKeys]]] = (), again: bool = False) -> LookupResult:
        if not chunks:
            return LookupResult([], [], [], ns.block_size)
        # msgpack packs the key tuples as arrays: no per-chunk list copies
        message: dict[str, Any] = {"op": "lookup", "chunks": [c.block_keys for c in chunks]}
        if lease:
            message["lease"] = True
        if again:
            message["again"] = True
        if ranks:  # their namespaces are registered and named by fingerprint when sent (submit)
            message["ranks"] = [(other, [c.block_keys for c in other_chunks]) for other, other_chunks in ranks]
        reply = self._request(message, ns)
        if reply is None:
            return LookupResult([], [], [], ns.block_size)
        return LookupResult(chunks, reply["hits"], reply["tiers"], ns.block_size, reply.get("bw") or {},
                            reply.get("rtt") or {}, bool(reply.get("pending", False)), reply.get("lease", 0))

    def release(self, leases: Sequence[int], wait: bool = True) -> int:
        """End leases this client holds (a lookup's); how many the server confirmed held to the end. Without
        `wait` the request is only sent (0 is returned): a lookup's lease needs no confirmation, and a server
        that died meanwhile must not stall the caller for a timeout."""
        if not leases:
            return 0
        if not wait:
            self.submit({"op": "release", "leases": list(leases)})
            return 0
        reply = self._request({"op": "release", "leases": list(leases)})
        return int(reply["released"]) if reply else 0

    def report(self, counts: dict[str, Any], ns: Namespace | None = None) -> bool:
        """Send a connector's counts (the `report` op: skipped requests, undelivered tokens, verifications)."""
        return self._request({"op": "report", **counts}, ns) is not None

    # -- store -----------------------------------------------------------------------------------

    def store(
        self, ns: Namespace, token_ids: Sequence[int] | np.ndarray, sizes: Callable[[ChunkKeys], int],
        write: WriteFn, skip_chunks: int = 0, identity: RequestIdentity = PLAIN,
    ) -> StoreResult:
        """Store every chunk of `token_ids` from chunk `skip_chunks` on: reserve pages, let `write`
        copy the chunk's bytes into them, commit. Chunks already stored (or being stored) are skipped."""
        chunks = chunk_keys(ns, token_ids, identity)[skip_chunks:]
        return self.store_chunks(ns, chunks, sizes, write)

    def store_chunks(self, ns: Namespace, chunks: list[ChunkKeys], sizes: Callable[[ChunkKeys], int],
                     write: WriteFn) -> StoreResult:
        if len(chunks) > p.MAX_STORE_ITEMS:  # one reserve holds at most MAX_STORE_ITEMS items
            parts = [self.store_chunks(ns, chunks[i:i + p.MAX_STORE_ITEMS], sizes, write)
                     for i in range(0, len(chunks), p.MAX_STORE_ITEMS)]
            return StoreResult.merged(parts)
        result = StoreResult()
        if not chunks:
            return result
        feed = bool(self.events_endpoint)
        items = [p.StoreItem(c.key, sizes(c), len(c.block_keys), c.aliases, c.tokens if feed else b"", c.parent)
                 for c in chunks]
        got = self._exchange({"op": "reserve", "items": [i.to_wire() for i in items]}, ns)
        if got is None:
            result.refused["unreachable"] = len(chunks)
            return result
        reply, conn = got
        done: list[int] = []
        try:
            for chunk, item, status in zip(chunks, items, reply["results"], strict=True):
                if status[0] == p.RESERVED:
                    rid, extents = status[1], status[2]
                    span = self._span(conn, extents, item.size)
                    if span is None:  # the connection was reset meanwhile: the rest is aborted
                        break
                    write(chunk, span)
                    done.append(rid)
                elif status[0] == p.EXISTS:
                    result.existing += 1
                elif status[0] == p.BUSY:
                    result.busy += 1
                else:
                    reason = status[1] if len(status) > 1 else "unknown"
                    result.refused[reason] = result.refused.get(reason, 0) + 1
        finally:
            written = set(done)
            pending = [s[1] for s in reply["results"] if s[0] == p.RESERVED and s[1] not in written]
            if pending:
                self._request({"op": "abort", "res": pending})
            if done:
                committed = self._request({"op": "commit", "res": done})
                result.stored = committed["committed"] if committed else 0
                if result.stored < len(done):  # reservations that expired (TTL) or a server that went away
                    result.refused["not_committed"] = len(done) - result.stored
        return result

    @staticmethod
    def _span(conn: _Connection, extents: Sequence[int], size: int) -> PageSpan | None:
        array = conn.array
        return PageSpan(array, extents, conn.page_size, size) if array is not None else None

    # -- retrieve --------------------------------------------------------------------------------

    def retrieve(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray, read: ReadFn,
                 max_blocks: int | None = None, identity: RequestIdentity = PLAIN) -> int:
        """Copy out the longest stored prefix of `token_ids` (lookup, lease, `read` each chunk, release).

        Returns the number of prefix tokens whose bytes `read` received; 0 on a miss or an error, and 0
        when the server could not confirm the lease held to the end (the bytes read may be another chunk's:
        the caller must treat them as a load error).
        """
        chunks = chunk_keys(ns, token_ids, identity)
        if not chunks:
            return 0
        got = self._exchange({"op": "lookup", "chunks": [c.block_keys for c in chunks], "acquire": True}, ns)
        if got is None or not got[0]["hits"]:
            return 0
        return self._read_leased(chunks, *got, read, max_blocks) * ns.block_size

    def retrieve_prefix(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray, read: ReadFn,
                        identity: RequestIdentity = PLAIN) -> int:
        """Copy out exactly the whole blocks of `token_ids` that an earlier lookup found, without a second
        lookup (so hit metrics count the request once). Returns the prefix tokens `read` received."""
        return self.read_prefix(ns, token_ids, read, identity).blocks * ns.block_size

    def read_prefix(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray, read: ReadFn,
                    identity: RequestIdentity = PLAIN) -> ReadOutcome:
        """`retrieve_prefix` that also says why it stopped short (ReadOutcome.reason)."""
        hits = [ChunkHit(c, len(c.block_keys), L1_TIER) for c in chunk_keys(ns, token_ids, identity)]
        return self._retrieve(ns, hits, read)

    def retrieve_chunks(self, ns: Namespace, hits: list[ChunkHit], read: ReadFn) -> int:
        """Copy out chunks a previous lookup found (each at its matched length); returns blocks read."""
        return self._retrieve(ns, hits, read).blocks

    def _retrieve(self, ns: Namespace, hits: list[ChunkHit], read: ReadFn) -> ReadOutcome:
        if not hits:
            return ReadOutcome(0)
        keys = [h.chunk.block_keys[h.match - 1] for h in hits]
        got = self._exchange({"op": "acquire", "keys": keys}, ns)
        if got is None:
            return ReadOutcome(0, p.UNDELIVERED_UNREACHABLE)
        outcome = ReadOutcome(0)
        outcome.blocks = self._read_leased([h.chunk for h in hits], *got, read, None, outcome)
        return outcome

    def _read_leased(self, chunks: list[ChunkKeys], reply: dict[str, Any], conn: _Connection, read: ReadFn,
                     max_blocks: int | None, outcome: ReadOutcome | None = None) -> int:
        """Blocks read under the reply's lease, or 0 unless the release confirms the lease held; `outcome`
        learns why fewer blocks than asked were read."""
        blocks = 0
        why = ""
        try:
            for chunk, item in zip(chunks, reply["items"], strict=False):
                if item is None:
                    why = p.UNDELIVERED_MISSING
                    break
                stored, match, size, extents = item
                if max_blocks is not None:
                    match = min(match, max_blocks - blocks)
                span = self._span(conn, extents, size)
                if match <= 0 or span is None:
                    why = p.UNDELIVERED_UNREACHABLE if span is None else why
                    break
                read(ReadChunk(chunk, stored, match, span))
                blocks += match
                if match < len(chunk.block_keys):
                    why = p.UNDELIVERED_MISSING
                    break
        except Exception:
            why = p.UNDELIVERED_FAILED
            raise
        finally:
            released = self._request({"op": "release", "leases": [reply["lease"]]}) if reply.get("lease") else None
            if outcome is not None:
                outcome.reason = why
        if blocks and not (released and released.get("released") == 1):
            log.warning("kvtier: a read outlived its lease (or the server went away): %d blocks dropped", blocks)
            if outcome is not None:
                outcome.reason = p.UNDELIVERED_LEASE_LOST if released else p.UNDELIVERED_UNREACHABLE
            return 0
        return blocks


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
