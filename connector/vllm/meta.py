"""What both sides of the vLLM connector share: the options, the per-step metadata the scheduler sends
the workers (which prompt blocks to load, which to store), and the base of both sides (a client and the
kvtier namespace per request salt)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.connector.client import DEFAULT_URL, ClientConfig, KVTierClient
from kvtier.connector.tally import Tally
from kvtier.connector.vllm.identity import IdentityUnknown, model_fingerprint
from kvtier.connector.vllm.namespace import namespace_for
from kvtier.server.keys import PLAIN, Namespace, RequestIdentity
from kvtier.server.protocol import NO_HINT, Hint
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig

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
    tenant: str = ""  # another name for cache_salt (the engine's tenant, docs/tenants.md)
    token: str = ""
    prefill_tokens_per_s: float = 0.0  # the engine's prefill rate: lower-tier hits slower than it are skipped
    pending_wait_ms: float = 250.0  # how long a request may wait for a remote probe or a promotion into L1
    kv_layout: str = ""  # GPU: the KV layout asked of vLLM (e.g. BLNHC, block-major); "" = vLLM's choice
    async_transfers: bool = False  # loads in the background too (WAITING_FOR_REMOTE_KVS)
    async_stores: bool = True  # stores on a worker thread, off the engine's step (a finished request's blocks held)
    defer_stores: bool = True  # an asynchronous store starts when the next step begins (after the sampling)
    server_stores: bool = False  # CPU engines: the server copies a store's blocks out of the worker (docs/vllm.md)
    populate_l1: bool = True  # CPU engines: the worker maps all of L1 ahead, so that its copies take no page fault
    model_id: str = ""  # names the weights instead of fingerprinting their files (docs/vllm.md, the key)
    verify_fraction: float = 0.0  # sampled hits recomputed and compared with what kvtier holds (0 = off)
    verify_tolerance: float = 0.05  # relative L2 difference above which a recomputed block is a mismatch
    # kvtier's blocks in the engine's KV events (`"engine_events": true`, without the prefix: engine_events.py)
    engine_events: bool = False

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorOptions:
        known = {f"kvtier.{name}": name for name in cls.__dataclass_fields__}
        known["engine_events"] = "engine_events"
        unknown = sorted(k for k in extra if k.startswith("kvtier.") and k not in known)
        if unknown:
            raise ValueError(f"unknown kvtier options {unknown}; known: {sorted(known)}")
        values = {}
        for key, name in known.items():
            if key in extra:
                kind = type(getattr(cls, name))
                values[name] = _flag(key, extra[key]) if kind is bool else kind(extra[key])
        tenant, salt = values.get("tenant", ""), values.get("cache_salt", "")
        if tenant and salt and tenant != salt:
            raise ValueError(f"kvtier.tenant {tenant!r} and kvtier.cache_salt {salt!r} differ: they are one "
                             "option under two names; set one of them")
        values["tenant"] = values["cache_salt"] = tenant or salt
        options = cls(**values)
        if not 0.0 <= options.verify_fraction <= 1.0:
            raise ValueError(f"kvtier.verify_fraction must be in [0, 1], not {options.verify_fraction}")
        return options

    def client_config(self) -> ClientConfig:
        return ClientConfig(
            url=self.url, connect_timeout_s=self.connect_timeout_s, request_timeout_s=self.request_timeout_s,
            retry_backoff_s=self.retry_backoff_s, token=self.token or os.environ.get(TOKEN_ENV, ""),
        )


def _flag(key: str, value: Any) -> bool:
    """A boolean option from JSON (true/false) or a string ("true", "0", ...); anything else is refused."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{key} must be true or false, not {value!r}")


@dataclass
class LoadSpec:
    """Load prompt blocks [first_block, end_block) of `token_ids` into engine blocks."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    first_block: int
    end_block: int
    salt: str
    identity: RequestIdentity = PLAIN


@dataclass
class SaveSpec:
    """Store the whole blocks of a completed prompt, from chunk `skip_chunks` on."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    salt: str
    skip_chunks: int = 0
    identity: RequestIdentity = PLAIN
    # sampled verification: prompt blocks [0, verify_blocks) were recomputed instead of loaded from kvtier;
    # compare them with what kvtier holds
    verify_blocks: int = 0
    hint: Hint = NO_HINT  # the request's hints for these chunks (retention, priority, session: hints.py)


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # asynchronous stores: requests preempted in this step (their stores must end before the forward
    # pass) and finished requests whose blocks the scheduler holds until their stores are reported
    preempted: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, each step: the requests whose asynchronous store each worker finished since its
    last report (request id -> workers; vLLM sums the workers' reports of a step with `aggregate`)."""

    stored: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTierWorkerMetadata:
        merged = dict(self.stored)
        for req_id, n in getattr(other, "stored", {}).items():
            merged[req_id] = merged.get(req_id, 0) + n
        return KVTierWorkerMetadata(merged)


class ConnectorSide:
    """State both sides hold: the options, the engine block size, a kvtier client, the namespace per salt.

    The caller connects the client (`client.connect()`) once the side is built: a miss-only start if the
    server is down; the client retries later.
    """

    def __init__(self, vllm_config: VllmConfig, options: ConnectorOptions, tp_rank: int, kv_cache_config: Any,
                 pp_rank: int = 0) -> None:
        self.vllm_config = vllm_config
        self.options = options
        self.block_size = vllm_config.cache_config.block_size
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.kv_cache_config = kv_cache_config
        self._namespaces: dict[str, Namespace] = {}
        self.client = KVTierClient(options.client_config())
        self.tally = Tally(self.client.report)
        # GPU engines always transfer asynchronously (the server's copier moves the blocks); on CPU engines
        # stores are asynchronous by default and loads only with kvtier.async_transfers (docs/vllm.md)
        self.gpu = vllm_config.device_config.device_type == "cuda"
        self.async_loads = options.async_transfers or self.gpu
        self.async_stores = self.async_loads or options.async_stores
        # The model's identity: without it no request is looked up or stored (each counted as a skip).
        self.identity_error = ""
        self.model_fingerprint = ""
        try:
            self.model_fingerprint = model_fingerprint(vllm_config, options.model_id)
            self.namespace("")
        except IdentityUnknown as exc:
            self.identity_error = str(exc)
            log.warning("kvtier connector: the model's identity cannot be established (%s): every request "
                        "will be a miss; set kvtier.model_id to a name for these weights", exc)

    @property
    def kv_layout(self) -> str:
        """The engine memory layout in the namespace: "paged" for the CPU copy path; on GPU the layout vLLM
        resolved (KVCacheLayout name, the same in the scheduler and every worker)."""
        return (self.vllm_config.cache_config.kv_cache_layout or "unresolved") if self.gpu else "paged"

    def namespace(self, salt: str) -> Namespace:
        ns = self._namespaces.get(salt)
        if ns is None:
            salt_full = f"{self.options.cache_salt}|{salt}" if salt else self.options.cache_salt
            ns = namespace_for(self.vllm_config, self.options.chunk_size, self.tp_rank, salt_full, self.kv_layout,
                               pp_rank=self.pp_rank, model_fingerprint=self.model_fingerprint,
                               kv_cache_config=self.kv_cache_config)
            self._namespaces[salt] = ns
        return ns

    def shutdown(self) -> None:
        self.tally.close()
        self.client.close()
