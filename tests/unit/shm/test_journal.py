"""shm/journal.py: the record log a writer may be killed in at any instant (framing, header, compaction)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import struct
import time
import uuid

import pytest
from kvtier.shm.journal import (
    HEADER_BYTES,
    STATE_OFFSET,
    Journal,
    JournalDamaged,
    JournalMismatch,
    frame,
    journal_bytes,
    parse,
    write_header,
)
from kvtier.shm.segment import SHM_DIR, Segment

pytestmark = pytest.mark.unit

HALF = 64 * 1024
GEOMETRY = (1 << 20, 4096, 256, 7)


@pytest.fixture
def name():
    name = f"kvtier-unit-journal-{uuid.uuid4().hex[:12]}"
    yield name
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))


def new_journal(name: str, half: int = HALF) -> Journal:
    return Journal.create(Segment.create(name, journal_bytes(half)), 1, GEOMETRY)


def reopen(name: str, half: int = HALF, version: int = 1, geometry: tuple = GEOMETRY) -> Journal:
    segment = Segment.adopt(name, journal_bytes(half))
    try:
        return Journal.open(segment, version, geometry)
    except BaseException:
        segment.close(keep=True)
        raise


def payloads(journal: Journal) -> list[bytes]:
    return [bytes(payload) for _, payload, _ in journal.records()]


def test_records_survive_the_writer_and_come_back_in_order(name):
    j = new_journal(name)
    written = [os.urandom(n) for n in (0, 1, 100, 5000)]
    for i, data in enumerate(written):
        assert j.append(frame(i + 1, data))
    j.close()  # the file stays (a dead writer's would too)
    j = reopen(name)
    assert [(t, bytes(p)) for t, p, _ in j.records()] == [(i + 1, d) for i, d in enumerate(written)]
    assert [bytes(r) for _, _, r in j.records()] == [frame(i + 1, d) for i, d in enumerate(written)]
    j.close(keep=False)


def test_bytes_past_the_committed_length_are_never_read(name):
    """A writer killed inside a record: its bytes are there, the state word was not advanced."""
    j = new_journal(name)
    j.append(frame(1, b"kept"))
    torn = frame(2, b"torn record")
    start = HEADER_BYTES + j.length
    j.segment.buf[start : start + len(torn) - 3] = torn[:-3]  # killed before the last bytes and the word
    j.close()
    j = reopen(name)
    assert payloads(j) == [b"kept"]
    assert j.append(frame(3, b"next"))  # appends go over the torn bytes
    j.close()
    assert payloads(reopen(name)) == [b"kept", b"next"]


@pytest.mark.parametrize("offset", [0, 4, 5, 9, 12])
def test_a_damaged_committed_record_makes_the_journal_untrusted(name, offset):
    j = new_journal(name)
    j.append(frame(1, b"first"))
    at = HEADER_BYTES + j.length
    j.append(frame(2, b"damaged"))
    j.append(frame(3, b"after"))
    j.segment.buf[at + offset] ^= 0x40
    with pytest.raises(JournalDamaged):
        list(j.records())  # records come lazily: a reader discards what it took when this is raised
    j.close(keep=False)


def test_parse_refuses_a_record_cut_short():
    record = frame(1, b"payload")
    assert [bytes(p) for _, p, _ in parse(record)] == [b"payload"]
    for cut in (3, len(record) - 1):
        with pytest.raises(JournalDamaged):
            list(parse(record[:cut]))


def test_append_refuses_what_does_not_fit_and_rewrite_flips_halves(name):
    half = 8192
    j = new_journal(name, half)
    record = frame(1, bytes(1000))
    n = 0
    while j.append(record):
        n += 1
    assert n == half // len(record) and j.length == n * len(record)
    j.rewrite(frame(9, b"snapshot"))
    assert j.active == 1 and payloads(j) == [b"snapshot"]
    assert j.append(frame(1, b"after"))
    j.close()
    j = reopen(name, half)
    assert j.active == 1 and payloads(j) == [b"snapshot", b"after"]
    with pytest.raises(ValueError, match="do not fit"):
        j.rewrite(bytes(half + 1))
    j.close(keep=False)


def test_rewrite_gives_the_old_halfs_memory_back(name):
    half = 1 << 20
    j = new_journal(name, half)
    record = frame(1, os.urandom(4000))
    while j.append(record):
        pass
    path = os.path.join(SHM_DIR, name)
    full = os.stat(path).st_blocks * 512
    j.rewrite(frame(2, b"small"))
    assert full > half and os.stat(path).st_blocks * 512 < full - half + 65536
    j.close(keep=False)


def test_header_mismatches_are_named(name):
    j = new_journal(name)
    j.append(frame(1, b"x"))
    j.close()
    with pytest.raises(JournalMismatch, match=r"format 1\.1; this kvtier reads 1\.2"):
        reopen(name, version=2)
    with pytest.raises(JournalMismatch, match="geometry"):
        reopen(name, geometry=(1 << 20, 8192, 128, 7))
    seg = Segment.adopt(name, journal_bytes(HALF))
    write_header(seg.buf, 5, HALF, GEOMETRY)  # a journal a newer kvtier wrote: records kept, version 5
    seg.close(keep=True)
    with pytest.raises(JournalMismatch, match=r"format 1\.5"):
        reopen(name)
    seg = Segment.adopt(name, journal_bytes(HALF))
    seg.buf[20] ^= 1  # a header field changed under its crc
    seg.close(keep=True)
    with pytest.raises(JournalMismatch, match="checksum"):
        reopen(name, version=5)
    seg = Segment.adopt(name, journal_bytes(HALF))
    seg.buf[0:4] = b"ABCD"
    seg.close(keep=True)
    with pytest.raises(JournalMismatch, match="no magic"):
        reopen(name)


def test_a_state_word_past_the_half_is_damage(name):
    j = new_journal(name)
    j.close()
    seg = Segment.adopt(name, journal_bytes(HALF))
    seg.buf[STATE_OFFSET : STATE_OFFSET + 8] = struct.pack("<Q", HALF + 1)
    seg.close(keep=True)
    with pytest.raises(JournalDamaged, match="state word"):
        reopen(name)


# -- killed at any instant -----------------------------------------------------------------------

SNAPSHOT, STEP = 1, 2


def _state(journal: Journal) -> int:
    """The writer's counter as the journal tells it: a SNAPSHOT sets it, each STEP must add exactly one."""
    count = 0
    for rtype, payload, _ in journal.records():
        value, = struct.unpack_from("<Q", payload)
        if rtype == SNAPSHOT:
            count = value
        else:
            assert rtype == STEP and value == count + 1, f"record {value} after {count}: a step lost or repeated"
            count = value
    return count


def _writer(name: str, half: int, seed: int, staged: bool) -> None:
    """Count up for ever: a STEP record per number (of random length); when the half is full, a rewrite to one
    SNAPSHOT, or when `staged`, past half a half, a SNAPSHOT of the count so far (padded, in many parts) staged
    and switched to at the first append after the worker is done (or when the half is full)."""
    journal = reopen(name, half)
    count = _state(journal)
    rng = random.Random(seed)
    while True:
        count += 1
        record = frame(STEP, struct.pack("<Q", count) + bytes(rng.randrange(0, 3000)))
        if staged and journal.staging is not None and journal.staging.done.is_set():
            assert journal.switch()
        elif staged and journal.staging is None and journal.length > half // 2:
            journal.stage([frame(SNAPSHOT, struct.pack("<Q", count - 1) + bytes(20_000)), *[b""] * 10_000])
        if journal.append(record):
            continue
        if staged:
            assert journal.switch()
        else:
            journal.rewrite(frame(SNAPSHOT, struct.pack("<Q", count - 1)))
        assert journal.append(record)


@pytest.mark.parametrize("staged", [False, True], ids=["rewrite", "stage-switch"])
def test_a_writer_killed_at_random_instants_leaves_a_journal_that_replays_to_a_prefix(name, staged):
    """Kills land in appends, in compactions and between them (staged: while the worker writes the snapshot,
    in the switch)."""
    half = 256 * 1024 if staged else 64 * 1024  # a compaction every ~40 (staged: ~85) records
    new_journal(name, half).close()
    fork = multiprocessing.get_context("fork")
    rng = random.Random(0)
    counts = [0]
    for i in range(40):
        child = fork.Process(target=_writer, args=(name, half, i, staged))
        child.start()
        time.sleep(rng.uniform(0.02, 0.08))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        journal = reopen(name, half)
        counts.append(_state(journal))  # raises on a torn, lost or repeated record
        journal.close()
        assert counts[-1] >= counts[-2]
    assert counts[-1] > 1000  # the writer got somewhere: the kills landed in a busy log
    os.unlink(os.path.join(SHM_DIR, name))
