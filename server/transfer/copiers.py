"""The daemon's CopyEngine: one copier process per (engine, GPU) (server/transfer/copier.py), spawned at the
first registration for that GPU, supervised and replaced when it fails (supervisor.py).

A copier that cannot start (no cupy, no such GPU) fails its registrations with the reason it gave, and so do
the registrations for that GPU in the next VERDICT_S, without a new process; then the GPU is forgotten (and
leaves /status) and the next registration tries again. At most `max_copiers` copiers run (or start) at once:
a registration naming one GPU more is refused as NO_COPIER without a process, so a client naming made-up
GPUs costs a bounded number of processes.
This module never imports the backends (cupy stays out of the daemon).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from typing import Any

from kvtier.server.protocol import COPIER_FAILED, NO_COPIER, GpuMemory
from kvtier.server.transfer.base import LOAD, STORE, Copy, CopyEngine, GpuUnavailable
from kvtier.server.transfer.copier import INVALID, copy_to_wire
from kvtier.server.transfer.supervisor import Copier, CopiersConfig, Observer, Registration

VERDICT_S = 60.0  # how long a GPU whose copier could not start answers that failure without a new process


def _error(reply: dict[str, Any]) -> Exception:
    if reply["reason"] == INVALID:
        return ValueError(reply["detail"])
    return GpuUnavailable(reply["reason"], reply["detail"])


class Copiers(CopyEngine):
    def __init__(self, config: CopiersConfig, observer: Observer | None = None) -> None:
        self.config = config
        self.observer = observer
        self._copiers: dict[tuple[str, str], Copier] = {}
        self._registrations: dict[int, Registration] = {}
        self._ids = itertools.count(1)
        self._closed = False

    def _copier(self, key: tuple[str, str]) -> Copier:
        """The GPU's copier; one that could not start in the last VERDICT_S (its wait_ready raises why), else a
        new one, unless max_copiers run already."""
        self._forget_failed()
        copier = self._copiers.get(key)
        if copier is not None:
            return copier
        running = sum(c.state != "failed" for c in self._copiers.values())
        if running >= self.config.max_copiers:
            raise GpuUnavailable(NO_COPIER, f"{running} copiers run already (--gpu-max-copiers "
                                 f"{self.config.max_copiers}); {key[1]} gets none")
        copier = self._copiers[key] = Copier(key, self.config, self._registrations, self.observer)
        return copier

    def _forget_failed(self) -> None:
        """Drop failed copiers past VERDICT_S, and the oldest beyond max_copiers of them (/status stays short)."""
        failed = sorted((c for c in self._copiers.values() if c.state == "failed"), key=lambda c: c.failed_at)
        now = time.monotonic()
        for i, copier in enumerate(failed):
            if now - copier.failed_at > VERDICT_S or len(failed) - i > self.config.max_copiers:
                del self._copiers[copier.key]

    async def register(self, memory: GpuMemory) -> int:
        if self._closed:
            raise GpuUnavailable(NO_COPIER, "the copy engine is closing")
        registration = Registration(next(self._ids), memory)
        copier = self._copier(registration.key)
        await copier.wait_ready()
        reply = await copier.request({"op": "register", "reg": registration.id, "memory": memory.to_wire()})
        if not reply["ok"]:
            raise _error(reply)
        self._registrations[registration.id] = registration
        return registration.id

    def unregister(self, registration: int) -> None:
        held = self._registrations.pop(registration, None)
        copier = self._copiers.get(held.key) if held else None
        if copier is not None and copier.state == "serving":
            copier.send({"op": "unregister", "reg": registration})

    async def copy(self, registration: int, direction: str, copies: Sequence[Copy], event: int) -> None:
        """As CopyEngine.copy; KeyError for an unknown registration, ValueError for a copy that does not fit
        the registered memory or L1 (the copier plans and bounds-checks it; callers check first with
        plan.check, so this is a bug on the daemon's side)."""
        held = self._registrations.get(registration)
        if held is None:
            raise KeyError(registration)
        if direction not in (STORE, LOAD) or not 0 <= event < len(held.memory.events):
            raise ValueError(f"copy {direction!r} on event {event} of {len(held.memory.events)}")
        copier = self._copiers.get(held.key)
        if copier is None:  # closed, or failed and forgotten
            why = held.failure or GpuUnavailable(COPIER_FAILED, "the copy engine is closed")
            raise GpuUnavailable(why.reason, why.detail)
        await copier.wait_ready()
        if held.failure is not None:
            raise GpuUnavailable(held.failure.reason, held.failure.detail)
        reply = await copier.request({"op": "copy", "reg": registration, "direction": direction,
                                      "copies": [copy_to_wire(c) for c in copies], "event": event})
        if not reply["ok"]:
            raise _error(reply)

    def status(self) -> dict[str, Any]:
        self._forget_failed()
        return {"copiers": [copier.status() for copier in self._copiers.values()]}

    async def close(self) -> None:
        self._closed = True
        copiers, self._copiers = list(self._copiers.values()), {}
        await asyncio.gather(*(copier.stop() for copier in copiers))
