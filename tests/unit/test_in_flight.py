"""InFlight: the asynchronous connector's bookkeeping keeps vLLM's reporting rules (connector/vllm/in_flight.py).

Its package (connector/vllm/__init__.py) imports torch and vLLM: the dev venv skips it;
tests/e2e/test_torch_unit_tests.py runs it in vLLM's venv.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvtier.connector.vllm.idle_thread import usable_cpus  # noqa: E402
from kvtier.connector.vllm.in_flight import InFlight  # noqa: E402

pytestmark = pytest.mark.unit


def _gated() -> tuple[threading.Event, threading.Event]:
    """(started, release): a job sets `started` and waits for `release`."""
    return threading.Event(), threading.Event()


def _wait(flight: InFlight, ids: set[str], what: str, timeout: float = 5.0):
    """Call `finished(ids)` (then with no ids) until `what` of the result is non-empty."""
    deadline = time.monotonic() + timeout
    first = True
    while time.monotonic() < deadline:
        done = flight.finished(ids if first else set())
        first = False
        if getattr(done, what):
            return done
        time.sleep(0.01)
    raise AssertionError(f"nothing in {what} within {timeout} s")


@pytest.fixture
def flight():
    f = InFlight()
    yield f
    f.close()


def test_load_reported_once_with_its_errors_in_the_same_call(flight):
    started, release = _gated()

    def job() -> set[int]:
        started.set()
        release.wait(5)
        return {7}

    flight.load("r1", [5, 6, 7], job)
    assert started.wait(5)
    early = flight.finished(set())
    assert not early.recving and not early.load_errors  # in flight: not reported yet
    release.set()
    done = _wait(flight, set(), "recving")
    assert done.recving == {"r1"} and done.load_errors == {7}
    again = flight.finished(set())
    assert not again.recving and not again.load_errors


def test_a_load_that_raises_fails_every_block(flight):
    def job() -> set[int]:
        raise RuntimeError("server gone")

    flight.load("r1", [3, 4], job)
    done = _wait(flight, set(), "recving")
    assert done.recving == {"r1"} and done.load_errors == {3, 4}


def test_two_loads_of_one_request_refused(flight):
    release = threading.Event()
    flight.load("r1", [1], lambda: (release.wait(5), set())[1])
    with pytest.raises(ValueError):
        flight.load("r1", [1], set)
    release.set()


def test_held_store_reported_only_when_finished_and_done(flight):
    started, release = _gated()
    flight.store("r1", lambda: (started.set(), release.wait(5), None)[2])
    assert started.wait(5)
    flight.hold(["r1"])
    assert not flight.finished({"r1"}).sending  # finished, store still running: blocks stay held
    release.set()
    done = _wait(flight, set(), "sending")
    assert done.sending == {"r1"}
    assert not flight.finished({"r1"}).sending  # never twice


def test_store_done_before_finish_reported_at_finish(flight):
    flight.store("r1", lambda: None)
    flight.wait_for_stores(["r1"])
    flight.hold(["r1"])
    assert flight.finished({"r1"}).sending == {"r1"}


def test_a_done_store_is_told_once_for_the_scheduler(flight):
    started, release = _gated()
    flight.store("r1", lambda: (started.set(), release.wait(5), None)[2])
    assert started.wait(5)
    assert flight.stored() == set()  # still running: the scheduler must hold r1's blocks if it finishes now
    release.set()
    flight.wait_for_stores(["r1"])
    assert flight.stored() == {"r1"}
    assert flight.stored() == set()  # told once
    assert not flight.finished({"r1"}).sending  # the scheduler did not hold it: never in finished_sending


def test_store_of_a_request_not_held_is_never_reported(flight):
    flight.store("r1", lambda: None)
    flight.wait_for_stores(["r1"])
    assert not flight.finished({"r1"}).sending
    flight.hold(["r2"])  # another request; held without a store (e.g. the worker had no KV)
    assert flight.finished({"r2"}).sending == {"r2"}


def test_a_failing_store_still_releases_its_blocks(flight):
    def job() -> None:
        raise RuntimeError("reserve refused")

    flight.store("r1", job)
    flight.hold(["r1"])
    assert _wait(flight, {"r1"}, "sending").sending == {"r1"}


def test_wait_for_stores_blocks_until_the_store_is_done(flight):
    started, release = _gated()
    copied = []

    def job() -> None:
        started.set()
        release.wait(5)
        copied.append(True)

    flight.store("r1", job)
    assert started.wait(5)
    threading.Timer(0.2, release.set).start()
    assert flight.wait_for_stores(["r1", "r-unknown"]) == 1
    assert copied == [True]  # the blocks were read before the caller went on
    assert flight.wait_for_stores(["r1"]) == 0


def _store_policy(flight: InFlight) -> int:
    """The scheduling policy the store thread runs a job under."""
    seen: list[int] = []
    flight.store("p", lambda: seen.append(os.sched_getscheduler(0)))
    flight.wait_for_stores(["p"])
    return seen[0]


@pytest.mark.skipif(
    not hasattr(os, "SCHED_IDLE") or len(os.sched_getaffinity(0)) < 2,
    reason="Linux scheduling policies, two cores",
)
def test_idle_stores_run_at_idle_priority_on_every_usable_core():
    everywhere = os.sched_getaffinity(0)
    os.sched_setaffinity(
        0, {min(everywhere)}
    )  # as vLLM binds its worker's main thread, whose threads inherit it
    flight = InFlight(idle_stores=True)
    try:
        cores: list[set[int]] = []
        assert _store_policy(flight) == os.SCHED_IDLE
        flight.store("q", lambda: cores.append(os.sched_getaffinity(0)))
        flight.wait_for_stores(["q"])
        assert cores == [everywhere & usable_cpus()] and len(cores[0]) > 1
    finally:
        os.sched_setaffinity(0, everywhere)
        flight.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_stores_keep_the_workers_priority_unless_idle_is_asked(flight):
    assert _store_policy(flight) == os.sched_getscheduler(0) != os.SCHED_IDLE


def test_a_late_store_waiting_on_the_server_is_not_waited_for():
    """The step never waits on the network for a store: a store blocked (here on an event, as on the server's
    reply) is left alone however long it has waited."""
    flight = InFlight(idle_stores=True, max_store_wait_s=0.01, max_lend_s=1.0)
    started, release = _gated()
    try:
        flight.store("s", lambda: (started.set(), release.wait(5)))
        assert started.wait(5)
        time.sleep(0.05)
        t0 = time.monotonic()
        flight.finished(set())
        assert time.monotonic() - t0 < 0.5 and flight.lent == 0
    finally:
        release.set()
        flight.close()


@pytest.mark.parametrize("idle", [True, False])
def test_a_late_runnable_store_is_lent_the_workers_core_for_a_bounded_time(idle):
    """A store thread that wants CPU (runnable) and whose store is past the bound gets the worker's core: the
    step sleeps, up to `max_lend_s`. Only with idle stores: otherwise the thread has the worker's priority."""
    flight = InFlight(idle_stores=idle, max_store_wait_s=0.01, max_lend_s=0.1)
    started, stop = _gated()

    def spin() -> None:
        started.set()
        while not stop.is_set():
            pass

    try:
        flight.store("s", spin)
        assert started.wait(5)
        time.sleep(0.05)
        t0 = time.monotonic()
        flight.finished(set())
        lent = time.monotonic() - t0
        assert (flight.lent, lent >= 0.09) == ((1, True) if idle else (0, False))
        assert lent < 5
    finally:
        stop.set()
        flight.close()
