"""Loads and stores a vLLM worker runs in the background, and what it may tell the scheduler about them.

vLLM's rules for asynchronous transfers (docs/dev/vllm-connector-notes.md §6):
- every load handed to a worker is reported once in `finished_recving`, a failed one too, and its failed
  blocks are reported (`get_block_ids_with_load_errors`) no later than the step that reports the load;
- a store is reported in `finished_sending` only for a request the scheduler holds for it
  (`request_finished` returned True: the scheduler says so in the step metadata, `held`), once the request is
  finished (its id came in `finished_req_ids`) and the store is done; reporting any other id, or one twice,
  frees blocks twice. A store done before its request finishes is told to the scheduler at once (`stored`,
  through the worker's step metadata), so that the scheduler does not hold that request's blocks at all;
- a preempted request's blocks are freed at once: its store must be done before the step's forward pass
  writes into them (`wait_for_stores`).

A store handed over with `defer` starts only once the worker begins its next step (`release_deferred`), or
when it is waited for, or after DEFER_MAX_S: the step that completed the prompt still samples that request's
first token, and a store thread running meanwhile takes the worker's core and GIL from it
(docs/performance.md, "deferred stores").

Torch- and vLLM-free, so that it is unit-tested on its own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

log = logging.getLogger("kvtier.connector")

DEFER_MAX_S = 0.05  # a deferred store starts by then even when no next step comes (an idle engine)


@dataclass
class Finished:
    """What one `get_finished` call reports."""

    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    load_errors: set[int] = field(default_factory=set)


class InFlight:
    """One thread for loads and one for stores (each in submission order), and the bookkeeping above.

    A load job returns the engine block ids it could not fill (all of them when it raises); a store job's
    result is ignored (a failed store is only a future miss). Called from the worker's one thread.
    """

    def __init__(self) -> None:
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-load")
        self._storer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-store")
        self._loads: dict[str, tuple[Future[set[int]], list[int]]] = {}
        self._stores: dict[str, Future[None]] = {}
        self._held: set[str] = set()  # the scheduler holds these requests' blocks until we report the store
        self._finished: set[str] = set()  # finished requests with a store still in flight
        self._told: set[str] = set()  # requests whose finished store `stored` has reported
        self._next_step = threading.Event()  # set when the worker's next step begins (deferred stores wait)

    def load(self, req_id: str, block_ids: list[int], job: Callable[[], set[int]]) -> None:
        if req_id in self._loads:  # vLLM never plans two loads of one request at once
            raise ValueError(f"a load of request {req_id} is in flight already")
        self._loads[req_id] = (self._loader.submit(job), block_ids)

    def store(self, req_id: str, job: Callable[[], object], defer: bool = False) -> None:
        """Run `job` on the store thread; with `defer`, not before the worker's next step begins."""
        previous = self._stores.get(req_id)
        if previous is not None and not previous.done():
            self.release_deferred()  # waited for here: it may not wait for the next step
            previous.result()  # one store per request at a time: a second waits for the first
        self._told.discard(req_id)
        gate = self._next_step if defer else None
        self._stores[req_id] = self._storer.submit(self._logged(req_id, job, gate))

    def release_deferred(self) -> None:
        """Let the deferred stores handed over so far run now (the worker begins its next step, or one of them
        is waited for); later ones wait for the next release."""
        self._next_step.set()
        self._next_step = threading.Event()

    @staticmethod
    def _logged(req_id: str, job: Callable[[], object], after: threading.Event | None) -> Callable[[], None]:
        def run() -> None:
            if after is not None:
                after.wait(DEFER_MAX_S)
            try:
                job()
            except Exception:  # a failed store is only a future miss
                log.exception("kvtier store failed for request %s", req_id)
        return run

    def hold(self, req_ids: Iterable[str]) -> None:
        """The scheduler holds these requests' blocks for their stores (step metadata)."""
        self._held.update(req_ids)

    def wait_for_stores(self, req_ids: Iterable[str]) -> int:
        """Block until the stores of `req_ids` (preempted: their blocks are free again) are done; how many."""
        futures = (self._stores.get(req_id) for req_id in req_ids)
        pending = [f for f in futures if f is not None and not f.done()]
        if pending:
            self.release_deferred()  # waited for now, not at the next step
        for future in pending:
            future.result()
        return len(pending)

    def stored(self) -> set[str]:
        """Requests whose store is done, each reported once (the worker's step metadata): the scheduler need
        not hold the blocks of one that finishes afterwards."""
        done = {req_id for req_id, future in self._stores.items() if future.done() and req_id not in self._told}
        self._told |= done
        return done

    def finished(self, finished_req_ids: Iterable[str]) -> Finished:
        out = Finished()
        self._finished.update(finished_req_ids)
        for req_id in list(self._finished):
            future = self._stores.get(req_id)
            if future is not None and not future.done():
                continue
            self._stores.pop(req_id, None)
            self._finished.discard(req_id)
            self._told.discard(req_id)
            if req_id in self._held:
                self._held.discard(req_id)
                out.sending.add(req_id)
        for req_id, (future, block_ids) in list(self._loads.items()):
            if not future.done():
                continue
            del self._loads[req_id]
            try:
                out.load_errors.update(future.result())
            except Exception:
                log.exception("kvtier load failed for request %s", req_id)
                out.load_errors.update(block_ids)
            out.recving.add(req_id)
        return out

    def close(self) -> None:
        """Wait for what is in flight (a store reads engine memory vLLM is about to free), then stop."""
        self.release_deferred()
        self._loader.shutdown(wait=True)
        self._storer.shutdown(wait=True)
