"""The fake GPU allocation (shm/fake_device.py): a second mapping sees the owner's bytes, and its events wait
for the generation recorded when the wait was handed its operation."""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid

import numpy as np
import pytest
from kvtier.shm.fake_device import FakeDevice, parse_event_handle

pytestmark = pytest.mark.unit


@pytest.fixture
def device():
    dev = FakeDevice.create(f"kvtier-fd-{uuid.uuid4().hex[:12]}", 3 * 4096 + 100, 4)
    yield dev
    dev.close()
    dev.unlink()


def test_an_attached_mapping_sees_the_owners_writes_and_back(device):
    other = FakeDevice.attach(device.name)
    try:
        assert (other.size, other.num_events) == (device.size, device.num_events)
        pattern = np.random.default_rng(1).integers(0, 256, device.size, dtype=np.uint8)
        device.data[:] = pattern
        assert np.array_equal(other.data, pattern)
        other.data[-100:] = 7
        assert np.all(device.data[-100:] == 7) and np.array_equal(device.data[:-100], pattern[:-100])
    finally:
        other.close()


def test_another_process_sees_the_bytes(device):
    device.data[5:9] = [1, 2, 3, 4]
    code = ("import sys; from kvtier.shm.fake_device import FakeDevice; d = FakeDevice.attach(sys.argv[1]); "
            "print(bytes(d.data[5:9]).hex()); d.data[0] = 99")
    out = subprocess.run([sys.executable, "-c", code, device.name], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "01020304"
    assert device.data[0] == 99


def test_a_wait_returns_once_the_recorded_generation_completes(device):
    waiter = FakeDevice.attach(device.name)
    try:
        assert waiter.wait(2, waiter.recorded(2), 0.0)  # nothing recorded: nothing to wait for
        assert device.record(2) == 1
        generation = waiter.recorded(2)
        assert not waiter.wait(2, generation, 0.05)  # recorded, not completed: times out
        result: list[bool] = []
        thread = threading.Thread(target=lambda: result.append(waiter.wait(2, generation, 10.0)))
        thread.start()
        thread.join(0.1)
        assert thread.is_alive()  # still waiting
        device.complete(2)
        thread.join(10)
        assert result == [True]
        assert not waiter.wait(1, 1, 0.01)  # the other slots are untouched
    finally:
        waiter.close()


def test_a_wait_taken_before_a_later_record_needs_only_its_own_generation(device):
    first = device.record(0)
    device.complete(0)
    second = device.record(0)  # recorded again: a waiter handed its op now waits for this one
    assert second == first + 1 and device.recorded(0) == second
    assert device.wait(0, first, 0.0)
    assert not device.wait(0, second, 0.02)
    device.complete(0)
    assert device.wait(0, second, 0.0)


def test_event_handles_name_the_device_and_slot(device):
    for slot in range(device.num_events):
        handle = device.event_handle(slot)
        assert len(handle) <= 64
        assert parse_event_handle(handle) == (device.name, slot)
    for bad in [b"noslot", b"name:x", b":3", b"\xff\xfe:1", b"bad name:1"]:
        with pytest.raises(ValueError):
            parse_event_handle(bad)
    with pytest.raises(IndexError):
        device.record(device.num_events)


def test_attach_refuses_what_is_not_a_device(tmp_path):
    with pytest.raises(FileNotFoundError):
        FakeDevice.attach(f"kvtier-fd-missing-{uuid.uuid4().hex[:8]}")
    (tmp_path / "plain").write_bytes(b"x" * 100)
    with pytest.raises(ValueError):
        FakeDevice.attach("plain", str(tmp_path))
    with pytest.raises(ValueError):
        FakeDevice.create("no/slashes", 10, 1, str(tmp_path))
