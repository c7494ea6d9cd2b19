"""open_l1 (server/l1/adopt.py): a warm restart adopts the segment and journal a previous daemon left, and
anything that does not match starts empty, saying why. Real segment files in /dev/shm; a "kill" is
`abandon()` (the files closed as they are, no last snapshot), a clean stop `close()`."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import uuid

import numpy as np
import pytest
from kvtier.server.eviction import make_policy
from kvtier.server.l1.adopt import JOURNAL_SUFFIX, L1Files, OpenedL1, open_l1
from kvtier.server.l1.holds import Holds
from kvtier.server.l1.journal_records import VERSION, half_bytes
from kvtier.server.l1.pool import extent_pages, from_extents
from kvtier.server.l1.reconfig import drain_policy
from kvtier.server.metrics import Metrics
from kvtier.shm.client_lock import LOCK_INFIX, ClientLock, LockDirectory
from kvtier.shm.journal import HEADER_BYTES, journal_bytes, write_header
from kvtier.shm.segment import SHM_DIR, Segment, SegmentInUse
from l1_helpers import BPC, MIN_BLOCK_BYTES, NS, PAGE, FakeClock, block_key, hello, item

pytestmark = pytest.mark.unit

PAGES = 32


@pytest.fixture
def files():
    name = f"kvtier-unit-adopt-{uuid.uuid4().hex[:12]}"
    yield L1Files(name, SHM_DIR, 0o600)
    for suffix in ("", JOURNAL_SUFFIX):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name + suffix))


def start(files: L1Files, pages: int = PAGES, page: int = PAGE, policy: str = "lru", **kw) -> tuple[OpenedL1, Holds]:
    kw.setdefault("clock", FakeClock())
    kw.setdefault("quarantine_s", 30.0)
    l1 = open_l1(files, pages, page, make_policy(policy), Metrics(), min_block_bytes=MIN_BLOCK_BYTES, **kw)
    return l1, Holds(l1.store, l1.store.metrics, clock=kw["clock"])


def fill(l1: OpenedL1, holds: Holds, families: range) -> dict[bytes, bytes]:
    """Store one chunk per family, its pages filled with bytes of its key; returns key -> bytes."""
    client = hello(holds, b"writer")
    fp = holds.register(NS, client)
    data = {}
    segment = l1.segment.array()
    for family in families:
        [res] = holds.reserve(client, fp, [item(family, BPC, 2 * PAGE)])
        payload = np.frombuffer(block_key(family, BPC) * (2 * PAGE // 16), dtype=np.uint8)
        runs = from_extents(tuple(res[2]))
        for i, page in enumerate(runs.tolist()):
            segment[page * PAGE : (page + 1) * PAGE] = payload[i * PAGE : (i + 1) * PAGE]
        assert holds.commit(client, [res[1]]) == 1
        data[block_key(family, BPC)] = payload.tobytes()
    return data


def served(l1: OpenedL1) -> dict[bytes, bytes]:
    segment = l1.segment.array()
    return {key: b"".join(segment[p * PAGE : (p + 1) * PAGE].tobytes() for p in from_extents(e.extents).tolist())
            for key, e in l1.store.entries.items()}


def test_first_start_is_empty_with_a_journal_only_the_server_reads(files):
    l1, _ = start(files)
    assert l1.outcome.startswith("L1 starts empty: no segment") and l1.adopted == 0
    assert os.stat(os.path.join(SHM_DIR, files.name + JOURNAL_SUFFIX)).st_mode & 0o777 == 0o600
    assert l1.close() == "shared-memory segment removed"  # nothing to adopt: nothing kept
    assert not os.path.exists(os.path.join(SHM_DIR, files.name))
    assert not os.path.exists(os.path.join(SHM_DIR, files.name + JOURNAL_SUFFIX))


def test_a_clean_stop_keeps_only_the_memory_of_what_it_will_serve_again(files):
    l1, holds = start(files)
    l1.segment.array()[:] = 1  # every page backed (the prefault does this)
    data = fill(l1, holds, range(3))  # 6 of 32 pages
    path = os.path.join(SHM_DIR, files.name)
    assert os.stat(path).st_blocks * 512 == PAGES * PAGE
    used = {p * PAGE // mmap.PAGESIZE for e in l1.store.entries.values() for p in from_extents(e.extents).tolist()}
    assert l1.close().startswith("L1 kept for the next start: 3 chunks")
    assert os.stat(path).st_blocks * 512 == len(used) * mmap.PAGESIZE < PAGES * PAGE
    l1, _ = start(files)
    assert served(l1) == data
    l1.close()


def test_a_killed_daemons_l1_is_adopted_bit_exact_with_its_writers_pages_quarantined(files):
    l1, holds = start(files)
    data = fill(l1, holds, range(6))
    writer = holds.client(b"writer")
    [open_res] = holds.reserve(writer, NS.fingerprint(), [item(20, BPC, 3 * PAGE)])  # a client still copying
    reader = hello(holds, b"reader")
    assert holds.acquire(reader, NS.fingerprint(), [block_key(0, BPC)])[0]
    l1.store.remove(l1.store.entries[block_key(0, BPC)], "clear")  # removed while read: its pages not free yet
    del data[block_key(0, BPC)]
    l1.abandon()  # killed: no last snapshot

    clock = FakeClock()
    l1, holds = start(files, clock=clock, quarantine_s=30.0)
    assert l1.adopted == 5 and "adopted" in l1.outcome and "5 pages quarantined" in l1.outcome
    assert served(l1) == data
    quarantined = set(from_extents(l1.store.quarantined).tolist())
    assert set(from_extents(tuple(open_res[2])).tolist()) <= quarantined and len(quarantined) == 5
    assert NS.fingerprint() in l1.store.namespaces  # known before any client registers again
    assert l1.store.ns_usage[NS.fingerprint()] == [5, 5 * 2 * PAGE]
    # the quarantine is not handed out, however full L1 gets, until its time is up
    client = hello(holds, b"new")
    fp = holds.register(NS, client)
    got = [holds.reserve(client, fp, [item(100 + i, BPC, PAGE)])[0] for i in range(PAGES)]
    taken = {p for r in got if r[0] == "ok" for p in from_extents(tuple(r[2])).tolist()}
    assert taken and not taken & quarantined
    clock.now += 29.0
    holds.sweep()
    assert l1.store.quarantined
    clock.now += 2.0
    holds.sweep()
    assert not l1.store.quarantined and l1.store.metrics.l1_quarantined._value.get() == 0
    l1.close()


def test_an_old_clients_pages_stay_quarantined_until_it_settles_them_or_dies(files):
    """Issue 29: the pages a client of the killed daemon was writing are not freed on a timer while that client
    lives (it may resume its copy at any time); they go when it names the reservation (commit or abort, both
    refused) or its lock file shows it dead. Pages a copier of the dead daemon wrote go on the timer."""
    locks = LockDirectory(SHM_DIR, files.name)
    dying = f"{files.name}{LOCK_INFIX}{uuid.uuid4().hex}"  # a client that will be killed: its file stays
    fd = os.open(os.path.join(SHM_DIR, dying), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    settling = ClientLock(SHM_DIR, files.name)  # a client that settles one reservation, then exits cleanly
    try:
        l1, _ = start(files)
        holds = Holds(l1.store, l1.store.metrics, clock=FakeClock(), locks=locks)
        fp = holds.register(NS)
        reserved = {}
        for name, lock in (("dying", dying), ("settling", settling.name)):
            holds.hello(name.encode(), name, 1, lock)
            client = holds.client(name.encode())
            for n in range(2):
                [res] = holds.reserve(client, fp, [item(10 * len(name) + n, BPC, PAGE)])
                reserved[name, n] = res[1], set(from_extents(tuple(res[2])).tolist())
        [res] = holds.reserve(holds.client(b"dying"), fp, [item(99, BPC, PAGE)], client_writes=False)
        reserved["copier", 0] = res[1], set(from_extents(tuple(res[2])).tolist())
        l1.abandon()

        clock = FakeClock()
        l1, _ = start(files, clock=clock, quarantine_s=30.0)
        holds = Holds(l1.store, l1.store.metrics, clock=clock, locks=locks)
        assert "5 pages quarantined (4 until the old clients writing them settle or exit, the rest for 30 s)" \
            in l1.outcome

        def quarantined() -> set[int]:
            holds.sweep()
            return set(from_extents(l1.store.quarantined).tolist())

        every = set().union(*(pages for _, pages in reserved.values()))
        assert quarantined() == every
        stranger = holds.caller(b"settling")  # not registered with this daemon: a stand-in
        assert holds.commit(stranger, [reserved["settling", 0][0]]) == 0  # refused, but its writer is done
        assert quarantined() == every - reserved["settling", 0][1]
        assert holds.abort(stranger, [reserved["settling", 1][0]]) == 0
        assert quarantined() == reserved["dying", 0][1] | reserved["dying", 1][1] | reserved["copier", 0][1]
        clock.now += 31.0  # the copier died with the daemon: its pages go on the timer; a live client's stay
        assert quarantined() == reserved["dying", 0][1] | reserved["dying", 1][1]
        clock.now += 3600.0
        assert quarantined() == reserved["dying", 0][1] | reserved["dying", 1][1]
        os.close(fd)  # killed: the lock is free, the file left behind
        fd = -1
        assert quarantined() == set() and not os.path.exists(os.path.join(SHM_DIR, dying))
        assert l1.store.metrics.l1_quarantined._value.get() == 0 and l1.store.pool.used_pages == 0
        l1.close()
    finally:
        settling.close()
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, dying))


def test_an_old_clients_pages_whose_lock_file_is_gone_are_freed_at_once(files):
    lock = ClientLock(SHM_DIR, files.name)
    l1, _ = start(files)
    holds = Holds(l1.store, l1.store.metrics, clock=FakeClock(), locks=LockDirectory(SHM_DIR, files.name))
    holds.hello(b"gone", "gone", 1, lock.name)
    [res] = holds.reserve(holds.client(b"gone"), holds.register(NS), [item(1, BPC, 2 * PAGE)])
    assert res[0] == "ok"
    l1.abandon()
    lock.close()  # exited (its file removed) while no daemon ran
    l1, _ = start(files)
    holds = Holds(l1.store, l1.store.metrics, clock=FakeClock(), locks=LockDirectory(SHM_DIR, files.name))
    assert extent_pages(l1.store.quarantined) == 2
    holds.sweep()
    assert not l1.store.quarantined and l1.store.pool.used_pages == 0
    l1.close()


def test_a_clean_stop_keeps_everything_and_the_policys_order(files):
    l1, holds = start(files, policy="lru")
    fill(l1, holds, range(8))
    for family in (5, 1, 6):  # most recent last: 5, 1, 6
        l1.store.touch(l1.store.entries[block_key(family, BPC)])
    before = [e for e in l1.store.entries]
    l1.close()
    l1, holds = start(files, policy="lru")
    assert sorted(l1.store.entries) == sorted(before) and not l1.store.quarantined
    order = drain_policy(l1.store)
    assert order[-3:] == [block_key(f, BPC) for f in (5, 1, 6)]  # recency survived the restart
    l1.abandon()


def test_a_journal_of_another_version_starts_empty_and_serves_nothing_of_it(files):
    l1, holds = start(files)
    fill(l1, holds, range(4))
    l1.close()
    path = os.path.join(SHM_DIR, files.name)
    old_inode = os.stat(path).st_ino
    half = half_bytes(PAGES, PAGE, MIN_BLOCK_BYTES)
    journal = Segment.adopt(files.name + JOURNAL_SUFFIX, journal_bytes(half))
    geometry = (PAGES * PAGE, PAGE, PAGES, old_inode)
    write_header(journal.buf, VERSION + 1, half, geometry)  # a journal a newer kvtier wrote, records and all
    journal.close(keep=True)
    l1, _ = start(files)
    assert l1.adopted == 0 and not l1.store.entries
    assert f"journal format 1.{VERSION + 1}; this kvtier reads 1.{VERSION}" in l1.outcome
    assert os.stat(path).st_ino != old_inode  # the old segment is gone, not reused
    assert not l1.segment.array().any()
    l1.close()


@pytest.mark.parametrize(("change", "says"), [
    ({"pages": PAGES * 2}, "has 32768 bytes, not 65536"),
    ({"pages": PAGES // 2, "page": PAGE * 2}, "--page-size-kb changed?"),
    ({"discard": True}, "--l1-discard"),
])
def test_anything_that_does_not_match_starts_empty_saying_why(files, change, says):
    l1, holds = start(files)
    fill(l1, holds, range(3))
    l1.abandon()
    l1, _ = start(files, **change)
    assert l1.adopted == 0 and not l1.store.entries and says in l1.outcome, l1.outcome
    l1.close()


def test_a_damaged_journal_starts_empty(files):
    l1, holds = start(files)
    fill(l1, holds, range(3))
    l1.abandon()
    with open(os.path.join(SHM_DIR, files.name + JOURNAL_SUFFIX), "r+b") as fh:
        fh.seek(HEADER_BYTES + 30)
        byte = fh.read(1)
        fh.seek(HEADER_BYTES + 30)
        fh.write(bytes([byte[0] ^ 0xFF]))
    l1, _ = start(files)
    assert l1.adopted == 0 and "fails its checksum" in l1.outcome, l1.outcome
    l1.close()


def test_a_new_segment_under_an_old_journal_is_never_adopted(files):
    """Were the segment recreated (zeros) beside a surviving journal, adopting would serve zeros as chunks."""
    l1, holds = start(files)
    fill(l1, holds, range(3))
    l1.abandon()
    path = os.path.join(SHM_DIR, files.name)
    os.unlink(path)
    with open(path, "wb") as fh:
        fh.truncate(PAGES * PAGE)
    os.chmod(path, 0o600)
    l1, _ = start(files)
    assert l1.adopted == 0 and "geometry" in l1.outcome, l1.outcome
    l1.close()


def test_no_adopt_means_no_journal_and_the_segment_goes_at_stop(files):
    l1, holds = start(files)
    fill(l1, holds, range(2))
    l1.close()
    l1, _ = start(files, adopt=False)
    assert l1.journal is None and not l1.store.entries
    assert not os.path.exists(os.path.join(SHM_DIR, files.name + JOURNAL_SUFFIX))
    l1.close()
    assert not os.path.exists(os.path.join(SHM_DIR, files.name))


def test_a_live_owner_keeps_its_l1(files):
    l1, _ = start(files)
    with pytest.raises(SegmentInUse):
        start(files)
    l1.close()


def test_a_pinned_partial_stays_pinned_and_once_unpinned_leaves_with_the_adoption(files):
    """A partial chunk kept only because it was pinned comes back pinned; unpinned, it is superseded when the
    longer one is re-inserted, and the journal follows."""
    l1, holds = start(files)
    client = hello(holds, b"w")
    fp = holds.register(NS, client)
    for blocks in (2, BPC):
        [res] = holds.reserve(client, fp, [item(7, blocks, PAGE)])
        holds.commit(client, [res[1]])
        if blocks == 2:
            l1.store.pin_keys([block_key(7, 2)])  # kept when the longer one arrives
    assert len(l1.store.entries) == 2
    l1.abandon()
    l1, _ = start(files)
    assert list(l1.store.entries) == [block_key(7, 2), block_key(7, BPC)]
    assert l1.store.entries[block_key(7, 2)].pins == 1 and l1.store.pinned_pages == 1
    l1.store.pin_keys([block_key(7, 2)], -1)
    l1.abandon()
    l1, _ = start(files)
    assert list(l1.store.entries) == [block_key(7, BPC)] and extent_pages(l1.store.quarantined) == 0
    assert l1.store.pool.used_pages == 1 and l1.store.pinned_pages == 0
    l1.abandon()
    l1, _ = start(files)  # the new journal says the same
    assert list(l1.store.entries) == [block_key(7, BPC)] and l1.store.pool.used_pages == 1
    l1.close()
