"""GpuTransfers: a GPU worker's side of the protocol's GPU operations, without torch or vLLM.

The worker registers its KV allocation once; then every store and load is one request that goes out
without waiting (KVTierClient.submit) after the worker recorded one of its interprocess events on its
stream, and whose reply says the copy is done: collected by `poll`, or by `wait` for one operation (from any
thread: the vLLM connector waits on its transfer threads, connector/in_flight.py). An event is reused only
after the reply of the operation that named it. A registration lost to a server restart (`unknown_registration`, or a new
`server_id`) is made again before the next operation; the operations it failed are misses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtier.connector.client import KVTierClient, KVTierError, Pending
from kvtier.server import protocol as p
from kvtier.server.keys import PLAIN, Namespace, RequestIdentity, chunk_keys

log = logging.getLogger("kvtier.connector")


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
    pending: Pending
    event: int
    block_ids: list[list[int]]  # per item (store) or key (load)
    finished: Finished | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class GpuTransfers:
    def __init__(self, client: KVTierClient, memory: p.GpuMemory, events: EventSource) -> None:
        self.client = client
        self.memory = memory
        self.events = events
        self._free_events = list(range(len(memory.events)))[::-1]
        self._ops: list[Operation] = []  # sent and not collected yet (by poll or wait), in sending order
        self._lock = threading.Lock()  # _ops and _free_events
        self._reg = 0
        self._server_id = ""
        self.unavailable = ""  # the last gpu_unavailable reason ("" = none)

    def register(self) -> bool:
        """Register the memory with the server (again after a restart); False when the server cannot use it
        (`unavailable` says why) or is unreachable."""
        try:
            reply = self.client.request({"op": "gpu_register", "memory": self.memory.to_wire()})
        except KVTierError as exc:
            self.unavailable = exc.reason or exc.code
            log.warning("kvtier: the server cannot copy for this GPU (%s): loads and stores are misses", exc)
            return False
        if reply is None:
            return False
        self._reg, self._server_id, self.unavailable = reply["reg"], self.client.server_id, ""
        return True

    def _ready(self) -> bool:
        if self._reg and self.client.server_id == self._server_id and self.client.connected:
            return True
        self._reg = 0
        return self.register()

    def _event(self) -> int:
        while True:
            with self._lock:
                if self._free_events:
                    return self._free_events.pop()
                oldest = next(op for op in self._ops if op.finished is None)
            self._settle(oldest)  # every event names an operation in flight: wait for the oldest

    def store(self, tag: Hashable, ns: Namespace, token_ids: Sequence[int], block_ids: Sequence[int],
              skip_chunks: int = 0, identity: RequestIdentity = PLAIN) -> Operation | None:
        """Store the whole chunks of `token_ids` (from chunk `skip_chunks`) out of engine blocks `block_ids`
        (one per block of the prompt); None when nothing was sent."""
        chunks = chunk_keys(ns, token_ids, identity)[skip_chunks:][: p.MAX_STORE_ITEMS]
        if not chunks or not self._ready():
            return None
        bs, m = ns.block_size, self.memory
        ids = [list(block_ids[c.start_token // bs: c.start_token // bs + len(c.block_keys)]) for c in chunks]
        items = [p.StoreItem(c.key, m.num_layers * len(c.block_keys) * m.page_bytes, len(c.block_keys),
                             c.aliases).to_wire() for c in chunks]
        return self._submit(tag, "store", ns, {"op": "gpu_store", "items": items, "block_ids": ids}, ids)

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
                ids: list[list[int]]) -> Operation | None:
        event = self._event()
        self.events.record(event)
        pending = self.client.submit({**message, "reg": self._reg, "event": event}, ns)
        op = Operation(tag, kind, pending, event, ids)
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

    def _outcome(self, op: Operation) -> Finished:
        every = {b for ids in op.block_ids for b in ids}
        try:
            reply = op.pending.result()
        except KVTierError as exc:
            if exc.code == p.UNKNOWN_REGISTRATION:
                self._reg = 0
            reply, reason = None, exc.reason or exc.code
        else:
            reason = "" if reply is not None else "unreachable"
        if reply is None:
            return Finished(op.tag, op.kind, False, every if op.kind == "load" else set(), reason)
        if op.kind == "store":
            failed = [r for r in reply["results"] if r[0] == "failed"]
            return Finished(op.tag, op.kind, not failed, set(), failed[0][1] if failed else "")
        missing = {b for ids, n in zip(op.block_ids, reply["loaded"], strict=True) if n != len(ids) for b in ids}
        return Finished(op.tag, op.kind, not missing, missing, reply.get("reason", ""))
