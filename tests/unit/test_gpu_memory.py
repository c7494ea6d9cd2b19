"""connector/vllm/gpu_memory.describe on CPU tensors built as vLLM 0.32 builds its KV views (one int8 buffer,
`as_strided` per layout as v1/kv_cache_interface.py compute_layout_strides does, then `.view(dtype)` per
layer): every page GpuMemory names is exactly its block's bytes, and the copy planner moves whole blocks.

Needs torch: the dev venv skips it; run it with the vLLM venv's python (scripts/vllm_env.sh).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvtier.connector.vllm.gpu_memory import describe  # noqa: E402
from kvtier.server.protocol import GpuMemory  # noqa: E402
from kvtier.server.transfer.base import Copy  # noqa: E402
from kvtier.server.transfer.plan import plan  # noqa: E402

pytestmark = pytest.mark.unit

LAYERS, BLOCKS, HEADS, TOKENS, HEAD_SIZE = 3, 5, 2, 4, 8
DTYPE = torch.bfloat16
CONTENT = 2 * HEAD_SIZE * 2  # K and V of one head and token, bytes
PAGE = HEADS * TOKENS * CONTENT
OFFSET = 512  # the KV tensor starts this far into the allocation
HEADS_OUTSIDE = ("LHBNC", "BHLNC")


def kv_caches(buf: torch.Tensor, layout: str, padded_page: int = 0) -> dict[str, torch.Tensor]:
    """vLLM's per-layer [B, H, N, C] views of `buf` for `layout` (the physical order, outermost first); a
    padded page widens the stride of the inner of L and B as vLLM's page_size_padded does."""
    shape = {"L": LAYERS, "B": BLOCKS, "H": HEADS, "N": TOKENS, "C": CONTENT}
    strides, step = {}, 1
    page_grid_end = max(layout.index("L"), layout.index("B")) + 1
    for i, dim in reversed(list(enumerate(layout))):
        if padded_page and i == page_grid_end - 1:
            step = max(step, padded_page)
        strides[dim] = step
        step *= shape[dim]
    view = torch.as_strided(buf, [shape[d] for d in "LBHNC"], [strides[d] for d in "LBHNC"], OFFSET)
    return {f"model.layers.{layer}.self_attn.attn": view[layer].view(DTYPE) for layer in range(LAYERS)}


def allocation(padded_page: int = 0) -> torch.Tensor:
    return torch.zeros(OFFSET + LAYERS * BLOCKS * max(PAGE, padded_page) + 256, dtype=torch.int8)


def registered(buf: torch.Tensor, kv: dict[str, torch.Tensor], layout: str | None) -> GpuMemory:
    fields = describe(kv, buf.data_ptr(), buf.nbytes, layout)
    memory = GpuMemory(engine="cuda", device="GPU-00000000-0000-0000-0000-000000000000", handle=bytes(64),
                       events=(bytes(64),), pid=1, **fields)
    memory.check()
    assert GpuMemory.from_wire(memory.to_wire()) == memory
    return memory


CASES = [(layout, 0) for layout in GpuMemory.LAYOUTS] + [("LBNHC", PAGE + 64), ("BLHNC", PAGE + 64)]


@pytest.mark.parametrize("layout, padded_page", CASES)
def test_each_page_is_exactly_the_bytes_of_its_block(layout: str, padded_page: int) -> None:
    buf = allocation(padded_page)
    kv = kv_caches(buf, layout, padded_page)
    memory = registered(buf, kv, layout)
    assert (memory.layout, memory.num_layers, memory.num_blocks, memory.page_bytes) == (layout, LAYERS, BLOCKS, PAGE)
    assert memory.runs == (HEADS if layout in HEADS_OUTSIDE else 1)
    assert memory.block_major == layout.startswith("B")
    for layer, view in enumerate(kv.values()):
        for block in range(BLOCKS):
            view[block].view(torch.int16).fill_(-1)  # what torch indexing says the block is
            touched = buf.numpy() != 0
            buf.zero_()
            covered = np.zeros(buf.nbytes, dtype=np.int64)
            for at, size in memory.page_pieces(layer, block):
                covered[at : at + size] += 1
            assert covered.max() == 1, (layer, block)  # no byte named twice
            assert np.array_equal(covered == 1, touched), (layer, block)


@pytest.mark.parametrize("layout", GpuMemory.LAYOUTS)
def test_the_strides_alone_tell_the_layout(layout: str) -> None:
    buf = allocation()
    assert registered(buf, kv_caches(buf, layout), None).layout == layout


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC", "LHBNC", "BHLNC"])
def test_planned_entries_store_and_load_whole_blocks(layout: str) -> None:
    """Blocks 4, 0, 2 stored as one chunk in L1 pages that straddle a page-locking piece, then the chunk's
    blocks 1 and 2 loaded into engine blocks 1 and 3: the engine bytes move exactly as torch indexing says."""
    buf = allocation()
    buf.copy_(torch.randint(-128, 128, buf.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(3)))
    kv = kv_caches(buf, layout)
    memory = registered(buf, kv, layout)
    before = kv_caches(buf.clone(), layout)
    engine, l1 = buf.numpy().view(np.uint8), np.zeros(16 << 10, dtype=np.uint8)
    l1_page, piece = 1024, 4096  # the chunk's 3 x 3 pages (2304 bytes) sit in L1 pages 3..5: piece edge at 4096
    size = LAYERS * 3 * PAGE
    store = Copy(bytes(16), (4, 0, 2), 0, 3, (3, 3), size)
    for at, seg, n in plan(memory, [store], l1_page, l1.nbytes, piece):
        assert seg // piece == (seg + n - 1) // piece  # no entry crosses a piece
        l1[seg : seg + n] = engine[at : at + n]
    load = Copy(bytes(16), (1, 3), 1, 3, (3, 3), size)
    for at, seg, n in plan(memory, [load], l1_page, l1.nbytes, piece):
        engine[at : at + n] = l1[seg : seg + n]
    for now, was in zip(kv.values(), before.values(), strict=True):
        now, was = now.view(torch.int16), was.view(torch.int16)  # random bytes hold NaNs: compare bits
        assert torch.equal(now[1], was[0]) and torch.equal(now[3], was[2])
        assert all(torch.equal(now[b], was[b]) for b in (0, 2, 4))


def test_layers_sharing_kv_count_once_in_their_order() -> None:
    buf = allocation()
    kv = kv_caches(buf, "LBNHC")
    first = next(iter(kv.values()))
    kv["model.layers.3.self_attn.attn"] = first  # vLLM's cross-layer KV sharing: the same view again
    memory = registered(buf, kv, "LBNHC")
    assert memory.layer_offsets == tuple(OFFSET + layer * BLOCKS * PAGE for layer in range(LAYERS))


def test_views_that_are_not_what_vllm_registers_are_refused() -> None:
    buf = allocation()
    kv = kv_caches(buf, "LBNHC")
    with pytest.raises(ValueError, match="not laid out as BLHNC"):
        describe(kv, buf.data_ptr(), buf.nbytes, "BLHNC")
    with pytest.raises(ValueError, match="inside the allocation"):
        describe(kv, buf.data_ptr() + OFFSET + 1, buf.nbytes, "LBNHC")
    with pytest.raises(ValueError, match="all alike"):
        describe({**kv, "other": torch.zeros(BLOCKS, HEADS, TOKENS, 2 * HEAD_SIZE, dtype=torch.float32)},
                 buf.data_ptr(), buf.nbytes, "LBNHC")
