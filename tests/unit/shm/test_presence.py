"""shm/presence.py: the counting Bloom filter a server writes and its clients read (one region per local tier)."""

from __future__ import annotations

import os
import time
import uuid

import pytest
from kvtier.shm.presence import (
    HEADER_BYTES,
    SATURATED,
    PresenceFile,
    PresenceMismatch,
    PresenceReader,
    file_bytes,
    mark_closed,
)
from kvtier.shm.segment import SHM_DIR

pytestmark = pytest.mark.unit

COUNTERS = 1 << 12


def _key(a: int, b: int) -> bytes:
    """A key whose two counters are a and b (mod COUNTERS)."""
    return a.to_bytes(8, "little") + b.to_bytes(8, "little")


@pytest.fixture
def files():
    made: list[PresenceFile] = []

    def make(regions: int = 1, counters: int = COUNTERS) -> PresenceFile:
        f = PresenceFile.create(f"kvtier-test-{uuid.uuid4().hex[:8]}.presence", regions, counters=counters)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def test_add_discard_clear(files) -> None:
    f = files()
    w = f.writer(0)
    r = PresenceReader(f.name)  # a separate mapping: sees the writer's changes at once
    k = os.urandom(16)
    assert not r.may_hold(k)
    w.add(k)
    assert r.may_hold(k)
    w.add(k)
    w.discard(k)
    assert r.may_hold(k)
    w.discard(k)
    assert not r.may_hold(k)
    keys = [os.urandom(16) for _ in range(50)]
    for key in keys:
        w.add(key)
    assert all(r.may_hold(key) for key in keys)
    w.clear()
    assert not any(r.may_hold(key) for key in keys)
    r.close()


def test_both_counters_must_be_set(files) -> None:
    f = files()
    w = f.writer(0)
    r = PresenceReader(f.name)
    w.add(_key(1, 2))
    w.add(_key(3, 4))
    assert r.may_hold(_key(1, 2)) and r.may_hold(_key(1 + COUNTERS, 2))  # positions are modulo the size
    assert r.may_hold(_key(1, 4))  # a false positive: both counters are set by others
    assert not r.may_hold(_key(1, 5))
    r.close()


def test_saturation_sticks(files) -> None:
    f = files()
    w = f.writer(0)
    k = _key(7, 9)
    for _ in range(SATURATED + 10):
        w.add(k)
    assert w.count(k) == (SATURATED, SATURATED)
    for _ in range(SATURATED + 10):
        w.discard(k)
    assert w.count(k) == (SATURATED, SATURATED)  # a false "maybe" from now on, never a false "no"
    other = _key(8, 10)
    w.discard(other)  # a zero counter is never decremented below zero
    assert w.count(other) == (0, 0)


def test_two_regions(files) -> None:
    f = files(regions=2)
    l1, l2 = f.writer(0), f.writer(1)
    r = PresenceReader(f.name)
    assert r.regions == 2 and os.path.getsize(os.path.join(SHM_DIR, f.name)) == file_bytes(2, COUNTERS)
    a, b = _key(1, 2), _key(5, 6)
    l1.add(a)
    l2.add(b)
    assert r.may_hold(a) and r.may_hold(b)
    assert not r.may_hold(_key(1, 6))  # counters of different regions never make one key
    l2.add(a)
    l1.discard(a)
    assert r.may_hold(a)  # L2 still holds it
    l2.clear()
    assert not r.may_hold(a) and not r.may_hold(b)
    r.close()


def test_closed_filter_says_maybe(files) -> None:
    f = files()
    r = PresenceReader(f.name)
    k = os.urandom(16)
    assert not r.may_hold(k) and r.open
    f.close()  # the server stopped: the file is gone, a mapping left says "maybe"
    assert not os.path.exists(os.path.join(SHM_DIR, f.name))
    assert r.may_hold(k) and not r.open
    f.writer(0).add(k)  # a writer of a closed file does nothing
    r.close()
    assert r.may_hold(k)  # and a closed reader answers "maybe"


def test_new_server_closes_a_dead_ones_file(files) -> None:
    old = files()
    r = PresenceReader(old.name)
    assert not r.may_hold(os.urandom(16))
    new = PresenceFile.create(old.name, 1, counters=COUNTERS, epoch=2)  # the old server was killed: file left
    assert r.may_hold(os.urandom(16))  # the old mapping is marked closed
    fresh = PresenceReader(new.name)
    assert fresh.epoch == 2 and not fresh.may_hold(os.urandom(16))
    fresh.close()
    r.close()
    new.close()


def test_reader_refuses_other_files(tmp_path) -> None:
    name = f"kvtier-test-{uuid.uuid4().hex[:8]}.presence"
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as out:
        out.write(b"x" * HEADER_BYTES)
    try:
        with pytest.raises(PresenceMismatch):
            PresenceReader(name)
        assert not mark_closed(name)
    finally:
        os.unlink(path)


def test_costs(files) -> None:
    """The per-update and per-check costs docs/architecture.md quotes (printed with -s; bound loosely here)."""
    f = files(counters=4 << 20)
    w = f.writer(0)
    r = PresenceReader(f.name)
    keys = [os.urandom(16) for _ in range(20_000)]
    started = time.perf_counter()
    for k in keys:
        w.add(k)
    for k in keys:
        w.discard(k)
    update = (time.perf_counter() - started) / (2 * len(keys))
    started = time.perf_counter()
    for k in keys:
        r.may_hold(k)
    check = (time.perf_counter() - started) / len(keys)
    print(f"presence: {update * 1e9:.0f} ns per add or discard, {check * 1e9:.0f} ns per may_hold")
    assert update < 20e-6 and check < 20e-6
    r.close()
