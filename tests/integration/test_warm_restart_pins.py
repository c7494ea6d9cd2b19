"""Pins survive a warm restart (issue 29 item 10): chunks pinned through the admin API are still pinned after
a SIGKILL and after a clean stop (the journal's PIN records, replayed or carried by a snapshot), with their pin
counts, and outlast eviction pressure bit-exact; a real server, real shared memory, the admin API over HTTP."""

from __future__ import annotations

import json
import signal
import urllib.request

import pytest
from _support import free_port
from test_warm_restart import (
    CHUNKS,
    KEYS,
    L1_GB,
    SERVER_ARGS,
    SIZES,
    admin,
    adopted_chunks,
    kill,
    metric,
    served,
    store_all,
)

pytestmark = pytest.mark.integration

PAGE = 4096


def post(http_port: int, path: str, keys: list[bytes]) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{http_port}{path}",
                                     data=json.dumps({"keys": [k.hex() for k in keys]}).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


def pages(keys: list[bytes]) -> int:
    return sum(-(-SIZES[k] // PAGE) for k in keys)


def pinned_bytes(http_port: int) -> tuple[float, int]:
    """The pinned bytes as the metric and /status tell them."""
    return metric(http_port, "kvtier_pinned_bytes"), json.loads(admin(http_port, "/status"))["l1"]["pinned_bytes"]


def test_pins_come_back_after_a_kill_and_a_clean_stop_and_hold_their_chunks_under_eviction(kvtier_server):
    http_port = free_port()
    srv = kvtier_server(l1_gb=L1_GB, extra=[*SERVER_ARGS, "--http-port", str(http_port)])
    assert store_all(srv.url, range(20)) == 20
    pinned = KEYS[:9]
    assert post(http_port, "/cache/pin", KEYS[:10])["entries"] == 10
    assert post(http_port, "/cache/pin", KEYS[:1])["entries"] == 1  # chunk 0: two pins
    assert post(http_port, "/cache/unpin", KEYS[9:10])["entries"] == 1  # chunk 9: none again
    assert pinned_bytes(http_port) == (pages(pinned) * PAGE,) * 2

    kill(srv)  # the log since the last snapshot is replayed
    srv.start()
    assert adopted_chunks(srv.log_text()) == 20
    assert pinned_bytes(http_port) == (pages(pinned) * PAGE,) * 2
    assert store_all(srv.url, range(20, CHUNKS)) > 1500  # an 8 MiB L1 holds about half of the 2,000 chunks
    kept = served(srv.url)  # every chunk served, read bit-exact
    assert set(pinned) <= set(kept) and not set(KEYS[9:20]) & set(kept) and len(kept) < CHUNKS // 2 + 100

    srv.signal(signal.SIGTERM)  # a last snapshot, in the policy's order: the pins are carried
    assert srv.proc.wait(timeout=15) == 0
    srv.start()
    assert pinned_bytes(http_port) == (pages(pinned) * PAGE,) * 2
    assert post(http_port, "/cache/unpin", pinned)["entries"] == 9
    assert pinned_bytes(http_port) == (pages(KEYS[:1]) * PAGE,) * 2  # chunk 0 kept its second pin
    kill(srv)
    srv.start()
    assert pinned_bytes(http_port) == (pages(KEYS[:1]) * PAGE,) * 2
