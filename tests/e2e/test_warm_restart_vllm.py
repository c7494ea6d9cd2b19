"""Warm restart with a real vLLM (issue 16, check 2): documents stored through kvtier are loaded from L1 after
kvtier is restarted (SIGTERM, then again after SIGKILL), vLLM's own prefix cache emptied in between, with the
greedy output of vLLM's own prefix hit of the same tokens. vLLM keeps running: its connector notices the new
server and registers again.

Prints the restart-to-ready time and the reload TTFT after each restart next to a cold prefill's TTFT (the
figures docs/performance.md records; `pytest -s` shows them).
"""

from __future__ import annotations

import time
from pathlib import Path

import harness
import pytest

pytestmark = pytest.mark.e2e

PROMPT_LEN = 2000
BLOCK = 128
RELOAD = (PROMPT_LEN - 1) // BLOCK * BLOCK  # 1920
RETRY_BACKOFF_S = 0.25
EXTERNAL = ("vllm:prompt_tokens_by_source_total", "external_kv_transfer")


def external(port: int) -> float:
    return harness.metric(harness.metrics(port), EXTERNAL[0], source=EXTERNAL[1])


def test_documents_come_back_from_l1_after_sigterm_and_sigkill(tiny_model: Path, vllm_python: Path, logdir: Path):
    kv_port, kv_http = harness.free_port(), harness.free_port()

    def start_kvtier() -> tuple[harness.Proc, float]:
        t0 = time.monotonic()
        proc = harness.start_kvtier(kv_port, kv_http, 0.25, python=vllm_python, logdir=logdir,
                                    name=f"kvtier-{kv_port}", adopt=True)
        return proc, time.monotonic() - t0

    kv, cold_start_s = start_kvtier()
    config = harness.kvtier_connector_config(kv_port, retry_backoff_s=RETRY_BACKOFF_S)
    vllm = harness.start_vllm(tiny_model, harness.free_port(), config, python=vllm_python, logdir=logdir)
    docs = [harness.prompt_ids(PROMPT_LEN, seed=1600 + i) for i in range(3)]
    expected = []
    cold_ttft = []
    for doc in docs:
        _, ttft, _ = harness.complete_stream(vllm.port, doc, 1)  # cold prefill; stored in kvtier
        cold_ttft.append(ttft)
        out, _ = harness.complete(vllm.port, doc, 16)  # vLLM's own prefix hit of 1,920 tokens
        expected.append(out)

    figures = {"cold start to ready s": round(cold_start_s, 2), "cold prefill TTFT s": round(min(cold_ttft), 3)}
    for how in ("sigterm", "sigkill"):
        if how == "sigterm":
            assert kv.stop() == 0
        else:
            kv.kill9()
        kv, ready_s = start_kvtier()
        assert "L1 adopted from" in kv.log_text(), kv.log_tail()
        harness.reset_prefix_cache(vllm.port)
        time.sleep(4 * RETRY_BACKOFF_S)  # the connector's backoff after the requests that met no server
        ttfts = []
        for doc, want in zip(docs, expected, strict=True):
            before = external(vllm.port)
            out, ttft, _ = harness.complete_stream(vllm.port, doc, 16)
            loaded = external(vllm.port) - before
            assert loaded == RELOAD, f"after {how}: {loaded} tokens loaded\n{kv.log_tail()}"
            assert out == want, f"after {how}: output differs from vLLM's own prefix hit"
            ttfts.append(ttft)
            harness.reset_prefix_cache(vllm.port)
        figures[f"{how}: restart to ready s"] = round(ready_s, 2)
        figures[f"{how}: reload TTFT s"] = round(min(ttfts), 3)
    print("warm restart figures:", figures)
    vllm.stop()
    kv.stop()
    for leftover in (Path("/dev/shm") / f"kvtier-{kv_port}", Path("/dev/shm") / f"kvtier-{kv_port}.journal"):
        leftover.unlink(missing_ok=True)  # a clean stop keeps the L1 for a successor: none comes
