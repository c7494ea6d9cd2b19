"""Unit tests that need torch (and so vLLM's environment, which has it; the dev venv does not): run them there.
Today: tests/unit/test_gpu_memory.py, the derivation of a GPU worker's registration from vLLM-shaped KV views."""

from __future__ import annotations

import subprocess
from pathlib import Path

import harness
import pytest

pytestmark = pytest.mark.e2e

TORCH_TESTS = ["tests/unit/test_gpu_memory.py", "tests/unit/test_vllm_identity.py", "tests/unit/test_vllm_tp_lookup.py",
               "tests/unit/test_in_flight.py", "tests/unit/test_engine_events.py", "tests/unit/test_request_hints.py",
               "tests/unit/test_scheduler_presence.py"]


def test_torch_unit_tests_pass_in_the_vllm_environment(vllm_python: Path):
    run = subprocess.run([str(vllm_python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "unit",
                          *TORCH_TESTS], capture_output=True, text=True, timeout=300, cwd=harness.REPO)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
