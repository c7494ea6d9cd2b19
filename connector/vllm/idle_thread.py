"""Idle scheduling for the worker's store thread on CPU engines (`kvtier.idle_stores`, on by default).

A store on a CPU engine copies the prompt's blocks and talks to the daemon on a Python thread of vLLM's worker.
It is handed over as the step that computed the prompt ends, while the worker's main thread still computes the
logits, samples the first token and sends the step's output. At normal priority, on the core vLLM bound the
worker to, the store thread takes that core and the GIL in that window: the request's first token came about
1.5 ms later than with its store turned off (docs/performance.md, "The store thread at idle priority"). At
`SCHED_IDLE` and free to run on any core the process may use, the thread runs only on cycles no other thread
of the machine wants (the worker's and the engine core's waits for each other, an idle core), and the first
token is no longer held up by it.

An idle thread gets almost nothing on cores that stay busy, so the worker bounds how long a store may wait
(in_flight.py): past `max_store_wait_s` its main thread waits for the store, as a synchronous store would have
made it, and its own core is then free for the store thread. Linux only; elsewhere, or where the kernel
refuses, the thread keeps the worker's priority and cores (one log line says so).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("kvtier.connector")

CPUSET_FILES = ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/devices/system/cpu/online")


def parse_cpu_list(text: str) -> set[int]:
    """The CPUs of a kernel CPU list such as ``0-3,8,10-11``."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def usable_cpus(files: tuple[str, ...] = CPUSET_FILES) -> set[int]:
    """Every CPU this process's cgroup lets it use (vLLM binds the worker's own threads to fewer): the first
    readable of `files`, or none known."""
    for name in files:
        try:
            cpus = parse_cpu_list(Path(name).read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            return cpus
    return set()


def enter_idle() -> bool:
    """Make the calling thread an idle-priority thread on every usable CPU; whether it now is one."""
    if not hasattr(os, "SCHED_IDLE"):
        log.info("kvtier: no SCHED_IDLE on this platform; the store thread keeps the worker's priority")
        return False
    cpus, bound = usable_cpus(), os.sched_getaffinity(0)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:
        log.info("kvtier: the store thread could not go idle (%s); it keeps the worker's priority", exc)
        return False
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)  # the kernel keeps only those the cgroup allows
    except OSError as exc:  # idle on the worker's own cores still leaves them to the worker's threads
        log.info("kvtier: the idle store thread stays on the worker's cores %s (%s)", sorted(bound), exc)
    return True
