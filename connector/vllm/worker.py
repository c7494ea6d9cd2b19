"""The worker side of the vLLM connector: copies between the engine's paged KV cache and kvtier's L1.

Loads run in ``start_load_kv``, before the forward pass; when a request's prompt is complete,
``wait_for_save`` stores its whole blocks (chunks kvtier already holds are skipped by the server without
a copy). A load that comes up short is reported through ``get_block_ids_with_load_errors`` so vLLM
recomputes those blocks: a miss, never wrong KV.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from kvtier.connector.kv_blocks import PagedKV
from kvtier.connector.results import ReadChunk
from kvtier.connector.vllm.meta import ConnectorOptions, ConnectorSide, KVTierMetadata, LoadSpec
from kvtier.server.keys import ChunkKeys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

log = logging.getLogger("kvtier.connector")


class WorkerSide(ConnectorSide):
    def __init__(self, vllm_config: VllmConfig, options: ConnectorOptions, tp_rank: int) -> None:
        super().__init__(vllm_config, options, tp_rank)
        self._kv: PagedKV | None = None
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = []
        for name, tensor in kv_caches.items():
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                log.warning("kvtier connector: layer %s is not a contiguous CPU tensor; the GPU data path "
                            "is not available in this build, connector disabled", name)
                return
            layers.append(tensor.view(torch.uint8).reshape(tensor.shape[0], -1).numpy())
        self._kv = PagedKV(layers)
        log.info("kvtier connector: %d layers x %d blocks of %d bytes", len(layers), self._kv.num_blocks,
                 self._kv.block_bytes)

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Carry out the step's loads (`meta`: the metadata bound for this step)."""
        if not isinstance(meta, KVTierMetadata) or self._kv is None:
            for spec in getattr(meta, "loads", ()):
                self._load_errors.update(spec.block_ids[spec.first_block:spec.end_block])
            return
        for spec in meta.loads:
            loaded = self._load(spec)
            missing = [b for i, b in enumerate(spec.block_ids) if spec.first_block <= i < spec.end_block
                       and i not in loaded]
            if missing:
                log.warning("kvtier: %d of %d blocks of request %s could not be loaded; vLLM recomputes them",
                            len(missing), spec.end_block - spec.first_block, spec.req_id)
                self._load_errors.update(missing)

    def _load(self, spec: LoadSpec) -> set[int]:
        """Copy the planned blocks in; returns the prompt block indices that arrived."""
        assert self._kv is not None
        kv = self._kv
        loaded: set[int] = set()

        def read(chunk: ReadChunk) -> None:
            base = chunk.chunk.start_token // self.block_size
            lo = max(spec.first_block - base, 0)
            hi = min(chunk.match, spec.end_block - base)
            if hi > lo:
                kv.load(chunk.span, chunk.blocks, lo, spec.block_ids[base + lo: base + hi])
                loaded.update(range(base + lo, base + hi))

        try:
            if not self.client.retrieve_prefix(self.namespace(spec.salt), spec.token_ids, read):
                return set()  # nothing, or a read the server could not vouch for: every block recomputes
        except Exception:  # a broken load is a miss; the blocks are reported and recomputed
            log.exception("kvtier load failed for request %s", spec.req_id)
            return set()
        return loaded

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # whole prompts are stored in wait_for_save, after every layer is computed

    def wait_for_save(self, meta: KVConnectorMetadata) -> None:
        """Carry out the step's stores (`meta`: the metadata bound for this step)."""
        if not isinstance(meta, KVTierMetadata) or self._kv is None:
            return
        kv = self._kv
        for spec in meta.saves:
            block_ids = spec.block_ids

            def write(chunk: ChunkKeys, span: Any, block_ids: list[int] = block_ids) -> None:
                first = chunk.start_token // self.block_size
                kv.save(span, block_ids[first: first + len(chunk.block_keys)])

            try:
                self.client.store(self.namespace(spec.salt), np.asarray(spec.token_ids),
                                  lambda c: kv.chunk_bytes(len(c.block_keys)), write, skip_chunks=spec.skip_chunks)
            except Exception:  # a failed store is only a future miss
                log.exception("kvtier store failed for request %s", spec.req_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


def tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # not initialised (single process): rank 0
        return 0
