"""A GPU worker on the CPU stand-in: a FakeDevice (shared-memory "device" allocation with sequence-slot
events) laid out as vLLM 0.32 lays out one KV allocation, the GpuMemory a worker registers for it, and the
event source GpuTransfers records on. Shared by tests/integration/test_gpu_path.py and the client worker
processes that tests kill."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import numpy as np
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.connector.gpu_transfers import START_S, GpuTransfers
from kvtier.server.keys import Namespace
from kvtier.server.protocol import GpuMemory
from kvtier.shm.fake_device import FakeDevice

LAYERS, BLOCKS, PAGE_BYTES, EVENTS = 3, 48, 4096, 8
BASE = 8192  # the KV tensor starts this far into the allocation
BLOCK_TOKENS = 16


def namespace(layout: str, chunk_size: int = 64) -> Namespace:
    return Namespace(model="fake-gpu-model", dtype="bfloat16", num_layers=LAYERS, kv_heads=2, head_size=64,
                     block_size=BLOCK_TOKENS, layout=f"vllm-fake-{layout}-p{PAGE_BYTES}", chunk_size=chunk_size)


@dataclass
class FakeEvents:
    """The worker's stream reaches an event as soon as it is recorded, unless the test holds it."""

    device: FakeDevice
    hold: bool = False
    last: int = -1  # the event recorded last

    def record(self, index: int) -> None:
        self.last = index
        self.device.record(index)
        if not self.hold:
            self.device.complete(index)


class FakeGpuWorker:
    def __init__(self, layout: str = "LBNHC", name: str = "") -> None:
        self.layout = layout
        self.name = name or f"kvtier-fakegpu-{uuid.uuid4().hex[:12]}"
        self.size = BASE + LAYERS * BLOCKS * PAGE_BYTES
        self.device = FakeDevice.create(self.name, self.size, EVENTS)
        self.events = FakeEvents(self.device)
        self.keepers: list[GpuTransfers] = []
        if layout == "LBNHC":  # layer-outer: each layer's blocks one after another
            offsets, stride = tuple(BASE + layer * BLOCKS * PAGE_BYTES for layer in range(LAYERS)), PAGE_BYTES
        elif layout == "BLHNC":  # block-outer: each block one run of all layers' pages
            offsets, stride = tuple(BASE + layer * PAGE_BYTES for layer in range(LAYERS)), LAYERS * PAGE_BYTES
        else:
            raise ValueError(layout)
        self.memory = GpuMemory("fake", self.name, self.name.encode(), self.size, offsets, stride, BLOCKS, PAGE_BYTES,
                                1, 0, layout, tuple(self.device.event_handle(i) for i in range(EVENTS)), 1)

    def page(self, layer: int, block: int) -> np.ndarray:
        at = self.memory.layer_offsets[layer] + block * self.memory.block_stride
        return self.device.data[at: at + PAGE_BYTES]

    def fill(self, block_ids: list[int], seed: int) -> None:
        """A pattern derived from (seed, position in `block_ids`, layer): the same KV wherever it sits."""
        for i, block in enumerate(block_ids):
            for layer in range(LAYERS):
                self.page(layer, block)[:] = np.random.default_rng([seed, i, layer]).integers(
                    0, 256, PAGE_BYTES, dtype=np.uint8)

    def blocks_equal(self, a: list[int], b: list[int]) -> bool:
        return all(np.array_equal(self.page(layer, x), self.page(layer, y))
                   for x, y in zip(a, b, strict=True) for layer in range(LAYERS))

    def scramble(self, block_ids: list[int]) -> None:
        for block in block_ids:
            for layer in range(LAYERS):
                self.page(layer, block)[:] = 0xEE

    def transfers(self, url: str, timeout_s: float = 10.0, start_s: float = START_S,
                  keeper: bool = True) -> tuple[KVTierClient, GpuTransfers]:
        """A client and its GpuTransfers, registered (with `keeper`: by its keeper thread, which then
        heartbeats; without it the test registers)."""
        client = KVTierClient(ClientConfig(url=url, connect_timeout_s=5.0, request_timeout_s=timeout_s,
                                           retry_backoff_s=0.2))
        assert client.connect()
        transfers = GpuTransfers(client, self.memory, self.events, start_s=start_s)
        self.keepers.append(transfers)
        if keeper:
            transfers.start()
            deadline = time.monotonic() + 20
            while not transfers.registered:
                assert time.monotonic() < deadline, f"not registered: {transfers.unavailable}"
                time.sleep(0.02)
        return client, transfers

    def close(self) -> None:
        for transfers in self.keepers:
            transfers.close()
        self.device.close()
        self.device.unlink()
