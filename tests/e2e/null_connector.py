"""A vLLM KV connector that does nothing: bench_serve.py's ``null`` configuration.

It measures what vLLM itself spends once any KV connector is configured (the per-step connector hooks, the
connector output each step carries back, the scheduler's calls), so that a connector's cost in
``bench_serve.py`` can be split into vLLM's share and the connector's own. It never loads and never stores.
Loaded by vLLM from ``kv_connector_module_path`` ``null_connector`` with this folder on ``PYTHONPATH``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class NullConnector(KVConnectorBase_V1):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
