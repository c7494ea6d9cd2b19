"""Issue 29, items 6 and 11: a writer stalled across a restart never overwrites another client's chunk.

Real processes: client A reserves a 2 MiB chunk and is SIGSTOPped mid-copy; the server is SIGKILLed and
restarted on the same segment with `--reservation-ttl-s 2`; 3.5 s later (past that TTL) client B stores 500
chunks; A is SIGCONTed and finishes its copy over its old extents (its commit is refused); B then retrieves
everything it stored. B must read its own bytes only: A's pages stay quarantined while A's lock file is held.

Run as `python test_warm_restart_stalled_writer.py writer|storer '<json>'` this file is a client.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a client: _support is beside it

from _support import REPO, free_port, payload_of, prompt, wait_for  # noqa: E402
from kvtier.connector.client import ClientConfig, KVTierClient  # noqa: E402
from kvtier.server.keys import Namespace  # noqa: E402

pytestmark = pytest.mark.integration

NS = Namespace(model="stalled-writer", dtype="uint8", num_layers=1, kv_heads=1, head_size=16, block_size=16,
               layout="NHD", chunk_size=64)  # 4 blocks a chunk
TTL_S = 2.0
A_SIZE = 2 << 20  # A's chunk
A_SLICES = 32  # A copies its chunk in slices, a layer at a time
A_BYTE = 0xA5  # every byte A writes
B_CHUNKS = 500
B_SIZE = 4 * 32 << 10  # 4 blocks of 32 KiB
B_BLOCK = B_SIZE // 4


def writer(url: str, control: str) -> None:
    """Client A: store one chunk, copying it slice by slice; `control`/copying appears after the first slice.
    Prints what the store reported."""
    client = KVTierClient(ClientConfig(url=url, request_timeout_s=5.0, instance="stalled-writer"))
    slice_bytes = A_SIZE // A_SLICES
    data = np.full(slice_bytes, A_BYTE, dtype=np.uint8)

    def write(_chunk, span) -> None:  # noqa: ANN001
        for i in range(A_SLICES):
            span.write(i * slice_bytes, data)
            if i == 0:
                (Path(control) / "copying").touch()  # the test stops this process now
            time.sleep(0.02)

    result = client.store(NS, prompt(7, NS.chunk_size), lambda _c: A_SIZE, write)
    client.close()
    print(json.dumps({"stored": result.stored}), flush=True)


def storer(url: str, control: str) -> None:
    """Client B: store 500 chunks (one prompt), write `control`/stored, wait for `control`/go, read them all
    back. Prints the chunks read, those not bit-exact, and the blocks that hold only A's bytes."""
    client = KVTierClient(ClientConfig(url=url, strict=True, instance="storer"))
    tokens = prompt(8, B_CHUNKS * NS.chunk_size)
    stored = client.store(NS, tokens, lambda _c: B_SIZE,
                          lambda chunk, span: span.write(0, payload_of(chunk.key, span.size)))
    (Path(control) / "stored").write_text(str(stored.stored))
    while not (Path(control) / "go").exists():
        time.sleep(0.02)
    counts = {"read": 0, "wrong": 0, "a_blocks": 0}

    def read(rc) -> None:  # noqa: ANN001
        buf = np.empty(rc.span.size, dtype=np.uint8)
        rc.span.read(0, buf)
        counts["read"] += 1
        counts["wrong"] += not np.array_equal(buf, payload_of(rc.chunk.key, rc.span.size))
        blocks = buf[: len(buf) // B_BLOCK * B_BLOCK].reshape(-1, B_BLOCK)
        counts["a_blocks"] += int((blocks == A_BYTE).all(axis=1).sum())

    counts["hit_tokens"] = client.retrieve(NS, tokens, read)
    client.close()
    print(json.dumps(counts), flush=True)


def quarantined_bytes(http_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("kvtier_l1_quarantined_bytes ")))


def client_proc(role: str, url: str, control: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, role, json.dumps({"url": url, "control": str(control)})],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True)


def test_a_writer_stopped_across_a_restart_never_overwrites_what_another_client_stored(kvtier_server, tmp_path):
    http_port = free_port()
    srv = kvtier_server(l1_gb=0.125, extra=["--reservation-ttl-s", str(TTL_S), "--http-port", str(http_port)])
    control = tmp_path / "control"
    control.mkdir()
    a = client_proc("writer", srv.url, control)
    b: subprocess.Popen | None = None
    try:
        wait_for(lambda: (control / "copying").exists(), 30, interval=0.005, what="A copying")
        a.send_signal(signal.SIGSTOP)
        srv.signal(signal.SIGKILL)
        srv.proc.wait(timeout=10)
        srv.start()
        assert "L1 adopted from" in srv.log_text()
        time.sleep(TTL_S + 1.5)  # the quarantine's timer is over; A is still stopped with its lock held
        b = client_proc("storer", srv.url, control)
        wait_for(lambda: (control / "stored").exists(), 60, what="B stored")
        assert (control / "stored").read_text() == str(B_CHUNKS)
        held = quarantined_bytes(http_port)  # A's pages, still out of the free list
        a.send_signal(signal.SIGCONT)
        a_out, a_err = a.communicate(timeout=30)
        assert json.loads(a_out.strip().splitlines()[-1]) == {"stored": 0}, a_err  # its commit is refused
        (control / "go").touch()
        b_out, b_err = b.communicate(timeout=60)
        got = json.loads(b_out.strip().splitlines()[-1])
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.communicate()
    assert got["a_blocks"] == 0 and got["wrong"] == 0, (got, b_err)  # B never reads A's bytes
    assert got["read"] == B_CHUNKS and got["hit_tokens"] == B_CHUNKS * NS.chunk_size, got
    assert held >= A_SIZE, held
    # A settled its old reservation (the refused commit names it) and exited: nothing stays quarantined
    wait_for(lambda: quarantined_bytes(http_port) == 0, 5, what="the quarantine emptied")


if __name__ == "__main__":
    {"writer": writer, "storer": storer}[sys.argv[1]](**json.loads(sys.argv[2]))
