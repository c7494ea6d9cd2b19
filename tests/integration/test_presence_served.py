"""The presence filter (shm/presence.py) against a real server process: a client answers "certainly not held"
locally for what neither L1 nor L2 holds, follows stores, evictions, clears and restarts (a new file at each
start, remapped at the next hello), and is not offered at all with a remote tier (it could not say "not
held" of what other nodes wrote)."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
import uuid

import pytest
from _support import free_port, payload_of, prompt, wait_for
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server.keys import Namespace, chunk_keys

pytestmark = pytest.mark.integration
pytest_plugins = ("redis_servers",)  # redis_standalone

NS = Namespace(model="org/tiny-presence", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64,
               block_size=16, layout="NHD", chunk_size=256)
TOKEN = "presence-test-token"
SIZE = 256 * 1024


def client(url: str) -> KVTierClient:
    c = KVTierClient(ClientConfig(url=url, connect_timeout_s=5.0, request_timeout_s=20.0, strict=True, token=TOKEN))
    assert c.connect()
    return c


def block_keys(tokens) -> list[bytes]:
    return [k for chunk in chunk_keys(NS, tokens) for k in chunk.block_keys]


def store(c: KVTierClient, tokens, size: int = SIZE) -> None:
    n = len(chunk_keys(NS, tokens))
    assert c.store(NS, tokens, lambda _c: size, lambda ch, span: span.write(0, payload_of(ch.key, size))).stored == n


def admin_clear(http: int, **body) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{http}/cache/clear", data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def server(kvtier_server, *extra: str, l1_gb: float = 0.0625):
    http = free_port()
    srv = kvtier_server(l1_gb=l1_gb, extra=["--http-port", str(http), "--admin-token", TOKEN, *extra])
    return srv, http


def presence_path(srv) -> str:
    return f"/dev/shm/{srv.shm_name}.presence"


def test_l1_stores_evictions_and_clear(kvtier_server):
    srv, http = server(kvtier_server, "--no-l1-adopt")
    c = client(srv.url)
    assert os.path.exists(presence_path(srv)) and c._presence is not None  # the hello named it
    doc = prompt(1, 4 * NS.chunk_size)
    keys = block_keys(doc)
    assert not any(c.may_hold(k) for k in keys)  # nothing stored: certainly a miss
    store(c, doc)
    assert all(c.may_hold(k) for k in keys)  # every block key: a chunk's own and its block-prefix aliases
    assert not c.may_hold(os.urandom(16))
    assert c.lookup(NS, doc).tokens == len(doc)

    admin_clear(http, scope="all")
    assert not any(c.may_hold(k) for k in keys)

    store(c, doc)
    assert all(c.may_hold(k) for k in keys)
    for seed in range(2, 2 + 40):  # 40 MiB more through a 64 MiB L1 (LRU): the first document goes
        store(c, prompt(seed, 4 * NS.chunk_size), 1 << 20)
    assert c.lookup(NS, doc).tokens == 0
    assert not any(c.may_hold(k) for k in keys)
    c.close()
    srv.signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=30) == 0
    assert not os.path.exists(presence_path(srv))  # removed at a clean stop


def test_l2_only_chunks_and_restart(kvtier_server, tmp_path):
    srv, http = server(kvtier_server, "--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "0.25", "--no-l1-adopt")
    c = client(srv.url)
    doc = prompt(7, 3 * NS.chunk_size)
    keys = block_keys(doc)
    store(c, doc)
    wait_for(lambda: c.stats()["l2_written"] >= 3, timeout=60, what="L2 writes durable")
    epoch = c._presence.epoch
    assert c._presence.regions == 2
    admin_clear(http, scope="tier", tier="l1")
    assert all(c.may_hold(k) for k in keys)  # only in L2 now: still "maybe" (a lookup finds it there)

    srv.signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=30) == 0
    assert all(c.may_hold(k) for k in keys)  # the file is closed: no "not held" from a stopped server
    srv.start()  # L1 starts empty (--no-l1-adopt); L2's scan refills its region
    assert c.stats() is not None  # the next request says hello again: the new file is mapped
    assert c._presence is not None and c._presence.epoch != epoch
    assert all(c.may_hold(k) for k in keys)
    assert not c.may_hold(os.urandom(16))
    assert c.lookup(NS, doc).tokens == len(doc)

    admin_clear(http, scope="all")
    assert not any(c.may_hold(k) for k in keys)
    c.close()


def test_killed_server_file_is_replaced_and_adopted_chunks_refill_it(kvtier_server):
    srv, _ = server(kvtier_server)
    c = client(srv.url)
    doc = prompt(5, 2 * NS.chunk_size)
    keys = block_keys(doc)
    store(c, doc)
    old = c._presence
    srv.signal(signal.SIGKILL)
    srv.proc.wait(timeout=30)
    assert os.path.exists(presence_path(srv))  # left by the killed server
    assert not old.may_hold(os.urandom(16))
    srv.start()  # adopts L1 (warm restart): its new filter is filled as the adopted index is rebuilt
    assert "L1 adopted" in srv.log_text()
    assert old.may_hold(os.urandom(16))  # the new server marked the old file closed
    # the client sees the closed filter as its server gone: the first request after the restart says hello on
    # a new connection (and is answered) instead of waiting on the old one
    assert c.may_hold(keys[0]) and not c.connected
    assert c.lookup(NS, doc).tokens == len(doc)
    assert c._presence is not old and not c.may_hold(os.urandom(16))
    assert all(c.may_hold(k) for k in keys)
    c.close()


def test_no_filter_with_a_remote_tier(kvtier_server, redis_standalone):
    srv, _ = server(kvtier_server, "--no-l1-adopt", "--remote-url", redis_standalone,
                    "--remote-prefix", f"t{uuid.uuid4().hex[:10]}")
    c = client(srv.url)
    assert c._presence is None and not os.path.exists(presence_path(srv))
    assert c.may_hold(os.urandom(16))  # unknown: ask the server
    doc = prompt(3, 2 * NS.chunk_size)
    store(c, doc)
    assert all(c.may_hold(k) for k in block_keys(doc))
    c.close()
