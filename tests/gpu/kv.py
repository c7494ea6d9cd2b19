"""A worker's KV allocation laid out as vLLM 0.32 lays it out (tests/gpu/layouts.json), on a GPU (CudaKV: torch,
registered through connector/vllm/gpu_memory.py `export`) or on the CPU stand-in (FakeKV: a FakeDevice, numpy,
registered with the geometry `describe` gave when layouts.json was made). Both write and check a pattern
through vLLM's own per-layer views, never through the registered geometry, so a geometry that misplaces a
byte fails the check.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from kvtier.server.protocol import GpuMemory
from kvtier.shm.fake_device import FakeDevice

REPO = Path(__file__).resolve().parents[2]
EVENTS = 16


@dataclass(frozen=True)
class Layout:
    """One case of layouts.json at one size: vLLM's per-layer views ([B, H, N, C] of `item`-byte elements,
    strides in elements, each layer `layer_offsets` bytes into the allocation)."""

    case: str
    layout: str
    dtype: str
    item: int
    alloc_size: int
    num_blocks: int  # vLLM's blocks; shape[0] // num_blocks kernel blocks each
    block_tokens: int
    kv_heads: int
    head_size: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    layer_offsets: tuple[int, ...]
    registered: dict[str, Any] | None  # describe's geometry (rehearse size only), None when it refused
    refused: str

    @classmethod
    def of(cls, case: str, spec: dict[str, Any]) -> Layout:
        return cls(case, spec["layout"], spec["dtype"], spec["item"], spec["alloc_size"], spec["num_blocks"],
                   spec["block_tokens"], spec["kv_heads"], spec["head_size"], tuple(spec["shape"]),
                   tuple(spec["stride"]), tuple(spec["layer_offsets"]), spec.get("registered"),
                   spec.get("refused", ""))

    @property
    def split(self) -> int:
        return self.shape[0] // self.num_blocks

    @property
    def page_bytes(self) -> int:
        """Bytes of one vLLM block of one layer."""
        return self.split * self.shape[1] * self.shape[2] * self.shape[3] * self.item

    @property
    def byte_shape(self) -> tuple[int, ...]:
        return (*self.shape[:3], self.shape[3] * self.item)

    @property
    def byte_strides(self) -> tuple[int, ...]:
        """The views' strides in bytes, of byte_shape: a (head, token)'s content is contiguous in vLLM 0.32."""
        return (*(s * self.item for s in self.stride[:3]), 1)

    def page_at(self, layer: int, block: int) -> int:
        """Where vLLM block `block` of `layer` starts in the allocation, by vLLM's view strides; its page is one
        run of page_bytes (every layout layouts.json holds: their heads and tokens nest inside the block)."""
        return self.layer_offsets[layer] + block * self.split * self.byte_strides[0]

    def kernel_ids(self, block_ids: list[int]) -> list[int]:
        """vLLM block b is kernel blocks b*k .. b*k+k-1 (v1/kv_cache_interface.py group_kernel_blocks)."""
        return [b * self.split + j for b in block_ids for j in range(self.split)]


def pattern(pos: Any, index: Any, seed: int, layer: int) -> Any:
    """Bytes of the pages at prompt positions `pos` (column) and byte `index` (row), numpy or torch int64:
    the same KV wherever the block sits; every position, layer and seed differs."""
    x = (pos * 1_000_003 + index * 7_919 + (seed * 131 + layer) * 104_729) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x45D9F3B) & 0xFFFFFFFF
    return (x ^ (x >> 16)) & 0xFF


class KV(Protocol):
    layout: Layout
    memory: GpuMemory
    events: Any  # connector/gpu_transfers.py EventSource

    def fill(self, block_ids: list[int], seed: int, positions: list[int] | None = None) -> None: ...

    def holds(self, block_ids: list[int], seed: int, positions: list[int]) -> bool: ...

    def scramble(self, block_ids: list[int]) -> None: ...

    def page(self, layer: int, block: int) -> np.ndarray:
        """The bytes of a block's page of one layer as they lie in the allocation."""
        ...

    def close(self) -> None: ...


class FakeEvents:
    """The stand-in's stream reaches an event as soon as it is recorded."""

    def __init__(self, device: FakeDevice) -> None:
        self.device = device

    def record(self, index: int) -> None:
        self.device.record(index)
        self.device.complete(index)


class FakeKV:
    def __init__(self, layout: Layout, prefix: str) -> None:
        """The device file is /dev/shm/`prefix`-<random>."""
        if layout.registered is None:
            raise ValueError(layout.refused)
        self.layout = layout
        self.name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.device = FakeDevice.create(self.name, layout.alloc_size, EVENTS)
        self.events = FakeEvents(self.device)
        self.memory = GpuMemory(engine="fake", device=self.name, handle=self.name.encode(), pid=os.getpid(),
                                events=tuple(self.device.event_handle(i) for i in range(EVENTS)),
                                **{**layout.registered, "layer_offsets": tuple(layout.registered["layer_offsets"])})
        self.views = [np.lib.stride_tricks.as_strided(self.device.data[offset:], layout.byte_shape,
                                                      layout.byte_strides) for offset in layout.layer_offsets]

    def _pages(self, positions: list[int], seed: int, layer: int) -> np.ndarray:
        index = np.arange(self.layout.page_bytes, dtype=np.int64)[None, :]
        return pattern(np.asarray(positions, dtype=np.int64)[:, None], index, seed, layer).astype(np.uint8)

    def fill(self, block_ids: list[int], seed: int, positions: list[int] | None = None) -> None:
        kernel = self.layout.kernel_ids(block_ids)
        for layer, view in enumerate(self.views):
            pages = self._pages(positions or list(range(len(block_ids))), seed, layer)
            view[kernel] = pages.reshape(len(kernel), *self.layout.byte_shape[1:])

    def holds(self, block_ids: list[int], seed: int, positions: list[int]) -> bool:
        kernel = self.layout.kernel_ids(block_ids)
        return all(np.array_equal(view[kernel].reshape(len(block_ids), -1), self._pages(positions, seed, layer))
                   for layer, view in enumerate(self.views))

    def scramble(self, block_ids: list[int]) -> None:
        kernel = self.layout.kernel_ids(block_ids)
        for view in self.views:
            view[kernel] = 0xEE

    def page(self, layer: int, block: int) -> np.ndarray:
        at = self.layout.page_at(layer, block)
        return self.device.data[at: at + self.layout.page_bytes].copy()

    def close(self) -> None:
        self.views = []
        self.device.close()
        self.device.unlink()


def gpu_memory_module() -> Any:
    """connector/vllm/gpu_memory.py alone: its package's __init__ imports vLLM, which this check does without."""
    spec = importlib.util.spec_from_file_location("kvtier_gpu_memory", REPO / "connector" / "vllm" / "gpu_memory.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CudaKV:
    """The allocation on GPU 0 as one int8 tensor, vLLM's views of it registered through `export` (ValueError
    when kvtier refuses them)."""

    def __init__(self, layout: Layout) -> None:
        import torch

        self.torch = torch
        self.layout = layout
        self.raw = torch.zeros(layout.alloc_size, dtype=torch.uint8, device="cuda")
        self.views = [torch.as_strided(self.raw, layout.byte_shape, layout.byte_strides, offset)
                      for offset in layout.layer_offsets]
        dtype = getattr(torch, layout.dtype)
        kv = {f"model.layers.{i}.self_attn.attn": v.view(torch.int8).view(dtype) for i, v in enumerate(self.views)}
        self.memory, self.events = gpu_memory_module().export(kv, EVENTS, layout.layout,
                                                              num_blocks=layout.num_blocks)

    def _ids(self, block_ids: list[int]) -> Any:
        return self.torch.tensor(self.layout.kernel_ids(block_ids), device="cuda")

    def _pages(self, positions: list[int], seed: int, layer: int) -> Any:
        torch = self.torch
        index = torch.arange(self.layout.page_bytes, dtype=torch.int64, device="cuda")[None, :]
        pos = torch.tensor(positions, dtype=torch.int64, device="cuda")[:, None]
        return pattern(pos, index, seed, layer).to(torch.uint8)

    def fill(self, block_ids: list[int], seed: int, positions: list[int] | None = None) -> None:
        """On the current stream, without a synchronize: a copy must wait for the event recorded after it."""
        ids = self._ids(block_ids)
        for layer, view in enumerate(self.views):
            pages = self._pages(positions or list(range(len(block_ids))), seed, layer)
            view[ids] = pages.view(len(ids), *self.layout.byte_shape[1:])

    def holds(self, block_ids: list[int], seed: int, positions: list[int]) -> bool:
        ids = self._ids(block_ids)
        return all(self.torch.equal(view[ids].reshape(len(block_ids), -1), self._pages(positions, seed, layer))
                   for layer, view in enumerate(self.views))

    def scramble(self, block_ids: list[int]) -> None:
        ids = self._ids(block_ids)
        for view in self.views:
            view[ids] = 0xEE

    def page(self, layer: int, block: int) -> np.ndarray:
        at = self.layout.page_at(layer, block)
        return self.raw[at: at + self.layout.page_bytes].cpu().numpy()

    def close(self) -> None:
        self.events.close()
        self.views = []
        del self.raw
        self.torch.cuda.empty_cache()
