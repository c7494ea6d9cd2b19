"""Issue 3 check 1: a prompt's KV comes back from kvtier after vLLM's own prefix cache is emptied."""

from __future__ import annotations

import harness
import pytest

pytestmark = pytest.mark.e2e

BLOCK = 128


def kvtier_config(port: int) -> dict:
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.connector.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvtier.url": f"tcp://127.0.0.1:{port}"},
    }


def external_tokens(m: dict) -> float:
    return harness.metric(m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def kvtier_hit_tokens(http_port: int) -> float:
    return harness.metric(harness.parse_metrics(harness.metrics_text(http_port)), "kvtier_hit_tokens_total", tier="l1")


def test_reload_after_prefix_cache_reset(vllm_python, tiny_model, logdir):
    kv_port, kv_http, port = harness.free_port(), harness.free_port(), harness.free_port()
    with harness.start_kvtier(kv_port, kv_http, 0.5, python=vllm_python, logdir=logdir), harness.start_vllm(
        tiny_model, port, kvtier_config(kv_port), python=vllm_python, logdir=logdir
    ) as v:
        harness.complete(v.port, harness.prompt_ids(300, seed=99), 2)  # warm-up
        prompt = harness.prompt_ids(2000, seed=7)
        out1, _ = harness.complete(v.port, prompt, 16)
        harness.reset_prefix_cache(v.port)
        m1 = harness.metrics(v.port)
        hits_before = kvtier_hit_tokens(kv_http)
        out2, _ = harness.complete(v.port, prompt, 16)
        m2 = harness.metrics(v.port)
        loaded = external_tokens(m2) - external_tokens(m1)
        assert loaded >= 1920, (loaded, v.log_tail())
        assert out2 == out1
        assert kvtier_hit_tokens(kv_http) - hits_before == loaded
