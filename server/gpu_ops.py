"""The GPU operations of the protocol (gpu_register, gpu_store, gpu_load, gpu_unregister) on top of the Cache.

A GPU engine cannot copy into L1 itself: it registers its KV allocation (protocol.GpuMemory) and asks the
server to move blocks. A store reserves the chunks' pages as the CPU path does, has the copier of the GPU
fill them once the engine's event fired, and commits them (or aborts when the copy failed); a load leases
the chunks, has the copier write them into the engine's blocks, and releases the lease. Each is answered
once the copy is done: the worker may reuse its blocks (store) or read them (load) only after the reply.
While a copier moves bytes, the reservations and leases involved are marked `copying`: a client that dies
meanwhile never gets those pages handed to anyone else before the copy ended (server/l1/holds.py).

An operation may carry `start_by` (the host's monotonic clock): its worker waits for the reply until then plus
`copy_timeout_s` (the gpu_register reply says it) and afterwards reuses its blocks, so no copy of it starts
later, neither here nor in the copier (which checks it again before it touches the engine's memory).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.server import protocol as p
from kvtier.server.cache import Cache
from kvtier.server.l1.holds import ClientState
from kvtier.server.metrics import GpuMetrics
from kvtier.server.transfer.base import LOAD, STORE, Copy, CopyEngine, GpuUnavailable
from kvtier.server.transfer.plan import PlanError, check

log = logging.getLogger("kvtier.server")

FAILED = "failed"  # a gpu_store item whose copy failed: [FAILED, reason]


@dataclass(frozen=True)
class Registration:
    rid: int
    owner: bytes  # the client socket that registered it
    memory: p.GpuMemory


class GpuOps:
    def __init__(self, cache: Cache, engine: CopyEngine, metrics: GpuMetrics, segment_size: int, *,
                 copy_timeout_s: float, allow_fake: bool = False, allow_host: bool = True) -> None:
        self.cache = cache
        self.holds = cache.holds
        self.engine = engine
        self.metrics = metrics
        self.page_size = cache.store.pool.page_size
        self.segment_size = segment_size
        self.copy_timeout_s = copy_timeout_s  # the copiers' bound on one operation, once started
        self.allow_fake = allow_fake
        self.allow_host = allow_host
        self.registrations: dict[int, Registration] = {}
        self.holds.on_client_gone.append(self.client_gone)

    # -- registrations ---------------------------------------------------------------------------

    async def register(self, ident: bytes, message: dict[str, Any]) -> dict[str, Any]:
        self.holds.client(ident)
        memory = p.GpuMemory.from_wire(p.field(message, "memory", dict))
        if memory.engine == "fake" and not self.allow_fake:
            raise p.ProtocolError(p.BAD_REQUEST, "this server does not accept the CPU stand-in engine "
                                  "(--gpu-fake-engine is for tests)")
        if memory.engine == "host" and not self.allow_host:
            raise p.ProtocolError(p.BAD_REQUEST, "this server does not copy for CPU engines (--no-host-copies): "
                                  "the worker copies by itself")
        try:
            rid = await self.engine.register(memory)
        except GpuUnavailable as exc:
            log.warning("GPU registration refused (%s, pid %d): %s", memory.device, memory.pid, exc)
            raise self._unavailable("gpu_register", exc) from None
        if ident not in self.holds.clients:  # the client left while its handles were being opened
            self.engine.unregister(rid)
            raise p.ProtocolError(p.NOT_REGISTERED, "say hello first (the client was dropped meanwhile)")
        self.registrations[rid] = Registration(rid, ident, memory)
        self.metrics.registrations.set(len(self.registrations))
        self.metrics.ops.labels("gpu_register", "ok").inc()
        log.info("GPU memory registered: %s %s, %d layers x %d blocks of %d KiB (%s), pid %d, registration %d",
                 memory.engine, memory.device, memory.num_layers, memory.num_blocks, memory.page_bytes >> 10,
                 memory.layout, memory.pid, rid)
        return p.ok(p.request_id(message), reg=rid, copy_timeout_s=self.copy_timeout_s)

    def unregister(self, ident: bytes, message: dict[str, Any]) -> dict[str, Any]:
        self.holds.client(ident)
        self._drop(self._registration(ident, message).rid)
        return p.ok(p.request_id(message))

    def client_gone(self, ident: bytes) -> None:
        """A client was unregistered (bye, death, silence, hello again): close its GPU registrations."""
        for rid in [r.rid for r in self.registrations.values() if r.owner == ident]:
            self._drop(rid)

    def _drop(self, rid: int) -> None:
        reg = self.registrations.pop(rid, None)
        if reg is not None:
            self.engine.unregister(rid)
            self.metrics.registrations.set(len(self.registrations))
            log.info("GPU registration %d closed (%s, pid %d)", rid, reg.memory.device, reg.memory.pid)

    def _registration(self, ident: bytes, message: dict[str, Any]) -> Registration:
        reg = self.registrations.get(p.field(message, "reg", int))
        if reg is None or reg.owner != ident:
            raise p.ProtocolError(p.UNKNOWN_REGISTRATION, "no such GPU registration of this client (the server "
                                  "may have restarted): register again")
        return reg

    def _unavailable(self, op: str, exc: GpuUnavailable) -> p.ProtocolError:
        self.metrics.ops.labels(op, exc.reason).inc()
        return p.ProtocolError(p.GPU_UNAVAILABLE, str(exc)[:300], reason=exc.reason)

    # -- copies ----------------------------------------------------------------------------------

    def _block_lists(self, message: dict[str, Any], memory: p.GpuMemory, count: int) -> list[tuple[int, ...]]:
        lists = p.list_field(message, "block_ids")
        if len(lists) != count:
            raise p.ProtocolError(p.BAD_REQUEST, "block_ids must hold one list per item")
        out = []
        for ids in lists:
            if (not isinstance(ids, list) or not 1 <= len(ids) <= p.MAX_BLOCKS
                    or not all(type(b) is int and 0 <= b < memory.num_blocks for b in ids)):
                raise p.ProtocolError(p.BAD_REQUEST, f"each block_ids item is 1 to {p.MAX_BLOCKS} block ids in "
                                      f"[0, {memory.num_blocks})")
            out.append(tuple(ids))
        return out

    def _operation(self, ident: bytes, message: dict[str, Any]
                   ) -> tuple[ClientState, Registration, bytes, int, float]:
        """The caller, its registration, the namespace, the event and the start-by deadline (0: none) of a
        gpu_store or gpu_load."""
        owner = self.holds.client(ident)
        reg = self._registration(ident, message)
        fp = p.key_field(p.field(message, "ns", bytes), "ns")
        start_by = float(p.field(message, "start_by", (int, float), 0))
        return owner, reg, fp, p.int_field(message, "event", 0, len(reg.memory.events) - 1), start_by

    async def store(self, ident: bytes, message: dict[str, Any]) -> dict[str, Any]:
        owner, reg, fp, event, start_by = self._operation(ident, message)
        memory = reg.memory
        items = [p.StoreItem.from_wire(v) for v in p.list_field(message, "items", p.MAX_STORE_ITEMS)]
        block_ids = self._block_lists(message, memory, len(items))
        for item, ids in zip(items, block_ids, strict=True):
            if len(ids) != item.blocks or item.size != memory.num_layers * item.blocks * memory.page_bytes:
                raise p.ProtocolError(p.BAD_REQUEST, "a gpu_store item holds one block id per block and "
                                      "layers x blocks x page_bytes of the registered memory")
        hint = p.Hint.from_wire(message["hint"]) if "hint" in message else p.NO_HINT  # as a reserve's (docs/hints.md)
        results = self.holds.reserve(owner, fp, items, client_writes=False, hint=hint)
        rids = [r[1] for r in results if r[0] == p.RESERVED]
        copies = [Copy(item.key, ids, 0, item.blocks, tuple(r[2]), item.size, start_by)
                  for item, ids, r in zip(items, block_ids, results, strict=True) if r[0] == p.RESERVED]
        reason = await self._copy(owner, reg, STORE, copies, event, rids=rids)
        if reason:
            self.holds.abort(owner, rids)
        else:
            committed = set(rids) if self.cache.commit(owner, rids) == len(rids) else set()
            reason = "" if committed else "lapsed"  # a reservation past its TTL stored nothing
        out = []
        for r in results:
            if r[0] != p.RESERVED:
                out.append(r)
            elif reason:
                out.append([FAILED, reason])
            else:
                out.append([p.RESERVED])
        return p.ok(p.request_id(message), results=out)

    async def load(self, ident: bytes, message: dict[str, Any]) -> dict[str, Any]:
        owner, reg, fp, event, start_by = self._operation(ident, message)
        memory = reg.memory
        keys = [p.key_field(k) for k in p.list_field(message, "keys", p.MAX_STORE_ITEMS)]
        firsts = p.int_list_field(message, "first", 0, p.MAX_BLOCKS, p.MAX_STORE_ITEMS)
        if len(firsts) != len(keys):
            raise p.ProtocolError(p.BAD_REQUEST, "first must hold one block index per key")
        block_ids = self._block_lists(message, memory, len(keys))
        leased = self.cache.acquire(ident, fp, keys)
        lid, items = leased if isinstance(leased, tuple) else await leased
        copies: list[Copy] = []
        wanted: list[int] = []  # blocks each key loads (0: a miss)
        for item, first, ids in zip(items, firsts, block_ids, strict=True):
            fits = (item is not None and first + len(ids) <= item.match
                    and item.size == memory.num_layers * item.blocks * memory.page_bytes)
            wanted.append(len(ids) if fits else 0)
            if fits:
                copies.append(Copy(keys[len(wanted) - 1], ids, first, item.blocks, tuple(item.extents), item.size,
                                   start_by))
        reason = await self._copy(owner, reg, LOAD, copies, event, lid=lid) if copies else ""
        held = self.holds.release(owner, lid) if lid else True
        if reason or not held:  # bytes the server cannot vouch for: every block is a load error
            wanted = [0] * len(wanted)
        reply = p.ok(p.request_id(message), loaded=wanted)
        if reason:
            reply["reason"] = reason
        return reply

    async def _copy(self, owner: ClientState, reg: Registration, direction: str, copies: Sequence[Copy],
                    event: int, rids: Sequence[int] = (), lid: int = 0) -> str:
        """Run the copy; "" when done, else the reason no byte of it may be trusted."""
        op = "gpu_store" if direction == STORE else "gpu_load"
        if not copies:
            return ""
        try:
            for c in copies:
                check(reg.memory, c, self.page_size, self.segment_size)
        except PlanError as exc:  # the server's own extents disagree with the registration: a bug, never a copy
            log.error("GPU %s refused by the planner: %s", direction, exc)
            return "bad_plan"
        if copies[0].start_by and time.monotonic() > copies[0].start_by:  # e.g. after a long promotion
            self.metrics.ops.labels(op, p.LATE).inc()
            return p.LATE
        self.holds.copying(rids, lid)
        started = time.perf_counter()
        try:
            await self.engine.copy(reg.rid, direction, copies, event)
        except GpuUnavailable as exc:
            self.metrics.ops.labels(op, exc.reason).inc()
            return exc.reason
        except KeyError:  # its client went away and the registration closed before the copy started
            return "unregistered"
        except ValueError as exc:  # the copier's planner refused what check() passed: a bug, never a copy
            log.error("GPU %s refused by the copier: %s", direction, exc)
            return "bad_plan"
        finally:
            self.holds.copying(rids, lid, on=False)
        self.metrics.copy_seconds.labels(direction).observe(time.perf_counter() - started)
        self.metrics.copied_bytes.labels(direction).inc(sum(
            reg.memory.num_layers * len(c.block_ids) * reg.memory.page_bytes for c in copies))
        self.metrics.ops.labels(op, "ok").inc()
        return ""

    def status(self) -> dict[str, Any]:
        return {"registrations": len(self.registrations), **self.engine.status()}
