"""From copies of whole engine blocks to DMA entries: (allocation offset, segment offset, bytes).

A copy names one chunk's blocks in the engine's memory (GpuMemory.page_pieces) and the chunk's page runs in
L1 (its extents); the chunk's pages follow each other in L1 layer-major or block-major (GpuMemory docstring).
The planner builds every piece of every named page with numpy, merges pieces that are contiguous on both
sides into one entry, then cuts entries where the chunk's bytes move from one page run to the next and where
they cross a page-locking piece of the segment (one DMA entry must not span two host registrations). The
same entries serve both directions. `check` is the cheap bounds check the daemon runs before anything moves.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from kvtier.server.protocol import GpuMemory
from kvtier.server.transfer.base import Copy, Entry


class PlanError(ValueError):
    """A copy that does not fit the registered memory or the segment."""


def check(memory: GpuMemory, copy: Copy, page_size: int, segment_size: int) -> None:
    """Block ids inside the allocation, the chunk's size that of its blocks' pages, its page runs inside the
    segment and large enough; PlanError otherwise."""
    if min(copy.block_ids) < 0 or max(copy.block_ids) >= memory.num_blocks:
        raise PlanError(f"block ids must be in [0, {memory.num_blocks})")
    if copy.size != memory.num_layers * copy.blocks * memory.page_bytes:
        raise PlanError(f"a chunk of {copy.blocks} blocks holds {memory.num_layers * copy.blocks * memory.page_bytes} "
                        f"bytes, not {copy.size}")
    pages = 0
    for first, count in zip(copy.extents[::2], copy.extents[1::2], strict=True):
        if first < 0 or count < 1 or (first + count) * page_size > segment_size:
            raise PlanError(f"page run ({first}, {count}) is outside the {segment_size}-byte segment")
        pages += count
    if pages * page_size < copy.size:
        raise PlanError(f"{pages} pages cannot hold a {copy.size}-byte chunk")


def _pieces(memory: GpuMemory, copy: Copy) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(device offset, chunk offset, bytes) of every piece of every page the copy names, in chunk order."""
    layers, runs, page, run = memory.num_layers, memory.runs, memory.page_bytes, memory.run_bytes
    blocks = np.asarray(copy.block_ids, dtype=np.int64)
    index = copy.first + np.arange(len(blocks), dtype=np.int64)  # the chunk's block of each engine block
    layer = np.arange(layers, dtype=np.int64)[:, None]
    dev = np.asarray(memory.layer_offsets, dtype=np.int64)[:, None] + blocks[None, :] * memory.block_stride
    pages = index[None, :] * layers + layer if memory.block_major else layer * copy.blocks + index[None, :]
    piece = np.arange(runs, dtype=np.int64)
    dev = (dev[:, :, None] + piece * memory.run_stride).ravel()
    chunk = (pages[:, :, None] * page + piece * run).ravel()
    order = np.argsort(chunk, kind="stable")
    return dev[order], chunk[order], np.full(len(order), run, dtype=np.int64)


def _merge(dev: np.ndarray, chunk: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Join neighbours contiguous on both sides (chunk offsets sorted)."""
    if len(dev) < 2:
        return dev, chunk, size
    joins = (dev[:-1] + size[:-1] == dev[1:]) & (chunk[:-1] + size[:-1] == chunk[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    ends = np.concatenate((starts[1:], [len(dev)]))
    return dev[starts], chunk[starts], chunk[ends - 1] + size[ends - 1] - chunk[starts]


def _cuts(copy: Copy, page_size: int, piece_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Chunk offsets where an entry must be cut (page-run starts and piece boundaries inside a run), and per
    page run its chunk start and segment start."""
    firsts = np.asarray(copy.extents[::2], dtype=np.int64) * page_size
    lengths = np.asarray(copy.extents[1::2], dtype=np.int64) * page_size
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    cuts = [starts[1:]]
    for seg, length, start in zip(firsts.tolist(), lengths.tolist(), starts.tolist(), strict=True):
        boundary = -(-seg // piece_bytes) * piece_bytes
        if boundary == seg:
            boundary += piece_bytes
        if boundary < seg + length:
            cuts.append(np.arange(boundary, seg + length, piece_bytes, dtype=np.int64) - seg + start)
    return np.unique(np.concatenate(cuts)), starts, firsts


def plan(memory: GpuMemory, copies: Sequence[Copy], page_size: int, segment_size: int,
         piece_bytes: int) -> list[Entry]:
    """The DMA entries of `copies`: exactly the bytes of their blocks, coalesced where contiguous on both
    sides, never crossing a multiple of `piece_bytes` in the segment."""
    out: list[Entry] = []
    for copy in copies:
        check(memory, copy, page_size, segment_size)
        dev, chunk, size = _merge(*_pieces(memory, copy))
        cuts, run_starts, run_segments = _cuts(copy, page_size, piece_bytes)
        if len(cuts):
            lo = np.searchsorted(cuts, chunk, side="right")
            hi = np.searchsorted(cuts, chunk + size, side="left")
            split = np.flatnonzero(hi > lo)  # entries with a cut strictly inside
            if len(split):
                counts = np.ones(len(dev), dtype=np.int64)
                counts[split] += hi[split] - lo[split]
                new_chunk = np.repeat(chunk, counts)
                new_dev = np.repeat(dev, counts)
                new_end = np.repeat(chunk + size, counts)
                pos = np.cumsum(counts) - counts  # where each entry's first part lands
                for i in split.tolist():
                    inner = cuts[lo[i]:hi[i]]
                    new_chunk[pos[i] + 1: pos[i] + 1 + len(inner)] = inner
                    new_end[pos[i]: pos[i] + len(inner)] = inner
                new_dev += new_chunk - np.repeat(chunk, counts)
                dev, chunk, size = new_dev, new_chunk, new_end - new_chunk
        run = np.searchsorted(run_starts, chunk, side="right") - 1
        seg = run_segments[run] + chunk - run_starts[run]
        out.extend(zip(dev.tolist(), seg.tolist(), size.tolist(), strict=True))
    return out
