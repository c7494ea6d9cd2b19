"""The vLLM connector's GPU worker branch where the server lets it down (issue 27, defects 1, 7 and 8), against a
real `kvtier server --gpu-fake-engine` and its copier process, in vLLM's environment
(gpu_worker_failures_glue.py): an idle worker keeps loading, a refused operation is a miss and never an
exception on vLLM's thread, and registration never holds vLLM's thread."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import harness
import pytest

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parent / "gpu_worker_failures_glue.py"
FLAGS = ["--gpu-fake-engine", "--gpu-pin-piece-mb", "4", "--page-size-kb", "16"]


def run(vllm_python: Path, logdir: Path, scenario: str, flags: list[str], env: dict[str, str] | None = None
        ) -> tuple[dict, str]:
    """The glue's findings and the server's log."""
    port, http_port = harness.free_port(), harness.free_port()
    server = harness.start_kvtier(port, http_port, 0.0625, [*FLAGS, *flags], python=vllm_python, logdir=logdir,
                                  env_extra=env)
    try:
        done = subprocess.run([str(vllm_python), str(SCRIPT), f"tcp://127.0.0.1:{port}", scenario],
                              capture_output=True, text=True, timeout=120, cwd=harness.REPO)
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        server.stop()
    return out, server.log_path.read_text(errors="replace")


def test_an_idle_gpu_worker_loads_what_it_stored(vllm_python: Path, logdir: Path) -> None:
    out, _ = run(vllm_python, logdir, "idle", ["--client-timeout-s", "1"])
    assert out["registered"] and out["load_errors"] == 0 and out["loaded_bit_exact"], out


def test_refused_gpu_operations_are_misses_not_exceptions(vllm_python: Path, logdir: Path) -> None:
    out, _ = run(vllm_python, logdir, "refused", [])
    assert out["registered"], out
    assert out["load_errors"] == out["steps"] * 8, out  # every block of every load reported for recompute


def test_registration_never_holds_vllms_thread_and_backs_off(vllm_python: Path, logdir: Path) -> None:
    out, log = run(vllm_python, logdir, "no_device", [])
    assert out["attach_s"] < 0.5 and out["slowest_step_s"] < 0.1, out
    attempts = log.count("GPU registration refused")
    assert 1 <= attempts <= 3, attempts  # 1 s, 2 s, ... apart over 4 s, not one per step


def test_a_slow_copier_start_is_waited_for_off_vllms_thread(vllm_python: Path, logdir: Path) -> None:
    out, _ = run(vllm_python, logdir, "slow_start", [], env={"KVTIER_FAKE_START_DELAY_S": "3"})
    assert out["attach_s"] < 0.5, out
    assert out["registered"] and out["load_errors"] == 0 and out["loaded_bit_exact"], out
