"""Per-thread CPU of a bench's processes, from /proc: where the cores went during one client run.

bench_serve.py ``--thread-cpu`` takes a snapshot of every thread of vLLM's process group and the daemon's before
the client starts and another after it ends. Per thread: CPU seconds (utime + stime), involuntary context
switches (the thread was runnable and another took its core: the sign of two busy threads on one core) and
the core it last ran on. Threads come and go between snapshots; one that ended before the second is not counted.
Rows are per thread name: a process's main thread is `main`, and CPython's other threads (which carry the
process's name in the OS: vLLM's venv is Python 3.11) share one row under that name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ThreadSample:
    process: str  # label/name: vllm/VLLM::EngineCore, vllm/VLLM::Worker, daemon/python ...
    thread: str
    cpu_s: float
    involuntary: int
    core: int


def _stat_fields(path: Path) -> list[str] | None:
    try:
        text = path.read_text()
    except OSError:  # the thread or process ended
        return None
    return text[text.rindex(")") + 2 :].split()  # fields after "pid (comm) ", comm may hold spaces


def _comm(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return "?"


def _involuntary(status: Path) -> int:
    try:
        for line in status.read_text().splitlines():
            if line.startswith("nonvoluntary_ctxt_switches:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def snapshot(groups: dict[int, str]) -> dict[tuple[int, int], ThreadSample]:
    """Every thread of every process whose process group is a key of `groups`, keyed by (pid, tid); the
    process named `label/comm`, with the group's label."""
    out: dict[tuple[int, int], ThreadSample] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        fields = _stat_fields(proc / "stat")
        if fields is None or int(fields[2]) not in groups:  # field 5 of stat: the process group
            continue
        process = f"{groups[int(fields[2])]}/{_comm(proc / 'comm')}"
        try:
            tasks = list((proc / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            tf = _stat_fields(task / "stat")
            if tf is None:
                continue
            out[(int(proc.name), int(task.name))] = ThreadSample(
                process=process,
                # CPython (before 3.14) leaves its threads' OS names at the process's: the main one told apart
                thread="main" if task.name == proc.name else _comm(task / "comm"),
                cpu_s=(int(tf[11]) + int(tf[12])) / TICK,  # utime, stime (fields 14, 15)
                involuntary=_involuntary(task / "status"),
                core=int(tf[36]),  # field 39: the CPU it last ran on
            )
    return out


@dataclass
class ThreadUsage:
    process: str
    thread: str
    cpu_s: float = 0.0
    involuntary: int = 0
    threads: int = 0
    cores: list[int] = field(default_factory=list)


def usage(
    before: dict[tuple[int, int], ThreadSample],
    after: dict[tuple[int, int], ThreadSample],
    min_cpu_s: float = 0.05,
) -> list[ThreadUsage]:
    """Per thread alive in both snapshots: CPU seconds and involuntary switches between them, busiest first;
    threads under `min_cpu_s` folded into one row per process."""
    rows: dict[tuple[str, str], ThreadUsage] = {}
    for key, a in after.items():
        b = before.get(key)
        if b is None:
            continue
        cpu = a.cpu_s - b.cpu_s
        name = (a.process, a.thread if cpu >= min_cpu_s else "(others)")
        row = rows.setdefault(name, ThreadUsage(*name))
        row.cpu_s += cpu
        row.involuntary += a.involuntary - b.involuntary
        row.threads += 1
        if a.core not in row.cores:
            row.cores.append(a.core)
    return sorted(rows.values(), key=lambda r: -r.cpu_s)
