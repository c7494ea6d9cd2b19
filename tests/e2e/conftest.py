"""Fixtures for end-to-end tests with a real vLLM (CPU build).

* Every test under tests/e2e is marked ``e2e`` (collection hook below).
* ``vllm_python`` builds/caches the vLLM venv once per session (scripts/vllm_env.sh).  The tests are
  skipped only when ``KVTIER_SKIP_E2E=1``; a failure to build the environment is an error.
* ``tiny_model`` / ``tiny_model_b``: two tiny random Llama directories (different seeds and dirs).
* ``logdir``: a per-test directory for process logs (kept on failure for inspection).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

_E2E_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _E2E_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    if os.environ.get("KVTIER_SKIP_E2E") == "1":
        pytest.skip("KVTIER_SKIP_E2E=1: end-to-end tests with real vLLM disabled")
    return harness.vllm_python()


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path) -> Path:
    return harness.build_tiny_model(vllm_python, seed=0)


@pytest.fixture(scope="session")
def tiny_model_b(vllm_python: Path) -> Path:
    """A second model (seed 1, its own directory): its KV must never hit entries of ``tiny_model``."""
    return harness.build_tiny_model(vllm_python, seed=1)


@pytest.fixture
def logdir(request, tmp_path_factory) -> Path:
    base = os.environ.get("KVTIER_E2E_LOGDIR")
    name = request.node.name.replace("/", "_")[:80]
    if base:
        d = Path(base) / name
        d.mkdir(parents=True, exist_ok=True)
        return d
    return tmp_path_factory.mktemp(f"logs-{name}")


@pytest.fixture(autouse=True)
def _kill_leftovers():
    yield
    harness.kill_all()
