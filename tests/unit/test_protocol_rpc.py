"""RequestHandler.handle: malformed frames get typed error replies (never an exception) and are counted."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier.server import protocol as p
from kvtier.server.cache import Cache
from kvtier.server.eviction import make_policy
from kvtier.server.keys import Namespace, chunk_keys
from kvtier.server.l1.holds import Holds
from kvtier.server.l1.pool import PagePool
from kvtier.server.l1.store import L1Store
from kvtier.server.metrics import Metrics
from kvtier.server.rpc import RequestHandler

pytestmark = pytest.mark.unit
MIN_BLOCK_BYTES = 1024  # 4 blocks per 4 KiB page

NS = Namespace(model="m", dtype="bf16", num_layers=2, kv_heads=2, head_size=8, block_size=16,
               layout="NHD", chunk_size=64)
IDENT = b"client-1"
MALFORMED_CODES = (p.BAD_REQUEST, p.UNKNOWN_OP)


def make_handler() -> RequestHandler:
    metrics = Metrics()
    store = L1Store(PagePool(64, 4096), make_policy("lru"), metrics, min_block_bytes=MIN_BLOCK_BYTES)
    cache = Cache(store, Holds(store, metrics), metrics)
    return RequestHandler(cache, {"shm_name": "x", "shm_size": 64 * 4096, "page_size": 4096}, 64, 5.0)


def malformed_count(h: RequestHandler) -> float:
    return h.metrics.registry.get_sample_value("kvtier_malformed_requests_total")


def call(h: RequestHandler, message, ident: bytes = IDENT) -> dict:
    frame = message if isinstance(message, bytes) else msgpack.packb(message, use_bin_type=True)
    reply = msgpack.unpackb(h.handle(ident, frame), raw=False)
    assert isinstance(reply, dict) and "ok" in reply and "id" in reply
    return reply


def registered() -> tuple[RequestHandler, bytes]:
    h = make_handler()
    assert call(h, {"op": "hello", "id": 1, "version": p.PROTOCOL_VERSION})["ok"]
    reply = call(h, {"op": "register", "id": 2, "namespace": NS.to_dict()})
    assert reply["ok"]
    return h, reply["ns"]


KEY = bytes(16)
BAD_MESSAGES = [
    b"",
    b"\xc1",  # never-used msgpack byte
    b"\x93\x01\x02",  # truncated array
    b"\xdd\x7f\xff\xff\xff",  # array header claiming 2^31-1 elements
    b"\xdf\x7f\xff\xff\xff",  # map header claiming 2^31-1 pairs
    b"\xc6\x7f\xff\xff\xff",  # bin32 claiming 2 GiB
    b"\x91" * 5000 + b"\xc0",  # nesting deeper than any unpacker stack
    msgpack.packb({"op": "stats"}) + b"\x00",  # trailing bytes
    msgpack.packb([1, 2, 3]),
    msgpack.packb("stats"),
    msgpack.packb(None),
    msgpack.packb({1: "op"}),  # non-string map key
    {},
    {"op": None},
    {"op": 5},
    {"op": "no-such-op"},
    {"op": "x" * 10000},
    {"op": b"stats"},
    {"op": "hello"},
    {"op": "hello", "version": "1"},
    {"op": "hello", "version": True},
    {"op": "hello", "version": p.PROTOCOL_VERSION, "instance": 5},
    {"op": "hello", "version": p.PROTOCOL_VERSION, "pid": "x"},
]

REGISTERED_BAD = [
    {"op": "register"},
    {"op": "register", "namespace": "m"},
    {"op": "register", "namespace": {"model": "m"}},
    {"op": "register", "namespace": {**NS.to_dict(), "block_size": "16"}},
    {"op": "register", "namespace": {**NS.to_dict(), "block_size": 0}},
    {"op": "register", "namespace": {**NS.to_dict(), "chunk_size": 100}},
    {"op": "register", "namespace": {**NS.to_dict(), "bogus": 1}},
    {"op": "register", "namespace": {**NS.to_dict(), "model": {"a": 1, b"b": 2}}},
    {"op": "register", "namespace": {**NS.to_dict(), "tp_rank": None}},
    {"op": "lookup"},
    {"op": "lookup", "ns": "x", "chunks": []},
    {"op": "lookup", "ns": b"short", "chunks": []},
    {"op": "lookup", "ns": "@NS", "chunks": "x"},
    {"op": "lookup", "ns": "@NS", "chunks": [[]]},
    {"op": "lookup", "ns": "@NS", "chunks": [5]},
    {"op": "lookup", "ns": "@NS", "chunks": [[b"short"]]},
    {"op": "lookup", "ns": "@NS", "chunks": [[KEY] * 5000]},
    {"op": "lookup", "ns": "@NS", "chunks": [[KEY]] * (p.MAX_ITEMS + 1)},
    {"op": "lookup", "ns": "@NS", "chunks": [[KEY]], "acquire": 1},
    {"op": "reserve", "ns": "@NS"},
    {"op": "reserve", "ns": "@NS", "items": [5]},
    {"op": "reserve", "ns": "@NS", "items": [[KEY, 10, 1]]},
    {"op": "reserve", "ns": "@NS", "items": [[KEY, -1, 1, []]]},
    {"op": "reserve", "ns": "@NS", "items": [[KEY, 0, 1, []]]},
    {"op": "reserve", "ns": "@NS", "items": [[KEY, True, 1, []]]},
    {"op": "reserve", "ns": "@NS", "items": [[KEY, 10, 0, []]]},
    {"op": "reserve", "ns": "@NS", "items": [[KEY, 10, 10**6, []]]},
    {"op": "reserve", "ns": "@NS", "items": [[KEY, 10, 1, [KEY]]]},
    {"op": "reserve", "ns": "@NS", "items": [[KEY, 10, 2, [b"x"]]]},
    {"op": "reserve", "ns": "@NS", "items": [[b"k", 10, 1, []]]},
    {"op": "reserve", "ns": "@NS", "items": [[KEY, 10, 1, "aliases"]]},
    {"op": "commit", "res": "1"},
    {"op": "commit", "res": [1, "2"]},
    {"op": "commit", "res": [True]},
    {"op": "abort", "res": [1.5]},
    {"op": "acquire", "keys": [b"x"]},
    {"op": "acquire", "keys": KEY},
    {"op": "release", "leases": [None]},
    {"op": "release"},
    {"op": "lookup", "ns": "@NS", "chunks": [[KEY]], "lease": "yes"},
    {"op": "lookup", "ns": "@NS", "chunks": [[KEY]], "again": 1},
    {"op": "lookup", "ns": "@NS", "chunks": [[KEY]], "ranks": "x"},
    {"op": "lookup", "ns": "@NS", "chunks": [[KEY]], "ranks": [5]},
    {"op": "lookup", "ns": "@NS", "chunks": [[KEY]], "ranks": [[KEY]]},
    {"op": "lookup", "ns": "@NS", "chunks": [[KEY]], "ranks": [[b"short", [[KEY]]]]},
    {"op": "lookup", "ns": "@NS", "chunks": [[KEY]], "ranks": [[KEY, [[b"short"]]]]},
    {"op": "lookup", "ns": "@NS", "chunks": [[KEY]], "ranks": [[KEY, [[KEY, KEY]]]]},  # other blocks per chunk
    {"op": "lookup", "ns": "@NS", "chunks": [[KEY]], "ranks": [[KEY, [[KEY], [KEY]]]]},  # other chunks
    {"op": "lookup", "ns": "@NS", "chunks": [[KEY]], "ranks": [[KEY, [[KEY]]]] * (p.MAX_LOOKUP_RANKS + 1)},
    {"op": "report", "skipped": {"bogus": 1}},
    {"op": "report", "skipped": {"lora_unknown": -1}},
    {"op": "report", "skipped": {"lora_unknown": True}},
    {"op": "report", "skipped": ["lora_unknown"]},
    {"op": "report", "undelivered": {"missing": 1.5}},
    {"op": "report", "undelivered": {"missing": 2**41}},
    {"op": "report", "verified": 2, "mismatched": 3, "ns": "@NS"},
    {"op": "report", "verified": 1},
    {"op": "report", "verified": -1},
]


@pytest.mark.parametrize("message", BAD_MESSAGES, ids=range(len(BAD_MESSAGES)))
def test_malformed_frames_are_answered_and_counted(message):
    h = make_handler()
    before = malformed_count(h)
    reply = call(h, message)
    assert reply["ok"] is False
    assert reply["code"] in MALFORMED_CODES, reply
    assert isinstance(reply["error"], str) and len(reply["error"]) < 1000
    assert malformed_count(h) == before + 1


def _decodes(message: dict) -> bool:
    try:
        p.unpack(p.pack(message))
    except p.ProtocolError:
        return False
    return True


@pytest.mark.parametrize("message", REGISTERED_BAD, ids=range(len(REGISTERED_BAD)))
def test_malformed_fields_after_hello_are_answered_and_counted(message):
    h, fp = registered()
    message = {k: (fp if v == "@NS" else v) for k, v in message.items()}
    message["id"] = 77
    before = malformed_count(h)
    reply = call(h, message)
    assert reply["ok"] is False
    assert reply["code"] in MALFORMED_CODES, reply
    assert reply["id"] == (77 if _decodes(message) else 0)  # a frame over the decode limits has no readable id
    assert malformed_count(h) == before + 1
    # The client is still served afterwards.
    assert call(h, {"op": "heartbeat", "id": 78})["ok"]


def test_oversized_frame_is_rejected_without_decoding():
    h = make_handler()
    reply = call(h, b"\x80" + bytes(p.MAX_FRAME_BYTES))
    assert reply["ok"] is False and reply["code"] == p.BAD_REQUEST
    assert malformed_count(h) == 1


def test_well_formed_errors_are_not_counted_as_malformed():
    h = make_handler()
    for message, code in [
        ({"op": "lookup", "ns": KEY, "chunks": [[KEY]]}, p.NOT_REGISTERED),
        ({"op": "hello", "version": p.PROTOCOL_VERSION + 1}, p.VERSION_MISMATCH),
    ]:
        reply = call(h, message)
        assert reply["ok"] is False and reply["code"] == code
    h2, _ = registered()
    reply = call(h2, {"op": "lookup", "ns": b"\x01" * 16, "chunks": [[KEY]]})
    assert reply["code"] == p.UNKNOWN_NAMESPACE
    assert malformed_count(h) == 0 and malformed_count(h2) == 0


def test_request_ids_are_echoed_and_bad_ids_become_zero():
    h = make_handler()
    assert call(h, {"op": "stats", "id": 2**63})["id"] == 2**63
    assert call(h, {"op": "stats", "id": "x"})["id"] == 0
    assert call(h, {"op": "nope", "id": 9})["id"] == 9


def test_valid_round_trip_after_garbage():
    h, fp = registered()
    for junk in BAD_MESSAGES:
        call(h, junk)
    # among the junk, failed hellos: the socket is no longer registered until a good one
    assert call(h, {"op": "heartbeat", "id": 2})["code"] == p.NOT_REGISTERED
    assert call(h, {"op": "hello", "id": 1, "version": p.PROTOCOL_VERSION})["ok"]
    fp = call(h, {"op": "register", "id": 2, "namespace": NS.to_dict()})["ns"]
    keys = chunk_keys(NS, list(range(64)))
    item = p.StoreItem(keys[0].key, 100, 4, keys[0].aliases)
    reply = call(h, {"op": "reserve", "id": 3, "ns": fp, "items": [item.to_wire()]})
    assert reply["ok"] and reply["results"][0][0] == p.RESERVED
    assert call(h, {"op": "commit", "id": 4, "res": [reply["results"][0][1]]})["committed"] == 1
    reply = call(h, {"op": "lookup", "id": 5, "ns": fp, "chunks": [list(keys[0].block_keys)]})
    assert reply["hits"] == [4] and reply["tiers"] == ["l1"]


@settings(max_examples=300, deadline=None)
@given(frame=st.binary(max_size=200))
def test_random_bytes_never_raise(frame):
    h = make_handler()
    before = malformed_count(h)
    reply = call(h, frame)
    if not reply["ok"]:
        assert reply["code"] != p.INTERNAL
        counted = reply["code"] in MALFORMED_CODES
        assert malformed_count(h) == before + counted


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=5)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(op=st.sampled_from(p.OPS), fields=st.dictionaries(
    st.sampled_from(["ns", "chunks", "items", "res", "keys", "leases", "namespace", "version", "acquire", "pid"]),
    json_like, max_size=4))
def test_random_fields_for_every_op_never_raise(op, fields):
    h, fp = registered()
    reply = call(h, {"op": op, "id": 1, **fields})
    if not reply["ok"]:
        assert reply["code"] != p.INTERNAL, reply
