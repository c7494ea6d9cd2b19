"""The worker side of the vLLM connector: copies between the engine's paged KV cache and kvtier's L1.

Loads run in ``start_load_kv``; when a request's prompt is complete, ``wait_for_save`` stores its whole
blocks (chunks kvtier already holds are skipped by the server without a copy). On CPU engines a load runs
before the forward pass by default, and a store goes to a background thread (``kvtier.async_stores``, on by
default; in_flight.py), reported through ``get_finished``; ``handle_preemptions`` waits for the stores of
preempted requests before the forward pass can overwrite their blocks. With ``kvtier.async_transfers`` loads
go to a background thread too. A load that comes up
short is reported through ``get_block_ids_with_load_errors`` so vLLM recomputes those blocks: a miss,
never wrong KV.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from kvtier.connector.gpu_transfers import EventSource, GpuTransfers
from kvtier.connector.host_memory import HostMemory
from kvtier.connector.kv_blocks import PagedKV
from kvtier.connector.results import ReadChunk
from kvtier.connector.verify import Difference
from kvtier.connector.vllm.in_flight import InFlight
from kvtier.connector.vllm.meta import (
    ConnectorOptions,
    ConnectorSide,
    KVTierMetadata,
    KVTierWorkerMetadata,
    LoadSpec,
    SaveSpec,
)
from kvtier.server import protocol as p
from kvtier.server.keys import ChunkKeys, chunk_keys
from kvtier.server.protocol import GpuMemory
from kvtier.shm.cuda_ipc import CudaError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

log = logging.getLogger("kvtier.connector")

GPU_EVENTS = 64  # interprocess events per worker: operations in flight at once before one must finish


class WorkerSide(ConnectorSide):
    def __init__(self, vllm_config: VllmConfig, options: ConnectorOptions, tp_rank: int, kv_cache_config: Any,
                 pp_rank: int = 0) -> None:
        super().__init__(vllm_config, options, tp_rank, kv_cache_config, pp_rank)
        self._kv: PagedKV | None = None
        self._kv_dtype = ""  # the engine's KV element type (torch's name), for verification
        self._load_errors: set[int] = set()
        self._in_flight = InFlight() if self.async_stores else None
        self._gpu: GpuTransfers | None = None
        self._events: Any = None  # the GPU worker's CudaEvents
        self._host: GpuTransfers | None = None  # a CPU worker's stores, copied by the server (server_stores)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if any(t.device.type == "cuda" for t in kv_caches.values()):
            self._register_gpu(kv_caches)
            return
        if self.identity_error:
            return  # the connector is a no-op: nothing is keyed without the model's identity
        layers = []
        for name, tensor in kv_caches.items():
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                log.warning("kvtier connector: layer %s is neither a contiguous CPU tensor nor a CUDA tensor; "
                            "connector disabled", name)
                return
            layers.append(tensor.view(torch.uint8).reshape(tensor.shape[0], -1).numpy())
        self._kv = PagedKV(layers)
        self._kv_dtype = str(next(iter(kv_caches.values())).dtype).removeprefix("torch.")
        log.info("kvtier connector: %d layers x %d blocks of %d bytes", len(layers), self._kv.num_blocks,
                 self._kv.block_bytes)
        if self.options.populate_l1:
            self.client.populate_l1()
        if self.options.server_stores:
            host = HostMemory(layers)
            self._host = GpuTransfers(self.client, host.memory, host, fallback="this worker copies its stores")
            self._host.start()

    def _register_gpu(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Export vLLM's KV allocation and events once and register them; the server's copier moves the
        blocks from then on (not yet run on a GPU: docs/vllm.md, "Data path")."""
        from kvtier.connector.vllm.gpu_memory import export  # imports the CUDA runtime on first use

        if self.identity_error:
            return
        try:
            memory, self._events = export(kv_caches, GPU_EVENTS, self.vllm_config.cache_config.kv_cache_layout,
                                          num_blocks=self.kv_cache_config.num_blocks)
        except (ValueError, CudaError, OSError) as exc:
            log.warning("kvtier connector: this GPU KV cache cannot be registered (%s); connector disabled", exc)
            return
        self.attach_gpu(memory, self._events)

    def attach_gpu(self, memory: GpuMemory, events: EventSource) -> None:
        """Move this worker's blocks through the server's copier from now on (`events`: where the worker
        records what its stream reached). Registration runs on GpuTransfers' keeper thread: until it is made,
        loads and stores are misses. Tests attach the CPU stand-in's memory here."""
        self._gpu = GpuTransfers(self.client, memory, events)
        if self._in_flight is None:
            self._in_flight = InFlight()
        self._gpu.start()

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Carry out the step's loads (`meta`: the metadata bound for this step), or start them (async)."""
        if not isinstance(meta, KVTierMetadata):
            return
        if self._in_flight is not None:
            self._in_flight.hold(meta.held)
        if self._in_flight is not None and (self.async_loads or self._gpu is not None):
            for spec in meta.loads:
                self._in_flight.load(spec.req_id, spec.block_ids[spec.first_block:spec.end_block],
                                     self._gpu_load(spec) if self._gpu is not None
                                     else lambda spec=spec: set(self._missing(spec)))
            return
        for spec in meta.loads:
            self._load_errors.update(self._missing(spec))

    def _gpu_load(self, spec: LoadSpec) -> Callable[[], set[int]]:
        """Send a GPU load now (its event recorded on vLLM's stream, after this step's forward); the job
        that waits for its reply and names the blocks that did not arrive. Any failure is a miss: every
        block is reported and recomputed, counted as undelivered tokens."""
        assert self._gpu is not None
        gpu, wanted = self._gpu, set(spec.block_ids[spec.first_block:spec.end_block])
        unsent = p.UNDELIVERED_UNREACHABLE  # None: not registered (yet), nothing was sent
        try:
            op = gpu.load(spec.req_id, self.namespace(spec.salt), spec.token_ids, spec.block_ids, spec.first_block,
                          spec.end_block, spec.identity)
        except Exception:
            log.exception("kvtier: GPU load of request %s failed; vLLM recomputes its blocks", spec.req_id)
            op, unsent = None, p.UNDELIVERED_FAILED

        def missing() -> set[int]:
            done = gpu.wait(op) if op is not None else None
            failed = done.failed & wanted if done is not None else wanted
            if failed:  # no reply: unreachable; a copy that failed; no reason: the chunks were gone
                reason = (unsent if done is None else done.reason if done.reason == p.UNDELIVERED_UNREACHABLE
                          else p.UNDELIVERED_FAILED if done.reason else p.UNDELIVERED_MISSING)
                self.tally.undelivered(reason, len(failed) * self.block_size)
            return failed

        return missing

    def _missing(self, spec: LoadSpec) -> list[int]:
        """Load `spec`; the engine blocks that could not be filled (vLLM recomputes them), counted as
        undelivered tokens by reason."""
        loaded, reason = self._load(spec) if self._kv is not None else (set(), p.UNDELIVERED_FAILED)
        missing = [b for i, b in enumerate(spec.block_ids) if spec.first_block <= i < spec.end_block
                   and i not in loaded]
        if missing:
            self.tally.undelivered(reason or p.UNDELIVERED_MISSING, len(missing) * self.block_size)
            if self._kv is not None:
                log.warning("kvtier: %d of %d blocks of request %s could not be loaded (%s); vLLM recomputes them",
                            len(missing), spec.end_block - spec.first_block, spec.req_id,
                            reason or p.UNDELIVERED_MISSING)
        return missing

    def _load(self, spec: LoadSpec) -> tuple[set[int], str]:
        """Copy the planned blocks in; returns the prompt block indices that arrived, and why not more."""
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
            outcome = self.client.read_prefix(self.namespace(spec.salt), spec.token_ids, read, spec.identity)
        except Exception:  # a broken load is a miss; the blocks are reported and recomputed
            log.exception("kvtier load failed for request %s", spec.req_id)
            return set(), p.UNDELIVERED_FAILED
        if not outcome.blocks:
            return set(), outcome.reason  # nothing, or a read the server could not vouch for: all recompute
        return loaded, outcome.reason

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # whole prompts are stored in wait_for_save, after every layer is computed

    def wait_for_save(self, meta: KVConnectorMetadata) -> None:
        """Carry out the step's stores (`meta`: the metadata bound for this step), or start them (async)."""
        if not isinstance(meta, KVTierMetadata):
            return
        if self._gpu is not None and self._in_flight is not None:
            gpu = self._gpu
            for spec in meta.saves:  # sent now: each records its event after this step's forward
                try:
                    op = gpu.store(spec.req_id, self.namespace(spec.salt), spec.token_ids, spec.block_ids,
                                   spec.skip_chunks, spec.identity, spec.hint)
                except Exception:  # a dropped store is only a future miss
                    log.exception("kvtier: GPU store of request %s failed; dropped", spec.req_id)
                    op = None
                self._in_flight.store(spec.req_id, partial(gpu.wait, op) if op is not None else lambda: None)
            return
        if self._kv is None:
            return
        for spec in meta.saves:
            if self._server_store(spec):
                continue
            if self._in_flight is not None:
                self._in_flight.store(spec.req_id, lambda spec=spec: self._store(spec),
                                      defer=self.options.defer_stores)
                continue
            try:
                self._store(spec)
            except Exception:  # a failed store is only a future miss
                log.exception("kvtier store failed for request %s", spec.req_id)

    def _server_store(self, spec: SaveSpec) -> bool:
        """Send `spec` for the server to copy out of this worker's memory (server_stores); False when the worker
        must copy it itself: not registered (yet, or refused), a store that verifies, or a failure to send."""
        host = self._host
        if host is None or spec.verify_blocks or not host.registered:
            return False
        try:
            op = host.store(spec.req_id, self.namespace(spec.salt), spec.token_ids, spec.block_ids,
                            spec.skip_chunks, spec.identity, spec.hint)
        except Exception:
            log.exception("kvtier: server-side store of request %s could not be sent; the worker copies it",
                          spec.req_id)
            return False
        if op is None:
            return False
        if self._in_flight is not None:
            self._in_flight.store(spec.req_id, partial(host.wait, op))
        else:
            host.wait(op)
        return True

    def _store(self, spec: SaveSpec) -> None:
        assert self._kv is not None
        kv = self._kv
        if spec.verify_blocks:
            self._verify(spec)

        def write(chunk: ChunkKeys, span: Any) -> None:
            first = chunk.start_token // self.block_size
            kv.save(span, spec.block_ids[first: first + len(chunk.block_keys)])

        self.client.store(self.namespace(spec.salt), np.asarray(spec.token_ids),
                          lambda c: kv.chunk_bytes(len(c.block_keys)), write, skip_chunks=spec.skip_chunks,
                          identity=spec.identity, hint=spec.hint)

    def _verify(self, spec: SaveSpec) -> None:
        """A sampled hit was recomputed instead of loaded: compare the engine's fresh KV of its blocks with what
        kvtier holds under their keys, and count the outcome (kvtier_verify_checks/mismatches_total)."""
        assert self._kv is not None
        kv, ns = self._kv, self.namespace(spec.salt)
        diff = Difference()
        compared = 0

        def read(chunk: ReadChunk) -> None:
            nonlocal compared
            base = chunk.chunk.start_token // self.block_size
            hi = min(chunk.match, spec.verify_blocks - base)
            if hi > 0:
                for stored, fresh in kv.pairs(chunk.span, chunk.blocks, 0, spec.block_ids[base: base + hi]):
                    diff.add(stored, fresh, self._kv_dtype)
                compared += hi

        try:
            self.client.read_prefix(ns, spec.token_ids[: spec.verify_blocks * self.block_size], read, spec.identity)
        except Exception:  # a verification that cannot read is no verdict
            log.exception("kvtier verification read failed for request %s", spec.req_id)
            return
        if not compared:
            return  # what was promised is gone meanwhile: no verdict
        mismatch = diff.relative > self.options.verify_tolerance
        self.tally.verified(ns, mismatch)
        if mismatch:
            log.warning("kvtier verification: request %s, %d blocks: recomputed KV differs from kvtier's by %.3g "
                        "(relative L2, tolerance %.3g); first chunk key %s", spec.req_id, compared, diff.relative,
                        self.options.verify_tolerance,
                        chunk_keys(ns, spec.token_ids[: self.block_size], spec.identity)[0].key.hex())
        else:
            log.debug("kvtier verification: request %s, %d blocks agree (relative L2 %.3g)", spec.req_id, compared,
                      diff.relative)

    def handle_preemptions(self, meta: KVConnectorMetadata) -> None:
        """A step begins (vLLM calls this first in every step): deferred stores may start. Before the forward
        pass reuses a preempted request's blocks, let its store finish reading them."""
        if self._in_flight is None:
            return
        self._in_flight.release_deferred()
        if isinstance(meta, KVTierMetadata) and meta.preempted:
            waited = self._in_flight.wait_for_stores(meta.preempted)
            if waited:
                log.debug("kvtier: waited for %d stores of preempted requests", waited)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._in_flight is None:
            return None, None
        done = self._in_flight.finished(finished_req_ids)
        self._load_errors.update(done.load_errors)  # reported in this same step, as vLLM requires
        return done.sending or None, done.recving or None

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        """The stores done since the last step (asynchronous stores), for the scheduler."""
        stored = self._in_flight.stored() if self._in_flight is not None else None
        return KVTierWorkerMetadata(dict.fromkeys(stored, 1)) if stored else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._in_flight is not None:
            self._in_flight.close()
        for transfers in (self._gpu, self._host):
            if transfers is not None:
                transfers.close()
        super().shutdown()  # its bye closes the server's GPU registrations
        if self._events is not None:
            self._events.close()


def tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # not initialised (single process): rank 0
        return 0


def pp_rank() -> int:
    """This worker's pipeline stage (0 without pipeline parallelism)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return get_pp_group().rank_in_group
    except Exception:  # not initialised (single process): stage 0
        return 0
