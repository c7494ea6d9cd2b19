"""kvtier's vLLM KV connector (KVConnectorBase_V1, vLLM 0.32), CPU engines.

Load with ``--kv-transfer-config '{"kv_connector":"KVTierConnector",
"kv_connector_module_path":"kvtier.connector.vllm","kv_role":"kv_both"}'``; options in docs/vllm.md.

Scheduler: one lookup per new request gives the block-aligned number of prompt tokens kvtier holds
beyond vLLM's own prefix-cache hit. Worker: loads in ``start_load_kv``; when a request's prompt is
complete, ``wait_for_save`` stores its whole blocks (chunks kvtier already holds are skipped by the server
without a copy). By default a load is synchronous (the first forward of the request waits for a copy of a
few milliseconds, far less than a prefill) and a store runs on a worker thread, off the engine's step
(``kvtier.async_stores``); ``kvtier.async_transfers`` runs loads in the background too (scheduler.py says how
vLLM's asynchronous states are used). A load that comes up short is reported through
``get_block_ids_with_load_errors`` so vLLM recomputes those blocks: a miss, never wrong KV.

vLLM builds one KVTierConnector per process, with its role: the scheduler's (SchedulerSide in
scheduler.py) or a worker's (WorkerSide in worker.py). The connector holds the one side its role owns
and hands every method to it; meta.py holds the options and the per-step metadata both sides use,
namespace.py the kvtier namespace both derive from the vLLM config alone.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from kvtier.connector.vllm import hook_times
from kvtier.connector.vllm.meta import ConnectorOptions, ConnectorSide, KVTierMetadata, LoadSpec, SaveSpec
from kvtier.connector.vllm.policy import recompute_failed_loads, refuse_unsupported_layers
from kvtier.connector.vllm.scheduler import SchedulerSide, kv_bytes_per_token
from kvtier.connector.vllm.worker import WorkerSide, pp_rank, tp_rank
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["ConnectorOptions", "KVTierConnector", "KVTierMetadata", "LoadSpec", "SaveSpec", "kv_bytes_per_token"]

log = logging.getLogger("kvtier.connector")


class KVTierConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """`kvtier.kv_layout` (e.g. BLNHC, block-major: one run of every layer per block) asked of vLLM; vLLM
        may drop it for a backend that cannot use it, so the namespace carries the layout it resolved."""
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        return str(extra.get("kvtier.kv_layout") or "") or None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is only a future miss

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.options = ConnectorOptions.from_extra(extra)
        self.block_size = vllm_config.cache_config.block_size
        if self.options.chunk_size % self.block_size:
            raise ValueError(f"kvtier.chunk_size {self.options.chunk_size} is not a multiple of block size "
                             f"{self.block_size}")
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        side: ConnectorSide
        if role == KVConnectorRole.WORKER:
            side = self._worker = WorkerSide(vllm_config, self.options, tp_rank(), kv_cache_config, pp_rank())
        else:
            refuse_unsupported_layers(vllm_config, kv_cache_config)
            recompute_failed_loads(vllm_config)
            side = self._scheduler = SchedulerSide(vllm_config, self.options, kv_cache_config)
        self.side = side
        # KVTIER_HOOK_TIMES=DIR: time this side's hooks (hook_times.py); unset, nothing is wrapped
        self._hook_times = hook_times.install(self, "worker" if self._worker is not None else "scheduler")
        side.client.connect()  # a miss-only start if the server is down; the client retries later
        if self._scheduler is not None and self._scheduler.engine_events is not None:
            self._scheduler.engine_events.start()  # subscribed before the engine serves: no store is missed
        log.info("kvtier connector (%s) for %s at %s", role.name.lower(), vllm_config.model_config.model,
                 self.options.url)

    @property
    def scheduler(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("kvtier connector: a scheduler-side method called on a worker's connector")
        return self._scheduler

    @property
    def worker(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("kvtier connector: a worker-side method called on the scheduler's connector")
        return self._worker

    # ============================== scheduler side ==============================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """kvtier's blocks this engine can load, for its KV events (`"engine_events": true`, engine_events.py)."""
        return self.scheduler.take_events()

    # ============================== worker side ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._get_connector_metadata())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.worker.handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._get_connector_metadata())

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_connector_worker_meta()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    # ============================== both sides ==============================

    def shutdown(self) -> None:
        self.side.shutdown()  # the scheduler's and each worker's client
        if self._hook_times is not None:
            self._hook_times.write()
