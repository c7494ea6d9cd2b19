"""GpuTransfers: a GPU worker's side of the protocol's GPU operations, without torch or vLLM.

The worker registers its KV allocation once; then every store and load is one request that goes out
without waiting (KVTierClient.submit) after the worker recorded one of its interprocess events on its
stream, and whose reply, collected by `poll`, says the copy is done. An event is reused only after the reply
of the operation that named it. A registration lost to a server restart (`unknown_registration`, or a new
`server_id`) is made again before the next operation; the operations it failed are misses.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtier.connector.client import KVTierClient, KVTierError, Pending
from kvtier.server import protocol as p
from kvtier.server.keys import Namespace, chunk_keys

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


@dataclass
class _InFlight:
    tag: Hashable
    kind: str
    pending: Pending
    event: int
    block_ids: list[list[int]]  # per item (store) or key (load)


class GpuTransfers:
    def __init__(self, client: KVTierClient, memory: p.GpuMemory, events: EventSource) -> None:
        self.client = client
        self.memory = memory
        self.events = events
        self._free_events = list(range(len(memory.events)))[::-1]
        self._inflight: list[_InFlight] = []
        self._done: list[Finished] = []  # settled while waiting for a free event, not yet polled
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
        while not self._free_events:  # every event names an operation in flight: wait for the oldest
            self._done.append(self._settle(self._inflight[0]))
        return self._free_events.pop()

    def store(self, tag: Hashable, ns: Namespace, token_ids: Sequence[int], block_ids: Sequence[int],
              skip_chunks: int = 0) -> bool:
        """Store the whole chunks of `token_ids` (from chunk `skip_chunks`) out of engine blocks `block_ids`
        (one per block of the prompt); False when nothing was sent."""
        chunks = chunk_keys(ns, token_ids)[skip_chunks:][: p.MAX_STORE_ITEMS]
        if not chunks or not self._ready():
            return False
        bs, m = ns.block_size, self.memory
        ids = [list(block_ids[c.start_token // bs: c.start_token // bs + len(c.block_keys)]) for c in chunks]
        items = [p.StoreItem(c.key, m.num_layers * len(c.block_keys) * m.page_bytes, len(c.block_keys),
                             c.aliases).to_wire() for c in chunks]
        return self._submit(tag, "store", ns, {"op": "gpu_store", "items": items, "block_ids": ids}, ids)

    def load(self, tag: Hashable, ns: Namespace, token_ids: Sequence[int], block_ids: Sequence[int],
             first_block: int, end_block: int) -> bool:
        """Load prompt blocks [first_block, end_block) of `token_ids` into `block_ids` (one per prompt block);
        False when nothing was sent (the caller reports those blocks as load errors)."""
        bs = ns.block_size
        keys, firsts, ids = [], [], []
        for chunk in chunk_keys(ns, token_ids[: end_block * bs]):
            base = chunk.start_token // bs
            lo, hi = max(first_block - base, 0), min(len(chunk.block_keys), end_block - base)
            if hi > lo:
                keys.append(chunk.block_keys[hi - 1])
                firsts.append(lo)
                ids.append(list(block_ids[base + lo: base + hi]))
        if not keys or not self._ready():
            return False
        return self._submit(tag, "load", ns, {"op": "gpu_load", "keys": keys, "first": firsts, "block_ids": ids},
                            ids)

    def _submit(self, tag: Hashable, kind: str, ns: Namespace, message: dict[str, Any],
                ids: list[list[int]]) -> bool:
        event = self._event()
        self.events.record(event)
        pending = self.client.submit({**message, "reg": self._reg, "event": event}, ns)
        if pending is None:
            self._free_events.append(event)
            return False
        self._inflight.append(_InFlight(tag, kind, pending, event, ids))
        return True

    def poll(self, wait: bool = False) -> list[Finished]:
        """The operations whose reply arrived (with `wait`, every one in flight, waiting for them)."""
        done, self._done = self._done, []
        for op in list(self._inflight):
            if wait or op.pending.done():
                done.append(self._settle(op))
        return done

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def _settle(self, op: _InFlight) -> Finished:
        self._inflight.remove(op)
        self._free_events.append(op.event)
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
