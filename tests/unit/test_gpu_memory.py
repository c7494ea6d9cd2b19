"""connector/vllm/gpu_memory.describe on CPU tensors built as vLLM 0.32 builds its KV views (one int8 buffer,
`as_strided` per layout as v1/kv_cache_interface.py compute_layout_strides does, then `.view(dtype)` per
layer): every page GpuMemory names is exactly its block's bytes, and the copy planner moves whole blocks.
Kernel blocks smaller than vLLM's blocks are checked on views made by vLLM's own allocation code.

Needs torch: the dev venv skips it; run it with the vLLM venv's python (scripts/vllm_env.sh).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

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
    fields = describe(kv, buf.data_ptr(), buf.nbytes, layout, num_blocks=BLOCKS)
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
        describe(kv, buf.data_ptr(), buf.nbytes, "BLHNC", num_blocks=BLOCKS)
    with pytest.raises(ValueError, match="inside the allocation"):
        describe(kv, buf.data_ptr() + OFFSET + 1, buf.nbytes, "LBNHC", num_blocks=BLOCKS)
    with pytest.raises(ValueError, match="all alike"):
        describe({**kv, "other": torch.zeros(BLOCKS, HEADS, TOKENS, 2 * HEAD_SIZE, dtype=torch.float32)},
                 buf.data_ptr(), buf.nbytes, "LBNHC", num_blocks=BLOCKS)


# Kernel blocks: vLLM's own allocation code, as a worker runs it when the attention backend's kernel blocks are
# smaller than --block-size (FlashInfer at 128, FlashMLA's 64): register_kv_caches then gets kernel-block views.

def vllm_allocation(spec: Any, layout: str, kernel_block_size: int | None) -> tuple[Any, dict[str, torch.Tensor]]:
    """vLLM 0.32's KV cache config for 2 layers of `spec` in `layout` (get_kv_cache_config_from_groups) and the
    views its worker allocates and hands register_kv_caches (allocate_kv_cache) on CPU."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    resolved = KVCacheLayout[layout]
    cache = SimpleNamespace(get_resolved_kv_cache_layout=lambda: resolved, num_gpu_blocks_override=None,
                            prefix_cache_retention_interval=None)
    vllm_config = SimpleNamespace(cache_config=cache, attention_config=SimpleNamespace(hisparse_config=None))
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    config = get_kv_cache_config_from_groups(vllm_config, [KVCacheGroupSpec(layers, spec)],
                                             2 * 3 * spec.page_size_bytes)
    kv = allocate_kv_cache(config, torch.device("cpu"), resolved,
                           None if kernel_block_size is None else [kernel_block_size])
    return config, kv


def full(heads: int) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=128, num_kv_heads=heads, head_size=8, dtype=DTYPE)


def mla() -> Any:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=24, dtype=DTYPE)


def element_offsets(kv: dict[str, torch.Tensor], base: int, split: int) -> list[int]:
    """Byte offset of every (layer, block, head, token) of vLLM's views, in that order (token t of block b is
    kernel block b * split + t // kernel tokens)."""
    out = []
    for view in kv.values():
        kernel_tokens = view.shape[2]
        for block in range(view.shape[0] // split):
            for head in range(view.shape[1]):
                out += [view[block * split + t // kernel_tokens, head, t % kernel_tokens].data_ptr() - base
                        for t in range(kernel_tokens * split)]
    return out


@pytest.mark.parametrize("make_spec, layout, kernel", [(lambda: full(2), "LBNHC", 32), (mla, "LBNHC", 64),
                                                        (mla, "LBHNC", 64)])
def test_kernel_blocks_are_regrouped_into_vllm_blocks(make_spec: Any, layout: str, kernel: int) -> None:
    """Block b's page is exactly vLLM's block b (its kernel blocks, grouped as vLLM's own offloading connector
    groups them), laid out as the same block of an engine that does not split: the namespace can be shared."""
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    spec = make_spec()
    config, kv = vllm_allocation(spec, layout, kernel)
    first = next(iter(kv.values()))
    split = spec.block_size // kernel
    assert first.shape[0] == split * config.num_blocks  # the views are of kernel blocks
    buf = torch.tensor([], dtype=torch.int8).set_(first.untyped_storage())
    memory = GpuMemory(engine="cuda", device="GPU-00000000-0000-0000-0000-000000000000", handle=bytes(64),
                       events=(bytes(64),), pid=1,
                       **describe(kv, buf.data_ptr(), buf.nbytes, layout, num_blocks=config.num_blocks))
    memory.check()
    assert (memory.num_blocks, memory.page_bytes, memory.runs) == (config.num_blocks, spec.page_size_bytes, 1)
    for layer, view in enumerate(kv.values()):
        for block in range(config.num_blocks):
            group_kernel_blocks(view, config.num_blocks)[block].view(torch.int8).fill_(-1)
            touched = buf.numpy() != 0
            buf.zero_()
            covered = np.zeros(buf.nbytes, dtype=np.int64)
            for at, size in memory.page_pieces(layer, block):
                covered[at : at + size] += 1
            assert np.array_equal(covered == 1, touched), (layer, block)
    _, unsplit = vllm_allocation(spec, layout, None)
    unsplit_base = next(iter(unsplit.values())).untyped_storage().data_ptr()
    assert element_offsets(kv, buf.data_ptr(), split) == element_offsets(unsplit, unsplit_base, 1)


def test_kernel_blocks_with_the_heads_outside_the_tokens_are_refused() -> None:
    """FlashInfer's HND layout split into kernel blocks: a regrouped block orders its bytes otherwise than an
    unsplit one (so no engine could share it), and registration refuses it rather than copy it."""
    spec = full(2)
    config, kv = vllm_allocation(spec, "LBHNC", 32)
    _, unsplit = vllm_allocation(spec, "LBHNC", None)
    storage = next(iter(kv.values())).untyped_storage()
    assert element_offsets(kv, storage.data_ptr(), 4) != element_offsets(
        unsplit, next(iter(unsplit.values())).untyped_storage().data_ptr(), 1)
    with pytest.raises(ValueError, match="heads outside the tokens"):
        describe(kv, storage.data_ptr(), storage.nbytes(), "LBHNC", num_blocks=config.num_blocks)
    with pytest.raises(ValueError, match="not kernel blocks"):
        describe(kv, storage.data_ptr(), storage.nbytes(), "LBHNC", num_blocks=5)  # 12 kernel blocks
