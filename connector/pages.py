"""Byte access to one chunk's L1 pages through the client's mapping of the segment.

A chunk lives in a few runs of contiguous pages; a PageSpan turns the chunk's logical byte range into
those runs so callers copy straight between their own buffers and L1: one memcpy per direction.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

import numpy as np


class PageSpan:
    def __init__(self, segment: np.ndarray, extents: Sequence[int], page_size: int, size: int) -> None:
        self.size = size
        self._runs: list[tuple[int, int]] = []  # (segment offset, length) per extent
        self._starts: list[int] = []  # logical offset at which each run starts
        if len(extents) % 2:
            raise ValueError("extents are (first page, page count) pairs")
        segment_pages = len(segment) // page_size
        logical = 0
        for i in range(0, len(extents), 2):
            first, count = extents[i], extents[i + 1]
            # Both ends of every run, before any copy: numpy would follow a negative page number to the
            # segment's last pages.
            if not (isinstance(first, int) and isinstance(count, int) and first >= 0 and count > 0
                    and first + count <= segment_pages):
                raise ValueError(f"page run ({first}, {count}) lies outside the {segment_pages}-page segment")
            length = min(count * page_size, size - logical)
            if length <= 0:
                break
            self._starts.append(logical)
            self._runs.append((first * page_size, length))
            logical += length
        if logical < size:
            raise ValueError(f"pages hold {logical} bytes, chunk has {size}")
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
