"""A real server with L2 against a hostile or broken L2 directory: FIFOs in place of chunk files are
misses and never hang lookups or SIGTERM; a directory in place of a chunk file does not stop a cache clear,
and nothing cleared comes back after a restart; a cache clear racing lookups never lets a chunk from before
it be served after it; /healthz fails when the L2 directory goes away."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.error
import urllib.request

import blake3
import numpy as np
import pytest
from _support import free_port, prompt, wait_for
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server.keys import Namespace, chunk_keys

pytestmark = pytest.mark.integration

NS = Namespace(model="org/tiny-l2-hostile", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64,
               block_size=16, layout="NHD", chunk_size=256)
SIZE = 16384  # bytes per chunk: four 4 KiB pages
BLOCKS = NS.chunk_size // NS.block_size  # per chunk
STOP_S = 20.0  # SIGTERM to exit: only to tell a hang from a shutdown (one takes well under a second)
PROMOTE_THREADS = 4  # server/tiers/promotion.py


def payload_of(key: bytes) -> np.ndarray:
    return np.frombuffer(blake3.blake3(b"payload" + key).digest(length=SIZE), dtype=np.uint8)


def client(url: str) -> KVTierClient:
    c = KVTierClient(ClientConfig(url=url, connect_timeout_s=5.0, request_timeout_s=10.0, strict=True))
    assert c.connect()
    return c


def store(c: KVTierClient, tokens) -> int:
    return c.store(NS, tokens, lambda _c: SIZE, lambda ch, span: span.write(0, payload_of(ch.key))).stored


def store_durable(c: KVTierClient, prompts) -> None:
    written = c.stats()["l2_written"]
    for tokens in prompts:
        assert store(c, tokens) == len(chunk_keys(NS, tokens))
    n = sum(len(chunk_keys(NS, t)) for t in prompts)
    wait_for(lambda: (s := c.stats()) and s["l2_inflight"] == 0 and s["l2_written"] >= written + n,
             timeout=60, what="L2 writes durable")


def read_checked(c: KVTierClient, tokens) -> int:
    """Tokens of `tokens` retrieved (lookup with acquire); raises if a byte differs from what was stored."""
    def read(rc) -> None:
        buf = np.empty(rc.span.size, dtype=np.uint8)
        rc.span.read(0, buf)
        assert np.array_equal(buf, payload_of(rc.chunk.key)), "retrieved bytes differ"

    return c.retrieve(NS, tokens, read)


def http(port: int, path: str, body: dict | None = None) -> tuple[int, object]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST" if data else "GET",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            code, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        code, raw = e.code, e.read()
    try:
        return code, json.loads(raw)
    except ValueError:
        return code, raw.decode(errors="replace")


def start(kvtier_server, l2, port: int):
    return kvtier_server(l1_gb=0.0625, extra=["--page-size-kb", "4", "--l2-path", str(l2), "--l2-size-gb", "1",
                                              "--http-port", str(port)])


def stop(srv) -> None:
    """SIGTERM; the server must exit cleanly within STOP_S."""
    srv.signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=STOP_S) == 0, srv.log_text()


def chunk_path(l2, tokens, i: int = 0) -> str:
    return os.path.join(l2, f"{chunk_keys(NS, tokens)[i].key.hex()}.kv")


def test_fifos_in_place_of_chunk_files_are_misses_and_sigterm_still_stops(kvtier_server, tmp_path):
    l2, port = tmp_path / "l2", free_port()
    srv = start(kvtier_server, l2, port)
    armed = [prompt(100 + i, 2 * NS.chunk_size) for i in range(PROMOTE_THREADS + 2)]
    good = [prompt(200 + i, 2 * NS.chunk_size) for i in range(3)]
    c = client(srv.url)
    store_durable(c, armed + good)
    assert http(port, "/cache/clear", {"scope": "tier", "tier": "l1"})[0] == 200  # only L2 has them now
    for tokens in armed:  # the first chunk file of each: a FIFO nobody writes to
        os.unlink(chunk_path(l2, tokens))
        os.mkfifo(chunk_path(l2, tokens))
    for tokens in armed:  # promotions start, one per FIFO: more than there are promotion threads
        assert [h.tier for h in c.lookup(NS, tokens).hits] == ["l2", "l2"]
    for tokens in good:  # served, bit-exact, while (and after) the FIFOs are tried
        assert read_checked(c, tokens) == len(tokens)
    for tokens in armed:
        assert read_checked(c, tokens) == 0 and c.lookup(NS, tokens).hits == []  # a miss, never a hang
    s = c.stats()
    assert s["l2_corrupt_chunks"] == len(armed) and s["l2_promotion_failures"] == len(armed), s
    assert s["l2_promoting"] == 0 and s["leases"] == 0
    c.close()
    stop(srv)
    assert "Traceback" not in srv.log_text()


def test_clear_past_a_directory_removes_the_rest_and_nothing_comes_back(kvtier_server, tmp_path):
    l2, port = tmp_path / "l2", free_port()
    srv = start(kvtier_server, l2, port)
    prompts = [prompt(300 + i, 2 * NS.chunk_size) for i in range(4)]
    c = client(srv.url)
    store_durable(c, prompts)
    c.close()
    stop(srv)
    srv.start()  # the index is in file age order now: the oldest file is the first a clear removes
    names = sorted(os.listdir(l2), key=lambda n: os.stat(l2 / n).st_mtime_ns)
    assert len(names) == 8
    blocked = l2 / names[0]
    blocked.unlink()
    blocked.mkdir()
    code, r = http(port, "/cache/clear", {"scope": "all"})
    assert code == 200 and r["tiers"]["l2"]["entries"] == 7 and r["tiers"]["l2"]["failed"] == 1, r
    assert os.listdir(l2) == [names[0]] and blocked.is_dir()  # every other file is gone
    code, status = http(port, "/status")
    assert status["l2"]["l2_clear_failures"] == 1 and status["l2"]["l2_entries"] == 0, status
    stop(srv)
    srv.start()
    c = client(srv.url)
    for tokens in prompts:
        assert c.lookup(NS, tokens).hits == [] and read_checked(c, tokens) == 0
    assert c.stats()["l2_entries"] == 0
    c.close()


def test_clear_racing_lookups_never_serves_a_chunk_from_before_it(kvtier_server, tmp_path):
    l2, port = tmp_path / "l2", free_port()
    srv = start(kvtier_server, l2, port)
    c = client(srv.url)
    looker = client(srv.url)
    for rnd in range(40):
        prompts = [prompt(1000 + 10 * rnd + i, 2 * NS.chunk_size) for i in range(3)]
        store_durable(c, prompts)
        assert http(port, "/cache/clear", {"scope": "tier", "tier": "l1"})[0] == 200  # only L2 has them
        fresh = prompt(1000 + 10 * rnd + 9, 2 * NS.chunk_size)
        assert store(c, fresh) == 2  # in L1, its L2 copy queued or being written
        stopping, looked = threading.Event(), threading.Event()
        errors: list[BaseException] = []

        def look(prompts=prompts, stopping=stopping, looked=looked, errors=errors) -> None:
            try:
                while not stopping.is_set():
                    for tokens in prompts:
                        looker.lookup(NS, tokens)  # starts promotions
                        looked.set()
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)
                looked.set()

        t = threading.Thread(target=look, daemon=True)
        t.start()
        assert looked.wait(10)
        code, r = http(port, "/cache/clear", {"scope": "all"})
        stopping.set()
        t.join(20)
        assert code == 200 and not errors and not t.is_alive(), (r, errors)
        wait_for(lambda: (s := c.stats()) and s["l2_promoting"] == 0 and s["l2_inflight"] == 0, timeout=20,
                 what="promotions and writes settled")
        for tokens in [*prompts, fresh]:
            assert c.lookup(NS, tokens).hits == [], f"round {rnd}: a chunk from before the clear is served"
            assert read_checked(c, tokens) == 0, f"round {rnd}: acquired a chunk from before the clear"
        s = c.stats()
        assert s["entries"] == 0 and s["l2_entries"] == 0, (rnd, s)
    looker.close()
    c.close()


def test_healthz_fails_when_the_l2_directory_is_gone(kvtier_server, tmp_path):
    l2, port = tmp_path / "l2", free_port()
    srv = start(kvtier_server, l2, port)
    code, body = http(port, "/healthz")
    assert code == 200 and body == {"ok": True, "checks": {"l1_mapped": True, "l2": True}}, body
    os.rename(l2, tmp_path / "away")
    code, body = http(port, "/healthz")
    assert code == 503 and body["ok"] is False and body["checks"]["l2"] is False, body
    assert str(l2) in body["reasons"]["l2"], body
    l2.write_bytes(b"")  # a file where the directory was
    code, body = http(port, "/healthz")
    assert code == 503 and body["checks"]["l2"] is False, body
    l2.unlink()
    os.rename(tmp_path / "away", l2)
    code, body = http(port, "/healthz")
    assert code == 200 and body["checks"] == {"l1_mapped": True, "l2": True}, body
    stop(srv)
