"""Page extents -> bytes: the one mapping from a chunk's L1 pages to views of the shared-memory segment.

A chunk lives in a few runs of contiguous pages, given as flat (first page, page count, ...) extents.
`extent_byte_ranges` turns extents into segment byte ranges; `extent_views` gives a chunk's bytes as one
memoryview per run (whole-chunk copies: L2 reads and writes); a PageSpan turns the chunk's logical byte
range into those runs so callers copy straight between their own buffers and L1: one memcpy per direction.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

import numpy as np


def extent_byte_ranges(extents: Sequence[int], page_size: int) -> Iterator[tuple[int, int]]:
    """The (start, end) segment byte range of each (first page, page count) run of `extents`, in order.

    Raises ValueError, as it reaches the run, for extents that are not pairs or a run that is not two ints
    with first >= 0 and count > 0; the end of the segment is the caller's to check (it alone knows it).
    """
    if len(extents) % 2:
        raise ValueError("extents are (first page, page count) pairs")
    for i in range(0, len(extents), 2):
        first, count = extents[i], extents[i + 1]
        # Numpy would follow a negative page number to the segment's last pages.
        if not (isinstance(first, int) and isinstance(count, int) and first >= 0 and count > 0):
            raise ValueError(f"page run ({first}, {count}) is not a (first page >= 0, page count > 0) pair")
        yield first * page_size, (first + count) * page_size


def chunk_runs(segment: np.ndarray, extents: Sequence[int], page_size: int, size: int) -> list[tuple[int, int]]:
    """(segment offset, length) of each run that holds the chunk's `size` bytes, in chunk order.

    Both ends of every run it uses, and the run after the last one it uses, are checked before any copy
    can happen; ValueError if a run lies outside the segment or the runs hold fewer than `size` bytes.
    """
    segment_pages = len(segment) // page_size
    runs: list[tuple[int, int]] = []
    logical = 0
    for start, end in extent_byte_ranges(extents, page_size):
        if end > segment_pages * page_size:
            raise ValueError(f"page run ({start // page_size}, {(end - start) // page_size}) lies outside "
                             f"the {segment_pages}-page segment")
        length = min(end - start, size - logical)
        if length <= 0:
            break
        runs.append((start, length))
        logical += length
    if logical < size:
        raise ValueError(f"pages hold {logical} bytes, chunk has {size}")
    return runs


def extent_views(segment: np.ndarray, extents: Sequence[int], page_size: int, size: int) -> list[memoryview]:
    """The chunk's `size` bytes as one memoryview of the segment per run (bounds-checked as a PageSpan)."""
    return [memoryview(segment[start : start + length]) for start, length in
            chunk_runs(segment, extents, page_size, size)]


class PageSpan:
    def __init__(self, segment: np.ndarray, extents: Sequence[int], page_size: int, size: int) -> None:
        self.size = size
        self._runs = chunk_runs(segment, extents, page_size, size)  # (segment offset, length) per extent
        self._starts: list[int] = []  # logical offset at which each run starts
        logical = 0
        for _, length in self._runs:
            self._starts.append(logical)
            logical += length
        self._segment = segment

    def pieces(self, offset: int, length: int) -> Iterator[tuple[int, np.ndarray]]:
        """(position within the request, segment view) pieces covering [offset, offset + length)."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"range [{offset}, {offset + length}) outside a chunk of {self.size} bytes")
        i = bisect.bisect_right(self._starts, offset) - 1
        done = 0
        while done < length:
            seg_off, run_len = self._runs[i]
            inner = offset + done - self._starts[i]
            n = min(run_len - inner, length - done)
            yield done, self._segment[seg_off + inner : seg_off + inner + n]
            done += n
            i += 1

    def _within_run(self, offset: int, length: int) -> np.ndarray | None:
        """The segment view of [offset, offset + length) when one page run holds it all (the common case:
        per-block copies of a chunk in one or two runs), so that a copy costs one slice and one np.copyto
        instead of a generator; None otherwise (a split range or an out-of-range request)."""
        if offset < 0 or length < 0 or offset + length > self.size:
            return None
        i = bisect.bisect_right(self._starts, offset) - 1
        seg_off, run_len = self._runs[i]
        inner = offset - self._starts[i]
        if inner + length > run_len:
            return None
        return self._segment[seg_off + inner : seg_off + inner + length]

    def write(self, offset: int, src: np.ndarray) -> None:
        """Copy a flat uint8 array into the chunk at `offset`."""
        view = self._within_run(offset, src.nbytes)
        if view is not None:
            np.copyto(view, src)
            return
        for pos, view in self.pieces(offset, src.nbytes):
            np.copyto(view, src[pos : pos + view.nbytes])

    def read(self, offset: int, dst: np.ndarray) -> None:
        """Copy the chunk's bytes at `offset` into a flat uint8 array."""
        view = self._within_run(offset, dst.nbytes)
        if view is not None:
            np.copyto(dst, view)
            return
        for pos, view in self.pieces(offset, dst.nbytes):
            np.copyto(dst[pos : pos + view.nbytes], view)
