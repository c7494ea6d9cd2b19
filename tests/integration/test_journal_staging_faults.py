"""Compaction off the serving loop (issue 29 item 8) on a tmpfs with no room left: the worker's reservation for
the snapshot is refused, and the journal is invalidated (the next start is cold) rather than a SIGBUS; the
writer runs in a process of its own, so that a SIGBUS would show as its exit status. Mounting needs root
(test_shm_faults.tmpfs skips elsewhere, except under CI=true)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _support import REPO
from test_shm_faults import tmpfs

pytestmark = pytest.mark.integration

_STAGE_WITHOUT_ROOM = """
import os, sys
from kvtier.shm.journal import Journal, frame, journal_bytes
from kvtier.shm.segment import Segment
point = sys.argv[1]
seg = Segment.create("kvtier-stage.journal", journal_bytes(4 << 20), 0o600, point)
j = Journal.create(seg, 1, (1, 2, 3, 4))
for _ in range(100):
    assert j.append(frame(2, bytes(1000)))  # within the first reserved step
room = os.statvfs(point)
filler = os.open(os.path.join(point, "filler"), os.O_WRONLY | os.O_CREAT)
os.posix_fallocate(filler, 0, room.f_bavail * room.f_frsize)  # someone else takes what is left of the tmpfs
j.stage([frame(1, bytes(1000)) for _ in range(2000)])  # a 2 MB snapshot: no room to reserve it
appended = j.append(frame(2, b"while staging"))
print(j.switch(), appended, j.lost, bytes(seg.buf[0:4]) == bytes(4), j.append(frame(2, b"after")), sep="|")
"""


def test_a_snapshot_staged_without_room_invalidates_the_journal_not_sigbus():
    with tmpfs("3m") as point:
        done = subprocess.run([sys.executable, "-c", _STAGE_WITHOUT_ROOM, str(point)], capture_output=True,
                              text=True, cwd=REPO, timeout=60)
        assert done.returncode == 0, f"rc {done.returncode}: {done.stderr[-2000:]}"
        switched, appended, lost, invalid, after = done.stdout.strip().split("|")
        assert (switched, appended, invalid, after) == ("False", "True", "True", "False"), done.stdout
        assert "No space left" in lost, done.stdout
