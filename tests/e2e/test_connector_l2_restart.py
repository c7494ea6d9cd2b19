"""End to end: vLLM (CPU) + kvtier with the L2 filesystem tier. A 2,000-token prompt is served and written
behind to L2; once the L2 queue is drained, kvtier is SIGKILLed (its L1, in shared memory, is gone with the
process as far as the new server is concerned) and restarted on the same port and L2 directory. After
vLLM's own prefix cache is reset, the same prompt is loaded from kvtier again -- every whole block, promoted
from L2 (the lookup starts the reads, the worker's acquire waits for them) -- with output identical to
vLLM's own prefix-cache reuse of the same blocks.

The server requires a client token (`--admin-token` via KVTIER_ADMIN_TOKEN), and the connector gets it from
the same environment variable, not from its command line.
"""

from __future__ import annotations

import time
from pathlib import Path

import harness
import pytest

pytestmark = pytest.mark.e2e

BLOCK = 128
L1_GB = 0.5
PROMPT_LEN = 2000
FULL_RELOAD = (PROMPT_LEN - 1) // BLOCK * BLOCK  # 1920
RETRY_BACKOFF_S = 0.2
TOKEN = "e2e-l2-token"
BY_SOURCE = "vllm:prompt_tokens_by_source_total"




def serve(port: int, prompt: list[int], max_tokens: int = 16, reset: bool = False) -> tuple[list[int], dict]:
    """Greedy completion; returns (output ids, per-source prompt token deltas from vLLM's /metrics)."""
    if reset:
        harness.reset_prefix_cache(port)
    m0 = harness.metrics(port)
    out, _ = harness.complete(port, prompt, max_tokens)
    m1 = harness.metrics(port)
    assert isinstance(out, list) and len(out) == max_tokens, out
    delta = {s: harness.metric(m1, BY_SOURCE, source=s) - harness.metric(m0, BY_SOURCE, source=s)
             for s in ("external_kv_transfer", "local_cache_hit", "local_compute")}
    return out, delta


def kv_metrics(http_port: int) -> dict:
    return harness.parse_metrics(harness.metrics_text(http_port))


def test_prompt_reloads_from_l2_after_kvtier_sigkill(vllm_python, tiny_model, logdir, tmp_path):
    l2 = tmp_path / "l2"
    kv_port, kv_http = harness.free_port(), harness.free_port()
    kv_args = ["--l2-path", str(l2), "--l2-size-gb", "2"]

    def start_kvtier() -> harness.Proc:
        return harness.start_kvtier(kv_port, kv_http, L1_GB, kv_args, python=vllm_python, logdir=logdir,
                                    env_extra={"KVTIER_ADMIN_TOKEN": TOKEN}, name=f"kvtier-{kv_port}")

    kv = start_kvtier()
    vport = harness.free_port()
    connector = harness.kvtier_connector_config(kv_port, retry_backoff_s=RETRY_BACKOFF_S)
    with harness.start_vllm(tiny_model, vport, connector, {"KVTIER_ADMIN_TOKEN": TOKEN}, python=vllm_python,
                            logdir=logdir, name=f"vllm-{vport}") as v:
        harness.complete(vport, harness.prompt_ids(300, seed=99), 2)  # warm-up, unrelated prefix
        prompt = harness.prompt_ids(PROMPT_LEN, seed=700)
        _, cold = serve(vport, prompt)
        assert cold["external_kv_transfer"] == 0 and cold["local_cache_hit"] == 0, cold
        # Reference for a reload of the same whole blocks: vLLM's own prefix-cache reuse of them.
        ref, cached = serve(vport, prompt)
        assert cached["local_cache_hit"] == FULL_RELOAD and cached["external_kv_transfer"] == 0, cached

        s = harness.wait_l2_drained(kv_http)
        assert s["l2_dropped_writes"] == 0 and s["l2_entries"] > 0, s
        assert any(p.name.endswith(".kv") for p in Path(l2).iterdir())
        assert harness.metric(kv_metrics(kv_http), "kvtier_l2_used_bytes") > 0

        kv.kill9()
        assert not kv.alive()
        kv = start_kvtier()  # same port, same L2 directory; takes over the stale /dev/shm segment
        s = harness.kvtier_status(kv_http)
        assert s["l1"]["entries"] == 0 and s["l2"]["l2_entries"] > 0, s  # L1 empty, L2 rescanned
        m0 = kv_metrics(kv_http)

        harness.reset_prefix_cache(vport)
        time.sleep(4 * RETRY_BACKOFF_S)  # let the connector's backoff after its last failure pass
        harness.complete(vport, harness.prompt_ids(300, seed=98), 2)  # throwaway request: reconnect
        out, again = serve(vport, prompt, reset=True)
        m1 = kv_metrics(kv_http)
        assert again["external_kv_transfer"] >= FULL_RELOAD, (again, v.log_tail(), kv.log_tail())
        assert again["local_cache_hit"] == 0, again
        assert out == ref, (out, ref)

        def moved(name: str, **labels: str) -> float:
            return harness.metric(m1, name, **labels) - harness.metric(m0, name, **labels)

        assert moved("kvtier_hit_tokens_total", tier="l2") >= FULL_RELOAD, (m0, m1)
        assert moved("kvtier_l2_promotions_total") > 0
        assert harness.kvtier_status(kv_http)["l2"]["l2_corrupt_chunks"] == 0
    kv.stop()
