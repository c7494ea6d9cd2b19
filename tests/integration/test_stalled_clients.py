"""Stalled clients never get, or give, another chunk's bytes (issue 11, the ownership rule).

A writer or reader stalls inside its copy, past its TTL or silent past the client timeout (SIGSTOPped
and resumed), while another client keeps storing into L1 so that free and evicted pages are reused. Every
byte any client is told it stored or read is verified.
"""

from __future__ import annotations

import json
import select
import signal

import numpy as np
import pytest
from _support import prompt, wait_for
from client_worker import chunk_bytes_of
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.connector.results import ReadChunk
from kvtier.server.keys import Namespace

pytestmark = pytest.mark.integration

NS = Namespace(model="org/stall", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64, block_size=16,
               layout="NHD", chunk_size=256)
CHUNK = 64 * 1024  # one page
L1_GB = 0.0625  # 1,024 pages
STALLED_CHUNKS = 32

VARIANTS = {
    # the copy outlives the TTL; the client keeps talking meanwhile (or not: its timeout is a minute)
    "ttl": (["--reservation-ttl-s", "1", "--lease-ttl-s", "1", "--client-timeout-s", "60"], 4.0, False),
    # the whole process is stopped past the client timeout, then resumed (TTLs a minute)
    "sigstop": (["--reservation-ttl-s", "60", "--lease-ttl-s", "60", "--client-timeout-s", "2"], 0.2, True),
}


def _client(url: str) -> KVTierClient:
    c = KVTierClient(ClientConfig(url=url, strict=True, request_timeout_s=10.0))
    assert c.connect()
    return c


def _store(c: KVTierClient, seed: int, n_chunks: int) -> int:
    tokens = prompt(seed, n_chunks * NS.chunk_size)
    r = c.store(NS, tokens, lambda _c: CHUNK, lambda ch, span: span.write(0, chunk_bytes_of(seed, ch.index, CHUNK)))
    return r.stored


def _verify(c: KVTierClient, seed: int, n_chunks: int) -> tuple[int, list[int]]:
    """(tokens the client reports read, chunk indices whose bytes were not the ones stored)."""
    wrong: list[int] = []

    def read(rc: ReadChunk) -> None:
        buf = np.empty(rc.span.size, dtype=np.uint8)
        rc.span.read(0, buf)
        if not np.array_equal(buf, chunk_bytes_of(seed, rc.chunk.index, rc.span.size)):
            wrong.append(rc.chunk.index)

    return c.retrieve(NS, prompt(seed, n_chunks * NS.chunk_size), read), wrong


def _await_line(worker, key: str) -> None:
    ready, _, _ = select.select([worker.stdout], [], [], 30)
    assert ready, f"worker did not report {key!r}: {worker.stderr.read() if worker.poll() is not None else ''}"
    assert key in json.loads(worker.stdout.readline())


def _stall(worker, stop: bool) -> None:
    """The sigstop variant stops the whole process until _finish (longer than the client timeout)."""
    if stop:
        worker.send_signal(signal.SIGSTOP)


def _lapsed(c: KVTierClient) -> dict:
    """Wait until the server has lapsed the stalled holdings: their pages show as held back."""
    return wait_for(lambda: (s := c.stats()) and s.get("held_back_bytes", 0) > 0 and s,
                    timeout=15, what="stalled holdings lapsed and held back")


def _finish(worker, stop: bool) -> dict:
    if stop:
        worker.send_signal(signal.SIGCONT)
    out, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_slow_writer_never_lands_in_another_clients_chunk(kvtier_server, start_client, variant):
    flags, delay_s, stop = VARIANTS[variant]
    srv = kvtier_server(l1_gb=L1_GB, extra=flags)
    b = _client(srv.url)
    assert _store(b, 100, 400) == 400
    writer = start_client("slow_store", url=srv.url, ns=NS.to_dict(), seed=1, n_chunks=STALLED_CHUNKS,
                          chunk_bytes=CHUNK, delay_s=delay_s)
    _await_line(writer, "reserved")
    _stall(writer, stop)
    held = _lapsed(b)
    assert held["held_back_bytes"] == STALLED_CHUNKS * CHUNK
    # B stores now: before the fix it was handed the stalled writer's pages (the free list is LIFO)
    for seed in range(200, 210):
        assert _store(b, seed, 20) == 20
    result = _finish(writer, stop)
    assert result["stored"] == 0 and result["refused"].get("not_committed") == STALLED_CHUNKS
    for seed, n in [(100, 400), *((s, 20) for s in range(200, 210))]:
        tokens, wrong = _verify(b, seed, n)
        assert not wrong, f"prompt {seed}: chunks {wrong} hold bytes that are not the ones stored"
        assert tokens == n * NS.chunk_size
    after = b.stats()
    assert after["held_back_bytes"] == 0 and after["reservations"] == 0
    b.close()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_slow_reader_reports_a_lapsed_lease_as_a_load_error(kvtier_server, start_client, variant):
    flags, delay_s, stop = VARIANTS[variant]
    delay_s += 2.0  # room for the evicting stores below
    srv = kvtier_server(l1_gb=L1_GB, extra=flags)
    b = _client(srv.url)
    assert _store(b, 1, STALLED_CHUNKS) == STALLED_CHUNKS
    reader = start_client("slow_read", url=srv.url, ns=NS.to_dict(), seed=1, n_chunks=STALLED_CHUNKS,
                          delay_s=delay_s)
    _await_line(reader, "leased")
    _stall(reader, stop)
    held = _lapsed(b)
    assert held["held_back_bytes"] == STALLED_CHUNKS * CHUNK
    # More than L1 holds: before the fix ordinary eviction reused the lapsed reader's pages
    stored = sum(_store(b, seed, 100) for seed in range(300, 312))
    assert stored >= 1000
    result = _finish(reader, stop)
    assert not result["wrong_chunks"] or result["retrieved_tokens"] == 0, "wrong bytes reported as a hit"
    assert result["retrieved_tokens"] == 0, "a read whose lease lapsed must be reported as a load error"
    tokens, wrong = _verify(b, 1, STALLED_CHUNKS)  # the chunks the stalled reader held are intact
    assert not wrong and tokens == STALLED_CHUNKS * NS.chunk_size
    assert b.stats()["held_back_bytes"] == 0
    b.close()
