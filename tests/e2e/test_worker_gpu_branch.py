"""The vLLM connector's GPU worker branch (WorkerSide with GpuTransfers, asynchronous) against a real
`kvtier server --gpu-fake-engine` and its copier process, run in vLLM's environment (gpu_worker_glue.py).
The CPU stand-in's shared-memory device stands for the GPU; the CUDA export itself runs only on a GPU
(tests/gpu/)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import harness
import pytest

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parent / "gpu_worker_glue.py"
FLAGS = ["--gpu-fake-engine", "--gpu-pin-piece-mb", "4", "--page-size-kb", "16"]


def test_gpu_worker_stores_holds_loads_and_waits_at_preemption(vllm_python: Path, logdir: Path):
    port, http_port = harness.free_port(), harness.free_port()
    server = harness.start_kvtier(port, http_port, 0.0625, FLAGS, python=vllm_python, logdir=logdir)
    try:
        run = subprocess.run([str(vllm_python), str(SCRIPT), f"tcp://127.0.0.1:{port}"], capture_output=True,
                             text=True, timeout=120, cwd=harness.REPO)
        assert run.returncode == 0, run.stderr[-3000:]
        out = json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        server.stop()
    assert out["held_before_event"], "a store was reported before the worker's stream reached its event"
    assert out["store_reported"]
    assert out["load_errors"] == [] and out["loaded_bit_exact"] and out["untouched_before_first"], out
    assert out["miss_errors"] == out["blocks"]  # a miss: every block reported for recompute
    assert out["preemption_waited_s"] >= 0.4, out  # handle_preemptions returned only after the store's copy
