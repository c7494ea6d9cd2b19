"""GpuTransfers: a GPU worker's side of the protocol's GPU operations, without torch or vLLM.

The worker registers its KV allocation once; then every store and load is one request that goes out
without waiting (KVTierClient.submit) after the worker recorded one of its interprocess events on its
stream, and whose reply says the copy is done: collected by `poll`, or by `wait` for one operation (from any
thread: the vLLM connector waits on its transfer threads, connector/vllm/in_flight.py). An event is reused only
after the reply of the operation that named it, and goes back to the pool on every failure path.

Registration runs off the engine's thread (`start`): a keeper thread registers (with its own timeout: the
server may be starting the GPU's copier), heartbeats so that an idle worker keeps its registration, and
registers again, backing off, when the registration was lost (server restart, client retired) or refused.
Until then operations are not sent (misses). An operation the server refused before any copy started
(`unknown_registration`, `not_registered`) is sent once more after registering again.

Every operation carries `start_by` (now + `start_s`): the server never starts its copy later, and the reply
is waited for until `start_by` + the copy bound the server gave at registration + a margin, so a copy can
never run after the engine took its blocks back. A slow operation is only that operation's failure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtier.connector.client import KVTierClient, KVTierError, Pending
from kvtier.server import protocol as p
from kvtier.server.keys import PLAIN, Namespace, RequestIdentity, chunk_keys

log = logging.getLogger("kvtier.connector")

START_S = 5.0  # how long an operation may wait on the server before its copy must have started
REPLY_MARGIN_S = 2.0  # after start_by + the copy bound: a failed copier's kill and the reply's way back
REGISTER_TIMEOUT_S = 60.0  # a first registration may wait for the copier's start (cupy import, CUDA context)
HEARTBEAT_S = 5.0  # when the server's hello did not say how often
RETRY_S, RETRY_MAX_S = 1.0, 60.0  # backoff of registrations that failed
_REFUSED = (p.UNKNOWN_REGISTRATION, p.NOT_REGISTERED)  # refused before any copy started: register, send again


class EventSource(Protocol):
    """The worker's interprocess events: record event `index` on the stream the KV is written on."""

    def record(self, index: int) -> None: ...


@dataclass
class Finished:
    """A finished operation: `failed` are the engine blocks a load could not fill (all of them when the copy
    failed); a store that failed is only a future miss and reports nothing but `ok`."""

    tag: Hashable
    kind: str  # "store" or "load"
    ok: bool
    failed: set[int] = field(default_factory=set)
    reason: str = ""


@dataclass(eq=False)
class Operation:
    """A store or load sent; `finished` once its reply is settled."""

    tag: Hashable
    kind: str
    ns: Namespace
    message: dict[str, Any]  # as sent (with reg, event and start_by)
    deadline: float  # when the reply is given up (time.monotonic())
    pending: Pending
    event: int
    block_ids: list[list[int]]  # per item (store) or key (load)
    finished: Finished | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class GpuTransfers:
    def __init__(self, client: KVTierClient, memory: p.GpuMemory, events: EventSource, start_s: float = START_S,
                 register_timeout_s: float = REGISTER_TIMEOUT_S, fallback: str = "") -> None:
        """`fallback`: what the worker does instead when the server refuses the registration (a CPU worker
        copies by itself); with one, a refusal is final and the keeper stops. Without, the keeper retries
        (a GPU worker has no other way: its loads and stores are misses meanwhile)."""
        self.client = client
        self.fallback = fallback
        self.memory = memory
        self.events = events
        self.start_s = start_s
        self.register_timeout_s = register_timeout_s
        self._free_events = list(range(len(memory.events)))[::-1]
        self._ops: list[Operation] = []  # sent and not collected yet (by poll or wait), in sending order
        self._lock = threading.Lock()  # _ops and _free_events
        self._registering = threading.Lock()
        self._reg = 0
        self._hellos = 0  # the client's hello count when `_reg` was made: a new hello means it is gone
        self.copy_timeout_s = 0.0  # the server's bound on a started copy (its gpu_register reply)
        self.unavailable = ""  # the last gpu_unavailable reason ("" = none)
        self._keeper: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._retry_at = 0.0  # registration backs off until then

    @property
    def registered(self) -> bool:
        return bool(self._reg) and self.client.hellos == self._hellos and self.client.connected

    def register(self) -> bool:
        """Register the memory with the server (again after a restart); False when the server cannot use it
        (`unavailable` says why) or is unreachable. Waits up to `register_timeout_s`."""
        with self._registering:
            return self._register()

    def _register(self) -> bool:
        try:
            reply = self.client.request({"op": "gpu_register", "memory": self.memory.to_wire()},
                                        timeout_s=self.register_timeout_s)
        except KVTierError as exc:
            self.unavailable = exc.reason or exc.code
            if self.fallback:
                log.warning("kvtier: the server does not copy for this %s worker (%s): %s", self.memory.engine, exc,
                            self.fallback)
                self._stop.set()
            else:
                log.warning("kvtier: the server cannot copy for this GPU (%s): loads and stores are misses", exc)
            return False
        if reply is None:
            return False
        self._reg, self._hellos, self.unavailable = reply["reg"], self.client.hellos, ""
        self.copy_timeout_s = float(reply["copy_timeout_s"])
        m = self.memory
        log.info("kvtier: %s memory %s registered (%s, %d layers x %d blocks of %d bytes)", m.engine, m.device,
                 m.layout, m.num_layers, m.num_blocks, m.page_bytes)
        return True

    def _register_again(self, failed: int) -> bool:
        """After registration `failed` was refused: register unless another thread did meanwhile."""
        with self._registering:
            return (self._reg != failed and self.registered) or self._register()

    def start(self) -> None:
        """Start the keeper thread: registration, heartbeats, registering again with backoff."""
        self._keeper = threading.Thread(target=self._keep, name="kvtier-gpu-keeper", daemon=True)
        self._keeper.start()

    def close(self) -> None:
        """Stop the keeper (a registration it is waiting for is left to its timeout: the thread is a daemon)."""
        self._stop.set()
        self._wake.set()
        if self._keeper is not None:
            self._keeper.join(1.0)

    def _keep(self) -> None:
        failures = 0
        while not self._stop.is_set():
            if self._keep_once():
                failures = 0
            else:
                failures += 1
                backoff = min(RETRY_MAX_S, RETRY_S * 2 ** (failures - 1))
                self._retry_at = time.monotonic() + backoff
                self._stop.wait(backoff)

    def _keep_once(self) -> bool:
        """Register if needed, then heartbeat after the server's interval (or when woken); False when the
        registration failed. A failure of the client itself is logged and backed off: the keeper never dies."""
        try:
            if not (self.registered or self.register()):
                return False
            self._wake.wait(self.client.heartbeat_s or HEARTBEAT_S)
            self._wake.clear()
            if self.registered and not self._stop.is_set():
                self.client.heartbeat()  # may find the server forgot this client: registered turns False
            return True
        except Exception as exc:
            if not self._stop.is_set():
                log.warning("kvtier: GPU registration keeper: %s: %s", type(exc).__name__, exc)
            return False

    def _ready(self) -> bool:
        """Whether operations can be sent now; never waits (the keeper registers, woken here past backoff)."""
        if self.registered:
            return True
        if time.monotonic() >= self._retry_at:
            self._wake.set()
        return False

    def _event(self) -> int:
        while True:
            with self._lock:
                if self._free_events:
                    return self._free_events.pop()
                oldest = next(op for op in self._ops if op.finished is None)
            self._settle(oldest)  # every event names an operation in flight: wait for the oldest

    def store(self, tag: Hashable, ns: Namespace, token_ids: Sequence[int], block_ids: Sequence[int],
              skip_chunks: int = 0, identity: RequestIdentity = PLAIN, hint: p.Hint = p.NO_HINT) -> Operation | None:
        """Store the whole chunks of `token_ids` (from chunk `skip_chunks`) out of engine blocks `block_ids`
        (one per block of the prompt), with the request's `hint` as a reserve carries it; None when nothing
        was sent."""
        chunks = chunk_keys(ns, token_ids, identity)[skip_chunks:][: p.MAX_STORE_ITEMS]
        if not chunks or not self._ready():
            return None
        bs, m = ns.block_size, self.memory
        ids = [list(block_ids[c.start_token // bs: c.start_token // bs + len(c.block_keys)]) for c in chunks]
        feed = bool(self.client.events_endpoint)  # the server's event feed names each chunk's tokens
        items = [p.StoreItem(c.key, m.num_layers * len(c.block_keys) * m.page_bytes, len(c.block_keys),
                             c.aliases, c.tokens if feed else b"", c.parent).to_wire() for c in chunks]
        message: dict[str, Any] = {"op": "gpu_store", "items": items, "block_ids": ids}
        if hint != p.NO_HINT:
            message["hint"] = hint.to_wire()
        return self._submit(tag, "store", ns, message, ids)

    def load(self, tag: Hashable, ns: Namespace, token_ids: Sequence[int], block_ids: Sequence[int],
             first_block: int, end_block: int, identity: RequestIdentity = PLAIN) -> Operation | None:
        """Load prompt blocks [first_block, end_block) of `token_ids` into `block_ids` (one per prompt block);
        None when nothing was sent (the caller reports those blocks as load errors)."""
        bs = ns.block_size
        keys, firsts, ids = [], [], []
        for chunk in chunk_keys(ns, token_ids[: end_block * bs], identity):
            base = chunk.start_token // bs
            lo, hi = max(first_block - base, 0), min(len(chunk.block_keys), end_block - base)
            if hi > lo:
                keys.append(chunk.block_keys[hi - 1])
                firsts.append(lo)
                ids.append(list(block_ids[base + lo: base + hi]))
        if not keys or not self._ready():
            return None
        return self._submit(tag, "load", ns, {"op": "gpu_load", "keys": keys, "first": firsts, "block_ids": ids},
                            ids)

    def _submit(self, tag: Hashable, kind: str, ns: Namespace, message: dict[str, Any],
                ids: list[list[int]]) -> Operation:
        event = self._event()
        try:
            self.events.record(event)
            start_by = time.monotonic() + self.start_s
            deadline = start_by + self.copy_timeout_s + REPLY_MARGIN_S
            wire = {**message, "reg": self._reg, "event": event, "start_by": start_by}
            op = Operation(tag, kind, ns, wire, deadline, self.client.submit(wire, ns, deadline - time.monotonic()),
                           event, ids)
        except BaseException:
            with self._lock:
                self._free_events.append(event)
            raise
        with self._lock:
            self._ops.append(op)
        return op

    def poll(self, wait: bool = False) -> list[Finished]:
        """The operations whose reply arrived (with `wait`, every one in flight, waiting for them), each once."""
        with self._lock:
            ops = list(self._ops)
        return [self.wait(op) for op in ops if wait or op.finished is not None or op.pending.done()]

    def wait(self, op: Operation) -> Finished:
        """Wait for `op`'s reply (any thread) and collect it: `poll` does not report it again."""
        finished = self._settle(op)
        with self._lock:
            if op in self._ops:
                self._ops.remove(op)
        return finished

    @property
    def in_flight(self) -> int:
        with self._lock:
            return sum(op.finished is None for op in self._ops)

    def _settle(self, op: Operation) -> Finished:
        with op.lock:
            if op.finished is None:
                op.finished = self._outcome(op)
                with self._lock:
                    self._free_events.append(op.event)
        return op.finished

    @staticmethod
    def _reply(pending: Pending) -> tuple[dict[str, Any] | None, str]:
        """The reply, or None and why not."""
        try:
            reply = pending.result()
        except KVTierError as exc:
            return None, exc.code if exc.code in _REFUSED else exc.reason or exc.code
        if reply is None:
            return None, p.NOT_REGISTERED if pending.forgotten else p.UNDELIVERED_UNREACHABLE
        return reply, ""

    def _outcome(self, op: Operation) -> Finished:
        every = {b for ids in op.block_ids for b in ids}
        try:
            reply, reason = self._reply(op.pending)
            if reason in _REFUSED and self._register_again(op.message["reg"]):  # no copy started: once more
                op.message = {**op.message, "reg": self._reg}  # same event, same start_by
                op.pending = self.client.submit(op.message, op.ns, op.deadline - time.monotonic())
                reply, reason = self._reply(op.pending)
        except Exception:  # a miss, never the engine's crash; the event goes back to the pool all the same
            log.exception("kvtier: GPU %s failed", op.kind)
            reply, reason = None, p.UNDELIVERED_FAILED
        if reply is None:
            return Finished(op.tag, op.kind, False, every if op.kind == "load" else set(), reason)
        if op.kind == "store":
            failed = [r for r in reply["results"] if r[0] == "failed"]
            return Finished(op.tag, op.kind, not failed, set(), failed[0][1] if failed else "")
        missing = {b for ids, n in zip(op.block_ids, reply["loaded"], strict=True) if n != len(ids) for b in ids}
        return Finished(op.tag, op.kind, not missing, missing, reply.get("reason", ""))
