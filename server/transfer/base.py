"""The copy-engine seam: what the server asks of whatever moves bytes for an engine that cannot copy itself.

CPU engines copy between their KV tensors and L1 pages themselves (connector/kv_blocks.py); the server only
keeps books. A GPU engine hands the server a registered memory (CUDA IPC handles of its KV allocation, its
layout and an event pool, DESIGN.md "GPU engines"); a copy engine then moves whole engine blocks between that
memory and L1 page extents, asynchronously: the server submits a store (engine -> L1) or a load
(L1 -> engine) and collects completions on its loop, committing or releasing the chunk's holding when its
copy is done. Nothing implements this contract yet: the GPU path (a copier process per GPU, and a CPU
stand-in with the same contract for CI) is built on it by the GPU issue. Every entry of a copy is checked
against the registered memory and the segment before any byte moves.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.server.keys import KEY_BYTES


@dataclass(frozen=True)
class Copy:
    """One chunk's copy: engine blocks `block_ids` (in chunk order) <-> the chunk's L1 page extents."""

    key: bytes  # the chunk (KEY_BYTES)
    block_ids: tuple[int, ...]
    extents: tuple[int, ...]  # (first page, page count, ...) as everywhere in the protocol
    size: int  # the chunk's bytes in its pages

    def __post_init__(self) -> None:
        if len(self.key) != KEY_BYTES or not self.block_ids or len(self.extents) % 2 or self.size <= 0:
            raise ValueError("a copy names one chunk, its blocks, its page runs and its size")


@dataclass(frozen=True)
class Completion:
    """A submitted operation is done: `ok` False means no byte of it may be trusted (the chunk is a miss)."""

    ticket: int
    ok: bool
    reason: str = ""


class CopyEngine(abc.ABC):
    """Moves bytes for registered engine memories; called on the serving loop, never blocks it."""

    @abc.abstractmethod
    def store(self, registration: int, copies: Sequence[Copy], wait_event: int) -> int:
        """Copy engine blocks into L1 pages once the engine's event `wait_event` has fired; a ticket."""

    @abc.abstractmethod
    def load(self, registration: int, copies: Sequence[Copy], wait_event: int) -> int:
        """Copy L1 pages into engine blocks after event `wait_event`; a ticket."""

    @abc.abstractmethod
    def completions(self) -> list[Completion]:
        """The operations finished since the last call, in any order."""
