"""Per-thread CPU of a bench's processes, from /proc: where the cores went during one client run.

bench_serve.py ``--thread-cpu`` takes a snapshot of every thread of vLLM's process group and the daemon's before
the client starts and another after it ends. Per thread: CPU seconds (utime + stime), involuntary context
switches (the thread was runnable and another took its core: the sign of two busy threads on one core) and
the core it last ran on. Threads come and go between snapshots; one that ended before the second is not counted.
Rows are per thread name: a process's main thread is `main`, and CPython's other threads (which carry the
process's name in the OS: vLLM's venv is Python 3.11) share one row under that name. `mean_rows` averages the
rows of several runs and then folds a process's rows under 0.05 s into one, `(others)`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def processes(groups: Iterable[int]) -> dict[int, int]:
    """The live processes of the process groups `groups`: pid -> its group."""
    wanted, out = set(groups), {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            fields = _stat_fields(proc / "stat")
            if fields is not None and int(fields[2]) in wanted:  # field 5 of stat: the process group
                out[int(proc.name)] = int(fields[2])
    return out


def snapshot(groups: dict[int, str]) -> dict[tuple[int, int], ThreadSample]:
    """Every thread of every process whose process group is a key of `groups`, keyed by (pid, tid); the
    process named `label/comm`, with the group's label."""
    out: dict[tuple[int, int], ThreadSample] = {}
    for pid, group in processes(groups).items():
        proc = Path(f"/proc/{pid}")
        process = f"{groups[group]}/{_comm(proc / 'comm')}"
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
    before: dict[tuple[int, int], ThreadSample], after: dict[tuple[int, int], ThreadSample]
) -> list[ThreadUsage]:
    """Per (process, thread name), over the threads alive in both snapshots: CPU seconds and involuntary
    switches between them, busiest first. Every name is a row of its own, however little it used, so that a
    row is the same set of threads in every run (`mean_rows` folds the small ones after averaging)."""
    rows: dict[tuple[str, str], ThreadUsage] = {}
    for key, a in after.items():
        b = before.get(key)
        if b is None:
            continue
        row = rows.setdefault((a.process, a.thread), ThreadUsage(a.process, a.thread))
        row.cpu_s += a.cpu_s - b.cpu_s
        row.involuntary += a.involuntary - b.involuntary
        row.threads += 1
        if a.core not in row.cores:
            row.cores.append(a.core)
    return sorted(rows.values(), key=lambda r: -r.cpu_s)


def _add(into: dict[str, Any], row: dict[str, Any], share: float) -> None:
    into["cpu_s"] += row["cpu_s"] * share
    into["involuntary"] += row["involuntary"] * share
    into["cores"].update(row["cores"])


def mean_rows(runs: list[list[dict[str, Any]]], min_cpu_s: float = 0.05) -> list[dict[str, Any]]:
    """`usage` rows (as dicts) of several runs: per (process, thread) the mean CPU seconds and involuntary
    switches per run (a row missing from a run counts 0 there), busiest first; the rows of a process whose
    mean is under `min_cpu_s` are folded into one row, `(others)`, `threads` saying how many threads it holds."""

    def blank(process: str, thread: str) -> dict[str, Any]:
        return {
            "process": process,
            "thread": thread,
            "cpu_s": 0.0,
            "involuntary": 0.0,
            "threads": 0,
            "cores": set(),
        }

    means: dict[tuple[str, str], dict[str, Any]] = {}
    for rows in runs:
        for r in rows:
            m = means.setdefault((r["process"], r["thread"]), blank(r["process"], r["thread"]))
            _add(m, r, 1 / len(runs))
            m["threads"] = max(m["threads"], r["threads"])
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for (process, thread), m in means.items():
        if m["cpu_s"] >= min_cpu_s:
            out[(process, thread)] = m
            continue
        o = out.setdefault((process, "(others)"), blank(process, "(others)"))
        _add(o, m, 1.0)
        o["threads"] += m["threads"]
    return sorted(({**o, "cores": sorted(o["cores"])} for o in out.values()), key=lambda o: -o["cpu_s"])
