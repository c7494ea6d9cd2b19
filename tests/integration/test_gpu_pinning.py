"""Page-locked L1 and what it constrains (issue 27, defects 5 and 6), against a real `kvtier server
--gpu-fake-engine` whose copier process "pins" L1 at the pace KVTIER_FAKE_PIN_DELAY_S sets (seconds per
--gpu-pin-piece-mb piece; server/transfer/fake.py).

* While a copier pins L1 (at its GPU's first registration and again after every restart) its loads answer
  `not_pinned`: lookups of the namespaces its worker uses answer misses meanwhile, and hit again once it has.
* /reconfigure refuses to give free L1 memory back (holes punched in the segment) while a copier holds L1
  page-locked: the GPU would keep the old pages. Shrinking the budget alone still works.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from _gpu_rig import FakeGpuWorker, namespace
from _support import prompt, wait_for
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server import protocol as p
from kvtier.server.transfer.fake import PIN_DELAY_ENV
from test_admin_api import Server, clean_env
from test_gpu_path import TOKENS, copier_pids, holds_pattern, load

pytestmark = pytest.mark.integration

FLAGS = ["--gpu-fake-engine", "--gpu-pin-piece-mb", "4", "--page-size-kb", "16"]
PIECES, PIN_DELAY_S = 32, 0.1  # a 128 MiB L1 in 4 MiB pieces: each copier start pins for about 3.2 s


def stored_once_pinned(transfers, ns, tokens, block_ids) -> None:
    """Store (answered not_pinned until the copier has page-locked L1), retrying until it is."""

    def stored() -> bool:
        assert transfers.store("s", ns, tokens, block_ids)
        (done,) = transfers.poll(wait=True)
        return done.ok

    wait_for(stored, 30, interval=0.2, what="a store once L1 is page-locked")


def test_lookups_answer_misses_while_the_copier_pins_and_hit_once_it_has(kvtier_server) -> None:
    srv = kvtier_server(l1_gb=PIECES * 4 / 1024, extra=FLAGS, env={PIN_DELAY_ENV: str(PIN_DELAY_S)})
    w = FakeGpuWorker()
    scheduler = KVTierClient(ClientConfig(url=srv.url, connect_timeout_s=5.0))  # vLLM's scheduler: another client
    try:
        _, transfers = w.transfers(srv.url)
        ns, tokens = namespace("LBNHC"), prompt(21, TOKENS).tolist()
        src, dst, later = list(range(18)), list(range(18, 36)), list(range(30, 48))
        w.fill(src, seed=21)
        stored_once_pinned(transfers, ns, tokens, src)
        assert scheduler.connect()
        # the daemon hears of the pinning's end with the copier's next heartbeat (copier.HEARTBEAT_S)
        wait_for(lambda: scheduler.lookup(ns, tokens).tokens == TOKENS, 5, what="hits after the store")

        (old,) = copier_pids(srv.proc.pid)
        os.kill(old, signal.SIGKILL)  # its replacement pins all of L1 again
        wait_for(lambda: copier_pids(srv.proc.pid) not in ([], [old]), 10, interval=0.02, what="a new copier")
        started = time.monotonic()
        assert scheduler.lookup(ns, tokens).tokens == 0, "a hit promised while the copier cannot load it"
        done = load(transfers, ns, tokens, dst, 0, 18)  # what such a hit would have led to
        assert not done.ok and done.reason == p.NOT_PINNED
        seen = wait_for(lambda: scheduler.lookup(ns, tokens).tokens, 30, interval=0.05, what="hits once pinned")
        assert seen == TOKENS
        assert time.monotonic() - started > PIECES * PIN_DELAY_S / 2  # misses lasted as long as the pinning
        done = load(transfers, ns, tokens, later, 0, 18)  # at once: what the lookup promised loads
        assert done.ok and holds_pattern(w, later, 21, range(18))
    finally:
        scheduler.close()
        w.close()


def test_reconfigure_gives_no_memory_back_while_a_copier_holds_l1_page_locked(tmp_path) -> None:
    mib = 1 << 20
    s = Server(tmp_path, "--gpu-fake-engine", "--gpu-pin-piece-mb", "4", "--page-size-kb", "16", l1_gb=1 / 16,
               env=clean_env())
    w = FakeGpuWorker()
    try:
        _, transfers = w.transfers(s.zmq_url)
        ns, tokens = namespace("LBNHC"), prompt(22, TOKENS).tolist()
        w.fill(list(range(18)), seed=22)
        stored_once_pinned(transfers, ns, tokens, list(range(18)))
        wait_for(lambda: [c["pinned_bytes"] for c in s.http.get("/status").json()["gpu"]["copiers"]] == [64 * mib],
                 5, what="the copier's page-locking reported")

        r = s.http.post("/reconfigure", json={"l1_size_bytes": 32 * mib, "eviction_policy": "lru"})
        assert r.status_code == 409, r.text
        assert "page-locked" in r.json()["detail"] and w.name in r.json()["detail"]
        assert '"release_memory": false' in r.json()["detail"]  # what to do instead
        status = s.http.get("/status").json()
        assert status["l1"]["capacity_bytes"] == 64 * mib and status["policy"] != "lru"  # nothing changed

        r = s.http.post("/reconfigure", json={"l1_size_bytes": 32 * mib, "release_memory": False})
        assert r.status_code == 200, r.text
        assert r.json()["l1"]["capacity_bytes"] == 32 * mib and "released_bytes" not in r.json()["l1"]
        assert s.http.post("/reconfigure", json={"l1_size_bytes": 64 * mib}).status_code == 200  # a grow frees nothing
        done = load(transfers, ns, tokens, list(range(20, 38)), 0, 18)
        assert done.ok and holds_pattern(w, list(range(20, 38)), 22, range(18))
    finally:
        s.stop()
        w.close()
