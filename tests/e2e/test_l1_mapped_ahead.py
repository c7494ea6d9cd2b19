"""A CPU vLLM worker maps all of kvtier's L1 into its page tables ahead (`kvtier.populate_l1`, on by default;
docs/vllm.md "Data path"), so that its copies into and out of L1 take no page faults; the scheduler's process,
which copies nothing, does not; and the engine serves as before, its prompt stored and loaded again."""

from __future__ import annotations

import harness
import pytest
import thread_cpu

pytestmark = pytest.mark.e2e

L1_GB = 0.25
L1_BYTES = int(L1_GB * (1 << 30))


def test_a_cpu_worker_maps_all_of_l1_ahead(vllm_python, tiny_model, logdir):
    kp, kh, port = harness.free_port(), harness.free_port(), harness.free_port()
    with harness.start_kvtier(kp, kh, L1_GB, python=vllm_python, logdir=logdir):
        segment = f"/dev/shm/kvtier-{kp}"  # the server's default segment name, kvtier-<port>
        kvc = harness.kvtier_connector_config(kp)
        with harness.start_vllm(tiny_model, port, kvc, python=vllm_python, logdir=logdir) as v:
            def mapped() -> dict[int, int]:
                return {pid: harness.mapped_bytes(pid, segment) for pid in thread_cpu.processes([v.pgid])}

            harness.wait_for(mapped, lambda m: max(m.values(), default=0) >= 0.95 * L1_BYTES, 60,
                             "all of L1 mapped into the vLLM worker")
            by_process = sorted(mapped().values(), reverse=True)
            assert by_process[0] >= 0.95 * L1_BYTES, by_process
            assert all(n < 0.05 * L1_BYTES for n in by_process[1:]), by_process  # only the worker copies

            prompt = harness.prompt_ids(1000, seed=7)
            first, _ = harness.complete(v.port, prompt, 8)
            harness.wait_cached(kh, tiny_model, prompt, 896)
            harness.reset_prefix_cache(v.port)
            before = harness.metrics(v.port)
            again, _ = harness.complete(v.port, prompt, 8)
            loaded = harness.metric(harness.metrics(v.port), "vllm:prompt_tokens_by_source_total",
                                    source="external_kv_transfer") - harness.metric(
                before, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
            assert again == first
            assert loaded == 896, loaded
