"""The CPU stand-in for a GPU's KV allocation and its interprocess events, shared by a worker and a copier.

One shared-memory file holds a header, an event area and the allocation's bytes. Each event slot is two
uint64 counters: `recorded` (bumped by the worker when it records the event on its "stream") and `completed`
(set to `recorded` once the "stream" reached it). A waiter takes the generation to wait for when it is handed
the operation (`recorded` then, as cudaStreamWaitEvent waits on the last record) and waits until `completed`
catches up. The worker is the only writer of both counters; aligned 8-byte stores are atomic on the hosts
kvtier runs on, so the copier needs no lock.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import struct
import time
from dataclasses import dataclass

import numpy as np

SHM_DIR = "/dev/shm"
MAGIC = 0x6B76746965724644  # "kvtierFD"
_HEADER = struct.Struct("<QQQ")  # magic, allocation bytes, event slots
_DATA_ALIGN = 4096
MAX_NAME = 48  # a handle is the name (<= 64 bytes on the wire); an event handle adds ":<slot>"
_NAME_RE = re.compile(rf"^[A-Za-z0-9_.-]{{1,{MAX_NAME}}}$")


def _layout(num_events: int) -> tuple[int, int]:
    """(offset of the event area, offset of the allocation's bytes)."""
    events = _HEADER.size
    data = -(-(events + 16 * num_events) // _DATA_ALIGN) * _DATA_ALIGN
    return events, data


def _path(name: str, directory: str) -> str:
    if not _NAME_RE.match(name):
        raise ValueError(f"invalid fake device name {name!r}")
    return os.path.join(directory, name)


def parse_event_handle(handle: bytes) -> tuple[str, int]:
    """(device name, slot) of an event handle; ValueError if it is not one."""
    name, sep, slot = handle.decode("ascii", "strict").rpartition(":")
    if not sep or not _NAME_RE.match(name) or not slot.isdigit():
        raise ValueError(f"not a fake event handle: {handle!r}")
    return name, int(slot)


@dataclass
class FakeDevice:
    name: str
    size: int
    num_events: int
    path: str
    buf: mmap.mmap
    data: np.ndarray  # the allocation: writable uint8, `size` bytes
    _counters: np.ndarray  # (num_events, 2) uint64: recorded, completed

    @classmethod
    def create(cls, name: str, size: int, num_events: int, directory: str = SHM_DIR) -> FakeDevice:
        """Make a new device file (the worker's allocation); FileExistsError if the name is taken."""
        if size <= 0 or num_events <= 0:
            raise ValueError("a fake device has bytes and events")
        path = _path(name, directory)
        _, data = _layout(num_events)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, data + size)
            buf = mmap.mmap(fd, data + size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        buf[: _HEADER.size] = _HEADER.pack(MAGIC, size, num_events)
        return cls._mapped(name, path, buf)

    @classmethod
    def attach(cls, name: str, directory: str = SHM_DIR) -> FakeDevice:
        """Map an existing device (the copier); FileNotFoundError or ValueError if there is none by that name."""
        path = _path(name, directory)
        fd = os.open(path, os.O_RDWR)
        try:
            length = os.fstat(fd).st_size
            if length < _HEADER.size:
                raise ValueError(f"{path} is not a fake device")
            buf = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, size, num_events = _HEADER.unpack_from(buf)
        if magic != MAGIC or length < _layout(num_events)[1] + size:
            buf.close()
            raise ValueError(f"{path} is not a fake device")
        return cls._mapped(name, path, buf)

    @classmethod
    def _mapped(cls, name: str, path: str, buf: mmap.mmap) -> FakeDevice:
        _, size, num_events = _HEADER.unpack_from(buf)
        events, data = _layout(num_events)
        counters = np.frombuffer(buf, np.uint64, 2 * num_events, events).reshape(num_events, 2)
        return cls(name, size, num_events, path, buf, np.frombuffer(buf, np.uint8, size, data), counters)

    def event_handle(self, slot: int) -> bytes:
        self._check(slot)
        return f"{self.name}:{slot}".encode()

    def record(self, slot: int) -> int:
        """The worker records event `slot` on its stream: the new generation."""
        self._check(slot)
        self._counters[slot, 0] += np.uint64(1)
        return int(self._counters[slot, 0])

    def complete(self, slot: int) -> None:
        """The worker's stream reached its last record of `slot`."""
        self._check(slot)
        self._counters[slot, 1] = self._counters[slot, 0]

    def recorded(self, slot: int) -> int:
        """The generation a waiter handed an operation now waits for."""
        self._check(slot)
        return int(self._counters[slot, 0])

    def wait(self, slot: int, generation: int, timeout_s: float) -> bool:
        """Until generation `generation` of `slot` completed (True) or `timeout_s` passed (False)."""
        self._check(slot)
        deadline = time.monotonic() + timeout_s
        pause = 20e-6
        while int(self._counters[slot, 1]) < generation:
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return True

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_events:
            raise IndexError(f"event slot {slot} of a {self.num_events}-event device")

    def close(self) -> None:
        """Unmap (views handed out elsewhere keep the mapping until they are gone)."""
        self.data = np.empty(0, np.uint8)
        self._counters = np.zeros((0, 2), np.uint64)
        with contextlib.suppress(BufferError):
            self.buf.close()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
