"""Smoke test of the e2e harness: vLLM (CPU) without any connector on the tiny model."""

from __future__ import annotations

import harness
import pytest

pytestmark = pytest.mark.e2e

PROMPT_LEN = 2000
BLOCK = 128  # vLLM CPU block size


def test_vllm_prefix_cache_smoke(vllm_python, tiny_model, logdir):
    port = harness.free_port()
    with harness.start_vllm(tiny_model, port, None, python=vllm_python, logdir=logdir) as v:
        prompt = harness.prompt_ids(PROMPT_LEN, seed=1)
        harness.complete(v.port, harness.prompt_ids(300, seed=99), 2)  # warm-up, unrelated prefix

        m0 = harness.metrics(v.port)
        out1, t1 = harness.complete(v.port, prompt, 16)
        m1 = harness.metrics(v.port)
        out2, ttft2, _ = harness.complete_stream(v.port, prompt, 16)
        m2 = harness.metrics(v.port)

        assert isinstance(out1, list) and len(out1) == 16, out1
        assert out1 == out2, "greedy output differs between identical requests"

        hits = "vllm:prefix_cache_hits_total"
        assert harness.metric(m1, hits) - harness.metric(m0, hits) == 0
        got = harness.metric(m2, hits) - harness.metric(m1, hits)
        # All whole blocks of the prompt except those holding its last token come from the cache.
        assert got >= (PROMPT_LEN - 1) // BLOCK * BLOCK, (got, m2)
        by_source = "vllm:prompt_tokens_by_source_total"
        cached = harness.metric(m2, by_source, source="local_cache_hit") - harness.metric(
            m1, by_source, source="local_cache_hit"
        )
        assert cached == got, {k: v for k, v in m2.items() if k.startswith(by_source)}

        # After a reset the same prompt must be computed again: no new hits.
        harness.reset_prefix_cache(v.port)
        out3, _ = harness.complete(v.port, prompt, 16)
        m3 = harness.metrics(v.port)
        assert out3 == out1
        assert harness.metric(m3, hits) == harness.metric(m2, hits)
        print(f"cold {t1 * 1e3:.0f} ms, cached ttft {ttft2 * 1e3:.0f} ms, hit tokens {got:.0f}")
    assert not v.alive()
