"""10,000 malformed frames from raw DEALER sockets: every one answered or dropped, the server keeps serving."""

from __future__ import annotations

import random

import msgpack
import pytest
import zmq
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server import protocol as p
from kvtier.server.keys import Namespace

pytestmark = pytest.mark.integration

NS = Namespace(model="org/tiny", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64, block_size=16,
               layout="NHD", chunk_size=256)
N_FRAMES = 10_000
MALFORMED_CODES = (p.BAD_REQUEST, p.UNKNOWN_OP)
KEY = bytes(16)
TOO_MANY = [msgpack.packb({"op": op, field: [0] * (p.MAX_ITEMS + 1)})
            for op, field in (("acquire", "keys"), ("release", "leases"), ("commit", "res"))]


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def garbage(rng: random.Random, fp: bytes) -> list[bytes]:
    """One malformed message (as its frames) of a randomly chosen kind."""
    kind = rng.randrange(12)
    if kind == 0:  # random bytes
        return [rng.randbytes(rng.randrange(0, 300))]
    if kind == 1:  # truncated msgpack of a valid request
        whole = pack({"op": "lookup", "id": 1, "ns": fp, "chunks": [[KEY] * 8]})
        return [whole[: rng.randrange(0, len(whole))]]
    if kind == 2:  # headers claiming huge containers
        return [rng.choice([b"\xdd", b"\xdf", b"\xc6", b"\xdb"]) + rng.choice([b"\x7f\xff\xff\xff", b"\xff\xff\xff\xff"])]
    if kind == 3:  # unknown or mistyped op
        return [pack({"op": rng.choice(["nope", "", "HELLO", 5, None, b"stats", ["lookup"]]), "id": rng.randrange(100)})]
    if kind == 4:  # wrong field types for real ops
        return [pack(rng.choice([
            {"op": "lookup", "ns": fp, "chunks": "x"},
            {"op": "lookup", "ns": fp, "chunks": [[b"short"]]},
            {"op": "lookup", "ns": 7, "chunks": []},
            {"op": "reserve", "ns": fp, "items": [[KEY, -5, 1, []]]},
            {"op": "reserve", "ns": fp, "items": [[KEY, 10, 2]]},
            {"op": "reserve", "ns": fp, "items": {"a": 1}},
            {"op": "commit", "res": ["1"]},
            {"op": "abort", "res": [True]},
            {"op": "acquire", "keys": [1, 2]},
            {"op": "release", "leases": "all"},
            {"op": "register", "namespace": {"model": 5}},
            {"op": "hello", "version": "one"},
        ]))]
    if kind == 5:  # not a map
        return [pack(rng.choice([[1, 2], "hello", 3, None, True, 1.5, b"\x00" * 16]))]
    if kind == 6:  # multi-frame messages
        return [pack({"op": "stats", "id": 1})] * rng.randrange(2, 5)
    if kind == 7:  # empty frame
        return [b""]
    if kind == 8:  # trailing garbage after a valid request
        return [pack({"op": "stats", "id": 1}) + rng.randbytes(rng.randrange(1, 10))]
    if kind == 9:  # deep nesting
        return [b"\x91" * rng.randrange(1000, 20000) + b"\xc0"]
    if kind == 10:  # too many items
        return [rng.choice(TOO_MANY)]
    return [pack({1: 2, 3: 4})]  # non-string map keys


def test_server_survives_malformed_frames(kvtier_server):
    srv = kvtier_server(l1_gb=0.0625)
    ctx = zmq.Context.instance()
    good = KVTierClient(ClientConfig(url=srv.url, strict=True))
    assert good.register(NS)
    fp = good._namespaces[NS]
    start = good.stats()["malformed"]

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"fuzzer")
    sock.connect(srv.url)
    try:
        sock.send(pack({"op": "hello", "id": 1, "version": p.PROTOCOL_VERSION}))
        assert sock.poll(5000) and msgpack.unpackb(sock.recv())["ok"]
        rng = random.Random(20240601)
        unexpected = []
        for i in range(N_FRAMES):
            frames = garbage(rng, fp)
            sock.send_multipart(frames)
            assert sock.poll(5000), f"no reply to malformed frame {i}"
            reply = msgpack.unpackb(sock.recv(), raw=False)
            if reply.get("ok") is not False or reply.get("code") not in MALFORMED_CODES:
                unexpected.append(reply)
            if frames[0] == pack({"op": "hello", "version": "one"}):  # a failed hello unregisters the socket
                sock.send(pack({"op": "stats", "id": 2}))
                assert sock.poll(5000) and msgpack.unpackb(sock.recv())["code"] == p.NOT_REGISTERED
                sock.send(pack({"op": "hello", "id": 1, "version": p.PROTOCOL_VERSION}))
                assert sock.poll(5000) and msgpack.unpackb(sock.recv())["ok"]
        assert not unexpected, unexpected[:5]
        assert srv.proc.poll() is None
        assert good.stats()["malformed"] - start == N_FRAMES

        # Frames over MAX_FRAME_BYTES: ZeroMQ drops them (and the connection) before they are decoded.
        big = bytes(p.MAX_FRAME_BYTES + 1)
        for _ in range(2):
            sock.send(big)
        # The same socket (reconnected by ZeroMQ) is served again.
        sock.send(pack({"op": "stats", "id": 42}))
        assert sock.poll(10_000)
        replies = []
        while sock.poll(2000):
            replies.append(msgpack.unpackb(sock.recv(), raw=False))
            if replies[-1].get("id") == 42:
                break
        assert replies and replies[-1]["id"] == 42 and replies[-1]["ok"]
    finally:
        sock.close(0)

    # The server still answers valid requests and still stores and finds chunks.
    assert srv.proc.poll() is None
    tokens = list(range(NS.chunk_size))
    r = good.store(NS, tokens, lambda _c: 4096, lambda _c, span: None)
    assert r.stored == 1
    assert good.lookup(NS, tokens).tokens == NS.chunk_size
    # The oversized frames never reached the handler, or were counted if they did.
    assert N_FRAMES <= good.stats()["malformed"] - start <= N_FRAMES + 2
    good.close()
