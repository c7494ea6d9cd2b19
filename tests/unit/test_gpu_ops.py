"""The GPU operations' bookkeeping (server/gpu_ops.py) against an in-test CopyEngine whose copies the test
finishes or fails by hand: what is committed, released or refused, and that pages a copier is still moving
are never freed, whatever the client does. The real copier process is tested in
tests/integration/test_gpu_path.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import pytest
from kvtier.server import protocol as p
from kvtier.server.cache import Cache
from kvtier.server.eviction import make_policy
from kvtier.server.gpu_ops import FAILED, GpuOps
from kvtier.server.keys import Namespace, chunk_keys
from kvtier.server.l1.holds import Holds
from kvtier.server.l1.pool import PagePool
from kvtier.server.l1.store import L1Store
from kvtier.server.metrics import GpuMetrics, Metrics
from kvtier.server.rpc import RequestHandler
from kvtier.server.transfer.base import Copy, CopyEngine, GpuUnavailable

pytestmark = pytest.mark.unit

PAGE = 4096
LAYERS, BLOCKS, PAGE_BYTES = 2, 32, 1024  # a chunk of 4 blocks = 8 KiB = 2 L1 pages
NS = Namespace(model="m", dtype="bf16", num_layers=LAYERS, kv_heads=2, head_size=8, block_size=16,
               layout="vllm-fake-LBNHC-p1024", chunk_size=64)
IDENT = b"worker-1"


def memory(**changes: Any) -> dict[str, Any]:
    wire = p.GpuMemory("fake", "fake-0", b"dev", LAYERS * BLOCKS * PAGE_BYTES, (0, BLOCKS * PAGE_BYTES),
                       PAGE_BYTES, BLOCKS, PAGE_BYTES, 1, 0, "LBNHC", (b"e0", b"e1"), 1).to_wire()
    return {**wire, **changes}


class HandEngine(CopyEngine):
    """Copies end when the test says so."""

    def __init__(self) -> None:
        self.pending: list[tuple[str, list[Copy], asyncio.Future[None]]] = []
        self.registered: set[int] = set()
        self.refuse = ""

    async def register(self, memory: p.GpuMemory) -> int:
        if self.refuse:
            raise GpuUnavailable(self.refuse, "refused by the test")
        rid = len(self.registered) + 1
        self.registered.add(rid)
        return rid

    def unregister(self, registration: int) -> None:
        self.registered.discard(registration)

    async def copy(self, registration: int, direction: str, copies: Sequence[Copy], event: int) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pending.append((direction, list(copies), done))
        await done

    def finish(self, reason: str = "") -> None:
        _, _, done = self.pending.pop(0)
        done.set_exception(GpuUnavailable(reason)) if reason else done.set_result(None)

    def status(self) -> dict[str, Any]:
        return {"copiers": []}

    async def close(self) -> None:
        return None


def setup() -> tuple[RequestHandler, HandEngine]:
    metrics = Metrics()
    store = L1Store(PagePool(64, PAGE), make_policy("lru"), metrics, min_block_bytes=256)
    cache = Cache(store, Holds(store, metrics), metrics)
    engine = HandEngine()
    gpu = GpuOps(cache, engine, GpuMetrics(metrics), 64 * PAGE, copy_timeout_s=10.0, allow_fake=True)
    return RequestHandler(cache, {"shm_name": "x", "shm_size": 64 * PAGE, "page_size": PAGE}, 64, 5.0, gpu=gpu), engine


async def call(h: RequestHandler, message: dict[str, Any], ident: bytes = IDENT) -> dict[str, Any]:
    reply = h.handle(ident, msgpack.packb(message, use_bin_type=True))
    if not isinstance(reply, bytes):
        reply = await reply
    return msgpack.unpackb(reply, raw=False)


async def registered(h: RequestHandler) -> tuple[bytes, int]:
    assert (await call(h, {"op": "hello", "id": 1, "version": p.PROTOCOL_VERSION}))["ok"]
    ns = (await call(h, {"op": "register", "id": 2, "namespace": NS.to_dict()}))["ns"]
    reply = await call(h, {"op": "gpu_register", "id": 3, "memory": memory()})
    assert reply["ok"], reply
    return ns, reply["reg"]


def store_message(ns: bytes, reg: int, tokens: int = 128, block_ids: list[list[int]] | None = None) -> dict:
    chunks = chunk_keys(NS, list(range(tokens)))
    items = [p.StoreItem(c.key, LAYERS * len(c.block_keys) * PAGE_BYTES, len(c.block_keys), c.aliases).to_wire()
             for c in chunks]
    ids = block_ids or [[4 * i + j for j in range(len(c.block_keys))] for i, c in enumerate(chunks)]
    return {"op": "gpu_store", "id": 9, "ns": ns, "reg": reg, "event": 1, "items": items, "block_ids": ids}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_store_commits_only_after_its_copy_and_a_failed_copy_stores_nothing() -> None:
    async def scenario() -> None:
        h, engine = setup()
        ns, reg = await registered(h)
        reply = asyncio.ensure_future(call(h, store_message(ns, reg)))
        await asyncio.sleep(0)
        direction, copies, _ = engine.pending[0]
        assert direction == "store" and [c.block_ids for c in copies] == [(0, 1, 2, 3), (4, 5, 6, 7)]
        assert not reply.done() and h.cache.store.entries == {}  # nothing visible before the copy ended
        engine.finish()
        assert (await reply)["results"] == [["ok"], ["ok"]]
        assert len(h.cache.store.entries) == 2
        used = h.cache.store.pool.used_pages
        other = chunk_keys(NS, list(range(1000, 1128)))
        msg = store_message(ns, reg)
        msg["items"] = [p.StoreItem(c.key, LAYERS * 4 * PAGE_BYTES, 4, c.aliases).to_wire() for c in other]
        reply = asyncio.ensure_future(call(h, msg))
        await asyncio.sleep(0)
        engine.finish(p.COPIER_FAILED)
        assert (await reply)["results"] == [[FAILED, p.COPIER_FAILED]] * 2
        assert len(h.cache.store.entries) == 2 and not h.holds.reservations
        assert h.cache.store.pool.used_pages == used

    run(scenario())


def test_a_gpu_store_carries_its_requests_hint_as_a_reserve_does() -> None:
    async def scenario() -> None:
        h, engine = setup()
        ns, reg = await registered(h)
        hint = p.Hint(0.0, p.PRIORITIES.index("high"), "conv-7")
        reply = asyncio.ensure_future(call(h, {**store_message(ns, reg), "hint": hint.to_wire()}))
        await asyncio.sleep(0)
        engine.finish()
        assert (await reply)["results"] == [["ok"], ["ok"]]
        entries = list(h.cache.store.entries.values())
        assert [(e.priority, e.session, e.kept) for e in entries] == [(2, "conv-7", True)] * 2
        assert h.cache.end_session("conv-7") and not any(e.kept for e in entries)  # its session kept them
        bad = await call(h, {**store_message(ns, reg, tokens=64), "hint": {"priority": "urgent"}})
        assert bad["code"] == p.BAD_REQUEST and not engine.pending

    run(scenario())


def test_a_load_copies_the_named_blocks_and_reports_misses_and_failures_per_key() -> None:
    async def scenario() -> None:
        h, engine = setup()
        ns, reg = await registered(h)
        stored = asyncio.ensure_future(call(h, store_message(ns, reg)))
        await asyncio.sleep(0)
        engine.finish()
        await stored
        chunks = chunk_keys(NS, list(range(128)))
        missing = chunk_keys(NS, list(range(500, 564)))[0]
        load = {"op": "gpu_load", "id": 10, "ns": ns, "reg": reg, "event": 0,
                "keys": [chunks[0].key, chunks[1].block_keys[1], missing.key],
                "first": [1, 0, 0], "block_ids": [[20, 21, 22], [23, 24], [25, 26, 27, 28]]}
        reply = asyncio.ensure_future(call(h, load))
        await asyncio.sleep(0)
        direction, copies, _ = engine.pending[0]
        assert direction == "load" and [(c.first, c.block_ids) for c in copies] == [(1, (20, 21, 22)), (0, (23, 24))]
        assert h.holds.leases  # held while the copy runs
        engine.finish()
        assert (await reply)["loaded"] == [3, 2, 0] and not h.holds.leases
        reply = asyncio.ensure_future(call(h, {**load, "keys": load["keys"][:1], "first": [0],
                                                "block_ids": [[1, 2, 3, 4]]}))
        await asyncio.sleep(0)
        engine.finish(p.COPIER_FAILED)
        got = await reply
        assert got["loaded"] == [0] and got["reason"] == p.COPIER_FAILED

    run(scenario())


def test_pages_a_copier_still_writes_are_not_freed_when_its_client_dies() -> None:
    async def scenario() -> None:
        h, engine = setup()
        ns, reg = await registered(h)
        free_before = h.cache.store.pool.free_pages
        reply = asyncio.ensure_future(call(h, store_message(ns, reg)))
        await asyncio.sleep(0)
        h.holds.drop_client(IDENT)  # what a dead lock file or a bye does
        assert reg not in engine.registered  # the registration closes with its client
        assert h.cache.store.pool.free_pages < free_before  # the copier's pages stay out of the free list
        engine.finish()
        assert (await reply)["ok"]
        assert h.cache.store.entries == {} and h.cache.store.pool.free_pages == free_before

    run(scenario())


@pytest.mark.parametrize("change, code", [
    ({"block_ids": [[0, 1, 2, BLOCKS]]}, p.BAD_REQUEST),
    ({"block_ids": [[0, 1, 2, -1]]}, p.BAD_REQUEST),
    ({"block_ids": [[0, 1, 2]]}, p.BAD_REQUEST),
    ({"event": 2}, p.BAD_REQUEST),
    ({"reg": 99}, p.UNKNOWN_REGISTRATION),
])
def test_out_of_bounds_stores_are_refused_with_a_code_before_anything_is_reserved(change: dict, code: str) -> None:
    async def scenario() -> None:
        h, engine = setup()
        ns, reg = await registered(h)
        msg = store_message(ns, reg, tokens=64)
        reply = await call(h, {**msg, **change})
        assert reply["code"] == code and not engine.pending and not h.holds.reservations

    run(scenario())


@pytest.mark.parametrize("change", [
    {"layer_offsets": [0, BLOCKS * PAGE_BYTES + 1]},  # the last layer runs past the allocation
    {"block_stride": PAGE_BYTES - 1},  # pages of neighbouring blocks overlap
    {"page_bytes": 1000, "runs": 3},
    {"runs": 2, "run_stride": 100},
    {"layout": "XYZ"},
    {"engine": "rocm"},
    {"events": []},
    {"handle": b""},
    {"num_blocks": 0},
])
def test_malformed_registrations_are_refused_with_bad_request(change: dict) -> None:
    async def scenario() -> None:
        h, engine = setup()
        await registered(h)
        reply = await call(h, {"op": "gpu_register", "id": 4, "memory": memory(**change)})
        assert reply["code"] == p.BAD_REQUEST and len(engine.registered) == 1

    run(scenario())


def test_unavailable_engines_answer_their_typed_reason() -> None:
    async def scenario() -> None:
        h, engine = setup()
        await registered(h)
        engine.refuse = p.NO_DEVICE
        reply = await call(h, {"op": "gpu_register", "id": 4, "memory": memory()})
        assert (reply["code"], reply["reason"]) == (p.GPU_UNAVAILABLE, p.NO_DEVICE)
        plain = RequestHandler(h.cache, {}, 64, 5.0)  # a server built without a copy engine
        reply = await call(plain, {"op": "gpu_register", "id": 5, "memory": memory()})
        assert (reply["code"], reply["reason"]) == (p.GPU_UNAVAILABLE, p.NO_COPIER)

    run(scenario())


def test_the_fake_engine_needs_the_test_flag() -> None:
    async def scenario() -> None:
        h, _ = setup()
        h.gpu.allow_fake = False
        await call(h, {"op": "hello", "id": 1, "version": p.PROTOCOL_VERSION})
        reply = await call(h, {"op": "gpu_register", "id": 3, "memory": memory()})
        assert reply["code"] == p.BAD_REQUEST and "gpu-fake-engine" in reply["error"]

    run(scenario())


def test_an_operation_past_its_start_by_copies_nothing_and_answers_late() -> None:
    async def scenario() -> None:
        h, engine = setup()
        ns, reg = await registered(h)
        past = time.monotonic() - 0.001  # e.g. a promotion took longer than the worker waits
        reply = await asyncio.wait_for(call(h, {**store_message(ns, reg), "start_by": past}), 1.0)  # no copy
        assert reply["results"] == [[FAILED, p.LATE]] * 2
        assert not engine.pending and not h.holds.reservations and h.cache.store.entries == {}
        # a deadline still ahead travels with every copy to the copier, which checks it again
        later = time.monotonic() + 60
        pending = asyncio.ensure_future(call(h, {**store_message(ns, reg), "start_by": later}))
        await asyncio.sleep(0)
        assert [c.start_by for c in engine.pending[0][1]] == [later, later]
        engine.finish()
        assert (await pending)["results"] == [["ok"], ["ok"]]
        keys = [c.block_keys[-1] for c in chunk_keys(NS, list(range(128)))]
        load = {"op": "gpu_load", "id": 10, "ns": ns, "reg": reg, "event": 0, "keys": keys, "first": [0, 0],
                "block_ids": [[8, 9, 10, 11], [12, 13, 14, 15]]}
        reply = await call(h, {**load, "start_by": past})
        assert reply["loaded"] == [0, 0] and reply["reason"] == p.LATE and not engine.pending
        assert not h.holds.leases  # released
        assert (await call(h, {**load, "start_by": "soon"}))["code"] == p.BAD_REQUEST

    run(scenario())
