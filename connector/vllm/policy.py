"""What the connector requires of the engine, settled when the scheduler's connector is built.

- A failed load is recomputed, never a failed request: vLLM 0.32 defaults `kv_load_failure_policy` to "fail"
  (a block reported in `get_block_ids_with_load_errors` ends the request with HTTP 500). vLLM's scheduler builds
  its connector before it reads the policy (reference/request-identity.md), so a "fail" is switched to
  "recompute" here, with one WARNING that names the setting to add.
- Attention-only KV: kvtier stores every layer's blocks of a prompt alike. It is not a `SupportsHMA` connector,
  so vLLM turns its hybrid KV cache manager off (sliding-window layers then keep full-attention blocks, which
  kvtier stores like any other); a model whose KV vLLM cannot express as full attention (Mamba/SSM state of
  hybrid models) is refused here with a clear error instead of a failure later (docs/vllm.md, hybrid models).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("kvtier.connector")

POLICY_FIX = '"kv_load_failure_policy": "recompute"'


def recompute_failed_loads(vllm_config: Any) -> bool:
    """Switch vLLM's KV load failure policy to "recompute"; True when it was "fail" and was switched."""
    config = vllm_config.kv_transfer_config
    if getattr(config, "kv_load_failure_policy", "recompute") != "fail":
        return False
    config.kv_load_failure_policy = "recompute"
    log.warning("kvtier connector: vLLM's kv_load_failure_policy was \"fail\", under which a KV load kvtier cannot "
                "complete fails the request (HTTP 500); switched to \"recompute\". Add %s to --kv-transfer-config "
                "to set it yourself.", POLICY_FIX)
    return True


def unsupported_layers(kv_cache_config: Any) -> list[str]:
    """Descriptions of the KV cache groups kvtier cannot store (not full attention); empty when all can be."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

    bad = []
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = group.kv_cache_spec
        specs = list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
        kinds = sorted({type(s).__name__ for s in specs if not isinstance(s, FullAttentionSpec)})
        if kinds:
            bad.append(f"{len(group.layer_names)} layers of {', '.join(kinds)}")
    return bad


def refuse_unsupported_layers(vllm_config: Any, kv_cache_config: Any) -> None:
    bad = unsupported_layers(kv_cache_config)
    if bad:
        raise ValueError(f"kvtier connector: {vllm_config.model_config.model} has KV that is not full attention "
                         f"({'; '.join(bad)}); kvtier stores full-attention KV only (docs/vllm.md, hybrid models). "
                         "Run this model without the kvtier connector.")
