"""KVTIER_HOOK_TIMES (connector/vllm/hook_times.py): nothing wrapped when unset; timed hooks and a summary
file when set.

hook_times.py needs neither torch nor vLLM, but its package's __init__ imports both: the module is loaded
from its file, so the dev venv runs this test.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parents[2] / "connector" / "vllm" / "hook_times.py"


@pytest.fixture
def hook_times():
    spec = importlib.util.spec_from_file_location("kvtier_hook_times_under_test", SRC)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class FakeWorker:
    def start_load_kv(self, meta):
        return ("loaded", meta)

    def wait_for_save(self, meta):
        raise RuntimeError("boom")


class FakeScheduler:
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 128, False

    def build_connector_meta(self, scheduler_output):
        return {"out": scheduler_output}


def test_unset_wraps_nothing(hook_times, monkeypatch):
    monkeypatch.delenv(hook_times.ENV, raising=False)
    w, s = FakeWorker(), FakeScheduler()
    assert hook_times.install(w, "worker") is None
    assert hook_times.install(s, "scheduler") is None
    assert vars(w) == {} and vars(s) == {}  # the class's own methods, untouched


def test_set_times_each_hook_and_writes_a_summary(hook_times, monkeypatch, tmp_path):
    monkeypatch.setenv(hook_times.ENV, str(tmp_path / "hooks"))
    w, s = FakeWorker(), FakeScheduler()
    rw = hook_times.install(w, "worker")
    rs = hook_times.install(s, "scheduler")
    assert rw is not None and rs is not None and rw.path != rs.path
    assert w.start_load_kv("m") == ("loaded", "m")  # results pass through
    with pytest.raises(RuntimeError, match="boom"):  # so do exceptions, and the call is still timed
        w.wait_for_save("m")
    for _ in range(3):
        assert s.get_num_new_matched_tokens("r", 0) == (128, False)
    s.build_connector_meta("x")
    rw.write()
    rs.write()
    files = sorted((tmp_path / "hooks").glob("hook-times-*.json"))
    assert [json.loads(f.read_text())["role"] for f in files] == ["scheduler", "worker"]
    sched = json.loads(rs.path.read_text())["hooks"]
    work = json.loads(rw.path.read_text())["hooks"]
    assert sched["get_num_new_matched_tokens"]["calls"] == 3
    assert sched["build_connector_meta"]["calls"] == 1
    assert work["start_load_kv"]["calls"] == 1 and work["wait_for_save"]["calls"] == 1
    h = sched["get_num_new_matched_tokens"]
    assert 0 <= h["p50_ms"] <= h["p99_ms"] <= h["max_ms"]
    assert h["mean_ms"] == pytest.approx(h["total_ms"] / 3)


class SleepyScheduler(FakeScheduler):
    """One hook that waits (no CPU), one that computes (CPU about equal to its wall time)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        time.sleep(0.05)
        return 0, False

    def build_connector_meta(self, scheduler_output):
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            pass
        return {}


def test_the_summary_splits_cpu_time_from_waiting(hook_times, monkeypatch, tmp_path):
    monkeypatch.setenv(hook_times.ENV, str(tmp_path / "hooks"))
    s = SleepyScheduler()
    rec = hook_times.install(s, "scheduler")
    s.get_num_new_matched_tokens("r", 0)
    s.build_connector_meta("x")
    rec.write()
    hooks = json.loads(rec.path.read_text())["hooks"]
    waited, computed = hooks["get_num_new_matched_tokens"], hooks["build_connector_meta"]
    assert waited["mean_ms"] >= 50 and waited["cpu_mean_ms"] < 25
    assert computed["mean_ms"] >= 50 and computed["cpu_mean_ms"] > 10  # a busy machine may take some of it
    assert computed["cpu_ms"] == pytest.approx(computed["cpu_mean_ms"])
