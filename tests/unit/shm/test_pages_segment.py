"""PageSpan and extent_views byte mapping over page extents, and POSIX shared-memory segment ownership."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import resource
import threading
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier.shm.pages import PageSpan, extent_byte_ranges, extent_views
from kvtier.shm.segment import SHM_DIR, Segment, SegmentInUse, remove_stale, tmpfs_options

pytestmark = pytest.mark.unit

PAGE = 64
NUM_PAGES = 32


@st.composite
def spans(draw):
    """Distinct pages grouped into runs, and a chunk size those pages hold (last page possibly partial)."""
    pages = draw(st.permutations(range(NUM_PAGES)))
    n = draw(st.integers(1, 12))
    chosen = sorted(pages[:n]) if draw(st.booleans()) else list(pages[:n])
    extents: list[int] = []
    for page in chosen:
        if extents and extents[-2] + extents[-1] == page:
            extents[-1] += 1
        else:
            extents += [page, 1]
    size = draw(st.integers((n - 1) * PAGE + 1, n * PAGE))
    return chosen, extents, size


@settings(max_examples=200, deadline=None)
@given(span=spans(), data=st.data())
def test_pagespan_maps_logical_bytes_onto_pages(span, data):
    pages, extents, size = span
    segment = np.zeros(NUM_PAGES * PAGE, dtype=np.uint8)
    ps = PageSpan(segment, extents, PAGE, size)
    payload = np.random.default_rng(size).integers(1, 256, size, dtype=np.uint8)
    ps.write(0, payload)
    # Byte i of the chunk lives at page pages[i // PAGE], offset i % PAGE.
    expect = np.zeros_like(segment)
    for i, page in enumerate(pages):
        piece = payload[i * PAGE : (i + 1) * PAGE]
        expect[page * PAGE : page * PAGE + len(piece)] = piece
    assert np.array_equal(segment, expect)
    # Any sub-range reads back what was written.
    off = data.draw(st.integers(0, size))
    length = data.draw(st.integers(0, size - off))
    out = np.empty(length, dtype=np.uint8)
    ps.read(off, out)
    assert np.array_equal(out, payload[off : off + length])
    with pytest.raises(ValueError):
        ps.read(off, np.empty(size - off + 1, dtype=np.uint8))


def test_pagespan_rejects_too_few_pages_and_out_of_segment():
    segment = np.zeros(4 * PAGE, dtype=np.uint8)
    with pytest.raises(ValueError):
        PageSpan(segment, [0, 1], PAGE, PAGE + 1)
    with pytest.raises(ValueError):
        PageSpan(segment, [3, 2], PAGE, 2 * PAGE)


def test_extent_views_are_the_segment_slices_of_each_run():
    segment = np.arange(8 * PAGE, dtype=np.uint64).astype(np.uint8)
    extents = [5, 2, 0, 1, 3, 1]
    views = extent_views(segment, extents, PAGE, 4 * PAGE)
    assert [bytes(v) for v in views] == [
        segment[5 * PAGE : 7 * PAGE].tobytes(), segment[:PAGE].tobytes(), segment[3 * PAGE : 4 * PAGE].tobytes()]
    # The views share the segment's memory (an L2 read lands in L1 directly).
    views[1][0] = 0xAB
    assert segment[0] == 0xAB
    assert list(extent_byte_ranges(extents, PAGE)) == [(5 * PAGE, 7 * PAGE), (0, PAGE), (3 * PAGE, 4 * PAGE)]


def test_extent_views_truncate_to_the_chunk_size():
    segment = np.arange(8 * PAGE, dtype=np.uint64).astype(np.uint8)
    views = extent_views(segment, [5, 2, 0, 1, 3, 1], PAGE, PAGE + 10)
    assert [bytes(v) for v in views] == [segment[5 * PAGE : 6 * PAGE + 10].tobytes()]
    views = extent_views(segment, [5, 2, 0, 1], PAGE, 2 * PAGE + 1)
    assert [len(v) for v in views] == [2 * PAGE, 1]
    assert extent_views(segment, [5, 2], PAGE, 0) == []


@pytest.mark.parametrize("extents", [(7, 2), (8, 1), (-1, 1), (0, 0), (0, -1), (0, 1, 9, 1), (0,), (0.5, 1)])
def test_extent_views_reject_a_run_outside_the_segment(extents):
    segment = np.zeros(8 * PAGE, dtype=np.uint8)
    with pytest.raises(ValueError):
        extent_views(segment, extents, PAGE, 2 * PAGE)


def test_extent_views_reject_too_few_pages():
    segment = np.zeros(8 * PAGE, dtype=np.uint8)
    with pytest.raises(ValueError):
        extent_views(segment, [0, 1], PAGE, PAGE + 1)


@pytest.fixture
def seg_name():
    name = f"kvtier-unit-{uuid.uuid4().hex[:12]}"
    yield name
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))


def test_segment_create_attach_share_bytes_and_close_removes(seg_name):
    owner = Segment.create(seg_name, 1 << 20)
    path = os.path.join(SHM_DIR, seg_name)
    assert os.path.exists(path) and (os.stat(path).st_mode & 0o777) == 0o600
    client = Segment.attach(seg_name, 1 << 20)
    owner.array()[123:127] = [1, 2, 3, 4]
    assert client.array()[123:127].tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        Segment.attach(seg_name, 1 << 19)
    client.close()
    assert os.path.exists(path)  # a client never removes the segment
    owner.close()
    assert not os.path.exists(path)


def test_live_segment_cannot_be_taken_over(seg_name):
    owner = Segment.create(seg_name, 4096)
    with pytest.raises(SegmentInUse, match="owned by a running server"):
        Segment.create(seg_name, 4096)
    with pytest.raises(SegmentInUse):
        remove_stale(seg_name)
    assert os.path.exists(os.path.join(SHM_DIR, seg_name))
    owner.close()


def test_stale_segment_is_removed_on_create(seg_name):
    path = os.path.join(SHM_DIR, seg_name)
    with open(path, "wb") as fh:  # left behind by a killed owner: no lock held
        fh.write(b"old")
    seg = Segment.create(seg_name, 8192)
    assert os.stat(path).st_size == 8192
    seg.close()
    assert remove_stale(seg_name) is False


@pytest.mark.parametrize("name", ["", "../etc/passwd", "a/b", "x" * 201, "sp ace"])
def test_invalid_segment_names(name):
    with pytest.raises(ValueError):
        Segment.create(name, 4096)


@pytest.mark.parametrize("mode", [0o600, 0o660, 0o666])
def test_segment_mode_is_exact_despite_umask(seg_name, mode):
    old = os.umask(0o022)
    try:
        seg = Segment.create(seg_name, 4096, mode)
    finally:
        os.umask(old)
    assert os.stat(os.path.join(SHM_DIR, seg_name)).st_mode & 0o777 == mode
    seg.close()


def test_tmpfs_options_accepts_tmpfs_and_refuses_other_filesystems(tmp_path):
    assert isinstance(tmpfs_options(SHM_DIR), dict)
    with pytest.raises(ValueError, match="not tmpfs"):
        tmpfs_options("/proc")
    with pytest.raises(ValueError, match="does not exist"):
        tmpfs_options(str(tmp_path / "missing"))


def _faults_writing_every_page(segment: Segment) -> int:
    """Minor page faults this thread takes writing one byte into every page of `segment`."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    segment.array()[:: mmap.PAGESIZE] = 7
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_populate_maps_every_page_ahead_so_that_writes_take_no_fault(seg_name):
    size = 8 << 20
    pages = size // mmap.PAGESIZE
    owner = Segment.create(seg_name, size)
    assert owner.prefault(threading.Event(), lambda _done: None)  # backed, as by the server's prefault
    cold, warm, stopped = (Segment.attach(seg_name, size) for _ in range(3))
    try:
        try:
            assert warm.populate(threading.Event(), step=1 << 20)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14 or later")
            raise
        assert _faults_writing_every_page(cold) >= pages // 2  # not mapped ahead: pages fault in on first touch
        assert _faults_writing_every_page(warm) < pages // 16
        assert owner.array()[:: mmap.PAGESIZE].tolist() == [7] * pages  # the same memory, written once more
        stop = threading.Event()
        stop.set()
        assert not stopped.populate(stop)
        assert _faults_writing_every_page(stopped) >= pages // 2  # a stopped pass mapped nothing
    finally:
        for segment in (cold, warm, stopped, owner):
            segment.close()
