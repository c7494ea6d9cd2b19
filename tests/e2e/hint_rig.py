"""One real vLLM (CPU build, the tiny model) for a whole test module, and the kvtier server of the moment on a fixed
port: each test starts its own server (its own flags, an empty L1) and vLLM's connector goes on with it. Used by
test_request_hints.py and test_tenant_quotas.py.

vLLM runs with the kv-transfer config the docs give (harness.kvtier_connector_config: `kv_load_failure_policy`
recompute). Every completion must answer HTTP 200 (harness.http_json raises otherwise).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import pytest

BLOCK = 128  # vLLM's CPU block size
CHUNK = 256  # kvtier.chunk_size (the default)
PROMPT_LEN = 2000
FULL = (PROMPT_LEN - 1) // BLOCK * BLOCK  # 1920: what a reload of a whole 2,000-token prompt gives vLLM
BLOCK_BYTES = 256 << 10  # one 128-token block of the tiny Llama (4 layers x K,V x 2 heads x 64 x bf16)
MAX_TOKENS = 8
RETRY_BACKOFF_S = 0.25
BY_SOURCE = "vllm:prompt_tokens_by_source_total"


def chunks_of(tokens: int) -> int:
    """The chunks kvtier holds of a stored prompt of `tokens` tokens (whole blocks, CHUNK-token chunks)."""
    blocks = tokens // BLOCK
    return -(-blocks // (CHUNK // BLOCK))


def hints(**given: Any) -> dict[str, Any]:
    """A request's extra body carrying kvtier hints."""
    return {"kv_transfer_params": {"kvtier": given}}


@dataclass
class Served:
    """One completion and the prompt tokens vLLM took from each source for it (deltas of its /metrics)."""

    out: list[int]
    external: float
    local_hit: float
    computed: float


class Rig:
    def __init__(self, python: Path, model: Path, logdir: Path) -> None:
        self.python, self.model, self.logdir = python, model, logdir
        self.kv_port, self.kv_http, self.port = harness.free_port(), harness.free_port(), harness.free_port()
        self.kv: harness.Proc | None = None
        self.vllm: harness.Proc | None = None
        self._throwaway = 0

    # -- processes
    def start_vllm(self) -> None:
        config = harness.kvtier_connector_config(self.kv_port, retry_backoff_s=RETRY_BACKOFF_S)
        assert config["kv_load_failure_policy"] == "recompute"
        self.vllm = harness.start_vllm(self.model, self.port, config, python=self.python, logdir=self.logdir)

    def start_kvtier(self, l1_gb: float, args: Sequence[str] = ()) -> harness.Proc:
        """Stop the running server (if any), start one with `args` and an empty L1, and wait until vLLM's
        connector (scheduler and worker) works with it."""
        self.stop_kvtier()
        self.kv = harness.start_kvtier(self.kv_port, self.kv_http, l1_gb, list(args), python=self.python,
                                       logdir=self.logdir, name=f"kvtier-{self.kv_port}")
        if self.vllm is not None:
            self.connect()
        return self.kv

    def stop_kvtier(self) -> None:
        if self.kv is not None:
            self.kv.stop()
            self.kv = None
        for leftover in Path("/dev/shm").glob(f"kvtier-{self.kv_port}*"):  # a clean stop keeps L1 for a successor
            leftover.unlink(missing_ok=True)

    def stop(self) -> None:
        if self.vllm is not None:
            self.vllm.stop()
        self.stop_kvtier()

    def connect(self, timeout: float = 60.0) -> None:
        """Throwaway requests (unrelated 300-token prompts) until the connector's scheduler looked up and its
        worker stored on the current server (after a failure it waits `retry_backoff_s` before trying again)."""
        deadline = time.monotonic() + timeout
        while True:
            self._throwaway += 1
            harness.complete(self.port, harness.prompt_ids(300, seed=970_000 + self._throwaway), 1)
            m = self.kv_metrics()
            if m.get("kvtier_requested_tokens_total", 0) > 0 and m.get("kvtier_stores_total", 0) > 0:
                return
            assert time.monotonic() < deadline, f"the connector did not reach the new server: {self.vllm_tail()}"
            time.sleep(0.3)

    # -- requests
    def serve(self, prompt: list[int], max_tokens: int = MAX_TOKENS, reset: bool = False, **extra: Any) -> Served:
        """A greedy completion (HTTP 200 or a failure), after emptying vLLM's prefix cache if `reset`."""
        if reset:
            harness.reset_prefix_cache(self.port)
        m0 = harness.metrics(self.port)
        out, _ = harness.complete(self.port, prompt, max_tokens, **extra)
        m1 = harness.metrics(self.port)
        assert isinstance(out, list) and len(out) == max_tokens, out

        def delta(source: str) -> float:
            return harness.metric(m1, BY_SOURCE, source=source) - harness.metric(m0, BY_SOURCE, source=source)

        return Served(out, delta("external_kv_transfer"), delta("local_cache_hit"), delta("local_compute"))

    def cold_and_cached(self, prompt: list[int], **extra: Any) -> tuple[list[int], list[int]]:
        """Serve `prompt` cold (vLLM's prefix cache reset, nothing of it in kvtier), then from vLLM's own prefix
        cache: (cold output, the reference for a reload of its whole blocks)."""
        cold = self.serve(prompt, reset=True, **extra)
        assert cold.external == 0 and cold.local_hit == 0, cold
        cached = self.serve(prompt, **extra)
        assert cached.local_hit == (len(prompt) - 1) // BLOCK * BLOCK and cached.external == 0, cached
        return cold.out, cached.out

    def flood(self, l1_gb: float, times: float, seed: int, **extra: Any) -> None:
        """Unrelated 2,000-token prompts whose stored blocks add up to `times` x L1, one token each."""
        count = int(times * l1_gb * (1 << 30) / ((PROMPT_LEN // BLOCK) * BLOCK_BYTES)) + 1
        for i in range(count):
            harness.complete(self.port, harness.prompt_ids(PROMPT_LEN, seed=seed + i), 1, **extra)

    # -- kvtier
    def status(self) -> dict:
        return harness.kvtier_status(self.kv_http)

    def l1_entries(self) -> int:
        return int(self.status()["l1"]["entries"])

    def kv_metrics(self) -> dict[str, float]:
        return harness.metrics(self.kv_http)

    def vllm_tail(self) -> str:
        return self.vllm.log_tail(40) if self.vllm is not None else ""


def module_rig(python: Path, model: Path, logdir: Path, l1_gb: float, args: Sequence[str] = ()) -> Rig:
    """A started rig: a kvtier server (`l1_gb`, `args`) first, then vLLM connected to it."""
    logdir.mkdir(parents=True, exist_ok=True)
    rig = Rig(python, model, logdir)
    try:
        rig.start_kvtier(l1_gb, args)
        rig.start_vllm()
        rig.connect()
    except BaseException:
        rig.stop()
        raise
    return rig


def rig_fixtures(name: str, l1_gb: float, args: Sequence[str] = ()) -> tuple[Any, Any]:
    """A test module's fixtures: `rig`, one vLLM for the module (on a kvtier server of `l1_gb`, `args`), and an
    autouse `_kill_leftovers` that overrides conftest's (the module's vLLM stays up from test to test; kvtier is
    each test's own). Assign both at the module's top level: `rig, _kill_leftovers = rig_fixtures(...)`."""

    @pytest.fixture(scope="module")
    def rig(tiny_model: Path, vllm_python: Path, tmp_path_factory: Any):
        base = os.environ.get("KVTIER_E2E_LOGDIR")
        logdir = Path(base) / name if base else tmp_path_factory.mktemp(f"{name}-logs")
        r = module_rig(vllm_python, tiny_model, logdir, l1_gb, args)
        try:
            yield r
        finally:
            r.stop()

    @pytest.fixture(autouse=True)
    def _kill_leftovers(request: Any):
        yield
        rig = request.getfixturevalue("rig")
        with harness._LIVE_LOCK:
            leftovers = [p for p in harness._LIVE if p is not rig.vllm and p is not rig.kv]
        for proc in leftovers:
            proc.kill9()

    return rig, _kill_leftovers
