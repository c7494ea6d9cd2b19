"""The admin API's request bodies: strict pydantic models (unknown fields and type coercion refused)."""

from __future__ import annotations

from typing import Annotated, Literal

from kvtier.server.eviction import POLICIES
from kvtier.server.keys import MAX_NS_STR
from kvtier.server.tenants import MAX_TENANTS
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

MAX_KEYS = 65536
MAX_TOKENS = 1 << 20
# The most token ids one /cache/lookup may carry (a 413 beyond): its key chain is hashed on the serving loop.
MAX_LOOKUP_TOKENS = 1 << 17
LOG_LEVELS = ("debug", "info", "warning", "error")

HexKey = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{32}$")]
TierName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,31}$")]  # l1, l2, remote, a plug-in's
TokenId = Annotated[int, Field(ge=0, lt=0xFFFFFFFF)]  # 0xFFFFFFFF is reserved by the key chain (keys.py)
TenantName = Annotated[str, StringConstraints(min_length=1, max_length=128)]  # a name of the quota table, or "*"
# A quota table's text: at most MAX_TENANTS entries and `*` of NAME=GUARANTEED:MAXIMUM (server/tenants.py).
MAX_TABLE_CHARS = (MAX_TENANTS + 1) * 160
_STRICT = ConfigDict(extra="forbid", strict=True)


class ClearRequest(BaseModel):
    """Remove every chunk (`all`), those of one namespace, one tier, or one tenant (each of its namespaces)."""

    model_config = _STRICT
    scope: Literal["all", "namespace", "tier", "tenant"]
    namespace: HexKey | None = Field(None, description="namespace fingerprint (hex), for scope=namespace")
    tier: TierName | None = Field(None, description="tier name (l1, l2, remote, a plug-in tier), for scope=tier")
    tenant: TenantName | None = Field(None, description="a tenant of the quota table (or *), for scope=tenant")

    @model_validator(mode="after")
    def _consistent(self) -> ClearRequest:
        for field in ("namespace", "tier", "tenant"):
            if (self.scope == field) != (getattr(self, field) is not None):
                raise ValueError(f"{field} is required with scope={field} and not allowed otherwise")
        return self


class PinRequest(BaseModel):
    """Chunks to (un)pin: by chunk keys, or token ids (every full and partial chunk of the prefix) in one
    namespace or in each namespace of a tenant."""

    model_config = _STRICT
    keys: list[HexKey] | None = Field(None, max_length=MAX_KEYS, description="chunk or block-prefix keys (hex)")
    namespace: HexKey | None = Field(None, description="namespace fingerprint (hex)")
    tenant: TenantName | None = Field(None, description="a tenant of the quota table (or *): its namespaces")
    token_ids: list[TokenId] | None = Field(None, max_length=MAX_TOKENS, description="the prefix's token ids")

    @model_validator(mode="after")
    def _one_form(self) -> PinRequest:
        by_keys = self.keys is not None
        by_tokens = self.namespace is not None or self.tenant is not None or self.token_ids is not None
        if by_keys == by_tokens:
            raise ValueError("give either keys, or namespace (or tenant) and token_ids")
        if by_tokens and ((self.namespace is None) == (self.tenant is None) or self.token_ids is None):
            raise ValueError("token_ids go with one of namespace and tenant")
        return self


class LookupRequest(BaseModel):
    """A prompt's token ids and where to look them up: one namespace by fingerprint, or every registered
    namespace of a model (and cache salt). Plain requests only: no LoRA, images or prompt embeddings."""

    model_config = _STRICT
    tokens: list[TokenId] = Field(description=f"the prompt's token ids (at most {MAX_LOOKUP_TOKENS})")
    namespace: HexKey | None = Field(None, description="namespace fingerprint (hex)")
    model: str | None = Field(None, min_length=1, max_length=MAX_NS_STR,
                              description="every registered namespace whose `model` is this")
    cache_salt: str = Field("", max_length=MAX_NS_STR, description="with model: the namespaces' cache_salt")

    @model_validator(mode="after")
    def _one_form(self) -> LookupRequest:
        if (self.namespace is None) == (self.model is None):
            raise ValueError("give either namespace or model")
        if self.cache_salt and self.model is None:
            raise ValueError("cache_salt goes with model (a namespace fingerprint includes its salt)")
        return self


class ReconfigureRequest(BaseModel):
    """Live changes; omitted fields stay as they are."""

    model_config = _STRICT
    eviction_policy: Literal[tuple(sorted(POLICIES))] | None = None
    l1_size_bytes: int | None = Field(None, gt=0, le=1 << 50, description="new L1 budget (rounded down to pages)")
    l1_size_gb: float | None = Field(None, gt=0, le=1 << 20, allow_inf_nan=False, description="same, in GiB")
    release_memory: bool = Field(True, description="on a shrink, return free pages' memory to the OS")
    log_level: Literal[LOG_LEVELS] | None = None
    tenant_quotas: str | None = Field(None, max_length=MAX_TABLE_CHARS,
                                      description='L1 tenant quota table (docs/tenants.md); "" removes it')
    l2_tenant_quotas: str | None = Field(None, max_length=MAX_TABLE_CHARS,
                                         description='L2 tenant quota table (docs/l2.md, "Tenants"); "" removes it')

    @model_validator(mode="after")
    def _something(self) -> ReconfigureRequest:
        if self.l1_size_bytes is not None and self.l1_size_gb is not None:
            raise ValueError("give l1_size_bytes or l1_size_gb, not both")
        if self.eviction_policy is None and self.log_level is None and self.l1_size_bytes is None \
                and self.l1_size_gb is None and self.tenant_quotas is None and self.l2_tenant_quotas is None:
            raise ValueError("nothing to change: give eviction_policy, l1_size_bytes/l1_size_gb, log_level, "
                             "tenant_quotas or l2_tenant_quotas")
        return self
