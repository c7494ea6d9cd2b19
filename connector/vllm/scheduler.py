"""The scheduler side of the vLLM connector: one lookup per new request, and per step the loads and stores
the workers carry out (KVTierMetadata).

A lookup gives the block-aligned number of prompt tokens kvtier holds beyond vLLM's own prefix-cache hit
(lower-tier hits slower than the engine's prefill are left out). A request's whole prompt blocks are stored
once, in the step that computes its last prompt token.

Loads are synchronous by default: a load runs before the forward pass of the request's first step. With
`kvtier.async_transfers` a request with a hit waits in WAITING_FOR_REMOTE_KVS while a worker thread loads it,
and other requests keep running. Stores are asynchronous by default (`kvtier.async_stores`): a worker thread
stores after the step; a finished request whose store may still be running keeps its blocks
(`request_finished` -> True) until the workers report the store; a preempted request's store is waited for by
the workers before its blocks are reused (worker.py, in_flight.py).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvtier.connector.results import L1_TIER, LookupResult
from kvtier.connector.vllm.engine_events import Converter, EngineEvents, engine_hasher
from kvtier.connector.vllm.hints import NO_HINTS, RequestHints, parse_hints
from kvtier.connector.vllm.identity import LoraFingerprints, request_identity
from kvtier.connector.vllm.meta import ConnectorOptions, ConnectorSide, KVTierMetadata, LoadSpec, SaveSpec
from kvtier.server.keys import PLAIN, Namespace, RequestIdentity, chunk_keys
from kvtier.server.protocol import NO_HINT, SKIP_MODEL

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.connector")

# A synchronous load runs in the step its metadata is built for; vLLM's scheduler builds at most this many steps
# ahead of the one that runs (async scheduling, a pipeline's batch queue), so a lookup's lease on what that load
# reads is released once this many later steps were built.
RELEASE_AFTER_STEPS = 4


@dataclass
class _Tracked:
    """Scheduler-side state of one request."""

    prompt: list[int]
    salt: str
    identity: RequestIdentity = PLAIN
    skip: bool = False  # its identity could not be established: never looked up or stored
    hints: RequestHints = NO_HINTS  # what its kv_transfer_params ask (hints.py)
    asked: float = 0.0  # when vLLM first asked about it (monotonic)
    asked_again: bool = False  # its first lookup answered "ask again": later ones are not counted again
    lease: int = 0  # the lookup's lease on the L1 hits it promised (released once the load has read them)
    verify_blocks: int = 0  # sampled for verification: these prompt blocks are recomputed, then compared
    looked_up: bool = False
    block_ids: list[int] = field(default_factory=list)
    hit_tokens: int = 0
    local_tokens: int = 0
    external_tokens: int = 0
    load_pending: bool = False
    loading: list[int] | None = None  # the engine blocks of an asynchronous load in flight (until reported)
    saved: bool = False  # its store was decided (once, in the step that computes its last prompt token)
    storing: bool = False  # a store was sent to the workers
    stored_by: int = 0  # workers that reported its asynchronous store done (all of them: its blocks are not held)


class SchedulerSide(ConnectorSide):
    def __init__(self, vllm_config: VllmConfig, options: ConnectorOptions, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, options, tp_rank=0, kv_cache_config=kv_cache_config)
        self._requests: dict[str, _Tracked] = {}
        self._ranks: dict[str, list[Namespace]] = {}  # per salt: the namespaces of the other TP ranks
        lora_config = getattr(vllm_config, "lora_config", None)
        self._loras = LoraFingerprints(str(getattr(lora_config, "lora_dtype", "") or ""))
        self._steps = 0  # build_connector_meta calls so far
        self._due: dict[int, int] = {}  # lease of a synchronous load -> the step after which it is released
        self._to_release: list[int] = []  # sent with the next step's metadata
        self._verify_fraction = options.verify_fraction
        if self._verify_fraction and self.gpu:
            log.warning("kvtier connector: kvtier.verify_fraction is not supported on GPU engines yet; ignored")
            self._verify_fraction = 0.0
        self._async_loads: list[LoadSpec] = []  # planned in update_state_after_alloc, sent in the next step
        self._held: list[str] = []  # finished requests held for their stores, told to the workers next step
        self._workers = vllm_config.parallel_config.world_size  # each reports a request's store done
        # Break-even: a lower tier pays off only if it delivers a token's KV faster than prefill computes it.
        # Every TP rank loads its share through the same server, hence the whole model's bytes.
        self.min_load_bandwidth = (kv_bytes_per_token(kv_cache_config) * options.prefill_tokens_per_s
                                   * vllm_config.parallel_config.tensor_parallel_size)
        self.engine_events = self._engine_events() if options.engine_events else None

    def _engine_events(self) -> EngineEvents | None:
        """kvtier's blocks in this engine's KV events (engine_events.py); None when they cannot be."""
        events_config = getattr(self.vllm_config, "kv_events_config", None)
        if events_config is None or not events_config.enable_kv_cache_events:
            log.warning("kvtier connector: engine_events needs vLLM's --kv-events-config with "
                        "enable_kv_cache_events: off")
            return None
        if self.identity_error:
            return None  # the model has no namespace: nothing of kvtier is loadable
        converter = Converter(self.namespace("").fingerprint(), self.block_size,
                              engine_hasher(self.vllm_config.cache_config.prefix_caching_hash_algo))
        client = self.client
        return EngineEvents(lambda: (client.events_endpoint, client.events_replay), lambda: client.connected,
                            self.options.url, converter)

    def take_events(self) -> list[Any]:
        return self.engine_events.take() if self.engine_events is not None else []

    def shutdown(self) -> None:
        if self.engine_events is not None:
            self.engine_events.close()
        super().shutdown()

    def _track(self, request: Request) -> _Tracked:
        """Start tracking a request: its prompt, salt and identity (or why it has none: a counted skip)."""
        prompt = list(request.prompt_token_ids or [])
        tracked = _Tracked(prompt, getattr(request, "cache_salt", None) or "", asked=time.monotonic(),
                           hints=parse_hints(getattr(request, "kv_transfer_params", None)))
        for reason in tracked.hints.ignored:
            self.tally.hint_ignored(reason)
        reason = SKIP_MODEL if self.identity_error else ""
        if not reason:
            identity = request_identity(request, self.block_size, prompt, self._loras)
            if isinstance(identity, str):
                reason = identity
            else:
                tracked.identity = identity
        if reason:
            tracked.skip = True
            self.tally.skipped(reason)
            log.debug("kvtier: request %s skipped (%s)", request.request_id, reason)
        self._requests[request.request_id] = tracked
        return tracked

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tracked = self._requests.get(request.request_id) or self._track(request)
        if tracked.skip:
            return 0, False
        prompt = tracked.prompt
        # At least one prompt token must stay to compute, and only whole blocks load.
        limit = (len(prompt) - 1) // self.block_size * self.block_size
        if not tracked.looked_up:
            # One answered lookup per request: the scheduler may ask again while the request waits for room.
            # The answer is a promise, so it promises only what is held: what the lookup found in L1 is
            # leased to this side until the load has read it. A remote tier still probing answers "pending",
            # and hits in a lower tier are being promoted into L1: vLLM asks again next step (None), when
            # they are in L1 and leased, for up to `pending_wait_ms`; then the request goes on with the L1
            # hits alone (a promotion still running is not waited for in the step: it is recomputed).
            if limit > num_computed_tokens:
                try:
                    found = self._lookup(tracked, prompt[:limit], num_computed_tokens)
                except Exception:  # a lookup the server refused is a miss: the scheduler must never fail
                    log.exception("kvtier lookup failed for request %s", request.request_id)
                else:
                    hit = min(found.tokens_faster_than(self.min_load_bandwidth, self.options.prefill_tokens_per_s),
                              limit)
                    in_l1 = sum(m for m, t in zip(found.matches, found.tiers, strict=True) if t == L1_TIER)
                    if (found.pending or hit > in_l1 * self.block_size) \
                            and time.monotonic() - tracked.asked < self.options.pending_wait_ms / 1000:
                        if found.lease:
                            self._to_release.append(found.lease)
                        tracked.asked_again = True
                        return None, False
                    tracked.lease = found.lease
                    hit = min(hit, in_l1 * self.block_size)
                    if hit > num_computed_tokens and self._verify_fraction and tracked.hints.store \
                            and random.random() < self._verify_fraction:
                        tracked.verify_blocks, hit = hit // self.block_size, 0  # recomputed, then compared
                    tracked.hit_tokens = hit
            tracked.looked_up = True
        hit = tracked.hit_tokens
        tracked.local_tokens = num_computed_tokens
        tracked.external_tokens = max(0, hit - num_computed_tokens)
        return tracked.external_tokens, self.async_loads and tracked.external_tokens > 0

    def _lookup(self, tracked: _Tracked, tokens: list[int], local: int) -> LookupResult:
        """The server's answer for `tokens`, or a miss without a round trip when the server's presence filter
        (shm/presence.py, read here in shared memory) says the first block past vLLM's own hit (`local` tokens)
        is held by no tier: nothing past that hit could be loaded. The miss is reported, so the server's
        lookup metrics still count it."""
        ns = self.namespace(tracked.salt)
        chunks = chunk_keys(ns, tokens, tracked.identity)
        first = local // self.block_size  # the first block vLLM's own cache does not hold
        chunk = chunks[first // ns.blocks_per_chunk]
        if not self.client.may_hold(chunk.block_keys[first % ns.blocks_per_chunk]):
            if not tracked.asked_again:
                self.tally.local_miss(ns, len(tokens) // self.block_size)
            return LookupResult([], [], [], self.block_size)
        ranks = [(other, chunk_keys(other, tokens, tracked.identity)) for other in self._other_ranks(tracked.salt)]
        return self.client.lookup_chunks(ns, chunks, lease=True, ranks=ranks, again=tracked.asked_again)

    def _other_ranks(self, salt: str) -> list[Namespace]:
        """The namespaces of TP ranks 1.. (this side's is rank 0's): every rank stores its own KV of a prompt
        under its own keys and each rank's chunks are evicted on their own, so a lookup promises only the
        prefix every rank holds (docs/vllm.md, "Tensor parallelism")."""
        ranks = self._ranks.get(salt)
        if ranks is None:
            ns = self.namespace(salt)
            ranks = self._ranks[salt] = [replace(ns, tp_rank=rank) for rank in range(1, ns.tp_size)]
        return ranks

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            return
        tracked.external_tokens = num_external_tokens
        # a synchronous load is built from the request's first scheduled step
        tracked.load_pending = num_external_tokens > 0 and not self.async_loads
        if num_external_tokens <= 0:
            self._release(tracked)  # nothing to load: the promise is not needed
        if num_external_tokens <= 0 or not self.async_loads:
            return
        # An asynchronous load: the request is not scheduled until it is done, so plan it from these blocks.
        block_ids = list(blocks.get_block_ids()[0])
        first = tracked.local_tokens // self.block_size
        end = first + num_external_tokens // self.block_size
        self._async_loads.append(LoadSpec(request.request_id, tracked.prompt[: end * self.block_size],
                                          block_ids[:end], first, end, tracked.salt, tracked.identity))
        tracked.loading = block_ids[first:end]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        meta = KVTierMetadata(loads=self._async_loads, held=self._held,
                              preempted=sorted(scheduler_output.preempted_req_ids or ()))
        self._async_loads, self._held = [], []
        self._steps += 1
        for lease in [lease for lease, step in self._due.items() if step <= self._steps]:
            del self._due[lease]
            self._to_release.append(lease)
        self._flush_releases()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is None:  # never asked about: its identity is unknown, so it is neither loaded nor stored
                tracked = self._requests[new.req_id] = _Tracked(list(new.prompt_token_ids or []), "", skip=True)
            tracked.block_ids = list(new.block_ids[0])
            if tracked.load_pending:
                first = tracked.local_tokens // self.block_size
                end = first + tracked.external_tokens // self.block_size
                meta.loads.append(LoadSpec(new.req_id, tracked.prompt[: end * self.block_size],
                                           tracked.block_ids[:end], first, end, tracked.salt, tracked.identity))
                tracked.load_pending = False
                if tracked.lease:  # the load runs in this step: its lease goes a few steps later
                    self._due[tracked.lease] = self._steps + RELEASE_AFTER_STEPS
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
        """Store once, in the step that computes the prompt's last token: the whole blocks its hints allow
        (none with `store: false`, those within `max_store_tokens`)."""
        if tracked.skip or tracked.saved or computed_after < len(tracked.prompt):
            return
        tracked.saved = True
        whole = tracked.hints.stored_blocks(len(tracked.prompt), self.block_size)
        # Chunks kvtier just served, or that vLLM's own cache held (this instance computed and offered
        # them before), are not offered again: that saves a store round trip on every cache hit, at the
        # price of not re-offering a prefix kvtier has evicted while vLLM still caches it. A request with a
        # hint offers them all: its hint applies to the chunks that exist too (answered "exists", no copy).
        chunk = self.options.chunk_size
        skip = max(tracked.hit_tokens, tracked.local_tokens) // chunk if tracked.hints.hint == NO_HINT else 0
        if whole and len(tracked.block_ids) >= whole and (skip * chunk < whole * self.block_size
                                                           or tracked.verify_blocks):
            meta.saves.append(SaveSpec(req_id, tracked.prompt[: whole * self.block_size], tracked.block_ids[:whole],
                                       tracked.salt, skip, tracked.identity, min(tracked.verify_blocks, whole),
                                       tracked.hints.hint))
            tracked.storing = True

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # the workers' KVTierWorkerMetadata (meta.py), summed over them by vLLM: stores done since the last step
        stored = getattr(connector_output.kv_connector_worker_meta, "stored", None)
        if stored:
            for req_id, workers in stored.items():
                tracked = self._requests.get(req_id)
                if tracked is not None:
                    tracked.stored_by += workers
        for req_id in connector_output.finished_recving or ():
            tracked = self._requests.get(req_id)
            if tracked is None or tracked.loading is None:
                continue
            if not connector_output.invalid_block_ids.isdisjoint(tracked.loading):
                tracked.hit_tokens = 0  # if vLLM schedules it from scratch again, it recomputes, not reloads
            tracked.loading = None
            self._release(tracked)  # the asynchronous load has read what the lookup promised

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks of a finished request whose store may be in flight (asynchronous stores: not
        one whose store every worker has reported done, `update_connector_output`); end the session of a
        request that is its session's last turn (`session.end`).

        Not one whose load is in flight: vLLM holds those itself until the load is reported, and a request
        loading again after a preemption has had its store finished before its blocks were freed. A session
        ends here even when the store is still in flight: the server keeps no late store of an ended session.
        """
        tracked = self._requests.pop(request.request_id, None)
        if tracked is not None and tracked.hints.ends_session:
            self.client.end_session(tracked.hints.ends_session)
        if tracked is not None and tracked.lease:  # at once: the engine may go idle after its last request
            self._release(tracked)
            self._flush_releases()
        hold = self.async_stores and tracked is not None and tracked.storing and tracked.loading is None \
            and tracked.stored_by < self._workers
        if hold:
            self._held.append(request.request_id)
        return hold, None

    def _release(self, tracked: _Tracked) -> None:
        """Release a request's lookup lease with the next step's metadata (one round trip for all of them)."""
        if tracked.lease:
            self._due.pop(tracked.lease, None)
            self._to_release.append(tracked.lease)
            tracked.lease = 0

    def _flush_releases(self) -> None:
        if self._to_release:
            leases, self._to_release = self._to_release, []
            try:
                self.client.release(leases, wait=False)
            except Exception:  # a refused release only keeps chunks from eviction until the lease's client goes
                log.exception("kvtier: releasing %d lookup leases failed", len(leases))


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
