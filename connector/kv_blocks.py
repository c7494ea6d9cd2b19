"""Copies between an engine's paged KV cache (CPU tensors) and a chunk's L1 pages.

A chunk of m engine blocks is laid out layer-major: layer l's block b sits at byte
(l * m + b) * block_bytes, so a load of the leading j blocks reads j contiguous slices per layer.
Blocks are opaque pages: whole blocks are copied, never tokens inside one (the CPU layout
interleaves K and V tiles within a block).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
from kvtier.shm.pages import PageSpan


class PagedKV:
    def __init__(self, layers: Sequence[np.ndarray]) -> None:
        """`layers`: one uint8 array per layer, shape (num_blocks, block_bytes), sharing the engine's memory."""
        if not layers:
            raise ValueError("no KV layers")
        shapes = {a.shape for a in layers}
        if len(shapes) != 1:
            raise ValueError(f"KV layers differ in shape: {sorted(shapes)}")
        self.layers = list(layers)
        self.num_blocks, self.block_bytes = layers[0].shape

    def chunk_bytes(self, blocks: int) -> int:
        return len(self.layers) * blocks * self.block_bytes

    def save(self, span: PageSpan, block_ids: Sequence[int]) -> None:
        """Copy engine blocks `block_ids` (one chunk, in order) into the chunk's pages."""
        m, bb = len(block_ids), self.block_bytes
        for layer_index, layer in enumerate(self.layers):
            base = layer_index * m * bb
            for b, block_id in enumerate(block_ids):
                span.write(base + b * bb, layer[block_id])

    def load(self, span: PageSpan, stored_blocks: int, first: int, block_ids: Sequence[int]) -> None:
        """Copy the chunk's blocks first, first+1, ... (of `stored_blocks`) into engine blocks `block_ids`."""
        bb = self.block_bytes
        if first + len(block_ids) > stored_blocks:
            raise ValueError("load past the stored blocks of a chunk")
        for layer_index, layer in enumerate(self.layers):
            base = (layer_index * stored_blocks + first) * bb
            for b, block_id in enumerate(block_ids):
                span.read(base + b * bb, layer[block_id])

    def pairs(self, span: PageSpan, stored_blocks: int, first: int, block_ids: Sequence[int]
              ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(the chunk's bytes, the engine's bytes) of blocks first, first+1, ... against engine blocks
        `block_ids`, layer by layer: what a verification compares."""
        bb = self.block_bytes
        if first + len(block_ids) > stored_blocks:
            raise ValueError("compare past the stored blocks of a chunk")
        held = np.empty(bb, dtype=np.uint8)
        for layer_index, layer in enumerate(self.layers):
            base = (layer_index * stored_blocks + first) * bb
            for b, block_id in enumerate(block_ids):
                span.read(base + b * bb, held)
                yield held, layer[block_id]
