"""The copy-engine seam: what the server asks of whatever moves bytes for an engine that cannot copy itself.

CPU engines copy between their KV tensors and L1 pages themselves (connector/kv_blocks.py); the server only
keeps books. A GPU engine registers its memory (`GpuMemory`: CUDA IPC handles of its KV allocation, its
layout and an event pool, DESIGN.md "GPU engines"); the daemon hands that to a `CopyEngine` (the copier
processes, server/transfer/copier.py), which moves whole engine blocks between that memory and L1 page
extents once the engine's event has fired, and answers when the bytes are there. Inside a copier process a
`DeviceBackend` (server/transfer/cuda.py, or the CPU stand-in server/transfer/fake.py) does the driver work.
Every entry of a copy is checked against the registered memory and the segment before any byte moves
(server/transfer/plan.py).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.server.keys import KEY_BYTES
from kvtier.server.protocol import GpuMemory

STORE = "store"  # engine -> L1
LOAD = "load"  # L1 -> engine


class GpuUnavailable(Exception):
    """A GPU operation cannot run: `reason` is one of protocol.GPU_REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Copy:
    """One chunk's copy: engine blocks `block_ids` hold the chunk's blocks `first`, `first + 1`, ... of the
    `blocks` it has in L1 (its page layout depends on `blocks`), whose bytes are in page runs `extents`."""

    key: bytes  # the chunk (KEY_BYTES)
    block_ids: tuple[int, ...]
    first: int
    blocks: int
    extents: tuple[int, ...]  # (first page, page count, ...) as everywhere in the protocol
    size: int  # the chunk's bytes in its pages
    start_by: float = 0.0  # its operation's start-by deadline (time.monotonic() of this host; 0: none)

    def __post_init__(self) -> None:
        if (len(self.key) != KEY_BYTES or not self.block_ids or len(self.extents) % 2 or not self.extents
                or self.size <= 0 or self.first < 0 or self.first + len(self.block_ids) > self.blocks):
            raise ValueError("a copy names one chunk, some of its blocks, its page runs and its size")


# One DMA entry: (offset in the engine's allocation, offset in the L1 segment, bytes).
Entry = tuple[int, int, int]


class CopyEngine(abc.ABC):
    """The daemon's view of the copiers; called on the serving loop, never blocks it."""

    @abc.abstractmethod
    async def register(self, memory: GpuMemory) -> int:
        """Open `memory` in the copier of its GPU (spawned on first use); a registration id, or GpuUnavailable."""

    @abc.abstractmethod
    def unregister(self, registration: int) -> None:
        """Close the registration's handles and events (its engine is gone or said bye); idempotent."""

    @abc.abstractmethod
    async def copy(self, registration: int, direction: str, copies: Sequence[Copy], event: int) -> None:
        """Copy `copies` (STORE or LOAD) once the engine's event `event` has fired; returns when every byte is
        there. Raises GpuUnavailable (COPIER_FAILED, NOT_PINNED, ...) when no byte of it may be trusted."""

    @abc.abstractmethod
    def status(self) -> dict[str, Any]:
        """Copiers, their GPUs, page-locking progress, registrations (for /status)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop every copier; in-flight copies fail."""


class DeviceBackend(abc.ABC):
    """The driver work inside one copier process, for one GPU (or the fake device)."""

    @abc.abstractmethod
    def pin(self, segment: memoryview, piece_bytes: int, progress: Callable[[int], None]) -> None:
        """Page-lock the mapped L1 segment in pieces of at most `piece_bytes`, calling `progress(bytes done)`
        after each; raises OSError when the host refuses (the copier then answers NO_COPIER)."""

    @abc.abstractmethod
    def open(self, memory: GpuMemory) -> Any:
        """Map the engine's allocation and import its events; an opaque handle, or GpuUnavailable."""

    @abc.abstractmethod
    def close(self, opened: Any) -> None:
        """Unmap and destroy what `open` made; the engine's memory is freed once nothing maps it."""

    @abc.abstractmethod
    def run(self, opened: Any, direction: str, entries: Sequence[Entry], event: int, timeout_s: float) -> None:
        """Wait for event `event`, then copy `entries` on the registration's stream for `direction`; return when
        done. Raises GpuUnavailable(COPIER_FAILED, ...) on any failure, TimeoutError when the event never fires."""
