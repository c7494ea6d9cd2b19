"""The kvtier namespace of a vLLM instance, derived from its config alone.

Scheduler and workers compute it independently, so it may only use facts both have: model path and
revision, KV dtype, layer count, KV heads and head size per rank, engine block size, the platform and
the engine's memory layout with its page bytes (a GPU worker checks that its KV tensors have the layout
the connector asked vLLM for, docs/vllm.md), TP size and rank, chunk size and the tenant salt. Any difference gives another namespace: a miss,
never another model's KV.
"""

from __future__ import annotations

from typing import Any

import torch
from kvtier.server.keys import Namespace


def kv_dtype_name(vllm_config: Any) -> str:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        return cache_dtype
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def page_bytes(vllm_config: Any) -> int:
    """Bytes of one (layer, block) page: K and V of every KV head for a block of tokens."""
    model = vllm_config.model_config
    name = kv_dtype_name(vllm_config)
    itemsize = 1 if name.startswith("fp8") else getattr(torch, name).itemsize
    return (2 * model.get_num_kv_heads(vllm_config.parallel_config) * model.get_head_size()
            * vllm_config.cache_config.block_size * itemsize)


def namespace_for(vllm_config: Any, chunk_size: int, tp_rank: int, cache_salt: str = "",
                  kv_layout: str = "paged") -> Namespace:
    """`kv_layout`: the engine's memory layout (a vLLM layout name on GPU; "paged" for the CPU copy path)."""
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    return Namespace(
        model=str(model.model),
        revision=str(model.revision or ""),
        dtype=kv_dtype_name(vllm_config),
        num_layers=model.get_num_layers(parallel),
        kv_heads=model.get_num_kv_heads(parallel),
        head_size=model.get_head_size(),
        block_size=vllm_config.cache_config.block_size,
        layout=f"vllm-{current_platform.device_type}-{kv_layout}-p{page_bytes(vllm_config)}",
        chunk_size=chunk_size,
        tp_size=parallel.tensor_parallel_size,
        tp_rank=tp_rank,
        cache_salt=cache_salt,
    )
