"""What both sides of the vLLM connector share: the options, the per-step metadata the scheduler sends
the workers (which prompt blocks to load, which to store), and the base of both sides (a client and the
kvtier namespace per request salt)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.connector.client import DEFAULT_URL, ClientConfig, KVTierClient
from kvtier.connector.vllm.namespace import namespace_for
from kvtier.server.keys import Namespace
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig

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


class ConnectorSide:
    """State both sides hold: the options, the engine block size, a kvtier client, the namespace per salt.

    The caller connects the client (`client.connect()`) once the side is built: a miss-only start if the
    server is down; the client retries later.
    """

    def __init__(self, vllm_config: VllmConfig, options: ConnectorOptions, tp_rank: int) -> None:
        self.vllm_config = vllm_config
        self.options = options
        self.block_size = vllm_config.cache_config.block_size
        self.tp_rank = tp_rank
        self._namespaces: dict[str, Namespace] = {}
        self.client = KVTierClient(options.client_config())

    def namespace(self, salt: str) -> Namespace:
        ns = self._namespaces.get(salt)
        if ns is None:
            salt_full = f"{self.options.cache_salt}|{salt}" if salt else self.options.cache_salt
            ns = namespace_for(self.vllm_config, self.options.chunk_size, self.tp_rank, salt_full)
            self._namespaces[salt] = ns
        return ns

    def shutdown(self) -> None:
        self.client.close()
