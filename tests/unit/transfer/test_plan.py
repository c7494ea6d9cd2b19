"""The GPU copy planner (server/transfer/plan.py) against a naive byte-by-byte reference: for every layout,
partial chunks, scattered page runs and page-locking pieces, the entries move exactly the copy's bytes to
exactly their L1 places, each once, sorted, never across a piece or a page run, merged wherever they may be;
and `check` refuses what does not fit the registration or the segment."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from kvtier.server.protocol import GpuMemory
from kvtier.server.transfer.base import Copy, Entry
from kvtier.server.transfer.plan import PlanError, check, plan

pytestmark = pytest.mark.unit

SETTINGS = settings(max_examples=200, deadline=None)
KEY = b"k" * 16


@dataclass(frozen=True)
class Case:
    """One copy and the L1 geometry it is planned against."""

    memory: GpuMemory
    copy: Copy
    page_size: int
    segment_size: int
    piece_bytes: int


def engine_memory(layout: str, layers: int, num_blocks: int, heads: int, head_bytes: int, pad: int,
                  base: int, order: list[int]) -> GpuMemory:
    """The registration vLLM's `layout` gives (pages of `heads` pieces of `head_bytes`), every stride
    padded by `pad`, the layers' places permuted by `order`."""
    page = heads * head_bytes
    if layout in ("LBNHC", "LBHNC"):  # whole pages, blocks inside layers
        block_stride, run_stride, runs = page + pad, 0, 1
        layer_stride = num_blocks * block_stride + pad
    elif layout == "LHBNC":  # heads outside blocks, inside layers
        block_stride, runs = head_bytes + pad, heads
        run_stride = num_blocks * block_stride + pad
        layer_stride = heads * run_stride
    elif layout in ("BLHNC", "BLNHC"):  # whole pages, layers inside blocks
        layer_stride, run_stride, runs = page + pad, 0, 1
        block_stride = layers * layer_stride + pad
    else:  # BHLNC: heads outside layers, inside blocks
        layer_stride, runs = head_bytes + pad, heads
        run_stride = layers * layer_stride + pad
        block_stride = heads * run_stride
    if runs == 1:
        page_span, run_stride = page, 0
    else:
        page_span = (runs - 1) * run_stride + head_bytes
    offsets = tuple(base + order[layer] * layer_stride for layer in range(layers))
    alloc = max(offsets) + (num_blocks - 1) * block_stride + page_span
    memory = GpuMemory("fake", "fake-0", b"dev", alloc, offsets, block_stride, num_blocks, page, runs,
                       run_stride, layout, (b"e0",), 1)
    memory.check()
    return memory


@st.composite
def cases(draw: st.DrawFn, layout: str) -> Case:
    """A valid copy: distinct engine blocks for blocks [first, first + n) of an m-block chunk, whose pages
    (perhaps a few more than it needs) lie in page runs scattered over the segment in any order."""
    layers = draw(st.integers(1, 3))
    num_blocks = draw(st.integers(1, 8))
    pad = draw(st.one_of(st.just(0), st.integers(1, 3)))
    memory = engine_memory(layout, layers, num_blocks, draw(st.integers(1, 3)), draw(st.integers(1, 16)), pad,
                           draw(st.integers(0, 5)), draw(st.permutations(range(layers))))
    blocks = draw(st.integers(1, 4))
    first = draw(st.integers(0, blocks - 1))
    count = draw(st.integers(1, min(blocks - first, num_blocks)))
    neighbours = st.integers(0, num_blocks - count).map(lambda b: list(range(b, b + count)))  # mergeable
    scattered = st.lists(st.integers(0, num_blocks - 1), min_size=count, max_size=count, unique=True)
    block_ids = draw(st.one_of(neighbours, scattered))
    size = layers * blocks * memory.page_bytes
    page_size = draw(st.integers(1, 2 * memory.page_bytes))
    pages = -(-size // page_size) + draw(st.integers(0, 2))
    ends = sorted(draw(st.sets(st.integers(1, pages - 1), max_size=pages - 1))) if pages > 1 else []
    lengths = np.diff([0, *ends, pages]).tolist()
    place = draw(st.permutations(range(len(lengths))))  # the runs' order in the segment
    starts, at = [0] * len(lengths), draw(st.integers(0, 2))
    for run in place:
        starts[run] = at
        at += lengths[run] + draw(st.integers(0, 2))
    extents = tuple(v for run in zip(starts, lengths, strict=True) for v in run)
    segment_size = at * page_size + draw(st.integers(0, page_size - 1))
    whole_pages = st.integers(1, 4).map(lambda n: n * page_size)
    piece_bytes = draw(st.one_of(st.integers(1, 3 * page_size), whole_pages))
    return Case(memory, Copy(KEY, tuple(block_ids), first, blocks, extents, size), page_size, segment_size,
                piece_bytes)


def runs_of(case: Case) -> list[tuple[int, int]]:
    """[segment start, segment end) of each page run, in chunk order."""
    ext, ps = case.copy.extents, case.page_size
    return [(f * ps, (f + n) * ps) for f, n in zip(ext[::2], ext[1::2], strict=True)]


def reference(case: Case) -> np.ndarray:
    """Device byte -> segment byte (-1: not copied), one page piece and one byte at a time."""
    memory, copy = case.memory, case.copy
    segment_of_chunk = np.concatenate([np.arange(lo, hi) for lo, hi in runs_of(case)])
    out = np.full(memory.alloc_size, -1, dtype=np.int64)
    for layer in range(memory.num_layers):
        for i, block in enumerate(copy.block_ids):
            j = copy.first + i
            page = j * memory.num_layers + layer if memory.block_major else layer * copy.blocks + j
            at = page * memory.page_bytes
            for dev, size in memory.page_pieces(layer, block):
                for k in range(size):
                    assert out[dev + k] == -1, "the test's registration overlaps itself"
                    out[dev + k] = segment_of_chunk[at + k]
                at += size
    return out


def planned(case: Case, entries: list[Entry]) -> np.ndarray:
    """Device byte -> segment byte that `entries` give; fails if a byte is moved twice on either side."""
    out = np.full(case.memory.alloc_size, -1, dtype=np.int64)
    seen = np.zeros(case.segment_size, dtype=bool)
    for dev, seg, size in entries:
        assert size > 0 and dev >= 0 and seg >= 0
        assert dev + size <= case.memory.alloc_size and seg + size <= case.segment_size
        assert (out[dev:dev + size] == -1).all(), f"device bytes of {(dev, seg, size)} copied twice"
        assert not seen[seg:seg + size].any(), f"segment bytes of {(dev, seg, size)} copied twice"
        out[dev:dev + size] = np.arange(seg, seg + size)
        seen[seg:seg + size] = True
    return out


@pytest.mark.parametrize("layout", GpuMemory.LAYOUTS)
@SETTINGS
@given(data=st.data())
def test_entries_move_exactly_the_reference_bytes_in_pieces(layout: str, data: st.DataObject) -> None:
    case = data.draw(cases(layout))
    entries = plan(case.memory, [case.copy], case.page_size, case.segment_size, case.piece_bytes)
    assert np.array_equal(planned(case, entries), reference(case))
    assert plan(case.memory, [case.copy, case.copy], case.page_size, case.segment_size,
                case.piece_bytes) == entries + entries

    runs = runs_of(case)
    run_starts = {lo for lo, _ in runs}
    chunk_at = []  # each entry's offset in the chunk
    piece = case.piece_bytes
    for dev, seg, size in entries:
        assert seg // piece == (seg + size - 1) // piece, f"{(dev, seg, size)} crosses a piece"
        run = next((k for k, (lo, hi) in enumerate(runs) if lo <= seg < hi), None)
        assert run is not None and seg + size <= runs[run][1], f"{(dev, seg, size)} crosses a page run"
        chunk_at.append(sum(hi - lo for lo, hi in runs[:run]) + seg - runs[run][0])
    sizes = [size for _, _, size in entries]
    in_order = zip(chunk_at, sizes, chunk_at[1:], strict=False)
    assert all(a + n <= b for a, n, b in in_order), "entries not in chunk order or overlapping"

    ends = {(dev + size, seg + size) for dev, seg, size in entries}
    for dev, seg, _ in entries:  # entries adjacent on both sides only where a cut separates them
        if (dev, seg) in ends:
            assert seg % piece == 0 or seg in run_starts, f"entry at {(dev, seg)} was not merged"


def test_whole_pages_in_one_run_are_one_entry_per_block_and_cut_at_pieces() -> None:
    """A known answer: LBNHC, 2 layers of 4 blocks of 64 bytes; blocks 1-2 of a 3-block chunk from engine
    blocks 2-3 in pages 10.. of 32 bytes: one entry per layer (the blocks are neighbours), cut at 128 bytes
    (the first already starts at one)."""
    memory = engine_memory("LBNHC", 2, 4, 1, 64, 0, 0, [0, 1])
    copy = Copy(KEY, (2, 3), 1, 3, (10, 12), 2 * 3 * 64)
    assert plan(memory, [copy], 32, 32 * 32, 1 << 20) == [(128, 320 + 64, 128), (256 + 128, 320 + 256, 128)]
    assert plan(memory, [copy], 32, 32 * 32, 128) == [(128, 384, 128), (384, 576, 64), (448, 640, 64)]


@st.composite
def bad_cases(draw: st.DrawFn) -> Case:
    """A valid case broken one way: a block id outside the allocation, a wrong size or one more page run
    outside the segment (negative, empty or past its end)."""
    case = draw(cases(draw(st.sampled_from(GpuMemory.LAYOUTS))))
    copy, memory = case.copy, case.memory
    how = draw(st.sampled_from(["block", "size", "run"]))
    if how == "block":
        i = draw(st.integers(0, len(copy.block_ids) - 1))
        bad = draw(st.one_of(st.integers(-3, -1), st.integers(memory.num_blocks, memory.num_blocks + 3)))
        block_ids = copy.block_ids[:i] + (bad,) + copy.block_ids[i + 1:]
        return replace(case, copy=replace(copy, block_ids=block_ids))
    if how == "size":
        size = draw(st.integers(1, 2 * copy.size).filter(lambda s: s != copy.size))
        return replace(case, copy=replace(copy, size=size))
    k = 2 * draw(st.integers(0, len(copy.extents) // 2))  # an extra run, so that only its own fault is wrong
    end = case.segment_size // case.page_size
    run = draw(st.sampled_from([(-1, 1), (0, 0), (0, -1), (end, 1), (end - 1, 2)]))
    return replace(case, copy=replace(copy, extents=copy.extents[:k] + run + copy.extents[k:]))


@SETTINGS
@given(case=bad_cases())
def test_copies_outside_the_registration_or_the_segment_are_refused(case: Case) -> None:
    with pytest.raises(PlanError):
        check(case.memory, case.copy, case.page_size, case.segment_size)
    with pytest.raises(PlanError):
        plan(case.memory, [case.copy], case.page_size, case.segment_size, case.piece_bytes)


@SETTINGS
@given(data=st.data())
def test_too_few_pages_are_refused(data: st.DataObject) -> None:
    case = data.draw(cases(data.draw(st.sampled_from(GpuMemory.LAYOUTS))))
    needed = -(-case.copy.size // case.page_size)
    assume(needed > 1)
    copy = replace(case.copy, extents=(0, needed - 1))
    with pytest.raises(PlanError, match="cannot hold"):
        check(case.memory, copy, case.page_size, case.segment_size)
    check(case.memory, replace(copy, extents=(0, needed)), case.page_size, case.segment_size)
