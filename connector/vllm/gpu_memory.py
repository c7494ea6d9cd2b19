"""A vLLM 0.32 GPU worker's KV cache as kvtier registers it (protocol.GpuMemory), with torch only. Not yet run
on a GPU.

vLLM 0.32 puts every layer of the KV cache in one int8 allocation and hands `register_kv_caches` one
[B, H, N, C] view per layer (blocks, KV heads, tokens, K||V content of one head and token), strided in one of
six physical orders of [L, B, H, N, C] (v1/kv_cache_layout.py, v1/kv_cache_interface.py
create_kv_cache_views): layer l's block b starts at offset + l * layer_stride + b * block_stride. `describe`
reads the GpuMemory geometry back from those views: a block's page is one run of bytes unless the heads sit
outside the blocks (LHBNC, BHLNC: one piece per head). When the attention backend's kernel blocks are
smaller than vLLM's blocks (FlashInfer with --block-size >= 128, FlashMLA), the views are of kernel blocks,
k per vLLM block; `describe` regroups them into vLLM's blocks as vLLM's own offloading connector does
(v1/kv_cache_interface.py group_kernel_blocks), or refuses. `export` adds what the copier needs to reach the
memory: the raw CUDA IPC handle of the allocation's base, the GPU's UUID and a pool of interprocess events
(shm/cuda_ipc.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from itertools import pairwise
from typing import Any

import torch
from kvtier.server.protocol import GpuMemory
from kvtier.shm import cuda_ipc


def _fits(layout: str, sizes: dict[str, int], strides: dict[str, int]) -> bool:
    """Whether the strides nest as `layout` orders the dimensions (outermost first); dimensions of one element
    have no place."""
    dims = [d for d in layout if sizes[d] > 1]
    return all(strides[outer] >= sizes[inner] * strides[inner] for outer, inner in pairwise(dims))


def describe(kv_caches: Mapping[str, torch.Tensor], base: int, size: int, layout: str | None = None, *,
             num_blocks: int) -> dict[str, Any]:
    """GpuMemory's geometry (alloc_size, layer_offsets, block_stride, num_blocks, page_bytes, runs, run_stride,
    layout) of vLLM's per-layer views into the allocation [base, base + size): one layer per distinct view, in
    the order given (layers that share KV alias one view). `layout` is vLLM's resolved layout name, checked
    against the strides; without it, the first of GpuMemory.LAYOUTS the strides fit. `num_blocks`: vLLM's
    block count (KVCacheConfig.num_blocks), the blocks the scheduler's block ids name; views of k times as
    many kernel blocks are regrouped, k consecutive kernel blocks per block. ValueError for views kvtier
    cannot register."""
    views = list({t.data_ptr(): t for t in kv_caches.values()}.values())
    if not views:
        raise ValueError("no KV cache layers")
    first = views[0]
    if first.dim() != 4 or any((t.shape, t.stride(), t.dtype) != (first.shape, first.stride(), first.dtype)
                               for t in views):
        raise ValueError("expected one [blocks, heads, tokens, content] view per layer, all alike (vLLM 0.32)")
    item = first.element_size()
    blocks, heads, tokens, content = first.shape
    if num_blocks < 1 or blocks % num_blocks:
        raise ValueError(f"{blocks} blocks in the KV views are not kernel blocks of vLLM's {num_blocks} blocks")
    split = blocks // num_blocks  # kernel blocks per vLLM block
    block_stride, head_stride, token_stride, content_stride = (s * item for s in first.stride())
    if content_stride != item:
        raise ValueError("the content of a (head, token) must be contiguous")
    offsets = [t.data_ptr() - base for t in views]
    gaps = {b - a for a, b in pairwise(offsets)}
    if min(offsets) < 0 or len(gaps) > 1 or min(gaps, default=1) <= 0:
        raise ValueError("the layers must be evenly spaced views inside the allocation")
    sizes = {"L": len(views), "B": blocks, "H": heads, "N": tokens, "C": content * item}
    strides = {"L": min(gaps, default=0), "B": block_stride, "H": head_stride, "N": token_stride, "C": 1}
    fitting = [name for name in GpuMemory.LAYOUTS if _fits(name, sizes, strides)]
    if layout is None:
        layout = fitting[0] if fitting else ""
    if layout not in fitting:
        raise ValueError(f"the KV views are not laid out as {layout or 'any vLLM layout'} (their strides fit "
                         f"{fitting or 'none'})")
    if split > 1 and heads > 1 and head_stride > token_stride:
        # A block regrouped from kernel blocks is [kernel block, head, token] where an unsplit block of the
        # same layout is [head, token]: the same bytes in another order, which an engine that splits otherwise
        # (or not at all) would read as wrong KV under the same namespace.
        raise ValueError(f"vLLM's {tokens * split}-token blocks are split into {split} kernel blocks of {tokens} "
                         f"tokens with the heads outside the tokens ({layout}): such a block is not laid out as an "
                         f"unsplit one; use --block-size {tokens}, or a layout with the tokens outside the heads "
                         f"(VLLM_KV_CACHE_LAYOUT=LBNHC)")
    run, pieces = sizes["C"], []
    dims = [(tokens, token_stride), (heads, head_stride), (split, block_stride)]
    for count, stride in sorted(dims, key=lambda d: d[1]):
        if count == 1:
            continue
        if stride == run and not pieces:
            run *= count  # contiguous with what lies inside it
        else:
            pieces.append((count, stride))
    if len(pieces) > 1:
        raise ValueError("a page in pieces of pieces cannot be registered")
    runs, run_stride = pieces[0] if pieces else (1, 0)
    return {"alloc_size": size, "layer_offsets": tuple(offsets), "block_stride": block_stride * split,
            "num_blocks": num_blocks, "page_bytes": split * heads * tokens * content * item, "runs": runs,
            "run_stride": run_stride, "layout": layout}


class CudaEvents:
    """The worker's interprocess events (GpuTransfers' EventSource): `record(i)` records event i on the
    current torch stream of the KV's device, the one vLLM's forward writes and reads the KV on."""

    def __init__(self, device: torch.device, count: int) -> None:
        self.device = device
        self._events: list[int] = []
        try:
            with torch.cuda.device(device):
                for _ in range(count):
                    self._events.append(cuda_ipc.create_event())
                self.handles = tuple(cuda_ipc.event_handle(e) for e in self._events)
        except BaseException:
            self.close()
            raise

    def record(self, index: int) -> None:
        cuda_ipc.record_event(self._events[index], torch.cuda.current_stream(self.device).cuda_stream)

    def close(self) -> None:
        """Destroy the events (once no registration names them)."""
        events, self._events = self._events, []
        for event in events:
            cuda_ipc.destroy_event(event)


def export(kv_caches: Mapping[str, torch.Tensor], num_events: int, layout: str | None = None, *,
           num_blocks: int) -> tuple[GpuMemory, CudaEvents]:
    """The GpuMemory a worker registers for vLLM's CUDA `kv_caches` of `num_blocks` vLLM blocks (see
    describe) and the pool of `num_events` interprocess events it names; close the events once the
    registration is over."""
    tensors = list(kv_caches.values())
    if not tensors or any(t.device != tensors[0].device or t.device.type != "cuda" for t in tensors):
        raise ValueError("the KV caches must be CUDA tensors of one device")
    device = tensors[0].device
    with torch.cuda.device(device):
        base, size = cuda_ipc.address_range(tensors[0].data_ptr())
        fields = describe(kv_caches, base, size, layout, num_blocks=num_blocks)
        handle, uuid = cuda_ipc.mem_handle(base), cuda_ipc.device_uuid(device.index)
    events = CudaEvents(device, num_events)
    try:
        memory = GpuMemory(engine="cuda", device=uuid, handle=handle, events=events.handles, pid=os.getpid(), **fields)
        memory.check()
    except BaseException:
        events.close()
        raise
    return memory, events
