"""A client SIGKILLed while holding reservations and leases: everything it held is reclaimed, exactly."""

from __future__ import annotations

import json
import select
import signal
from pathlib import Path

import numpy as np
import pytest
from _support import prompt, wait_for
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server.keys import Namespace

pytestmark = pytest.mark.integration

NS = Namespace(model="org/tiny", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64, block_size=16,
               layout="NHD", chunk_size=256)
CHUNK_BYTES = 100 * 1024  # two 64 KiB pages each
FIELDS = ("l1_used_bytes", "l1_free_pages", "reservations", "leases", "evictable_bytes", "pinned_bytes",
          "entries", "index_keys")


@pytest.mark.parametrize(
    "reclaim, flags",
    [
        # Leases and reservations outlive the client: the client timeout reclaims them.
        ("client_timeout", ["--lease-ttl-s", "60", "--reservation-ttl-s", "60", "--client-timeout-s", "2"]),
        # The client is still "known" for a minute: the lease and reservation TTLs reclaim them.
        ("ttl", ["--lease-ttl-s", "2", "--reservation-ttl-s", "2", "--client-timeout-s", "60"]),
    ],
)
def test_killed_client_holdings_are_reclaimed(kvtier_server, start_client, reclaim, flags):
    srv = kvtier_server(l1_gb=0.0625, extra=flags)
    c = KVTierClient(ClientConfig(url=srv.url, strict=True))
    assert c.connect()
    payload = np.arange(CHUNK_BYTES, dtype=np.uint64).astype(np.uint8)
    tokens = prompt(1, 40 * NS.chunk_size)
    r = c.store(NS, tokens, lambda _c: CHUNK_BYTES, lambda _c, span: span.write(0, payload))
    assert r.stored == 40
    before = c.stats()
    assert before["evictable_bytes"] > 0 and before["reservations"] == 0 and before["leases"] == 0

    worker = start_client("hold_and_wait", url=srv.url, ns=NS.to_dict(), seed=1, n_chunks=40, reserve_seed=2,
                          n_reserve=30, chunk_bytes=CHUNK_BYTES)
    ready, _, _ = select.select([worker.stdout], [], [], 30)
    assert ready, "client worker did not report its holdings within 30 s"
    line = worker.stdout.readline()
    assert line, worker.stderr.read()
    held = json.loads(line)
    assert held["acquired"] == 40 and held["reserved"] == 30 and held["lease"] > 0
    during = c.stats()
    assert during["leases"] == 1 and during["reservations"] == 30
    assert during["evictable_bytes"] == 0
    assert during["l1_used_bytes"] == before["l1_used_bytes"] + 30 * 2 * during["page_size"]

    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=10)

    def settled():
        s = c.stats()
        return s if all(s[f] == before[f] for f in FIELDS) else None

    after = wait_for(settled, timeout=15, interval=0.2, what="pool accounting back to its state before")
    assert {f: after[f] for f in FIELDS} == {f: before[f] for f in FIELDS}
    # The reclaimed pages are usable: the chunks the dead client reserved can now be stored by us.
    r = c.store(NS, prompt(2, 30 * NS.chunk_size), lambda _c: CHUNK_BYTES, lambda _c, span: span.write(0, payload))
    assert r.stored == 30 and r.busy == 0
    # And the chunks it had leased are still there and evictable again.
    assert c.lookup(NS, tokens).tokens == 40 * NS.chunk_size
    c.close()


def test_a_client_whose_lock_file_was_removed_recovers_with_a_new_one(kvtier_server):
    """Someone deletes a live client's lock file (a careless /dev/shm cleanup): the server forgets the client
    at its next sweep, and the client's next call says hello again with a new lock file instead of failing."""
    srv = kvtier_server(l1_gb=0.0625)
    c = KVTierClient(ClientConfig(url=srv.url, strict=True))
    payload = np.zeros(CHUNK_BYTES, dtype=np.uint8)
    tokens = prompt(2, 2 * NS.chunk_size)
    assert c.store(NS, tokens, lambda _c: CHUNK_BYTES, lambda _c, span: span.write(0, payload)).stored == 2
    old = Path(c._alive.directory, c._alive.name)
    old.unlink()
    watcher = KVTierClient(ClientConfig(url=srv.url, strict=True))
    wait_for(lambda: watcher.stats()["clients"] == 1, timeout=10, what="the sweep to forget the client")
    assert c.lookup(NS, tokens).tokens == 2 * NS.chunk_size  # no KVTierError: a new hello, a new lock
    assert c._alive.name != old.name and Path(c._alive.directory, c._alive.name).exists()
    c.close()
    watcher.close()
