"""Issue 29, done-when 3: a kill loop serves only bytes a client stored.

Real processes. A server on an 8 MiB L1 of 4 KiB pages (about half of test_warm_restart's 2,000 chunks fit:
stores evict, freed pages are reused) is SIGKILLed every 2-3 s and restarted on the same segment, CYCLES times.
Two storm clients store and read chunks whose bytes derive from their key (`payload_of`), each on its own half
of the keys, so that it knows which of its chunks were stored before the current server started: a hit on one
of those is a chunk that came through a restart. Client A reserves a 256 KiB chunk, copies its first slice and
is SIGSTOPped there (between reserve and commit) before the first kill; it stays stopped through three
restarts and is resumed past the quarantine timer of the last one; it then writes its byte (0xA5) over its
whole reservation for a second, and its commit is refused. Every read a storm client got under a lease that
held (`retrieve` > 0) must be its key's bytes; then, with every client gone, whatever the server serves is
bit-exact, no page is in two chunks, the accounting is a recount and nothing stays quarantined.

Run as `python test_warm_restart_kill_loop.py storm|stalled '<json>'` this file is a client.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a client: _support is beside it

from _support import REPO, free_port, holds_its_bytes, payload_of, prompt, wait_for  # noqa: E402
from kvtier.connector.client import ClientConfig, KVTierClient  # noqa: E402
from kvtier.server.tiers.fs_io import file_name  # noqa: E402
from test_warm_restart import (  # noqa: E402
    CHUNKS,
    L1_GB,
    NS,
    adopted_chunks,
    check_served_and_accounting,
    kill,
    metric,
    served,
    size_of,
    tokens_of,
)

pytestmark = pytest.mark.integration

CYCLES = 5
TTL_S = 2.0  # --reservation-ttl-s: the quarantine timer of an adopted L1
RESUME_AFTER = 3  # A is resumed in the server started by the third kill
A_SIZE = 256 << 10
A_BYTE = 0xA5
SERVER_ARGS = ["--page-size-kb", "4", "--reservation-ttl-s", str(TTL_S), "--eviction-policy", "lru"]


def _client(url: str, instance: str) -> KVTierClient:
    return KVTierClient(ClientConfig(url=url, connect_timeout_s=1.0, request_timeout_s=2.0, retry_backoff_s=0.1,
                                     instance=instance))


def storm(url: str, seed: int, control: str) -> None:
    """Store and read chunks of keys `seed` mod 2 at random until `control`/stop exists; `control`/gen holds the
    number of the server generation (written after a kill, before the restart). Prints counts as JSON: `bad`,
    reads under a lease that held whose bytes were not the key's; `restarted_hits`, reads of chunks this client
    stored under an earlier generation."""
    client = _client(url, f"storm-{seed}")
    rng = random.Random(seed)
    control_dir = Path(control)
    stored_in: dict[int, int] = {}  # index -> generation of the server that committed it
    counts = {"stored": 0, "reads": 0, "hits": 0, "restarted_hits": 0, "bad": 0}
    while not (control_dir / "stop").exists():
        gen = int((control_dir / "gen").read_text())
        i = rng.randrange(seed % 2, CHUNKS, 2)
        if rng.random() < 0.5:
            result = client.store(NS, tokens_of(i), lambda _c, i=i: size_of(i),
                                  lambda chunk, span: span.write(0, payload_of(chunk.key, span.size)))
            if result.stored:
                stored_in[i] = gen
                counts["stored"] += 1
            continue
        wrong: list[bool] = []  # per chunk read: not its key's bytes
        counts["reads"] += 1
        # retrieve > 0: the lease held to the release (else what was read may be anything, and is dropped)
        if client.retrieve(NS, tokens_of(i), lambda rc, wrong=wrong: wrong.append(not holds_its_bytes(rc))):
            counts["hits"] += 1
            counts["bad"] += any(wrong)
            counts["restarted_hits"] += stored_in.get(i, gen) < gen
        else:
            stored_in.pop(i, None)  # evicted (or the lease lapsed in a restart): not counted again
    client.close()
    print(json.dumps(counts), flush=True)


def stalled(url: str, control: str) -> None:
    """Client A: store one chunk; after its first slice, touch `control`/copying (the test stops A there), then
    write A_BYTE over the whole reservation every 20 ms until `control`/finish exists. Prints the store's result."""
    client = _client(url, "stalled")
    data = np.full(A_SIZE, A_BYTE, dtype=np.uint8)

    def write(_chunk, span) -> None:  # noqa: ANN001
        span.write(0, data[: A_SIZE // 32])
        (Path(control) / "copying").touch()
        while not (Path(control) / "finish").exists():
            span.write(0, data)
            time.sleep(0.02)

    result = client.store(NS, prompt(7, NS.chunk_size), lambda _c: A_SIZE, write)
    client.close()
    print(json.dumps({"stored": result.stored, "refused": result.refused}), flush=True)


def client_proc(role: str, **kwargs: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, role, json.dumps(kwargs)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True)


def result_of(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_a_kill_loop_with_a_writer_stopped_mid_copy_serves_only_stored_bytes(kvtier_server, tmp_path):
    http_port = free_port()
    srv = kvtier_server(l1_gb=L1_GB, extra=[*SERVER_ARGS, "--http-port", str(http_port),
                                            "--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "0.05",  # all chunks fit
                                            "--l2-queue-depth", "8192"])  # no write-behind is dropped
    control = tmp_path / "control"
    control.mkdir()
    (control / "gen").write_text("0")
    a = client_proc("stalled", url=srv.url, control=str(control))
    storms = [client_proc("storm", url=srv.url, seed=seed, control=str(control)) for seed in range(2)]
    rng = random.Random(29)
    adopted: list[int] = []
    held = 0.0
    try:
        wait_for(lambda: (control / "copying").exists(), 30, interval=0.005, what="A copying")
        a.send_signal(signal.SIGSTOP)  # reserved, not committed
        for gen in range(1, CYCLES + 1):
            time.sleep(rng.uniform(2.0, 3.0))
            kill(srv)
            (control / "gen").write_text(str(gen))
            srv.start()
            started = time.monotonic()
            adopted.append(adopted_chunks(srv.log_text()))
            if gen == RESUME_AFTER:
                time.sleep(max(0.0, started + TTL_S + 0.5 - time.monotonic()))  # the timer is over
                held = metric(http_port, "kvtier_l1_quarantined_bytes")  # A's pages: its lock is held
                a.send_signal(signal.SIGCONT)  # A writes over its old reservation for a second
                time.sleep(1.0)
                (control / "finish").touch()
        (control / "stop").touch()
        a_result = result_of(a)
        results = [result_of(s) for s in storms]
    finally:
        for proc in (a, *storms):
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.communicate()
    assert all(r["bad"] == 0 for r in results), results  # every read under a lease that held was bit-exact
    assert a_result["stored"] == 0, a_result  # A's commit names a reservation of a dead server: refused
    assert held >= A_SIZE, held  # A's pages were still out of use three restarts later
    assert min(adopted) > 0, adopted  # every restart adopted L1
    hits, restarted = sum(r["hits"] for r in results), sum(r["restarted_hits"] for r in results)
    assert sum(r["stored"] for r in results) > 300 and hits > 100 and restarted > 20, results  # not vacuous
    log = srv.log_path.read_text()
    assert "adoption dropped" not in log and "Traceback" not in log
    # every client gone: bit-exact, no page twice, exact accounting, and nothing quarantined
    assert check_served_and_accounting(srv.url, http_port, started) > 0
    # what the killed servers had not written behind went to L2 after their restarts: L2 has every chunk L1 has
    stats = KVTierClient(ClientConfig(url=srv.url, strict=True))
    wait_for(lambda: stats.stats()["l2_inflight"] == 0, 30, what="L2 writes done")
    stats.close()
    in_l1 = served(srv.url)
    assert in_l1 and all((tmp_path / "l2" / file_name(key)).exists() for key in in_l1)
    requeued = [int(n) for n in re.findall(r"l2 write-behind after adoption: (\d+) of", log)]
    assert len(requeued) == CYCLES, requeued  # (a few a kill: the disk keeps up with these small chunks)
    wait_for(lambda: metric(http_port, "kvtier_l1_quarantined_bytes") == 0, 5, what="quarantine over")


if __name__ == "__main__":
    {"storm": storm, "stalled": stalled}[sys.argv[1]](**json.loads(sys.argv[2]))
