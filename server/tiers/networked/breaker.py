"""Per-node circuit breakers (purgatory's state machine) with an injected failure classifier: the tier says
which exceptions mean that a node did not answer (towards opening its breaker); any other outcome (a server
error reply included) closes the count. Nothing here knows the store's client library."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from purgatory import SyncCircuitBreakerFactory
from purgatory.domain.model import OpenedState

T = TypeVar("T")
IsFailure = Callable[[BaseException], bool]

__all__ = ["Breaker", "Breakers", "OpenedState"]


class Breaker:
    """One node's circuit breaker. purgatory keeps no lock, and its bookkeeping is not safe across threads,
    so it runs under ours; the call itself runs outside it, in parallel."""

    def __init__(self, factory: SyncCircuitBreakerFactory, node: str, is_failure: IsFailure) -> None:
        self._brk = factory.get_breaker(node)
        self._lock = threading.Lock()
        self._is_failure = is_failure

    @property
    def open(self) -> bool:
        """Opened, or half-opened by a probe in flight: data calls are not made."""
        return self._brk.context.state != "closed"

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()` through the breaker: purgatory.OpenedState while open and its reset time not passed; a node
        failure (`is_failure`) counts towards opening it, any other outcome closes the count."""
        with self._lock:
            self._brk.__enter__()
        try:
            out = fn()
        except BaseException as exc:
            failed = self._is_failure(exc)
            with self._lock:
                self._brk.__exit__(*((type(exc), exc, exc.__traceback__) if failed else (None, None, None)))
            raise
        with self._lock:
            self._brk.__exit__(None, None, None)
        return out


class Breakers:
    """The breakers of a tier's nodes, made on first use; `on_new(node, breaker)` and `on_drop(node)` let the
    tier keep a gauge per node. Thread-safe."""

    def __init__(self, threshold: int, reset_s: float, is_failure: IsFailure,
                 on_new: Callable[[str, Breaker], None] = lambda n, b: None,
                 on_drop: Callable[[str], None] = lambda n: None) -> None:
        self._factory = SyncCircuitBreakerFactory(default_threshold=threshold, default_ttl=reset_s)
        self._is_failure = is_failure
        self._on_new, self._on_drop = on_new, on_drop
        self._lock = threading.Lock()
        self._map: dict[str, Breaker] = {}

    def get(self, node: str) -> Breaker:
        brk = self._map.get(node)
        if brk is None:
            with self._lock:
                brk = self._map.get(node)
                if brk is None:
                    brk = self._map[node] = Breaker(self._factory, node, self._is_failure)
                    self._on_new(node, brk)
        return brk

    def available(self, node: str) -> bool:
        return not self.get(node).open

    def is_open(self, node: str) -> bool:
        """Whether `node` has a breaker and it is open (no breaker is made for it)."""
        brk = self._map.get(node)
        return brk is not None and brk.open

    def items(self) -> list[tuple[str, Breaker]]:
        return list(self._map.items())

    def keep_only(self, nodes: set[str]) -> list[str]:
        """Forget the breakers of nodes not in `nodes` (they left the store); the nodes forgotten."""
        with self._lock:
            gone = [node for node in self._map if node not in nodes]
            for node in gone:
                del self._map[node]
                self._on_drop(node)
        return gone
