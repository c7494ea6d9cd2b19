"""A CPU worker's KV cache as the server's copier reads it (a "host" protocol.GpuMemory, server/transfer/host.py).

The layers are PagedKV's (connector/kv_blocks.py): one (blocks, block bytes) array per layer, each block one
opaque page. Registered layer-outer, the copier lays a chunk's pages out in L1 exactly as PagedKV.save does
((layer * blocks + block) pages in), so chunks stored either way are the same bytes under the same keys, and a
worker loads them with PagedKV.load. The token proves to the copier that the pid it reads is this process.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence

import numpy as np
from kvtier.server.protocol import GpuMemory

EVENTS = 64  # stores in flight at once before one must be answered
LAYOUT = "LBNHC"  # layer-outer; a block's bytes are one opaque page


class HostMemory:
    """The registration of `layers` and its events (GpuTransfers' EventSource: nothing to record, the CPU
    forward has written the blocks before a store is sent)."""

    def __init__(self, layers: Sequence[np.ndarray]) -> None:
        starts = [a.ctypes.data for a in layers]
        num_blocks, block_bytes = layers[0].shape
        base = min(starts)
        self._token = np.frombuffer(bytearray(secrets.token_bytes(16)), np.uint8)  # read by the copier
        self.memory = GpuMemory(
            engine="host",
            device="host",
            handle=GpuMemory.HOST.pack(base, self._token.ctypes.data, self._token.tobytes()),
            alloc_size=max(starts) + num_blocks * block_bytes - base,
            layer_offsets=tuple(start - base for start in starts),
            block_stride=block_bytes,
            num_blocks=num_blocks,
            page_bytes=block_bytes,
            runs=1,
            run_stride=0,
            layout=LAYOUT,
            events=tuple(b"host-%d" % i for i in range(EVENTS)),
            pid=os.getpid(),
        )
        self.memory.check()

    def record(self, index: int) -> None:
        """Nothing to record: the blocks are written when the worker sends a store."""
