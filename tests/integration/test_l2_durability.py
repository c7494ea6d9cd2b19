"""L2 filesystem tier against a real server process and a real directory under tmp_path: durability across
SIGKILL, a crash loop, corrupt and foreign files, and the capacity bound under a write storm."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import blake3
import numpy as np
import pytest
from _support import prompt, wait_for
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server.keys import Namespace, chunk_keys

pytestmark = pytest.mark.integration

NS = Namespace(model="org/tiny-l2", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64, block_size=16,
               layout="NHD", chunk_size=64)
CHUNK_BYTES = 4096


def payload_of(key: bytes, size: int = CHUNK_BYTES) -> np.ndarray:
    return np.frombuffer(blake3.blake3(b"payload" + key).digest(length=size), dtype=np.uint8)


def l2_args(path, size_gb: float = 1.0, extra: list[str] | None = None) -> list[str]:
    """Restarts come back with an empty L1 (--no-l1-adopt): what is found again is L2's."""
    return ["--page-size-kb", "4", "--l2-path", str(path), "--l2-size-gb", str(size_gb), "--no-l1-adopt",
            *(extra or [])]


def client(url: str, strict: bool = True, timeout: float = 10.0) -> KVTierClient:
    c = KVTierClient(ClientConfig(url=url, connect_timeout_s=min(2.0, timeout), request_timeout_s=timeout,
                                  retry_backoff_s=0.05, strict=strict))
    if strict:
        assert c.connect()
    return c


def store(c: KVTierClient, tokens, size: int = CHUNK_BYTES):
    return c.store(NS, tokens, lambda _c: size, lambda ch, span: span.write(0, payload_of(ch.key, size)))


def retrieve_checked(c: KVTierClient, tokens) -> tuple[int, list[str]]:
    """(tokens retrieved, tier per hit); raises if any byte differs from what was stored for the key."""
    looked = c.lookup(NS, tokens)
    tiers = [h.tier for h in looked.hits]

    def read(rc) -> None:
        buf = np.empty(rc.span.size, dtype=np.uint8)
        rc.span.read(0, buf)
        assert np.array_equal(buf, payload_of(rc.chunk.key, rc.span.size)), "retrieved bytes differ"

    got = c.retrieve_chunks(NS, looked.hits, read) * NS.block_size
    return got, tiers


def drained(c: KVTierClient) -> dict | None:
    s = c.stats()
    return s if s and s["l2_inflight"] == 0 else None


def chunk_files(path) -> dict[str, int]:
    return {e.name: e.stat().st_size for e in os.scandir(path)
            if e.name.endswith(".kv") and e.is_file(follow_symlinks=False)}


@pytest.mark.parametrize("odirect", [False, True], ids=["buffered", "odirect"])
def test_l2_survives_sigkill_bit_exact(kvtier_server, tmp_path, odirect):
    """With --l2-odirect the files are written straight from the shared-memory pages and read back into
    them with O_DIRECT (tmp_path is on a disk filesystem here; where it refuses O_DIRECT the server falls
    back to buffered I/O and says so in its stats)."""
    l2 = tmp_path / "l2"
    srv = kvtier_server(l1_gb=0.0625, extra=l2_args(l2, extra=["--l2-odirect"] if odirect else []))
    c = client(srv.url)
    if odirect and not c.stats()["l2_odirect"]:
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    prompts = [prompt(100 + i, 50 * NS.chunk_size) for i in range(10)]  # 10 x 50 = 500 chunks
    for tokens in prompts:
        assert store(c, tokens).stored == 50
    s = wait_for(lambda: drained(c), timeout=30, what="L2 queue drained")
    assert s["l2_written"] == 500 and s["l2_entries"] == 500 and s["l2_dropped_writes"] == 0
    c.close()
    srv.signal(signal.SIGKILL)
    srv.proc.wait(timeout=10)

    srv.start()
    c = client(srv.url)
    s = c.stats()
    assert s["l2_entries"] == 500 and s["entries"] == 0 and s["l2_odirect"] is odirect
    for tokens in prompts:
        got, tiers = retrieve_checked(c, tokens)
        assert got == 50 * NS.chunk_size
        assert tiers == ["l2"] * 50
    # Promoted chunks are L1 entries now: a second lookup hits L1.
    _, tiers = retrieve_checked(c, prompts[0])
    assert tiers == ["l1"] * 50
    assert c.stats()["l2_corrupt_chunks"] == 0
    c.close()


def test_l2_crash_loop_never_serves_wrong_bytes(kvtier_server, tmp_path):
    l2 = tmp_path / "l2"
    rng = random.Random(7)
    port = None
    stored: list[np.ndarray] = []
    srv = None
    for round_ in range(20):
        if srv is None:
            srv = kvtier_server(l1_gb=0.0625, extra=l2_args(l2, extra=["--l2-queue-depth", "4096"]), port=port)
            port = srv.port
        else:
            srv.start()
        c = client(srv.url)
        # Everything stored in earlier rounds is either served bit-exact or missed, never wrong.
        for tokens in stored:
            retrieve_checked(c, tokens)
        s = c.stats()
        files = chunk_files(l2)
        assert s["l2_entries"] == len(files), "index and files on disk disagree"
        assert s["l2_used_bytes"] == sum(files.values())
        assert not [n for n in os.listdir(l2) if ".tmp-" in n], "leftover temp files after the scan"
        c.close()
        # Heavy L2 writes, SIGKILL at a random moment while they are queued or being written.
        tokens = [prompt(1000 * round_ + i, 30 * NS.chunk_size) for i in range(2)]
        stored += tokens
        killer = threading.Timer(rng.uniform(0.0, 0.15), srv.signal, (signal.SIGKILL,))
        killer.start()
        w = client(srv.url, strict=False, timeout=0.5)
        for t in tokens:
            store(w, t)
        killer.join()
        w.close()
        srv.proc.wait(timeout=10)
    srv.start()
    c = client(srv.url)
    hits = 0
    for tokens in stored:
        got, _ = retrieve_checked(c, tokens)
        hits += got
    assert hits > 0, "no chunk survived any crash"
    c.close()


def test_l2_corrupt_and_foreign_files(kvtier_server, tmp_path):
    l2 = tmp_path / "l2"
    srv = kvtier_server(l1_gb=0.0625, extra=l2_args(l2))
    c = client(srv.url)
    prompts = [prompt(500 + i, NS.chunk_size) for i in range(8)]  # one chunk each: independent lookups
    keys = [chunk_keys(NS, t)[0].key for t in prompts]
    for t in prompts:
        assert store(c, t).stored == 1
    wait_for(lambda: (s := drained(c)) and s["l2_entries"] == 8, timeout=30, what="L2 written")
    c.close()
    srv.signal(signal.SIGKILL)
    srv.proc.wait(timeout=10)

    path = {k: l2 / f"{k.hex()}.kv" for k in keys}
    size = path[keys[0]].stat().st_size
    with open(path[keys[0]], "r+b") as fh:  # payload byte flipped: found only when loaded
        fh.seek(size - 100)
        b = fh.read(1)
        fh.seek(size - 100)
        fh.write(bytes([b[0] ^ 0xFF]))
    with open(path[keys[1]], "r+b") as fh:  # header byte flipped (the blocks field)
        fh.seek(20)
        b = fh.read(1)
        fh.seek(20)
        fh.write(bytes([b[0] ^ 0x01]))
    os.truncate(path[keys[2]], size - 10)  # truncated
    os.truncate(path[keys[3]], 0)  # zero length
    path[keys[4]].write_bytes(os.urandom(size))  # junk under a kvtier name
    # Foreign entries: never counted, served or deleted.
    foreign = [l2 / "notes.txt", l2 / "README"]
    for f in foreign:
        f.write_bytes(b"not a chunk")
    outside = tmp_path / "outside.kv"
    outside.write_bytes(path[keys[5]].read_bytes())
    path[keys[5]].unlink()
    path[keys[5]].symlink_to(outside)  # a symlink with a chunk's name, to a valid chunk file
    subdir = l2 / "subdir"
    subdir.mkdir()
    (subdir / f"{keys[6].hex()}.kv").write_bytes(path[keys[6]].read_bytes())
    kv_dir = l2 / f"{'ab' * 16}.kv"
    kv_dir.mkdir()

    srv.start()
    c = client(srv.url)
    s = c.stats()
    assert s["l2_corrupt_chunks"] == 4  # header flip, truncated, zero length, junk: found by the scan
    assert s["l2_entries"] == 3  # keys 0 (payload flip, not yet loaded), 6, 7
    for i in (1, 2, 3, 4):
        assert not path[keys[i]].exists()
    for i in range(8):
        got, tiers = retrieve_checked(c, prompts[i])
        assert got == (NS.chunk_size if i in (6, 7) else 0), i
        if got:
            assert tiers == ["l2"]
    s = c.stats()
    assert s["l2_corrupt_chunks"] == 5 and s["l2_entries"] == 2
    assert not path[keys[0]].exists()
    assert path[keys[5]].is_symlink() and outside.exists()
    assert all(f.exists() for f in foreign) and subdir.is_dir() and kv_dir.is_dir()
    assert (subdir / f"{keys[6].hex()}.kv").exists()
    c.close()


def test_l2_capacity_bound_under_write_storm(kvtier_server, tmp_path):
    l2 = tmp_path / "l2"
    cap_gb = 0.001  # ~1 MiB: about 60 chunks of 16 KiB
    chunk = 16 * 1024
    srv = kvtier_server(l1_gb=0.0625, extra=l2_args(l2, cap_gb, ["--l2-queue-depth", "8192"]))
    cap = int(cap_gb * (1 << 30))
    stop = threading.Event()
    worst = [0]

    def watch() -> None:
        while not stop.is_set():
            try:
                used = sum(e.stat().st_size for e in os.scandir(l2) if e.is_file(follow_symlinks=False))
            except FileNotFoundError:
                continue
            worst[0] = max(worst[0], used)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    c = client(srv.url)
    try:
        for i in range(20):
            store(c, prompt(900 + i, 20 * NS.chunk_size), size=chunk)
        s = wait_for(lambda: drained(c), timeout=60, what="L2 queue drained")
    finally:
        stop.set()
        watcher.join()
    one_chunk = chunk + 4096  # payload plus a generous header allowance
    assert worst[0] <= cap + one_chunk, (worst[0], cap)
    assert s["l2_used_bytes"] <= cap
    files = chunk_files(l2)
    assert s["l2_used_bytes"] == sum(files.values()) and s["l2_entries"] == len(files)
    assert s["l2_evictions"] > 0
    c.close()
