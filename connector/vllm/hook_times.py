"""Per-hook wall times of the kvtier connector inside vLLM, for benchmarks (off unless asked for).

Set ``KVTIER_HOOK_TIMES=DIR`` in vLLM's environment: each connector (the scheduler's and each worker's, one
per process role) then times its hooks -- the scheduler's ``get_num_new_matched_tokens`` and
``build_connector_meta``, the worker's ``start_load_kv`` and ``wait_for_save`` -- and writes a summary to
``DIR/hook-times-<role>-<pid>-<n>.json``: per hook the number of calls, the total, mean, p50, p99 and max in
milliseconds, and the calling thread's CPU time in them (total and mean: wall time well above it is time the
thread waited for its core or a lock). A daemon thread rewrites the file once a second while new calls come
in; the connector's shutdown and interpreter exit write it once more, so a stopped vLLM leaves its final
figures.

With the variable unset nothing is wrapped: :func:`install` returns at once and the connector's methods are
the class's own. Timing adds two ``perf_counter_ns`` and two ``thread_time_ns`` calls, a lock and a list
append per hook call. The benchmark that reads these files is tests/e2e/bench_serve.py.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV = "KVTIER_HOOK_TIMES"
SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "build_connector_meta")
WORKER_HOOKS = ("start_load_kv", "wait_for_save")
MAX_SAMPLES = 1_000_000  # per hook; the count and total go on past it

log = logging.getLogger("kvtier.connector")
_seq = itertools.count()


def _pct(sorted_ms: list[float], p: float) -> float:
    if not sorted_ms:
        return float("nan")
    k = min(len(sorted_ms) - 1, max(0, round(p / 100 * (len(sorted_ms) - 1))))
    return sorted_ms[k]


class HookTimes:
    """Durations per hook name, summarized into one JSON file."""

    def __init__(self, path: Path, role: str) -> None:
        self.path = path
        self.role = role
        self.samples: dict[str, list[float]] = {}
        self.count: dict[str, int] = {}
        self.total_ms: dict[str, float] = {}
        self.cpu_ms: dict[str, float] = {}
        self._lock = threading.Lock()
        self._dirty = False

    def add(self, hook: str, ns: int, cpu_ns: int = 0) -> None:
        ms = ns / 1e6
        with self._lock:
            xs = self.samples.setdefault(hook, [])
            if len(xs) < MAX_SAMPLES:
                xs.append(ms)
            self.count[hook] = self.count.get(hook, 0) + 1
            self.total_ms[hook] = self.total_ms.get(hook, 0.0) + ms
            self.cpu_ms[hook] = self.cpu_ms.get(hook, 0.0) + cpu_ns / 1e6
            self._dirty = True

    def _writer(self) -> None:
        while True:  # a daemon thread: the summary is sorted and written off the hooks' path
            time.sleep(1.0)
            if self._dirty:
                self._dirty = False
                self.write()

    def summary(self) -> dict[str, Any]:
        with self._lock:
            hooks = {}
            for hook, xs in self.samples.items():
                s = sorted(xs)
                n = self.count[hook]
                hooks[hook] = {
                    "calls": n,
                    "total_ms": self.total_ms[hook],
                    "mean_ms": self.total_ms[hook] / n,
                    "cpu_ms": self.cpu_ms[hook],
                    "cpu_mean_ms": self.cpu_ms[hook] / n,
                    "p50_ms": _pct(s, 50),
                    "p99_ms": _pct(s, 99),
                    "max_ms": s[-1] if s else float("nan"),
                }
        return {"role": self.role, "pid": os.getpid(), "hooks": hooks}

    def write(self) -> None:
        try:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.summary(), indent=1))
            os.replace(tmp, self.path)
        except Exception:  # a benchmark aid: never let it disturb serving
            log.exception("kvtier: writing hook times to %s failed", self.path)


def _timed(fn: Callable[..., Any], rec: HookTimes, hook: str) -> Callable[..., Any]:
    clock, cpu = time.perf_counter_ns, time.thread_time_ns

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = clock(), cpu()
        try:
            return fn(*args, **kwargs)
        finally:
            rec.add(hook, clock() - t0, cpu() - c0)

    wrapper.__name__ = getattr(fn, "__name__", hook)
    wrapper.__doc__ = getattr(fn, "__doc__", None)
    return wrapper


def install(connector: Any, role: str) -> HookTimes | None:
    """Time `connector`'s hooks of its `role` ("scheduler" or "worker") when ``KVTIER_HOOK_TIMES`` names a
    directory: the bound methods are replaced by timed ones on the instance. None (and no change) otherwise."""
    where = os.environ.get(ENV, "")
    if not where:
        return None
    d = Path(where)
    d.mkdir(parents=True, exist_ok=True)
    rec = HookTimes(d / f"hook-times-{role}-{os.getpid()}-{next(_seq)}.json", role)
    for hook in SCHEDULER_HOOKS if role == "scheduler" else WORKER_HOOKS:
        setattr(connector, hook, _timed(getattr(connector, hook), rec, hook))
    atexit.register(rec.write)
    threading.Thread(target=rec._writer, name="kvtier-hook-times", daemon=True).start()
    log.info("kvtier: timing the %s hooks into %s", role, rec.path)
    return rec
