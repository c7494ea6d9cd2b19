"""Warm restart (issue 16), real server processes: the L1 a killed or stopped server leaves is adopted by the
next one, bit-exact, with exact accounting, and nothing an old client still writes reaches what it serves.

The storm: 2,000 chunks of known bytes (`payload_of(key, size)`), an 8 MiB L1 of 4 KiB pages that holds about
half of them (stores evict), two client processes storing and reading at random and a third whose every
store copies for 1.5 s, writing garbage into its pages until the last moment: killed mid-copy, it goes on
writing into a reservation of the dead server. The server is SIGKILLed at random moments 22 times and
restarted each time. Every read a client got under a lease that held must be bit-exact; every few restarts the
storm pauses and a raw-protocol checker reads every chunk the server serves (bit-exact, no page in two chunks)
and recounts what the server reports (entries, used pages, the namespace's bytes).

Run as `python test_warm_restart.py storm '<json>'` this file is a storm client.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a storm client: _support is beside it

from _support import REPO, free_port, payload_of, prompt, wait_for  # noqa: E402
from kvtier.connector.client import ClientConfig, KVTierClient  # noqa: E402
from kvtier.server import protocol as p  # noqa: E402
from kvtier.server.keys import Namespace, chunk_keys  # noqa: E402
from kvtier.server.l1.journal_records import VERSION  # noqa: E402
from kvtier.shm.client_lock import ClientLock  # noqa: E402
from kvtier.shm.journal import _HEADER, HEADER_BYTES, write_header  # noqa: E402
from kvtier.shm.pages import extent_views  # noqa: E402
from kvtier.shm.segment import Segment  # noqa: E402

pytestmark = pytest.mark.integration

NS = Namespace(model="warm-restart", dtype="uint8", num_layers=1, kv_heads=1, head_size=16, block_size=16,
               layout="NHD", chunk_size=64)  # 4 blocks a chunk
CHUNKS = 2000
PAGE = 4096
L1_GB = 8 / 1024  # 8 MiB: about half the chunks
TTL_S = 4.0  # --reservation-ttl-s: the quarantine of an adopted L1
SLOW_S = 1.5  # the slow client's copy: longer than a restart, shorter than the TTL
KILLS = 22
SERVER_ARGS = ["--page-size-kb", "4", "--reservation-ttl-s", str(TTL_S), "--eviction-policy", "lru"]


def tokens_of(i: int) -> np.ndarray:
    return prompt(100_000 + i, NS.chunk_size)


def size_of(i: int) -> int:
    return PAGE * (1 + i % 3) - 97 * (i % 11)  # 1 to 3 pages, most of them partly filled


KEYS = [chunk_keys(NS, tokens_of(i))[0].key for i in range(CHUNKS)]
SIZES = dict(zip(KEYS, map(size_of, range(CHUNKS)), strict=True))


# -- the storm client (a process of its own) -------------------------------------------------------


def storm(url: str, seed: int, control: str, slow: bool) -> None:
    """Store and read at random until `control`/stop exists; pause while `control`/pause exists (writing
    the pause's number to `control`/ack-<seed>). Prints counts as JSON: `bad` reads are bit-exactness
    failures under a lease the server confirmed."""
    client = KVTierClient(ClientConfig(url=url, connect_timeout_s=1.0, request_timeout_s=2.0, retry_backoff_s=0.1,
                                       instance=f"storm-{seed}"))
    rng = random.Random(seed)
    garbage = np.random.default_rng(seed)
    control_dir = Path(control)
    counts = {"stored": 0, "read": 0, "bad": 0, "not_committed": 0}

    def write(chunk, span) -> None:  # noqa: ANN001
        end = time.monotonic() + (SLOW_S if slow else 0.0)
        while time.monotonic() < end:  # a client still copying: whatever it writes is not the chunk yet
            span.write(0, garbage.integers(0, 256, span.size, dtype=np.uint8))
            time.sleep(0.03)
        span.write(0, payload_of(chunk.key, span.size))

    while not (control_dir / "stop").exists():
        pause = control_dir / "pause"
        if pause.exists():
            (control_dir / f"ack-{seed}").write_text(pause.read_text())
            time.sleep(0.02)
            continue
        i = rng.randrange(CHUNKS)
        if slow or rng.random() < 0.5:
            result = client.store(NS, tokens_of(i), lambda _c, i=i: size_of(i), write)
            counts["stored"] += result.stored
            counts["not_committed"] += bool(result.refused)  # the server was killed (mid-copy, for the slow one)
        else:
            wrong: list[bytes] = []

            def read(rc, wrong: list[bytes] = wrong) -> None:  # noqa: ANN001
                buf = np.empty(rc.span.size, dtype=np.uint8)
                rc.span.read(0, buf)
                if not np.array_equal(buf, payload_of(rc.chunk.key, rc.span.size)):
                    wrong.append(rc.chunk.key)

            if client.retrieve(NS, tokens_of(i), read):  # > 0: the lease held to the release
                counts["read"] += 1
                counts["bad"] += bool(wrong)
    client.close()
    print(json.dumps(counts), flush=True)


# -- the checker: a raw-protocol client that sees extents ----------------------------------------


class Checker:
    def __init__(self, url: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(url)
        self.n = 0
        hello = {"version": p.PROTOCOL_VERSION, "instance": "checker", "pid": os.getpid()}
        info = self.call("hello", **hello)
        self.lock = ClientLock(info["shm_dir"], info["shm_name"])  # may hold pages: must prove it is alive
        self.info = self.call("hello", **hello, lock=self.lock.name)
        self.segment = Segment.attach(info["shm_name"], info["shm_size"], info["shm_dir"])
        self.fp = self.call("register", namespace=NS.to_dict())["ns"]

    def call(self, op: str, **fields: object) -> dict:
        self.n += 1
        self.sock.send(p.pack({"op": op, "id": self.n, **fields}))
        assert self.sock.poll(10_000), f"no reply to {op}"
        reply = p.unpack_reply(self.sock.recv())
        assert reply["id"] == self.n and reply["ok"], reply
        return reply

    def served(self) -> dict[bytes, tuple[int, tuple[int, ...]]]:
        """key -> (size, extents) of every one of the 2,000 chunks the server serves, each read under a
        lease that held and compared with what was stored."""
        out = {}
        segment = self.segment.array()
        for start in range(0, CHUNKS, 250):
            keys = KEYS[start : start + 250]
            reply = self.call("acquire", ns=self.fp, keys=keys)
            for key, leased in zip(keys, reply["items"], strict=True):
                if leased is not None:
                    _, _, size, extents = leased
                    data = b"".join(map(bytes, extent_views(segment, extents, PAGE, size)))
                    assert size == SIZES[key] and data == payload_of(key, size).tobytes(), \
                        f"chunk {key.hex()} is served with bytes that are not its own"
                    out[key] = (size, tuple(extents))
            if reply["lease"]:
                assert self.call("release", leases=[reply["lease"]])["released"] == 1
        return out

    def close(self) -> None:
        self.call("bye")
        self.segment.close()
        self.lock.close()
        self.sock.close()


def pages_of(extents: tuple[int, ...]) -> list[int]:
    return [page for i in range(0, len(extents), 2) for page in range(extents[i], extents[i] + extents[i + 1])]


def admin(http_port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}{path}", timeout=10) as reply:
        return reply.read().decode()


def metric(http_port: int, name: str) -> float:
    line = next(x for x in admin(http_port, "/metrics").splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def check_served_and_accounting(url: str, http_port: int, started: float) -> int:
    """With no client active: once the quarantine's timer is over (`started`: the server's start, monotonic),
    what the server serves is bit-exact, no page is in two chunks, and entries, used pages and the namespace's
    bytes are the recount of it. Pages of reservations that live clients of an earlier server have not settled
    (a commit lost to a kill) stay quarantined (issue 29): counted, and at most a few per kill."""
    time.sleep(max(0.0, started + TTL_S + 1.0 - time.monotonic()))
    quarantined = metric(http_port, "kvtier_l1_quarantined_bytes")
    checker = Checker(url)
    try:
        served = checker.served()
        status = json.loads(admin(http_port, "/status"))
    finally:
        checker.close()
    assert quarantined <= KILLS * 3 * 3 * PAGE, quarantined  # three clients, one open store each, of 3 pages
    owners: dict[int, bytes] = {}
    for key, (_, extents) in served.items():
        for page in pages_of(extents):
            assert page not in owners, f"page {page} is in chunks {owners[page].hex()} and {key.hex()}"
            owners[page] = key
    l1 = status["l1"]
    assert l1["entries"] == len(served)
    assert l1["used_bytes"] == len(owners) * PAGE + l1["reserved_bytes"] + quarantined
    [ns] = [n for n in status["namespaces"] if n["fingerprint"] == NS.fingerprint().hex()] or [
        {"entries": 0, "bytes": 0}]
    assert (ns["entries"], ns["bytes"]) == (len(served), sum(size for size, _ in served.values()))
    return len(served)


def adopted_chunks(log: str) -> int:
    """The chunk count of the last start's adoption line (-1 when it started empty)."""
    line = [x for x in log.splitlines() if "L1 adopted from" in x or "L1 starts empty" in x][-1]
    return int(line.split(": ", 2)[-1].split()[0]) if "adopted" in line else -1


def kill(srv) -> None:  # noqa: ANN001
    srv.signal(signal.SIGKILL)
    srv.proc.wait(timeout=10)


# -- check 1: the kill storm --------------------------------------------------------------------


def test_l1_survives_a_storm_of_kills_bit_exact_and_exactly_accounted(kvtier_server, tmp_path):
    http_port = free_port()
    srv = kvtier_server(l1_gb=L1_GB, extra=[*SERVER_ARGS, "--http-port", str(http_port)])
    control = tmp_path / "control"
    control.mkdir()
    clients = [subprocess.Popen([sys.executable, __file__, "storm", json.dumps(
        {"url": srv.url, "seed": seed, "control": str(control), "slow": seed == 2})],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True)
        for seed in range(3)]
    rng = random.Random(16)
    adopted: list[int] = []
    checked: list[int] = []
    try:
        for kill_no in range(KILLS):
            time.sleep(rng.uniform(0.2, 0.9))
            kill(srv)
            srv.start()
            started = time.monotonic()
            adopted.append(adopted_chunks(srv.log_text()))
            if kill_no % 5 == 4 or kill_no == KILLS - 1:
                (control / "pause").write_text(str(kill_no))
                wait_for(lambda n=kill_no: all((control / f"ack-{s}").exists() and
                                               (control / f"ack-{s}").read_text() == str(n) for s in range(3)),
                         20, interval=0.05, what="the storm paused")
                checked.append(check_served_and_accounting(srv.url, http_port, started))
                if kill_no < KILLS - 1:  # the last check stays the final state: the storm stops paused
                    (control / "pause").unlink()
        (control / "stop").touch()
        results = [json.loads(c.communicate(timeout=30)[0].strip().splitlines()[-1]) for c in clients]
    finally:
        for c in clients:
            if c.poll() is None:
                os.killpg(c.pid, signal.SIGKILL)
                c.communicate()
    assert all(r["bad"] == 0 for r in results), results  # every confirmed read was bit-exact
    # the clients exited (their lock files gone): nothing of theirs stays quarantined
    wait_for(lambda: metric(http_port, "kvtier_l1_quarantined_bytes") == 0, 5, what="quarantine over")
    log = srv.log_path.read_text()
    assert "adoption dropped" not in log and "Traceback" not in log  # a journal that never contradicted itself
    assert min(adopted[1:]) > 0 and min(checked) > 200, (adopted, checked)  # the L1 came back every time
    assert results[2]["not_committed"] >= KILLS // 2, results  # the slow client was killed mid-copy
    assert sum(r["stored"] for r in results) > 1000 and sum(r["read"] for r in results) > 300, results
    srv.signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=15) == 0
    srv.start()
    assert adopted_chunks(srv.log_text()) == checked[-1]  # nothing changed since the last check
    assert check_served_and_accounting(srv.url, http_port, time.monotonic()) == checked[-1]


# -- clean stops, discarding, upgrades ------------------------------------------------------------


def store_all(url: str, indices: range) -> int:
    client = KVTierClient(ClientConfig(url=url, strict=True))
    stored = sum(client.store(NS, tokens_of(i), lambda _c, i=i: size_of(i),
                              lambda chunk, span: span.write(0, payload_of(chunk.key, span.size))).stored
                 for i in indices)
    client.close()
    return stored


def served(url: str) -> dict:
    checker = Checker(url)
    try:
        return checker.served()
    finally:
        checker.close()


def journal_path(srv) -> Path:  # noqa: ANN001
    return srv.shm_path.with_name(srv.shm_name + ".journal")


def test_sigterm_keeps_l1_for_the_next_start_and_discard_or_no_adopt_start_empty(kvtier_server):
    srv = kvtier_server(l1_gb=L1_GB, extra=SERVER_ARGS)
    assert store_all(srv.url, range(50)) == 50
    srv.signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=15) == 0
    assert "L1 kept for the next start: 50 chunks" in srv.log_text()
    assert srv.shm_path.exists() and journal_path(srv).exists()
    srv.start()
    assert adopted_chunks(srv.log_text()) == 50 and "0 pages quarantined" in srv.log_text()
    assert len(served(srv.url)) == 50

    srv.args.append("--l1-discard")  # on purpose: starts empty, the old segment's memory goes
    old_inode = srv.shm_path.stat().st_ino
    srv.signal(signal.SIGTERM)
    srv.proc.wait(timeout=15)
    srv.start()
    assert "L1 starts empty: --l1-discard" in srv.log_text() and srv.shm_path.stat().st_ino != old_inode
    assert served(srv.url) == {}
    srv.signal(signal.SIGTERM)  # an empty L1 is not kept
    srv.proc.wait(timeout=15)
    assert "segment removed" in srv.log_text() and not srv.shm_path.exists() and not journal_path(srv).exists()

    srv.args[-1] = "--no-l1-adopt"  # today's behaviour: no journal, the segment removed at stop
    srv.start()
    assert not journal_path(srv).exists() and store_all(srv.url, range(5)) == 5
    srv.signal(signal.SIGTERM)
    srv.proc.wait(timeout=15)
    assert not srv.shm_path.exists() and "segment removed" in srv.log_text()


@pytest.mark.parametrize("change", ["version", "damage"])
def test_a_journal_it_cannot_read_starts_empty_and_serves_nothing_of_it(kvtier_server, change):
    srv = kvtier_server(l1_gb=L1_GB, extra=SERVER_ARGS)
    assert store_all(srv.url, range(40)) == 40
    kill(srv)
    old_inode = srv.shm_path.stat().st_ino
    half = (journal_path(srv).stat().st_size - HEADER_BYTES) // 2
    journal = Segment.adopt(journal_path(srv).name, journal_path(srv).stat().st_size)
    if change == "version":  # what an upgrade to a kvtier of the next journal format would find
        geometry = _HEADER.unpack_from(journal.buf, 0)[5:]
        write_header(journal.buf, VERSION + 1, half, geometry)
    else:
        journal.buf[HEADER_BYTES + 100] ^= 0x20  # a byte of a committed record
    journal.close(keep=True)
    srv.start()
    log = srv.log_text()
    said = f"journal format 1.{VERSION + 1}; this kvtier reads 1.{VERSION}" if change == "version" else "checksum"
    assert "L1 starts empty" in log and said in log, log
    assert srv.shm_path.stat().st_ino != old_inode  # the old bytes are not even mapped
    assert served(srv.url) == {}
    assert store_all(srv.url, range(40)) == 40 and len(served(srv.url)) == 40  # bit-exact (checked inside)


# -- an old server's reservation ------------------------------------------------------------------


def test_an_old_servers_reservation_is_refused_at_commit_and_its_writer_corrupts_nothing(kvtier_server):
    http_port = free_port()
    srv = kvtier_server(l1_gb=1 / 1024, extra=[*SERVER_ARGS, "--http-port", str(http_port)])  # 256 pages
    assert store_all(srv.url, range(100)) > 50  # L1 full: the next stores evict
    old = Checker(srv.url)
    items = [p.StoreItem(KEYS[i], SIZES[KEYS[i]], 4, chunk_keys(NS, tokens_of(i))[0].aliases).to_wire()
             for i in range(1000, 1004)]
    results = old.call("reserve", ns=old.fp, items=items)["results"]
    assert all(r[0] == p.RESERVED for r in results)
    rids = [r[1] for r in results]
    pages = {page for r in results for page in pages_of(tuple(r[2]))}
    kill(srv)
    srv.start()
    assert f"{len(pages)} pages quarantined" in srv.log_text()
    assert metric(http_port, "kvtier_l1_quarantined_bytes") == len(pages) * PAGE
    segment = old.segment.array()  # the old client's mapping: the same memory the new server serves
    garbage = np.random.default_rng(0)

    def scribble() -> None:  # the old client, still copying into its reservation
        for r in results:
            for view in extent_views(segment, r[2], PAGE, SIZES[KEYS[results.index(r) + 1000]]):
                view[:] = garbage.integers(0, 256, len(view), dtype=np.uint8)

    scribble()
    assert store_all(srv.url, range(200, 400)) > 100  # fills L1 again, evicting: the free pages are reused
    scribble()
    now_served = served(srv.url)  # bit-exact despite the scribbling (checked inside)
    assert not pages & {page for _, ext in now_served.values() for page in pages_of(ext)}
    # the old client learns the server restarted, says hello again and commits: refused
    old.call("hello", version=p.PROTOCOL_VERSION, instance="old", pid=os.getpid(), lock=old.lock.name)
    old.fp = old.call("register", namespace=NS.to_dict())["ns"]
    assert old.call("commit", res=rids)["committed"] == 0
    assert all(item is None for item in old.call("acquire", ns=old.fp, keys=KEYS[1000:1004])["items"])
    old.close()
    wait_for(lambda: metric(http_port, "kvtier_l1_quarantined_bytes") == 0, TTL_S + 5, what="quarantine over")
    status = json.loads(admin(http_port, "/status"))["l1"]
    assert status["used_bytes"] == PAGE * sum(len(pages_of(ext)) for _, ext in served(srv.url).values())


# -- with L2 ----------------------------------------------------------------------------------------


def test_with_l2_adopted_chunks_are_served_from_l1_and_only_the_rest_promoted(kvtier_server, tmp_path):
    srv = kvtier_server(l1_gb=1 / 1024, extra=[*SERVER_ARGS, "--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "0.1"])
    assert store_all(srv.url, range(300)) == 300  # about 150 fit L1; all 300 go to L2
    client = KVTierClient(ClientConfig(url=srv.url, strict=True))
    wait_for(lambda: client.stats()["l2_written"] == 300, 30, what="L2 written")
    in_l1 = set(served(srv.url))
    client.close()
    kill(srv)
    srv.start()
    assert adopted_chunks(srv.log_text()) == len(in_l1)
    client = KVTierClient(ClientConfig(url=srv.url, strict=True))
    stats = client.stats()
    assert stats["l2_entries"] == 300 and stats["entries"] == len(in_l1)  # the disk index rebuilt as before
    adopted = [i for i in range(300) if KEYS[i] in in_l1]
    assert all(client.lookup(NS, tokens_of(i)).tiers == ["l1"] for i in adopted)  # (first: promotions evict)
    assert client.stats()["l2_promoted"] == 0  # no adopted chunk is promoted again
    rest = [i for i in range(300) if KEYS[i] not in in_l1]
    assert all(client.lookup(NS, tokens_of(i)).tiers == ["l2"] for i in rest)
    wait_for(lambda: client.stats()["l2_promoting"] == 0, 30, what="promotions done")
    assert client.stats()["l2_promoted"] == len(rest)
    assert served(srv.url).keys() & {KEYS[i] for i in rest}  # promoted ones read back bit-exact (checked inside)
    client.close()


# -- with the GPU path (the CPU stand-in engine) ----------------------------------------------------


def test_gpu_path_loads_what_was_stored_before_a_kill_once_l1_is_page_locked_again(kvtier_server):
    from _gpu_rig import LAYERS, FakeGpuWorker, namespace

    srv = kvtier_server(extra=["--gpu-fake-engine", "--page-size-kb", "16", "--gpu-pin-piece-mb", "4"])
    worker = FakeGpuWorker("LBNHC")
    try:
        _, transfers = worker.transfers(srv.url, timeout_s=5.0)
        ns, tokens = namespace("LBNHC"), prompt(21, 4 * 64).tolist()  # four chunks of four blocks
        worker.fill(list(range(16)), seed=5)
        assert transfers.store("s", ns, tokens, list(range(16)))
        assert transfers.poll(wait=True)[0].ok
        kill(srv)  # its copier goes with it
        srv.start()
        assert adopted_chunks(srv.log_text()) == 4

        def loaded() -> bool:  # not_pinned (a miss) until the new copier has page-locked the adopted L1
            # None (nothing sent) until the keeper has registered with the new server: the client saw the old
            # server's presence filter marked closed, so its registration is gone
            if transfers.load("l", ns, tokens, list(range(20, 36)), 0, 16) is None:
                return False
            return transfers.poll(wait=True)[0].ok

        wait_for(loaded, 30, interval=0.2, what="a load after the restart")
        fresh = FakeGpuWorker("LBNHC")  # what blocks 0..15 held: the same pattern, from another device
        fresh.fill(list(range(16)), seed=5)
        assert all(np.array_equal(worker.page(layer, 20 + b), fresh.page(layer, b))
                   for b in range(16) for layer in range(LAYERS))
        fresh.close()
    finally:
        worker.close()


if __name__ == "__main__" and sys.argv[1] == "storm":
    storm(**json.loads(sys.argv[2]))
