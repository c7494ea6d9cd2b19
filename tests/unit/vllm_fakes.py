"""A stand-in for vLLM's ModelConfig, as much of it as the connector's namespace reads (the vLLM-venv unit tests:
test_vllm_tp_lookup.py, test_request_hints.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class FakeModel:
    """A 4-layer model with 2 KV heads of 64, named `model`."""

    revision, dtype, quantization = "", "bfloat16", None
    hf_config = SimpleNamespace(hidden_size=256, num_hidden_layers=4)

    def __init__(self, model: str) -> None:
        self.model = model

    def get_num_layers(self, parallel: Any) -> int:
        return 4

    def get_num_kv_heads(self, parallel: Any) -> int:
        return 2

    def get_head_size(self) -> int:
        return 64
