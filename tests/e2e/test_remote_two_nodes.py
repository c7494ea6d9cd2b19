"""Two nodes share one Redis (issue 15, check 1, end to end): a 2,000-token prompt computed by a vLLM on node A
is loaded by a fresh vLLM on node B through B's own kvtier server, from the remote tier, with the greedy output
of vLLM's own prefix hit of the same tokens. B's first lookup finds the chunks unknown to it: the reply says
"pending", the connector answers vLLM "ask again", and the next step's lookup has the hits.

"Nodes" are two kvtier servers on this machine with nothing in common but the Redis server: their own L1
segments, ports and L2 directories, and different PYTHONHASHSEED values (kvtier's keys must not depend on
Python's hash seed). The like-for-like reference is A's own prefix-cache hit of the tokens B loads
(see test_connector_reload.py on why a cold prefill is not one).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import harness
import pytest

pytestmark = pytest.mark.e2e

REDIS_ENV = harness.REPO / "scripts" / "redis_env.sh"
PROMPT_LEN = 2000
BLOCK = 128
RELOAD = (PROMPT_LEN - 1) // BLOCK * BLOCK  # 1920
MIN_RELOAD = 1792  # the seven whole 256-token chunks; the partial eighth comes through its alias


@pytest.fixture
def redis_url(tmp_path: Path):
    directory = tmp_path / "redis"
    port = harness.free_port()
    run = subprocess.run(["bash", str(REDIS_ENV), "standalone", str(directory), str(port)], capture_output=True,
                         text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    yield run.stdout.strip().splitlines()[-1]
    subprocess.run(["bash", str(REDIS_ENV), "stop", str(directory)], capture_output=True, timeout=60)


def start_node(name: str, redis_url: str, seed: str, python: Path, logdir: Path, tmp_path: Path):
    port, http_port = harness.free_port(), harness.free_port()
    args = ["--shm-name", f"kvtier-e2e-{name}-{port}", "--remote-url", redis_url, "--l2-path",
            str(tmp_path / f"l2-{name}"), "--l2-size-gb", "0.25"]
    return harness.start_kvtier(port, http_port, 0.25, args, python=python, logdir=logdir,
                                env_extra={"PYTHONHASHSEED": seed}, name=f"kvtier-{name}")


def test_prompt_computed_on_node_a_loads_on_a_fresh_vllm_on_node_b(tiny_model: Path, vllm_python: Path,
                                                                 logdir: Path, tmp_path: Path, redis_url: str):
    node_a = start_node("a", redis_url, "1", vllm_python, logdir, tmp_path)
    node_b = start_node("b", redis_url, "2", vllm_python, logdir, tmp_path)
    prompt = harness.prompt_ids(PROMPT_LEN, seed=1501)

    vllm_a = harness.start_vllm(tiny_model, harness.free_port(), harness.kvtier_connector_config(node_a.port),
                                python=vllm_python, logdir=logdir, name="vllm-a")
    harness.complete(vllm_a.port, prompt, 1)  # computed on A; stored in A's L1, then written to Redis
    expected, _ = harness.complete(vllm_a.port, prompt, 16)  # A's own prefix hit of 1,920 tokens
    harness.wait_remote_drained(node_a.http_port)
    vllm_a.stop()

    vllm_b = harness.start_vllm(tiny_model, harness.free_port(), harness.kvtier_connector_config(node_b.port),
                                python=vllm_python, logdir=logdir, name="vllm-b")
    before = harness.metric(harness.metrics(vllm_b.port), "vllm:prompt_tokens_by_source_total",
                            source="external_kv_transfer")
    out, _ = harness.complete(vllm_b.port, prompt, 16)
    loaded = harness.metric(harness.metrics(vllm_b.port), "vllm:prompt_tokens_by_source_total",
                            source="external_kv_transfer") - before
    status_b = harness.kvtier_status(node_b.http_port)
    vllm_b.stop()

    assert loaded >= MIN_RELOAD, f"node B loaded {loaded} tokens ({status_b.get('remote')})"
    assert out == expected
    # B did not know the chunks when vLLM first asked: its lookup answered "pending" and vLLM asked again
    assert status_b["remote"]["remote_pending_lookups"] >= 1
