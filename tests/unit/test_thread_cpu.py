"""tests/e2e/thread_cpu.py, bench_serve.py's per-thread CPU: a row is one thread name in every run, and only
the averages decide which rows fold into `(others)` (a thread near the threshold is not split between rows)."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

import thread_cpu  # noqa: E402
from thread_cpu import ThreadSample  # noqa: E402

pytestmark = pytest.mark.unit


def sample(thread: str, cpu_s: float, involuntary: int = 0, core: int = 0) -> ThreadSample:
    return ThreadSample("vllm/Worker", thread, cpu_s, involuntary, core)


def run(**cpu: float) -> list[dict]:
    """One run's rows: thread name -> CPU seconds over the run (tid = position)."""
    before = {(1, tid): sample(name, 0.0) for tid, name in enumerate(cpu)}
    after = {
        (1, tid): sample(name, s, involuntary=10, core=tid % 2) for tid, (name, s) in enumerate(cpu.items())
    }
    return [asdict(u) for u in thread_cpu.usage(before, after)]


def test_usage_keeps_every_thread_name_a_row_and_merges_threads_of_one_name() -> None:
    before = {(1, 1): sample("main", 1.0), (1, 2): sample("python", 0.0), (1, 3): sample("python", 0.0)}
    after = {
        (1, 1): sample("main", 3.0, involuntary=5),
        (1, 2): sample("python", 0.01, core=1),
        (1, 3): sample("python", 0.02),
        (1, 4): sample("python", 9.0),  # started between the snapshots: not counted
    }
    rows = {u.thread: u for u in thread_cpu.usage(before, after)}
    assert set(rows) == {"main", "python"}
    assert rows["main"].cpu_s == pytest.approx(2.0) and rows["main"].involuntary == 5
    assert rows["python"].cpu_s == pytest.approx(0.03) and rows["python"].threads == 2
    assert sorted(rows["python"].cores) == [0, 1]


def test_mean_rows_fold_by_the_mean_not_by_each_run() -> None:
    # "store" is 0.04 s in one run and 0.07 s in the other: one row, mean 0.055 s, kept
    rows = thread_cpu.mean_rows([run(main=30.0, store=0.04, tally=0.01), run(main=31.0, store=0.07)])
    by_name = {r["thread"]: r for r in rows}
    assert [r["thread"] for r in rows] == ["main", "store", "(others)"]
    assert by_name["store"]["cpu_s"] == pytest.approx(0.055)
    assert by_name["(others)"]["cpu_s"] == pytest.approx(0.005) and by_name["(others)"]["threads"] == 1
    assert by_name["main"]["involuntary"] == pytest.approx(10)
