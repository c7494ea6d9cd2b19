"""Generate tests/gpu/layouts.json: the KV cache views vLLM 0.32 hands `register_kv_caches`, made by vLLM's own
allocation code on CPU (v1/core/kv_cache_utils.py get_kv_cache_config_from_groups for the allocation's tensors
and strides, v1/kv_cache_interface.py create_kv_cache_views for the per-layer views), for the cases the device
check runs: FlashAttention NHD (LBNHC) and HND (LBHNC), MLA, FP8, vLLM blocks split into kernel blocks
(LBNHC: kvtier regroups them; LBHNC: kvtier refuses), and NHD of two layers (its one-block ops take the
copier's per-entry path, every other op its batched one). Each case has two sizes: "rehearse" (small, for the CPU
rehearsal) and "gpu" (Llama-3.1-8B-like, for the H200). For the rehearse size, also the GpuMemory geometry
kvtier's connector/vllm/gpu_memory.py `describe` gives those views (or why it refuses them): the rehearsal
runs without torch and registers that geometry; on a GPU, check.py calls `export` on the live views.

Run in the vLLM CPU venv (torch and vLLM; kvtier is imported from this checkout, whatever the venv has):

    /root/.cache/kvtier/vllm-0.32.0-venv/bin/python tests/gpu/layouts.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _this_checkout() -> None:
    """Import kvtier from this checkout whatever the venv has installed (pyproject.toml's package-dir)."""
    site = Path(tempfile.mkdtemp(prefix="kvtier-layouts-"))
    (site / "kvtier").mkdir()
    for folder in ("server", "connector", "shm", "admin_api"):
        (site / "kvtier" / folder).symlink_to(REPO / folder)
    sys.path.insert(0, str(site))


_this_checkout()

import torch  # noqa: E402
import vllm  # noqa: E402
from kvtier.connector.vllm.gpu_memory import describe  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    AttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

OUT = Path(__file__).with_name("layouts.json")
# layers, KV heads (GQA cases) and the allocation's bytes (its block count follows)
SIZES = {"rehearse": (4, 2, 12 << 20), "gpu": (32, 8, 4 << 30)}


def spec(case: str, kv_heads: int) -> tuple[AttentionSpec, str, int | None]:
    """vLLM's KV spec of `case`, its layout name and its kernel block size (None: not split)."""
    gqa = {"num_kv_heads": kv_heads, "head_size": 128}
    if case in ("nhd", "two_layers"):
        return FullAttentionSpec(block_size=16, dtype=torch.bfloat16, **gqa), "LBNHC", None
    if case == "hnd":
        return FullAttentionSpec(block_size=16, dtype=torch.bfloat16, **gqa), "LBHNC", None
    if case == "mla":
        return MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16), "LBNHC", None
    if case == "fp8":
        return FullAttentionSpec(block_size=16, dtype=torch.float8_e4m3fn, **gqa), "LBNHC", None
    if case == "split_nhd":
        return FullAttentionSpec(block_size=64, dtype=torch.bfloat16, **gqa), "LBNHC", 16
    if case == "split_hnd":
        return FullAttentionSpec(block_size=64, dtype=torch.bfloat16, **gqa), "LBHNC", 16
    raise ValueError(case)


def views(case: str, size: str) -> dict[str, Any]:
    layers, kv_heads, nbytes = SIZES[size]
    if case == "two_layers":  # a one-block op is 2 copy entries: fewer than the copier batches (cuda.py BATCH_MIN)
        layers = 2
    kv_spec, layout, kernel = spec(case, kv_heads)
    want_blocks = nbytes // (layers * kv_spec.page_size_bytes)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    config = SimpleNamespace(
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: KVCacheLayout[layout],
                                     num_gpu_blocks_override=want_blocks, prefix_cache_retention_interval=None),
        attention_config=SimpleNamespace(hisparse_config=None))
    kv_config = get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(names, kv_spec)],
                                                want_blocks * layers * kv_spec.page_size_bytes)
    (tensor,) = kv_config.kv_cache_tensors
    device = "cpu" if size == "rehearse" else "meta"  # the gpu size only for its shapes and strides
    raw = torch.zeros(tensor.size, dtype=torch.int8, device=device)
    made = create_kv_cache_views(raw, kv_spec, kv_config.num_blocks, KVCacheLayout[layout], tensor, kernel)
    first = made[0]
    out: dict[str, Any] = {
        "layout": layout, "dtype": str(kv_spec.dtype).removeprefix("torch."), "item": first.element_size(),
        "alloc_size": tensor.size, "num_blocks": kv_config.num_blocks, "block_tokens": kv_spec.block_size,
        "kernel_block_tokens": kernel or kv_spec.block_size, "kv_heads": kv_spec.num_kv_heads,
        "head_size": kv_spec.head_size, "shape": list(first.shape), "stride": list(first.stride()),
        "layer_offsets": [v.storage_offset() * v.element_size() for v in made]}
    if size == "rehearse":
        try:
            out["registered"] = describe(dict(zip(names, made, strict=True)), raw.data_ptr(), tensor.size, layout,
                                         num_blocks=kv_config.num_blocks)
        except ValueError as exc:
            out["refused"] = str(exc)
    return out


def main() -> None:
    cases = ("nhd", "hnd", "mla", "fp8", "split_nhd", "split_hnd", "two_layers")
    layouts = {case: {size: views(case, size) for size in SIZES} for case in cases}
    OUT.write_text(json.dumps({"vllm": vllm.__version__, "layouts": layouts}, indent=1) + "\n")
    print(f"{OUT}: {', '.join(cases)} from vLLM {vllm.__version__}")


if __name__ == "__main__":
    main()
