"""The shared-memory directory under faults (issue 29, items 7, 9, 10, 12), real servers on small tmpfs mounts
of the test's own: a tmpfs too small for L1 and its journal is a clear refusal at start (never SIGBUS later), a
journal that runs out of room is invalidated (never SIGBUS), a second start while one is adopting changes
nothing, and `kvtier segments` lists and removes the segments stopped servers left.

Mounting needs root (CAP_SYS_ADMIN): elsewhere these tests skip, except under CI=true where they must run."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from _support import READY, REPO, free_port
from test_warm_restart import L1_GB, SERVER_ARGS, adopted_chunks, journal_path, store_all

pytestmark = pytest.mark.integration

MIB = 1 << 20


@contextlib.contextmanager
def tmpfs(size: str) -> Iterator[Path]:
    point = Path(tempfile.mkdtemp(prefix="kvtier-tmpfs-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                             capture_output=True, text=True)
    if mounted.returncode:
        point.rmdir()
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot mount a tmpfs in CI: {mounted.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs (needs root): {mounted.stderr.strip()}")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)
        point.rmdir()


def start_or_exit(srv, timeout: float = 30.0) -> str:  # noqa: ANN001
    """Start `srv` and wait until it is ready ("ready") or has exited ("exit <code>")."""
    offset = srv.log_path.stat().st_size
    proc = srv.start(wait=False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if READY in srv.log_path.read_text(errors="replace")[offset:]:
            return "ready"
        if proc.poll() is not None:
            return f"exit {proc.returncode}"
        time.sleep(0.05)
    raise AssertionError(f"neither ready nor exited:\n{srv.log_text()}")


def test_a_tmpfs_without_room_for_the_journal_is_a_clear_refusal_not_sigbus(kvtier_server):
    """Issue 29 item 12's reproduction: 64 MiB of L1 (64 KiB pages) on a 64.5 MiB tmpfs, which holds the segment
    but not its journal (about 50 MB): every start refuses, naming both sizes; a tmpfs that holds both serves."""
    with tmpfs("66048k") as point:
        srv = kvtier_server(l1_gb=0.0625, extra=["--shm-dir", str(point)], wait=False)
        srv.proc.wait(timeout=30)
        srv.proc = None
        for _ in range(2):  # and again: the first refusal left nothing that changes the second
            assert start_or_exit(srv) == "exit 2", srv.log_text()
            log = srv.log_text()
            assert f"{point} has room for 64.5 MiB" in log and f"{srv.shm_name} 64.0 MiB" in log, log
            assert f"{srv.shm_name}.journal " in log and "enlarge the tmpfs" in log, log
        subprocess.run(["mount", "-o", "remount,size=128m", str(point)], check=True)
        assert start_or_exit(srv) == "ready", srv.log_text()
        assert store_all(srv.url, range(20)) == 20
        srv.signal(signal.SIGKILL)
        srv.proc.wait(timeout=10)


_FILL_JOURNAL = """
import os, sys
from kvtier.shm.journal import Journal, frame, journal_bytes
from kvtier.shm.segment import Segment
point = sys.argv[1]
seg = Segment.create("kvtier-fill.journal", journal_bytes(2 << 20), 0o600, point)
j = Journal.create(seg, 1, (1, 2, 3, 4))
fd = os.open(os.path.join(point, "filler"), os.O_WRONLY | os.O_CREAT)  # someone else fills the tmpfs
try:
    while True:
        os.write(fd, bytes(1 << 16))
except OSError:
    pass
record = frame(1, bytes(1000))
n = 0
while j.append(record):
    n += 1
j.rewrite(record)  # a compaction after the refusal writes nothing either
print(n, j.lost, bytes(seg.buf[0:4]) == bytes(4), sep="|")
"""


def test_a_journal_that_runs_out_of_room_is_invalidated_not_sigbus():
    with tmpfs("3m") as point:
        done = subprocess.run([sys.executable, "-c", _FILL_JOURNAL, str(point)], capture_output=True, text=True,
                              cwd=REPO, timeout=60)
        assert done.returncode == 0, f"rc {done.returncode}: {done.stderr[-2000:]}"
        appended, lost, invalid = done.stdout.strip().split("|")
        assert int(appended) < (2 << 20) // 1000 and "No space left" in lost and invalid == "True", done.stdout
        assert "L1 journal kvtier-fill.journal invalidated: no room" in done.stderr


def hold_lock(path: Path) -> int:
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_a_second_start_while_one_adopts_changes_nothing(kvtier_server):
    """Item 9: a server adopting (here: the test, holding what an adopting server holds: the pair lock and the
    segment's owner lock) and a stray `--l1-discard` start on the same name: the second refuses having touched
    nothing, and the adoption then gets every chunk."""
    srv = kvtier_server(l1_gb=L1_GB, extra=SERVER_ARGS)
    assert store_all(srv.url, range(30)) == 30
    srv.signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=15) == 0
    journal_inode = journal_path(srv).stat().st_ino
    pair = srv.shm_path.with_name(srv.shm_name + ".lock")
    fds = [hold_lock(pair), hold_lock(srv.shm_path)]
    try:
        stray = kvtier_server(l1_gb=L1_GB, extra=[*SERVER_ARGS, "--l1-discard"], shm_name=srv.shm_name, wait=False)
        assert stray.proc.wait(timeout=30) == 2, stray.log_text()
        assert journal_path(srv).exists() and journal_path(srv).stat().st_ino == journal_inode
        assert "owned by a running server (or one starting" in stray.log_text()
    finally:
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            pair.unlink()
    srv.start()
    assert adopted_chunks(srv.log_text()) == 30


def segments(point: Path, *extra: str) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "kvtier.server.cli", "segments", "--shm-dir", str(point), "--json",
                           *extra], capture_output=True, text=True, cwd=REPO, timeout=60, check=True)
    return json.loads(done.stdout)


def test_kvtier_segments_lists_and_removes_what_stopped_servers_left_and_status_shows_it(kvtier_server):
    """Item 10: a live server and one that was killed, on one tmpfs: `kvtier segments` tells them apart with
    their sizes, the live one's /status shows the other's memory, `--remove-unused` removes only the dead one."""
    with tmpfs("256m") as point:
        http = free_port()
        live = kvtier_server(l1_gb=L1_GB, extra=[*SERVER_ARGS, "--shm-dir", str(point), "--http-port", str(http)])
        dead = kvtier_server(l1_gb=L1_GB, extra=[*SERVER_ARGS, "--shm-dir", str(point)])
        assert store_all(dead.url, range(10)) == 10
        dead.signal(signal.SIGKILL)
        dead.proc.wait(timeout=10)
        listed = {s["name"]: s for s in segments(point)}
        assert set(listed) == {live.shm_name, dead.shm_name}
        assert listed[live.shm_name]["live"] and not listed[dead.shm_name]["live"]
        assert listed[dead.shm_name]["size"] == 8 * MIB and listed[dead.shm_name]["journal"] > 0
        assert listed[dead.shm_name]["held"] >= 10 * 4096  # its chunks' pages, at least
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/status", timeout=10) as reply:
            others = json.load(reply)["shm_others"]
        assert [s["name"] for s in others["segments"]] == [dead.shm_name]
        assert others["unused_bytes"] == listed[dead.shm_name]["held"] > 0
        removed = segments(point, "--remove-unused")
        assert [s["name"] for s in removed] == [dead.shm_name]
        assert sorted(os.listdir(point)) == sorted([live.shm_name, live.shm_name + ".journal",
                                                     live.shm_name + ".lock", live.shm_name + ".presence"])
        assert store_all(live.url, range(5)) == 5  # the live one is untouched
        live.signal(signal.SIGKILL)
        live.proc.wait(timeout=10)


def test_a_prefault_that_runs_out_of_room_stops_the_server(kvtier_server):
    """Item 7: the start's check passes, yet the tmpfs cannot back L1: here a `--l1-discard` start while a client
    still maps the old, fully backed segment (its memory is freed only when the last mapping goes). The server
    stops with an error (exit 1) instead of serving an L1 whose stores would be SIGBUS."""
    with tmpfs("120m") as point:
        srv = kvtier_server(l1_gb=0.0625, extra=["--shm-dir", str(point)])
        deadline = time.monotonic() + 30
        while "L1 backed by memory" not in srv.log_text():
            assert time.monotonic() < deadline, srv.log_text()
            time.sleep(0.05)
        srv.signal(signal.SIGKILL)
        srv.proc.wait(timeout=10)
        segment = point / srv.shm_name
        fd = os.open(segment, os.O_RDONLY)
        old = mmap.mmap(fd, segment.stat().st_size, mmap.MAP_SHARED, mmap.PROT_READ)  # an old client's mapping
        os.close(fd)
        try:
            srv.args.append("--l1-discard")
            offset = srv.log_path.stat().st_size
            assert start_or_exit(srv) in ("ready", "exit 1")
            assert srv.proc.wait(timeout=30) == 1, srv.log_text()
            log = srv.log_path.read_text(errors="replace")[offset:]
            assert "L1 prefault failed" in log and "cannot back L1; stopping" in log, log
        finally:
            old.close()
