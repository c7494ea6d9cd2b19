"""A client that copies into and out of L1 (a CPU engine's worker: `Session.populate_l1`, connector/populate.py)
maps all of the server's L1 into its page tables ahead, after every hello, where the server backs all of L1
(`--l1-prefault`, the default): its copies then take no page fault. Never where the server leaves L1 sparse
(`--no-l1-prefault`): mapping it all would commit memory the server leaves unused."""

from __future__ import annotations

import os
import resource
import signal
import time

import pytest
from _support import payload_of, prompt, wait_for
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server.keys import Namespace, chunk_keys

pytestmark = pytest.mark.integration

NS = Namespace(model="org/tiny-populate", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64,
               block_size=16, layout="NHD", chunk_size=256)
SIZE = 1 << 20  # a chunk's bytes: 256 pages
PAGES = SIZE // os.sysconf("SC_PAGE_SIZE")


def client(url: str) -> KVTierClient:
    c = KVTierClient(ClientConfig(url=url, connect_timeout_s=5.0, request_timeout_s=20.0, strict=True))
    assert c.connect()
    return c


def faults_of_a_store(c: KVTierClient, seed: int) -> int:
    """Minor page faults this thread takes storing a new one-chunk prompt (the copy into L1 is this thread's)."""
    tokens = prompt(seed, 256)
    (chunk,) = chunk_keys(NS, tokens)
    payload = payload_of(chunk.key, SIZE)  # made (its own pages faulted in) before the count starts
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    result = c.store(NS, tokens, lambda _c: SIZE, lambda _ch, span: span.write(0, payload))
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    assert result.stored == 1
    return faults


def test_a_copying_client_maps_l1_ahead_and_again_after_a_server_restart(kvtier_server):
    srv = kvtier_server(l1_gb=0.125)
    c = client(srv.url)
    try:
        assert not c.l1_populated  # only a client that copies asks for it
        cold = faults_of_a_store(c, 1)
        c.populate_l1()
        wait_for(lambda: c.l1_populated, 30, what="L1 mapped into the client")
        warm = faults_of_a_store(c, 2)
        assert cold >= PAGES // 2, cold  # the copy into pages not mapped yet faulted them in
        assert warm < PAGES // 8, (cold, warm)

        srv.signal(signal.SIGTERM)  # a new server, a new segment: mapped again after the next hello
        assert srv.proc.wait(timeout=30) == 0
        srv.start()
        c.lookup(NS, prompt(3, 256))  # says hello again
        wait_for(lambda: c.l1_populated, 30, what="the new L1 mapped into the client")
        assert faults_of_a_store(c, 4) < PAGES // 8
    finally:
        c.close()
    assert not c.l1_populated  # stopped with the connection, before its mapping went


def test_a_sparse_l1_is_not_mapped_ahead(kvtier_server):
    srv = kvtier_server(l1_gb=0.125, extra=["--no-l1-prefault"])
    c = client(srv.url)
    try:
        c.populate_l1()
        time.sleep(1.0)  # a pass over 128 MiB takes well under this where one runs
        assert not c.l1_populated
        assert os.stat(srv.shm_path).st_blocks * 512 < 8 << 20  # L1 stayed sparse: nothing committed it
        assert faults_of_a_store(c, 5) >= PAGES // 2
    finally:
        c.close()
