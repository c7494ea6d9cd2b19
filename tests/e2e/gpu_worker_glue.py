"""Run in the vLLM venv (test_worker_gpu_branch.py starts it): the connector's GPU worker branch
(connector/vllm/worker.py WorkerSide with GpuTransfers and InFlight) driven as vLLM drives it, step by step,
against a real `kvtier server --gpu-fake-engine`. The CPU stand-in's device (tests/integration/_gpu_rig.py
FakeGpuWorker) stands for the GPU: its memory is attached where a GPU worker attaches its exported CUDA
allocation. vLLM's config is a stand-in too (the few fields the worker reads).

Prints one JSON line: what the checks found.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from _gpu_rig import BLOCK_TOKENS, FakeGpuWorker  # noqa: E402
from kvtier.connector.vllm.meta import ConnectorOptions, KVTierMetadata, LoadSpec, SaveSpec  # noqa: E402
from kvtier.connector.vllm.worker import WorkerSide  # noqa: E402


class _Model:
    model, revision, dtype, quantization = "fake-gpu-model", "", "bfloat16", None
    hf_config = SimpleNamespace(hidden_size=256, num_hidden_layers=3)

    def get_num_layers(self, parallel) -> int:
        return 3

    def get_num_kv_heads(self, parallel) -> int:
        return 2

    def get_head_size(self) -> int:
        return 64


def vllm_config() -> SimpleNamespace:
    return SimpleNamespace(
        model_config=_Model(), parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, world_size=1),
        cache_config=SimpleNamespace(block_size=BLOCK_TOKENS, cache_dtype="auto", kv_cache_layout="LBNHC"),
        device_config=SimpleNamespace(device_type="cpu"))


def finished(side: WorkerSide, ids: set[str], want: str, req: str, timeout: float = 20.0) -> tuple[set, set]:
    """Step `get_finished` (ids first) until `req` is reported in `want` ("sending"/"recving")."""
    deadline, sending, recving, first = time.monotonic() + timeout, set(), set(), True
    while time.monotonic() < deadline:
        s, r = side.get_finished(ids if first else set())
        first = False
        sending |= s or set()
        recving |= r or set()
        if req in (sending if want == "sending" else recving):
            return sending, recving
        time.sleep(0.01)
    raise TimeoutError(f"{req} not reported in finished_{want}")


def main(url: str) -> None:
    tokens = list(range(1000, 1000 + 4 * 64 + 32))  # 4 whole chunks of 64 tokens and 2 blocks: 18 blocks
    blocks = len(tokens) // BLOCK_TOKENS
    worker = FakeGpuWorker("LBNHC")
    out: dict = {}
    try:
        # no weight files to fingerprint: the operator's model id names the weights
        side = WorkerSide(vllm_config(), ConnectorOptions(url=url, chunk_size=64, request_timeout_s=10.0,
                                                          model_id="fake-gpu-model"), 0, None)
        side.client.connect()
        side.attach_gpu(worker.memory, worker.events)
        registered = time.monotonic() + 20  # registration runs on the keeper thread
        while not (side._gpu is not None and side._gpu.registered):
            assert time.monotonic() < registered, "the GPU memory was not registered"
            time.sleep(0.02)
        src = list(range(2, 2 + 2 * blocks, 2))  # scattered block ids
        worker.fill(src, seed=7)

        # step 1: the prompt's last token computed -> the store goes out; the request finishes, held
        worker.events.hold = True  # the stream has not reached the store's event yet
        side.wait_for_save(KVTierMetadata(saves=[SaveSpec("r1", tokens, src, "")]))
        side.start_load_kv(KVTierMetadata(held=["r1"]))
        s, _ = side.get_finished({"r1"})
        out["held_before_event"] = not s
        worker.device.complete(worker.events.last)  # the stream reaches the event: the copier copies
        worker.events.hold = False
        finished(side, set(), "sending", "r1")
        out["store_reported"] = True

        # step 2: a load into other blocks, from block 3 on (vLLM's own cache held the first three)
        dst = list(range(1, 1 + 2 * blocks, 2))  # other scattered block ids
        worker.scramble(dst)
        side.start_load_kv(KVTierMetadata(loads=[LoadSpec("r2", tokens, dst, 3, blocks, "")]))
        _, r = finished(side, set(), "recving", "r2")
        out["load_errors"] = sorted(side.get_block_ids_with_load_errors())
        out["loaded_bit_exact"] = worker.blocks_equal(src[3:], dst[3:])
        out["untouched_before_first"] = all((worker.page(0, b) == 0xEE).all() for b in dst[:3])

        # step 3: a load of a prompt nobody stored: every block reported, none left as if loaded
        other = [t + 7 for t in tokens]
        side.start_load_kv(KVTierMetadata(loads=[LoadSpec("r3", other, dst, 0, blocks, "")]))
        finished(side, set(), "recving", "r3")
        out["miss_errors"] = len(side.get_block_ids_with_load_errors())
        out["blocks"] = blocks

        # a preempted request's store is waited for before the step goes on
        worker.fill(src, seed=9)
        worker.events.hold = True
        side.wait_for_save(KVTierMetadata(saves=[SaveSpec("r4", [t + 1 for t in tokens], src, "")]))
        start = time.monotonic()
        threading.Timer(0.5, lambda: worker.device.complete(worker.events.last)).start()
        side.handle_preemptions(KVTierMetadata(preempted=["r4"]))
        out["preemption_waited_s"] = round(time.monotonic() - start, 3)
        worker.events.hold = False
        side.shutdown()
    finally:
        worker.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
