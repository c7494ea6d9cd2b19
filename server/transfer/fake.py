"""The CPU stand-in DeviceBackend: the "GPU" is a FakeDevice file (kvtier.shm.fake_device) in the L1
segment's directory, its events are the device's sequence slots, and a copy is a numpy slice assignment.

It runs inside the copier process exactly where cuda.py would, so CI drives the whole GPU path (daemon,
copier, planning, ordering, failures) without a GPU.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from kvtier.server.protocol import COPIER_FAILED, IPC_REFUSED, NO_DEVICE, GpuMemory
from kvtier.server.transfer.base import STORE, DeviceBackend, Entry, GpuUnavailable
from kvtier.shm.fake_device import FakeDevice, parse_event_handle

PIN_DELAY_ENV = "KVTIER_FAKE_PIN_DELAY_S"  # seconds per pinned piece, so that tests can see not_pinned
# a copy behind this event index moves its first entry and then never ends: a DMA that hangs mid-copy
HANG_EVENT_ENV = "KVTIER_FAKE_HANG_EVENT"
STORE_DELAY_ENV = "KVTIER_FAKE_STORE_DELAY_S"  # seconds a store waits before it reads the device: a slow copier
START_DELAY_ENV = "KVTIER_FAKE_START_DELAY_S"  # seconds the backend takes to start (cupy import, CUDA init)


@dataclass
class FakeOpened:
    device: FakeDevice
    slots: tuple[int, ...]  # the device's event slot of each registered event


class FakeBackend(DeviceBackend):
    def __init__(self, device: str, directory: str) -> None:
        """A copier for fake device `device`: NO_DEVICE unless a device file of that name exists."""
        self._device = device
        self._directory = directory
        self._segment = np.empty(0, np.uint8)
        time.sleep(float(os.environ.get(START_DELAY_ENV, "0")))
        self._hang_event = int(os.environ.get(HANG_EVENT_ENV, "-1"))
        try:
            FakeDevice.attach(device, directory).close()
        except (OSError, ValueError) as exc:
            raise GpuUnavailable(NO_DEVICE, f"no fake device {device!r} in {directory}: {exc}") from exc

    def pin(self, segment: memoryview, piece_bytes: int, progress: Callable[[int], None]) -> None:
        self._segment = np.frombuffer(segment, np.uint8)
        delay = float(os.environ.get(PIN_DELAY_ENV, "0"))
        for done in range(piece_bytes, len(segment) + piece_bytes, piece_bytes):
            if delay:
                time.sleep(delay)
            progress(min(done, len(segment)))

    def open(self, memory: GpuMemory) -> FakeOpened:
        try:
            name = memory.handle.decode("ascii")
            device = FakeDevice.attach(name, self._directory)
        except (OSError, ValueError) as exc:
            raise GpuUnavailable(IPC_REFUSED, f"cannot open fake device handle {memory.handle!r}: {exc}") from exc
        try:
            if name != memory.device:
                raise GpuUnavailable(NO_DEVICE, f"handle of device {name!r}, registered for {memory.device!r}")
            if device.size < memory.alloc_size:
                raise GpuUnavailable(IPC_REFUSED, f"device has {device.size} bytes, registration claims "
                                     f"{memory.alloc_size}")
            slots = []
            for handle in memory.events:
                try:
                    owner, slot = parse_event_handle(handle)
                except ValueError as exc:
                    raise GpuUnavailable(IPC_REFUSED, str(exc)) from exc
                if owner != name or not 0 <= slot < device.num_events:
                    raise GpuUnavailable(IPC_REFUSED, f"event handle {handle!r} is not one of {name!r}")
                slots.append(slot)
        except BaseException:
            device.close()
            raise
        return FakeOpened(device, tuple(slots))

    def close(self, opened: FakeOpened) -> None:
        opened.device.close()

    def run(self, opened: FakeOpened, direction: str, entries: Sequence[Entry], event: int, timeout_s: float) -> None:
        device = opened.device
        try:
            slot = opened.slots[event]
        except IndexError as exc:
            raise GpuUnavailable(COPIER_FAILED, f"event {event} of {len(opened.slots)}") from exc
        if not device.wait(slot, device.recorded(slot), timeout_s):
            raise TimeoutError(f"event {event} did not fire within {timeout_s} s")
        if direction == STORE and (delay := float(os.environ.get(STORE_DELAY_ENV, "0"))):
            time.sleep(delay)
        memory, segment = device.data, self._segment
        for i, (device_at, segment_at, size) in enumerate(entries):
            if i == 1 and event == self._hang_event:
                threading.Event().wait()
            if direction == STORE:
                segment[segment_at : segment_at + size] = memory[device_at : device_at + size]
            else:
                memory[device_at : device_at + size] = segment[segment_at : segment_at + size]
