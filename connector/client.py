"""KVTierClient: the Python API an engine integration uses to talk to a local kvtier server.

Stores and retrieves copy directly between caller buffers and the server's shared-memory L1 (one
memcpy per direction); the server only does bookkeeping. An unreachable server is a miss, never an
exception (unless `strict`), and a restarted server is detected and re-registered with transparently.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
from kvtier.connector.results import L1_TIER, ChunkHit, LookupResult, ReadChunk, ReadFn, StoreResult, WriteFn
from kvtier.server import protocol as p
from kvtier.server.keys import ChunkKeys, Namespace, chunk_keys
from kvtier.shm.client_lock import ClientLock
from kvtier.shm.pages import PageSpan
from kvtier.shm.segment import Segment

log = logging.getLogger("kvtier.client")

DEFAULT_URL = "tcp://127.0.0.1:5555"


class KVTierUnavailable(RuntimeError):
    """The server could not be reached (raised only in strict mode; otherwise it is a miss)."""


class KVTierError(RuntimeError):
    """The server answered with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass
class ClientConfig:
    url: str = DEFAULT_URL
    connect_timeout_s: float = 1.0
    request_timeout_s: float = 5.0
    retry_backoff_s: float = 1.0
    strict: bool = False
    instance: str = field(default_factory=lambda: f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    token: str = ""


class KVTierClient:
    def __init__(self, config: ClientConfig | None = None) -> None:
        self.config = config or ClientConfig()
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._segment: Segment | None = None
        self._segment_array: np.ndarray | None = None
        self._page_size = 0
        self.server_id = ""
        self._namespaces: dict[Namespace, bytes] = {}
        self._next_attempt = 0.0
        self._alive: ClientLock | None = None  # liveness lock beside the server's segment (docs/protocol.md)

    # -- connection ------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._sock is not None and bool(self.server_id)

    def connect(self) -> bool:
        """Say hello and map the segment. False (or KVTierUnavailable in strict mode) when unreachable."""
        with self._lock:
            try:
                self._hello()
                return True
            except KVTierUnavailable:
                if self.config.strict:
                    raise
                return False

    def close(self) -> None:
        with self._lock:
            if self._sock is not None and self.server_id:
                with contextlib.suppress(KVTierUnavailable, KVTierError):
                    self._call({"op": "bye"}, timeout=0.2)
            self._reset()
            if self._alive is not None:
                self._alive.close()
                self._alive = None

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock = None
        self.server_id = ""
        self._segment_array = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def _hello(self) -> None:
        self._reset()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.config.url)
        self._sock = sock
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
        self._segment_array = segment.array()
        self._page_size = reply["page_size"]
        self.server_id = reply["server_id"]
        self._namespaces = {ns: b"" for ns in self._namespaces}
        log.info("connected to kvtier server %s at %s", self.server_id[:8], self.config.url)

    def _call(self, message: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """One request/reply on the socket; replies to older (timed-out) requests are skipped."""
        assert self._sock is not None
        rid = next(self._ids)
        message["id"] = rid
        deadline = time.monotonic() + (timeout if timeout is not None else self.config.request_timeout_s)
        try:
            self._sock.send(p.pack(message), flags=zmq.NOBLOCK)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._sock.poll(remaining * 1000):
                    raise KVTierUnavailable(f"no reply from {self.config.url} within the timeout")
                reply = p.unpack_reply(self._sock.recv())
                if reply.get("id") == rid:
                    break
        except (zmq.ZMQError, p.ProtocolError) as exc:
            raise KVTierUnavailable(f"transport error talking to {self.config.url}: {exc}") from None
        if not reply.get("ok"):
            raise KVTierError(str(reply.get("code")), str(reply.get("error")))
        return reply

    def _request(self, message: dict[str, Any], ns: Namespace | None = None) -> dict[str, Any] | None:
        """A request with reconnect: re-hello and re-register once if the server restarted.

        Returns None when the server is unreachable (non-strict), after which further attempts are
        skipped until the backoff passes, so an engine is not slowed down by a dead server.
        """
        with self._lock:
            for attempt in range(2):
                try:
                    if not self.connected:
                        if time.monotonic() < self._next_attempt:
                            raise KVTierUnavailable("server unreachable; backing off")
                        self._hello()
                    if ns is not None:
                        message["ns"] = self._ns_id(ns)
                    return self._call(dict(message))
                except KVTierError as exc:
                    if exc.code in (p.NOT_REGISTERED, p.UNKNOWN_NAMESPACE) and attempt == 0:
                        log.info("kvtier server forgot this client (restart?): registering again")
                        self.server_id = ""
                        continue
                    raise
                except KVTierUnavailable:
                    if self._sock is not None:
                        log.warning("kvtier server at %s unreachable: treating as misses", self.config.url)
                    self._reset()
                    self._next_attempt = time.monotonic() + self.config.retry_backoff_s
                    if self.config.strict:
                        raise
                    return None
            return None

    def _ns_id(self, ns: Namespace) -> bytes:
        fp = self._namespaces.get(ns)
        if not fp:
            fp = self._call({"op": "register", "namespace": ns.to_dict()})["ns"]
            self._namespaces[ns] = fp
        return fp

    def register(self, ns: Namespace) -> bool:
        """Announce a namespace (also done lazily by every call that names one)."""
        with self._lock:
            self._namespaces.setdefault(ns, b"")
        return self._request({"op": "heartbeat"}, ns) is not None

    def heartbeat(self) -> bool:
        return self._request({"op": "heartbeat"}) is not None

    def stats(self) -> dict[str, Any] | None:
        return self._request({"op": "stats"})

    # -- lookup ----------------------------------------------------------------------------------

    def lookup(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray) -> LookupResult:
        """Longest stored prefix of `token_ids` at engine-block granularity."""
        chunks = chunk_keys(ns, token_ids)
        return self.lookup_chunks(ns, chunks)

    def lookup_chunks(self, ns: Namespace, chunks: list[ChunkKeys]) -> LookupResult:
        if not chunks:
            return LookupResult([], [], [], ns.block_size)
        # msgpack packs the key tuples as arrays: no per-chunk list copies
        reply = self._request({"op": "lookup", "chunks": [c.block_keys for c in chunks]}, ns)
        if reply is None:
            return LookupResult([], [], [], ns.block_size)
        return LookupResult(chunks, reply["hits"], reply["tiers"], ns.block_size, reply.get("bw") or {})

    # -- store -----------------------------------------------------------------------------------

    def store(
        self, ns: Namespace, token_ids: Sequence[int] | np.ndarray, sizes: Callable[[ChunkKeys], int],
        write: WriteFn, skip_chunks: int = 0,
    ) -> StoreResult:
        """Store every chunk of `token_ids` from chunk `skip_chunks` on: reserve pages, let `write`
        copy the chunk's bytes into them, commit. Chunks already stored (or being stored) are skipped."""
        chunks = chunk_keys(ns, token_ids)[skip_chunks:]
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
        items = [p.StoreItem(c.key, sizes(c), len(c.block_keys), c.aliases) for c in chunks]
        reply = self._request({"op": "reserve", "items": [i.to_wire() for i in items]}, ns)
        if reply is None:
            result.refused["unreachable"] = len(chunks)
            return result
        done: list[int] = []
        try:
            for chunk, item, status in zip(chunks, items, reply["results"], strict=True):
                if status[0] == p.RESERVED:
                    rid, extents = status[1], status[2]
                    write(chunk, self._span(extents, item.size))
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

    def _span(self, extents: Sequence[int], size: int) -> PageSpan:
        assert self._segment_array is not None
        return PageSpan(self._segment_array, extents, self._page_size, size)

    # -- retrieve --------------------------------------------------------------------------------

    def retrieve(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray, read: ReadFn,
                 max_blocks: int | None = None) -> int:
        """Copy out the longest stored prefix of `token_ids` (lookup, lease, `read` each chunk, release).

        Returns the number of prefix tokens whose bytes `read` received; 0 on a miss or an error, and 0
        when the server could not confirm the lease held to the end (the bytes read may be another chunk's:
        the caller must treat them as a load error).
        """
        chunks = chunk_keys(ns, token_ids)
        if not chunks:
            return 0
        reply = self._request({"op": "lookup", "chunks": [c.block_keys for c in chunks], "acquire": True}, ns)
        if reply is None or not reply["hits"]:
            return 0
        return self._read_leased(chunks, reply, read, max_blocks) * ns.block_size

    def retrieve_prefix(self, ns: Namespace, token_ids: Sequence[int] | np.ndarray, read: ReadFn) -> int:
        """Copy out exactly the whole blocks of `token_ids` that an earlier lookup found, without a second
        lookup (so hit metrics count the request once). Returns the prefix tokens `read` received."""
        hits = [ChunkHit(c, len(c.block_keys), L1_TIER) for c in chunk_keys(ns, token_ids)]
        return self.retrieve_chunks(ns, hits, read) * ns.block_size

    def retrieve_chunks(self, ns: Namespace, hits: list[ChunkHit], read: ReadFn) -> int:
        """Copy out chunks a previous lookup found (each at its matched length); returns blocks read."""
        if not hits:
            return 0
        keys = [h.chunk.block_keys[h.match - 1] for h in hits]
        reply = self._request({"op": "acquire", "keys": keys}, ns)
        if reply is None:
            return 0
        return self._read_leased([h.chunk for h in hits], reply, read, None)

    def _read_leased(self, chunks: list[ChunkKeys], reply: dict[str, Any], read: ReadFn,
                     max_blocks: int | None) -> int:
        """Blocks read under the reply's lease, or 0 unless the release confirms the lease held."""
        blocks = 0
        try:
            for chunk, item in zip(chunks, reply["items"], strict=False):
                if item is None:
                    break
                stored, match, size, extents = item
                if max_blocks is not None:
                    match = min(match, max_blocks - blocks)
                if match <= 0:
                    break
                read(ReadChunk(chunk, stored, match, self._span(extents, size)))
                blocks += match
                if match < len(chunk.block_keys):
                    break
        finally:
            released = self._request({"op": "release", "leases": [reply["lease"]]}) if reply.get("lease") else None
        if blocks and not (released and released.get("released") == 1):
            log.warning("kvtier: a read outlived its lease (or the server went away): %d blocks dropped", blocks)
            return 0
        return blocks
