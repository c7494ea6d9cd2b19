"""kvtier's vLLM KV connector (KVConnectorBase_V1, vLLM 0.32), CPU engines.

Load with ``--kv-transfer-config '{"kv_connector":"KVTierConnector",
"kv_connector_module_path":"kvtier.connector.vllm","kv_role":"kv_both"}'``; options in docs/vllm.md.

Scheduler: one lookup per new request gives the block-aligned number of prompt tokens kvtier holds
beyond vLLM's own prefix-cache hit; the load is synchronous (the first forward of the request waits
for a copy of a few milliseconds, far less than a prefill). Worker: loads in ``start_load_kv``; when a
request's prompt is complete, ``wait_for_save`` stores its whole blocks (chunks kvtier already holds are
skipped by the server without a copy). A load that comes up short is reported through
``get_block_ids_with_load_errors`` so vLLM recomputes those blocks: a miss, never wrong KV.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from kvtier.connector.client import DEFAULT_URL, ClientConfig, KVTierClient, ReadChunk
from kvtier.connector.kv_blocks import PagedKV
from kvtier.connector.vllm_namespace import namespace_for
from kvtier.server.keys import ChunkKeys, Namespace
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.connector")
TOKEN_ENV = "KVTIER_ADMIN_TOKEN"  # the token when kvtier.token is not set: keeps it out of vLLM's argv


@dataclass(frozen=True)
class ConnectorOptions:
    """`kv_connector_extra_config` keys (all optional)."""

    url: str = DEFAULT_URL
    connect_timeout_s: float = 1.0
    request_timeout_s: float = 2.0
    retry_backoff_s: float = 2.0
    chunk_size: int = 256
    cache_salt: str = ""
    token: str = ""
    prefill_tokens_per_s: float = 0.0  # the engine's prefill rate: lower-tier hits slower than it are skipped

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorOptions:
        known = {f"kvtier.{name}": name for name in cls.__dataclass_fields__}
        unknown = sorted(k for k in extra if k.startswith("kvtier.") and k not in known)
        if unknown:
            raise ValueError(f"unknown kvtier options {unknown}; known: {sorted(known)}")
        values = {}
        for key, name in known.items():
            if key in extra:
                kind = type(getattr(cls, name))
                values[name] = kind(extra[key])
        return cls(**values)

    def client_config(self) -> ClientConfig:
        return ClientConfig(
            url=self.url, connect_timeout_s=self.connect_timeout_s, request_timeout_s=self.request_timeout_s,
            retry_backoff_s=self.retry_backoff_s, token=self.token or os.environ.get(TOKEN_ENV, ""),
        )


@dataclass
class LoadSpec:
    """Load prompt blocks [first_block, end_block) of `token_ids` into engine blocks."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    first_block: int
    end_block: int
    salt: str


@dataclass
class SaveSpec:
    """Store the whole blocks of a completed prompt, from chunk `skip_chunks` on."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    salt: str
    skip_chunks: int = 0


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _Tracked:
    """Scheduler-side state of one request."""

    prompt: list[int]
    salt: str
    block_ids: list[int] = field(default_factory=list)
    hit_tokens: int = 0
    local_tokens: int = 0
    external_tokens: int = 0
    load_pending: bool = False
    saved: bool = False


class KVTierConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

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
        self.tp_rank = _tp_rank() if role == KVConnectorRole.WORKER else 0
        self._namespaces: dict[str, Namespace] = {}
        self.client = KVTierClient(self.options.client_config())
        self._requests: dict[str, _Tracked] = {}
        self._kv: PagedKV | None = None
        self._load_errors: set[int] = set()
        # Break-even: a lower tier pays off only if it delivers a token's KV faster than prefill computes it.
        # Every TP rank loads its share through the same server, hence the whole model's bytes.
        self.min_load_bandwidth = (kv_bytes_per_token(kv_cache_config) * self.options.prefill_tokens_per_s
                                   * vllm_config.parallel_config.tensor_parallel_size)
        self.client.connect()  # a miss-only start if the server is down; the client retries later
        log.info("kvtier connector (%s) for %s at %s", role.name.lower(), vllm_config.model_config.model,
                 self.options.url)

    def namespace(self, salt: str) -> Namespace:
        ns = self._namespaces.get(salt)
        if ns is None:
            salt_full = f"{self.options.cache_salt}|{salt}" if salt else self.options.cache_salt
            ns = namespace_for(self._vllm_config, self.options.chunk_size, self.tp_rank, salt_full)
            self._namespaces[salt] = ns
        return ns

    # ============================== scheduler side ==============================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = list(request.prompt_token_ids or [])
        salt = getattr(request, "cache_salt", None) or ""
        # At least one prompt token must stay to compute, and only whole blocks load.
        limit = (len(prompt) - 1) // self.block_size * self.block_size
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            # One lookup per request: the scheduler may ask again while the request waits for room.
            tracked = self._requests[request.request_id] = _Tracked(prompt, salt)
            if limit > num_computed_tokens:
                try:
                    found = self.client.lookup(self.namespace(salt), prompt[:limit])
                    tracked.hit_tokens = min(found.tokens_faster_than(self.min_load_bandwidth), limit)
                except Exception:  # a lookup the server refused is a miss: the scheduler must never fail
                    log.exception("kvtier lookup failed for request %s", request.request_id)
        hit = tracked.hit_tokens
        tracked.local_tokens = num_computed_tokens
        tracked.external_tokens = max(0, hit - num_computed_tokens)
        return tracked.external_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            return
        tracked.external_tokens = num_external_tokens
        tracked.load_pending = num_external_tokens > 0

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVTierMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is None:
                tracked = self._requests[new.req_id] = _Tracked(list(new.prompt_token_ids or []), "")
            tracked.block_ids = list(new.block_ids[0])
            if tracked.load_pending:
                first = tracked.local_tokens // self.block_size
                end = first + tracked.external_tokens // self.block_size
                meta.loads.append(LoadSpec(new.req_id, tracked.prompt[: end * self.block_size],
                                           tracked.block_ids[:end], first, end, tracked.salt))
                tracked.load_pending = False
            self._maybe_save(meta, new.req_id, tracked, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tracked.block_ids.extend(new_ids[0])
            self._maybe_save(meta, req_id, tracked, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _maybe_save(self, meta: KVTierMetadata, req_id: str, tracked: _Tracked, computed_after: int) -> None:
        """Store once, in the step that computes the prompt's last token."""
        if tracked.saved or computed_after < len(tracked.prompt):
            return
        tracked.saved = True
        whole = len(tracked.prompt) // self.block_size
        # Chunks kvtier just served, or that vLLM's own cache held (this instance computed and offered
        # them before), are not offered again: that saves a store round trip on every cache hit, at the
        # price of not re-offering a prefix kvtier has evicted while vLLM still caches it.
        chunk = self.options.chunk_size
        skip = max(tracked.hit_tokens, tracked.local_tokens) // chunk
        if whole and len(tracked.block_ids) >= whole and skip * chunk < whole * self.block_size:
            meta.saves.append(SaveSpec(req_id, tracked.prompt[: whole * self.block_size],
                                       tracked.block_ids[:whole], tracked.salt, skip))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, None

    # ============================== worker side ==============================

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

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
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

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
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

    def shutdown(self) -> None:
        self.client.close()


def kv_bytes_per_token(kv_cache_config: Any) -> float:
    """KV bytes one token takes in this rank's layers (0.0 when the config does not say: never skip)."""
    total = 0.0
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = group.kv_cache_spec
        try:
            total += len(group.layer_names) * spec.page_size_bytes / spec.block_size
        except (AttributeError, NotImplementedError, ZeroDivisionError):
            return 0.0
    return total


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # not initialised (single process): rank 0
        return 0
