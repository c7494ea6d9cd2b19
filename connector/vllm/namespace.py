"""The kvtier namespace of a vLLM instance, derived from its config alone.

Scheduler and workers compute it independently, so it may only use facts both have: model path and
revision, a fingerprint of the weights and config (identity.py), KV dtype as vLLM names it, layer count, KV
heads and head size per rank, engine block size, the platform and the engine's memory layout with its page
bytes (a GPU worker checks that its KV tensors have the layout the connector asked vLLM for, docs/vllm.md),
TP size and rank, pipeline size and stage, chunk size, kvtier's payload format and the tenant salt. Any
difference gives another namespace: a miss, never another model's KV.
"""

from __future__ import annotations

from typing import Any

from kvtier.connector.vllm.identity import IdentityUnknown
from kvtier.server.keys import Namespace


def kv_dtype_name(vllm_config: Any) -> str:
    """The KV cache dtype as vLLM names it (`--kv-cache-dtype`; "auto" is the model's dtype)."""
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        return cache_dtype
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def page_bytes(vllm_config: Any, kv_cache_config: Any = None) -> int:
    """Bytes of one (layer, block) page as vLLM allocates it: from its KV cache spec when there is one (any
    dtype, quantization scales included), else K and V of every KV head for a block of tokens."""
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        try:
            return int(group.kv_cache_spec.page_size_bytes)
        except (AttributeError, NotImplementedError, TypeError):
            break
    model = vllm_config.model_config
    name = kv_dtype_name(vllm_config)
    itemsize = _PLAIN_ITEMSIZE.get(name)
    if itemsize is None:  # packed or scaled formats (nvfp4, turboquant_*, ...): only vLLM's spec knows the size
        raise IdentityUnknown(f"KV cache dtype {name!r}: page size unknown without vLLM's KV cache spec")
    return (2 * model.get_num_kv_heads(vllm_config.parallel_config) * model.get_head_size()
            * vllm_config.cache_config.block_size * itemsize)


# KV dtypes (vLLM's names) stored as one plain element per value, and that element's bytes
_PLAIN_ITEMSIZE = {"float32": 4, "float": 4, "half": 2, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1,
                   "fp8_e5m2": 1, "fp8_inc": 1, "int8": 1}


def namespace_for(vllm_config: Any, chunk_size: int, tp_rank: int, cache_salt: str = "",
                  kv_layout: str = "paged", *, pp_rank: int = 0, model_fingerprint: str = "",
                  kv_cache_config: Any = None) -> Namespace:
    """`kv_layout`: the engine's memory layout (a vLLM layout name on GPU; "paged" for the CPU copy path)."""
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    return Namespace(
        model=str(model.model),
        revision=str(model.revision or ""),
        model_fingerprint=model_fingerprint,
        dtype=kv_dtype_name(vllm_config),
        num_layers=model.get_num_layers(parallel),
        kv_heads=model.get_num_kv_heads(parallel),
        head_size=model.get_head_size(),
        block_size=vllm_config.cache_config.block_size,
        layout=f"vllm-{current_platform.device_type}-{kv_layout}-p{page_bytes(vllm_config, kv_cache_config)}",
        chunk_size=chunk_size,
        tp_size=parallel.tensor_parallel_size,
        tp_rank=tp_rank,
        pp_size=parallel.pipeline_parallel_size,
        pp_rank=pp_rank,
        cache_salt=cache_salt,
    )
