"""Run in the vLLM venv (test_worker_gpu_failures.py starts it): the connector's GPU worker branch where the
server lets it down, driven as vLLM drives it (gpu_worker_glue.py's stand-ins). `argv`: the server's URL and
one scenario:

- ``idle``: a worker silent for longer than the server's --client-timeout-s loads what it stored.
- ``refused``: every operation is refused (the namespace is one the server will not register): vLLM's calls
  return, loads are reported as load errors, and the worker's events are not lost.
- ``no_device``: the server cannot open this GPU: the engine's calls never wait for registration attempts.
- ``slow_start``: the copier takes longer to start than a request may: the worker registers all the same.

Prints one JSON line: what the checks found.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from _gpu_rig import BLOCK_TOKENS, EVENTS, FakeGpuWorker  # noqa: E402
from gpu_worker_glue import finished, vllm_config  # noqa: E402
from kvtier.connector.vllm.meta import ConnectorOptions, KVTierMetadata, LoadSpec, SaveSpec  # noqa: E402
from kvtier.connector.vllm.worker import WorkerSide  # noqa: E402

TOKENS = list(range(2000, 2000 + 2 * 64))  # two whole chunks of 64 tokens: 8 blocks
BLOCKS = len(TOKENS) // BLOCK_TOKENS


def side_for(url: str, chunk_size: int = 64) -> WorkerSide:
    side = WorkerSide(vllm_config(), ConnectorOptions(url=url, chunk_size=chunk_size, request_timeout_s=2.0,
                                                      model_id="fake-gpu-model"), 0, None)
    side.client.connect()
    return side


def attach(side: WorkerSide, worker: FakeGpuWorker, out: dict) -> None:
    started = time.monotonic()
    side.attach_gpu(worker.memory, worker.events)
    out["attach_s"] = round(time.monotonic() - started, 3)


def registered(side: WorkerSide, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if side._gpu is not None and side._gpu._reg:
            return True
        time.sleep(0.05)
    return False


def step(side: WorkerSide, req: str, src: list[int], dst: list[int]) -> float:
    """One engine step that stores a prompt and loads it; how long vLLM's thread spent in the connector."""
    started = time.monotonic()
    side.start_load_kv(KVTierMetadata(loads=[LoadSpec(f"{req}-load", TOKENS, dst, 0, BLOCKS, "")]))
    side.wait_for_save(KVTierMetadata(saves=[SaveSpec(f"{req}-save", TOKENS, src, "")]))
    return time.monotonic() - started


def round_trip(side: WorkerSide, worker: FakeGpuWorker, out: dict, idle_s: float = 0.0) -> None:
    """Store a prompt, stay silent `idle_s`, load it into other blocks; what came back."""
    src, dst = list(range(8)), list(range(20, 28))
    worker.fill(src, seed=3)
    side.wait_for_save(KVTierMetadata(saves=[SaveSpec("r1", TOKENS, src, "")]))
    side.start_load_kv(KVTierMetadata(held=["r1"]))  # the request finished; its blocks wait for the store
    finished(side, {"r1"}, "sending", "r1")
    time.sleep(idle_s)
    worker.scramble(dst)
    side.start_load_kv(KVTierMetadata(loads=[LoadSpec("r2", TOKENS, dst, 0, BLOCKS, "")]))
    finished(side, set(), "recving", "r2")
    out["load_errors"] = len(side.get_block_ids_with_load_errors())
    out["loaded_bit_exact"] = worker.blocks_equal(src, dst)


def idle(url: str, worker: FakeGpuWorker, out: dict) -> None:
    side = side_for(url)
    attach(side, worker, out)
    out["registered"] = registered(side, 10)
    round_trip(side, worker, out, idle_s=3.0)  # silent past --client-timeout-s 1
    side.shutdown()


def refused(url: str, worker: FakeGpuWorker, out: dict) -> None:
    side = side_for(url, chunk_size=BLOCK_TOKENS * 5000)  # more blocks per chunk than a server registers
    attach(side, worker, out)
    out["registered"] = registered(side, 10)
    errors = 0
    for i in range(EVENTS + 2):  # more than the worker has events
        step(side, f"r{i}", list(range(8)), list(range(20, 28)))
        finished(side, {f"r{i}-save"}, "recving", f"r{i}-load")
        errors += len(side.get_block_ids_with_load_errors())
    out["load_errors"] = errors
    out["steps"] = EVENTS + 2
    side.shutdown()


def no_device(url: str, worker: FakeGpuWorker, out: dict) -> None:
    worker.device.unlink()  # the server finds no such device: every registration is refused
    side = side_for(url)
    attach(side, worker, out)
    slowest, end = 0.0, time.monotonic() + 4.0
    i = 0
    while time.monotonic() < end:
        slowest = max(slowest, step(side, f"r{i}", list(range(8)), list(range(20, 28))))
        i += 1
        time.sleep(0.05)
    out["slowest_step_s"] = round(slowest, 3)
    side.shutdown()


def slow_start(url: str, worker: FakeGpuWorker, out: dict) -> None:
    side = side_for(url)
    attach(side, worker, out)
    out["registered"] = registered(side, 15)
    round_trip(side, worker, out)
    side.shutdown()


def main(url: str, scenario: str) -> None:
    worker = FakeGpuWorker("LBNHC")
    out: dict = {}
    try:
        {"idle": idle, "refused": refused, "no_device": no_device, "slow_start": slow_start}[scenario](url, worker, out)
    finally:
        worker.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
