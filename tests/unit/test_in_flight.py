"""InFlight: the asynchronous connector's bookkeeping keeps vLLM's reporting rules (connector/vllm/in_flight.py).

Its package (connector/vllm/__init__.py) imports torch and vLLM: the dev venv skips it;
tests/e2e/test_torch_unit_tests.py runs it in vLLM's venv.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvtier.connector.vllm import in_flight  # noqa: E402
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


def test_a_deferred_store_starts_only_when_the_next_step_begins(flight, monkeypatch):
    monkeypatch.setattr(in_flight, "DEFER_MAX_S", 30.0)  # no fallback start within the test
    started = threading.Event()
    flight.store("r1", started.set, defer=True)
    flight.store("r2", lambda: None)  # not deferred, but queued behind r1 on the one store thread
    assert not started.wait(0.3)
    flight.release_deferred()
    assert started.wait(5)
    deferred_later = threading.Event()
    flight.store("r3", deferred_later.set, defer=True)  # a new step's store waits for the step after it
    assert not deferred_later.wait(0.3)
    flight.release_deferred()
    assert deferred_later.wait(5)


def test_a_deferred_store_starts_by_itself_when_no_step_comes(flight, monkeypatch):
    monkeypatch.setattr(in_flight, "DEFER_MAX_S", 0.2)
    started = threading.Event()
    flight.store("r1", started.set, defer=True)
    assert started.wait(5)


def test_a_deferred_store_waited_for_runs_at_once(flight, monkeypatch):
    monkeypatch.setattr(in_flight, "DEFER_MAX_S", 30.0)  # without the release the waits below take 30 s
    done = threading.Event()
    flight.store("r1", done.set, defer=True)
    t0 = time.monotonic()
    assert flight.wait_for_stores({"r1"}) == 1  # a preempted request's store, before its step began
    assert done.is_set() and time.monotonic() - t0 < 10.0
    second = threading.Event()
    flight.store("r2", lambda: None, defer=True)
    flight.store("r2", second.set, defer=True)  # a second store of one request waits for its first
    assert time.monotonic() - t0 < 10.0
    later = threading.Event()
    flight.store("r3", later.set, defer=True)  # the release let out only what was handed over before it
    assert not later.wait(0.3)
    flight.release_deferred()
    assert later.wait(5) and second.is_set()
