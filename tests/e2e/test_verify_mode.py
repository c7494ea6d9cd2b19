"""End-to-end: sampled verification (`kvtier.verify_fraction`) finds KV stored under the wrong identity and stays
quiet on honest hits (issue 26, check 5).

One kvtier server and one vLLM with a random LoRA adapter ``myl`` (lora_adapter.py) and the connector at
``verify_fraction: 1.0`` (every hit is recomputed and compared instead of loaded):
- honest: a prompt for the base model, vLLM's prefix cache reset, the prompt again: kvtier has it, the
  request is verified (kvtier_verify_checks_total grows), no mismatch, and the answer is the cold one;
- planted: a prompt for ``myl``; plant_kv.py copies the chunks ``myl`` stored under the base model's keys of
  that prompt (an identity mistake made on purpose); the prompt for the base model: the lookup hits, the
  sampled recompute differs from what kvtier holds (kvtier_verify_mismatches_total grows, the connector logs
  the keys), and the answer is still the base model's own (it was recomputed), as a fresh prefill after
  clearing kvtier confirms.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import harness
import lora_adapter
import pytest

pytestmark = pytest.mark.e2e

PROMPT_LEN = 1100
MAX_TOKENS = 8
BASE = harness.SERVED_MODEL_NAME
VERIFY = "kvtier_verify_checks_total"
MISMATCH = "kvtier_verify_mismatches_total"


def complete(port: int, model: str, ids: list[int], reset: bool = True) -> list[int]:
    if reset:
        harness.reset_prefix_cache(port)
    body = harness._completion_body(ids, MAX_TOKENS, False)
    body["model"] = model
    out = harness.http_json(port, "/v1/completions", body, timeout=300.0)["choices"][0]["token_ids"]
    assert isinstance(out, list) and len(out) == MAX_TOKENS
    return out


def verify_counts(http_port: int) -> tuple[float, float]:
    samples = harness.metrics(http_port)  # plain names: summed over the namespace labels
    return harness.metric(samples, VERIFY), harness.metric(samples, MISMATCH)


def wait_counts(http_port: int, checks: float, timeout: float = 20.0) -> tuple[float, float]:
    """The server's counts once `checks` verifications were reported (the connector reports within a step)."""
    deadline = time.monotonic() + timeout
    while True:
        got = verify_counts(http_port)
        if got[0] >= checks or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_verification_finds_planted_kv_and_passes_honest_hits(vllm_python, tiny_model, logdir, tmp_path: Path):
    adapter = lora_adapter.write_adapter(tmp_path / "myl", seed=1)
    kv_port, kv_http, port = harness.free_port(), harness.free_port(), harness.free_port()
    with harness.start_kvtier(kv_port, kv_http, 0.25, python=vllm_python, logdir=logdir) as kv:
        config = harness.kvtier_connector_config(kv_port, verify_fraction=1.0)
        lora = ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"myl={adapter}"]
        with harness.start_vllm(tiny_model, port, config, python=vllm_python, logdir=logdir,
                                extra_args=lora) as vllm:
            honest = harness.prompt_ids(PROMPT_LEN, seed=2701)
            cold = complete(port, BASE, honest)
            assert verify_counts(kv_http) == (0, 0)
            time.sleep(0.5)  # the store lands
            assert complete(port, BASE, honest) == cold
            assert wait_counts(kv_http, 1) == (1, 0), vllm.log_tail()

            planted = harness.prompt_ids(PROMPT_LEN, seed=2702)
            adapter_out = complete(port, "myl", planted)
            time.sleep(0.5)
            run = subprocess.run([str(vllm_python), str(Path(__file__).with_name("plant_kv.py")),
                                  f"tcp://127.0.0.1:{kv_port}", str(kv_http), str(adapter), json.dumps(planted)],
                                 capture_output=True, text=True, timeout=120)
            assert run.returncode == 0 and int(run.stdout.split()[-1]) > 0, run.stdout + run.stderr
            answered = complete(port, BASE, planted)
            checks, mismatches = wait_counts(kv_http, 2)
            assert (checks, mismatches) == (2, 1), vllm.log_tail()
            assert "kvtier verification: request" in vllm.log_text()
            # recomputed, so the base model's own answer: what a fresh prefill gives with kvtier emptied
            harness.http_json(kv_http, "/cache/clear", {"scope": "all"}, timeout=30.0)
            assert complete(port, BASE, planted) == answered != adapter_out
            vllm.check_alive()
            kv.check_alive()
