"""Client-supplied input that used to break the contract (issue 11): each case failed before its fix."""

from __future__ import annotations

import os
import time
import tracemalloc

import msgpack
import numpy as np
import pytest
from kvtier.server import protocol as p
from kvtier.server.cache import Cache
from kvtier.server.eviction import make_policy
from kvtier.server.keys import MAX_NS_STR, Namespace, chunk_keys, digest
from kvtier.server.l1.holds import Holds
from kvtier.server.l1.pool import PagePool
from kvtier.server.l1.store import Entry, L1Store
from kvtier.server.metrics import Metrics
from kvtier.server.rpc import RequestHandler
from kvtier.shm.client_lock import ClientLock, LockDirectory
from kvtier.shm.pages import PageSpan

pytestmark = pytest.mark.unit

PAGE = 64 * 1024
NS = Namespace(model="m", dtype="bf16", num_layers=2, kv_heads=2, head_size=8, block_size=16,
               layout="NHD", chunk_size=64)
NS_B = Namespace(model="other", dtype="bf16", num_layers=2, kv_heads=2, head_size=8, block_size=16,
                 layout="NHD", chunk_size=64)
IDENT = b"client-1"


def _handler(locks: LockDirectory | None = None) -> RequestHandler:
    """A handler over an L1-only cache of 64 pages (`locks`: clients must hold real lock files)."""
    metrics = Metrics()
    store = L1Store(PagePool(64, PAGE), make_policy("lru"), metrics)
    cache = Cache(store, Holds(store, metrics, locks=locks), metrics)
    return RequestHandler(cache, {"shm_name": "seg", "shm_size": 64 * PAGE, "page_size": PAGE}, 64, 5.0)


@pytest.fixture
def rig(tmp_path):
    """A handler over a store with real client lock files; `hello()` registers a client holding one."""
    h = _handler(LockDirectory(str(tmp_path), "seg"))
    locks: list[ClientLock] = []

    def call(message: dict, ident: bytes = IDENT) -> dict:
        return msgpack.unpackb(h.handle(ident, msgpack.packb({"id": 5, **message}, use_bin_type=True)), raw=False)

    def hello(ident: bytes = IDENT) -> bytes:
        locks.append(ClientLock(str(tmp_path), "seg"))
        assert call({"op": "hello", "version": p.PROTOCOL_VERSION, "lock": locks[-1].name}, ident)["ok"]
        return call({"op": "register", "namespace": NS.to_dict()}, ident)["ns"]

    h.call, h.hello = call, hello
    yield h
    for lock in locks:
        lock.close()


def _item(keys, size: int = PAGE, aliases=None) -> list:
    return [keys.key, size, len(keys.block_keys), list(keys.aliases if aliases is None else aliases)]


def test_alias_equal_to_its_own_key_is_refused(rig):
    fp = rig.hello()
    k = chunk_keys(NS, list(range(64)))[0]
    reply = rig.call({"op": "reserve", "ns": fp, "items": [[k.key, PAGE, 2, [k.key]]]})
    assert reply["code"] == p.BAD_REQUEST and "differ from its key" in reply["error"]
    reply = rig.call({"op": "reserve", "ns": fp, "items": [[k.key, PAGE, 3, [k.aliases[0]] * 2]]})
    assert reply["code"] == p.BAD_REQUEST
    assert not rig.cache.store.index and rig.cache.store.pool.used_pages == 0


def test_blocks_are_tied_to_the_namespace_and_to_l1_bytes(rig):
    fp = rig.hello()
    k = chunk_keys(NS, list(range(64)))[0]
    too_long = [k.key, PAGE, 4096, [bytes([i % 256, i // 256]) * 8 for i in range(4095)]]
    assert rig.call({"op": "reserve", "ns": fp, "items": [too_long]})["code"] == p.BAD_REQUEST  # > 4 blocks
    rig.cache.store.min_block_bytes = PAGE // 2  # two blocks per page at most
    assert rig.call({"op": "reserve", "ns": fp, "items": [_item(k, size=1)]})["code"] == p.BAD_REQUEST
    assert rig.call({"op": "reserve", "ns": fp, "items": [_item(k, size=PAGE + 1)]})["results"][0][0] == p.RESERVED


def test_namespace_fields_are_bounded_before_anything_is_built(rig):
    rig.hello()
    huge = {**NS.to_dict(), "model": "x" * (MAX_NS_STR + 1)}
    assert rig.call({"op": "register", "namespace": huge})["code"] == p.BAD_REQUEST
    many = {**NS.to_dict(), **{f"f{i}": 1 for i in range(20)}}
    assert rig.call({"op": "register", "namespace": many})["code"] == p.BAD_REQUEST
    assert rig.call({"op": "register", "namespace": {**NS.to_dict(), "chunk_size": 16 * 8192}})["code"] == p.BAD_REQUEST
    assert len(rig.cache.store.namespaces) == 1


def test_worst_frames_are_refused_fast():
    """Frames built to cost the most: each is answered in a small fraction of the 5 s client timeout
    (a register with 3 M unknown fields took 7-10 s). Measured figures: docs/protocol.md."""
    h = _handler()
    h.handle(IDENT, msgpack.packb({"op": "hello", "id": 1, "version": p.PROTOCOL_VERSION}))
    fp = msgpack.unpackb(h.handle(IDENT, msgpack.packb({"op": "register", "id": 2, "namespace": NS.to_dict()})))["ns"]
    key = bytes(16)
    frames = {
        "register, 300k unknown fields": {"op": "register", "namespace": {f"k{i}": 0 for i in range(300_000)}},
        "lookup, 200k keys": {"op": "lookup", "ns": fp, "chunks": [[key] * 3] * p.MAX_ITEMS},
        "reserve, 8192 items": {"op": "reserve", "ns": fp,
                                 "items": [[i.to_bytes(16), PAGE, 4, [(i + j << 20).to_bytes(16) for j in (1, 2, 3)]]
                                           for i in range(p.MAX_STORE_ITEMS)]},
        "reserve, 8192 items with checked tokens": {"op": "reserve", "ns": fp, "items": [
            [digest(digest(fp) + tokens), PAGE, 1, [], tokens, b""]
            for tokens in (i.to_bytes(4 * NS.block_size) for i in range(p.MAX_STORE_ITEMS))]},
        "acquire, 65536 keys": {"op": "acquire", "ns": fp, "keys": [key] * p.MAX_ITEMS},
        "commit, 65536 ids": {"op": "commit", "res": list(range(p.MAX_ITEMS))},
    }
    for name, message in frames.items():
        frame = msgpack.packb({"id": 3, **message}, use_bin_type=True)
        assert len(frame) <= p.MAX_FRAME_BYTES, name
        started = time.perf_counter()
        reply = msgpack.unpackb(h.handle(IDENT, frame), raw=False)
        took = time.perf_counter() - started
        assert isinstance(reply, dict), name
        assert reply.get("ok") or "tokens" not in name, reply  # every item's tokens were checked
        assert took < 1.0, f"{name}: {took:.2f} s holds the serving loop"
        print(f"{name}: {len(frame) / 1e6:.1f} MB frame answered in {took * 1000:.0f} ms")


def test_unused_namespaces_are_forgotten(rig):
    rig.hello()
    fp_b = rig.call({"op": "register", "namespace": NS_B.to_dict()})["ns"]
    assert fp_b in rig.cache.store.namespaces
    rig.call({"op": "bye"})
    rig.holds.sweep()
    assert not rig.cache.store.namespaces and not rig.cache.store.ns_usage


def test_requests_before_or_after_a_failed_hello_are_not_registered(rig):
    assert rig.call({"op": "stats"})["code"] == p.NOT_REGISTERED
    rig.hello()
    assert rig.call({"op": "stats"})["ok"]
    assert rig.call({"op": "hello", "version": p.PROTOCOL_VERSION + 1})["code"] == p.VERSION_MISMATCH
    assert rig.call({"op": "stats"})["code"] == p.NOT_REGISTERED
    rig.token = b"secret"
    assert rig.call({"op": "hello", "version": p.PROTOCOL_VERSION, "token": "wrong"})["code"] == p.UNAUTHORIZED
    assert rig.call({"op": "heartbeat"})["code"] == p.NOT_REGISTERED


def test_a_hello_must_name_a_lock_the_client_holds(rig, tmp_path):
    dead = ClientLock(str(tmp_path), "seg")
    name = dead.name
    dead.close()
    for lock in (name, "../etc/passwd", "seg.client-" + "0" * 32):
        reply = rig.call({"op": "hello", "version": p.PROTOCOL_VERSION, "lock": lock})
        assert reply["code"] == p.BAD_REQUEST
    assert rig.call({"op": "hello", "version": p.PROTOCOL_VERSION})["ok"]  # no lock: may not hold pages
    fp = rig.call({"op": "register", "namespace": NS.to_dict()})["ns"]
    k = chunk_keys(NS, list(range(64)))[0]
    assert rig.call({"op": "reserve", "ns": fp, "items": [_item(k)]})["code"] == p.BAD_REQUEST
    assert rig.call({"op": "acquire", "ns": fp, "keys": [k.key]})["code"] == p.BAD_REQUEST


def test_acquire_reads_ns_and_lookup_never_crosses_namespaces(rig):
    fp = rig.hello()
    fp_b = rig.call({"op": "register", "namespace": NS_B.to_dict()})["ns"]
    k = chunk_keys(NS, list(range(64)))[0]
    rid = rig.call({"op": "reserve", "ns": fp, "items": [_item(k)]})["results"][0][1]
    assert rig.call({"op": "commit", "res": [rid]})["committed"] == 1
    assert rig.call({"op": "acquire", "ns": "x", "keys": [k.key]})["code"] == p.BAD_REQUEST
    assert rig.call({"op": "acquire", "ns": bytes(16), "keys": [k.key]})["code"] == p.UNKNOWN_NAMESPACE
    assert rig.call({"op": "acquire", "ns": fp_b, "keys": [k.key]})["items"] == [None]
    assert rig.call({"op": "lookup", "ns": fp_b, "chunks": [list(k.block_keys)]})["hits"] == []
    partial = [list(k.block_keys[:2]) + [bytes(16)]]  # ends inside the chunk: the alias path
    assert rig.call({"op": "lookup", "ns": fp_b, "chunks": partial})["hits"] == []
    assert rig.call({"op": "lookup", "ns": fp, "chunks": partial})["hits"] == [2]
    assert rig.call({"op": "lookup", "ns": fp, "chunks": [list(k.block_keys)]})["hits"] == [4]


def test_every_key_of_a_lookup_is_checked_for_its_length(rig):
    fp = rig.hello()
    reply = rig.call({"op": "lookup", "ns": fp, "chunks": [[bytes(15), bytes(17)]]})
    assert reply["code"] == p.BAD_REQUEST


def test_commit_after_a_shrink_leaves_l1_within_budget(rig):
    fp = rig.hello()
    keys = chunk_keys(NS, list(range(64 * 40)))
    results = rig.call({"op": "reserve", "ns": fp, "items": [_item(k) for k in keys]})["results"]
    store = rig.cache.store
    store.resize(8)  # nothing committed yet: the 40 open writes drain
    assert store.pool.used_pages == 40
    assert rig.call({"op": "commit", "res": [r[1] for r in results]})["committed"] == 40
    assert store.pool.used_pages <= 8


@pytest.mark.parametrize("extents", [(-2, 1), (0, -1), (63, 2), (0, 1, -64, 1), (0,), (0.5, 1)])
def test_pagespan_checks_both_ends_of_every_run(extents):
    segment = np.zeros(64 * 4096, dtype=np.uint8)
    with pytest.raises(ValueError):
        PageSpan(segment, extents, 4096, 2 * 4096)


def test_index_cost_per_key_bounds_the_worst_case_per_l1_gib():
    """Server memory per index key (chunk key or alias), the figure behind docs/protocol.md's worst case:
    at most one key per MIN_BLOCK_BYTES of L1, so ~160 B a key is ~160 MiB of index per L1 GiB."""
    store = L1Store(PagePool(4096, PAGE), make_policy("lirs"), Metrics())
    keys_per_chunk = PAGE // p.MIN_BLOCK_BYTES
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(2000):
        key, aliases = os.urandom(16), tuple(os.urandom(16) for _ in range(keys_per_chunk - 1))
        store.insert(Entry(key, bytes(16), PAGE, keys_per_chunk, (i, 1), aliases))
    per_key = (tracemalloc.get_traced_memory()[0] - before) / (2000 * keys_per_chunk)
    tracemalloc.stop()
    print(f"index: {per_key:.0f} B per key, {per_key * (1 << 30) / p.MIN_BLOCK_BYTES / (1 << 20):.0f} MiB per L1 GiB "
          "at worst")
    assert per_key * (1 << 30) / p.MIN_BLOCK_BYTES < 0.25 * (1 << 30), "the index could outgrow a quarter of L1"
