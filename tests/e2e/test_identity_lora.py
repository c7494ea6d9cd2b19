"""End-to-end: KV computed under a LoRA adapter is never loaded for the base model or another adapter
(issue 26, check 1).

A LoRA adapter on ``k_proj``/``v_proj`` changes the KV of the same token ids, so kvtier's keys must tell
the base model and every adapter apart. Two random adapters (``lora_adapter.py``, seeds 1 and 2) on q/k/v
of the tiny Llama are served as ``myl`` and ``myl2`` beside the base model ``tiny``.

* Reference: a vLLM **without** a connector (same LoRA flags) answers every prompt for every model twice,
  cold and then from its own prefix cache; the three models' answers must differ pairwise (otherwise
  the test proves nothing).
* Then one kvtier server and one vLLM **with** the connector (``kv_load_failure_policy: recompute``),
  vLLM's prefix cache emptied before every request, a fresh prompt for each check:
  - ``myl`` then ``tiny``, ``tiny`` then ``myl``, ``myl`` then ``myl2``: the second request must load
    nothing from kvtier and answer exactly what the reference answers for its own model;
  - ``myl`` then ``myl`` again, and the same for ``myl2``: a kvtier hit of every whole block (1,024 of
    1,100 tokens) with the reference's answer for that adapter (the like-for-like reference of a reload is
    vLLM's own prefix-cache hit, see test_connector_reload.py). ``myl2`` is served from a path relative
    to vLLM's working directory, ``myl`` from an absolute one: the connector sees the path as given.

Each vLLM starts once and they never run at the same time; the adapters are written by the stdlib-only
``lora_adapter.py`` in this process (no torch needed).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

import harness
import lora_adapter
import pytest

pytestmark = pytest.mark.e2e

BLOCK = 128
L1_GB = 0.25
PROMPT_LEN = 1100
MAX_TOKENS = 8
FULL_RELOAD = (PROMPT_LEN - 1) // BLOCK * BLOCK  # 1024: every whole block but the one with the last token
BASE = harness.SERVED_MODEL_NAME
ADAPTER_SEEDS = {"myl": 1, "myl2": 2}
MODELS = (BASE, *ADAPTER_SEEDS)
LORA_RANK = 8
RETRY_BACKOFF_S = 0.25
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
# One fresh prompt per check (seed), so no check depends on what another one stored.
PROMPT_SEEDS = {"adapter_then_base": 2601, "base_then_adapter": 2602, "adapter_then_adapter": 2603,
                "repeat_myl": 2604, "repeat_myl2": 2605}


def prompt(check: str) -> list[int]:
    return harness.prompt_ids(PROMPT_LEN, seed=PROMPT_SEEDS[check])


def lora_args(adapters: dict[str, Path]) -> list[str]:
    """vLLM's LoRA flags. ``myl2`` is given by a path relative to vLLM's working directory (the harness
    starts vLLM in the repository root): vLLM hands that string unchanged to the scheduler-side connector
    as ``request.lora_request.lora_path``, so the connector must resolve it as vLLM does."""
    paths = {name: os.path.relpath(path, harness.REPO) if name == "myl2" else str(path)
             for name, path in adapters.items()}
    return ["--enable-lora", "--max-lora-rank", str(LORA_RANK), "--max-cpu-loras", str(len(adapters)),
            "--lora-modules", *(f"{name}={path}" for name, path in paths.items())]


@dataclass
class Served:
    """One greedy completion and the prompt tokens each source gave (deltas of vLLM's /metrics)."""

    out: list[int]
    external: float
    local_hit: float


def serve(port: int, model: str, ids: list[int], reset: bool = True) -> Served:
    """Complete ``ids`` greedily with ``model`` (base name or adapter name), after emptying vLLM's prefix
    cache if ``reset``."""
    if reset:
        harness.reset_prefix_cache(port)
    m0 = harness.metrics(port)
    body = harness._completion_body(ids, MAX_TOKENS, False)
    body["model"] = model
    resp = harness.http_json(port, "/v1/completions", body, timeout=300.0)
    m1 = harness.metrics(port)
    out = resp["choices"][0].get("token_ids")
    assert isinstance(out, list) and len(out) == MAX_TOKENS, resp

    def delta(source: str) -> float:
        return harness.metric(m1, BY_SOURCE, source=source) - harness.metric(m0, BY_SOURCE, source=source)

    return Served(list(out), delta("external_kv_transfer"), delta("local_cache_hit"))


@dataclass
class Reference:
    cold: list[int]  # full prefill
    cached: list[int]  # FULL_RELOAD tokens from vLLM's own prefix cache: the reference of a kvtier reload

    def expected(self, got: Served) -> list[int]:
        return self.cached if got.external > 0 else self.cold


@pytest.fixture(scope="module")
def logdir_mod(tmp_path_factory) -> Path:
    base = os.environ.get("KVTIER_E2E_LOGDIR")
    d = Path(base) / "identity-lora" if base else tmp_path_factory.mktemp("logs-identity-lora")
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-adapters")
    return {name: lora_adapter.write_adapter(root / name, seed, rank=LORA_RANK)
            for name, seed in ADAPTER_SEEDS.items()}


@pytest.fixture(scope="module")
def reference(vllm_python, tiny_model, adapters, logdir_mod) -> dict[tuple[str, str], Reference]:
    """(check, model) -> answers of a vLLM without a connector; that vLLM is stopped before returning."""
    t0 = time.monotonic()
    port = harness.free_port()
    refs: dict[tuple[str, str], Reference] = {}
    with harness.start_vllm(tiny_model, port, None, python=vllm_python, logdir=logdir_mod,
                            extra_args=lora_args(adapters), name=f"vllm-ref-{port}"):
        for check in PROMPT_SEEDS:
            ids = prompt(check)
            for model in MODELS:
                cold = serve(port, model, ids, reset=True)
                assert cold.external == 0 and cold.local_hit == 0, (check, model, cold)
                cached = serve(port, model, ids, reset=False)
                assert cached.local_hit == FULL_RELOAD, (check, model, cached)
                refs[check, model] = Reference(cold.out, cached.out)
    print(f"reference vLLM: {time.monotonic() - t0:.1f} s")
    for check in PROMPT_SEEDS:
        for a, b in combinations(MODELS, 2):
            ra, rb = refs[check, a], refs[check, b]
            assert ra.cold != rb.cold and ra.cached != rb.cached, (
                f"{a} and {b} answer the same for prompt {check}: the adapters do not change the output, "
                f"so this test cannot see a wrong load ({ra}, {rb})")
    return refs


@dataclass
class Rig:
    kv: harness.Proc
    vllm: harness.Proc

    def kv_hits(self) -> float:
        m = harness.parse_metrics(harness.metrics_text(self.kv.http_port))  # type: ignore[attr-defined]
        return harness.metric(m, "kvtier_hit_tokens_total", tier="l1")

    def alive(self) -> None:
        self.kv.check_alive()
        self.vllm.check_alive()


@pytest.fixture(scope="module")
def rig(reference, vllm_python, tiny_model, adapters, logdir_mod):
    """kvtier server + one vLLM with the connector and the same LoRA flags (after the reference vLLM)."""
    t0 = time.monotonic()
    kv_port, kv_http = harness.free_port(), harness.free_port()
    kv = harness.start_kvtier(kv_port, kv_http, L1_GB, python=vllm_python, logdir=logdir_mod,
                              name=f"kvtier-{kv_port}")
    vllm = None
    try:
        config = harness.kvtier_connector_config(kv_port, retry_backoff_s=RETRY_BACKOFF_S)
        config["kv_load_failure_policy"] = "recompute"
        port = harness.free_port()
        vllm = harness.start_vllm(tiny_model, port, config, python=vllm_python, logdir=logdir_mod,
                                  extra_args=lora_args(adapters), name=f"vllm-lora-{port}")
        print(f"kvtier + vLLM with connector up: {time.monotonic() - t0:.1f} s")
        yield Rig(kv, vllm)
    finally:
        if vllm is not None:
            vllm.stop()
        kv.stop()
        harness.kill_all()


@pytest.fixture(autouse=True)
def _kill_leftovers(request):
    """Overrides conftest's: the module's kvtier server and vLLM live until the module ends."""
    yield


def first_then_other(rig: Rig, reference, check: str, first: str, other: str) -> None:
    """``first`` stores a fresh prompt in kvtier; ``other`` (another model) must not load it."""
    rig.alive()
    ids = prompt(check)
    stored = serve(rig.vllm.port, first, ids)
    assert stored.external == 0 and stored.local_hit == 0, (check, first, stored)
    assert stored.out == reference[check, first].cold, (check, first, stored, reference[check, first])
    hits_before = rig.kv_hits()
    got = serve(rig.vllm.port, other, ids)
    ref = reference[check, other]
    assert got.out == ref.expected(got), (
        f"{other} after {first} answered {got.out}, its reference is {ref.expected(got)}: "
        f"{got.external:.0f} prompt tokens came from kvtier (KV computed by {first}?); "
        f"{first}'s own answer was {stored.out}")
    assert got.external == 0, (f"{other} loaded {got.external:.0f} tokens that only {first} stored", got)
    assert rig.kv_hits() == hits_before, "kvtier reported a hit for another model's lookup"
    assert got.local_hit == 0, got


def test_adapter_then_base(rig, reference):
    first_then_other(rig, reference, "adapter_then_base", "myl", BASE)


def test_base_then_adapter(rig, reference):
    first_then_other(rig, reference, "base_then_adapter", BASE, "myl")


def test_adapter_then_other_adapter(rig, reference):
    first_then_other(rig, reference, "adapter_then_adapter", "myl", "myl2")


@pytest.mark.parametrize("adapter", ["myl", "myl2"])
def test_repeat_within_adapter_hits(rig, reference, adapter):
    """The adapter's own KV does come back from kvtier, with the adapter's answer (``myl2``: an adapter
    given by a relative path)."""
    rig.alive()
    check = f"repeat_{adapter}"
    ids = prompt(check)
    ref = reference[check, adapter]
    stored = serve(rig.vllm.port, adapter, ids)
    assert stored.external == 0 and stored.out == ref.cold, (stored, ref)
    hits_before = rig.kv_hits()
    again = serve(rig.vllm.port, adapter, ids)
    assert again.external >= FULL_RELOAD, (again, rig.vllm.log_tail())
    assert again.local_hit == 0, again
    assert rig.kv_hits() - hits_before == again.external
    assert again.out == ref.cached, (again, ref)
