"""The admin API's request bodies: strict pydantic models (unknown fields and type coercion refused)."""

from __future__ import annotations

from typing import Annotated, Literal

from kvtier.server.eviction import POLICIES
from kvtier.server.keys import MAX_NS_STR
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

MAX_KEYS = 65536
MAX_TOKENS = 1 << 20
# The most token ids one /cache/lookup may carry (a 413 beyond): its key chain is hashed on the serving loop.
MAX_LOOKUP_TOKENS = 1 << 17
LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_TABLE_TEXT = 65 * 300  # a quota table: at most MAX_TENANTS names and `*`, each NAME=GUARANTEED:MAXIMUM

HexKey = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{32}$")]
TierName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,31}$")]  # l1, l2, remote, a plug-in's
TokenId = Annotated[int, Field(ge=0, lt=0xFFFFFFFF)]  # 0xFFFFFFFF is reserved by the key chain (keys.py)
_STRICT = ConfigDict(extra="forbid", strict=True)


class ClearRequest(BaseModel):
    """Remove every chunk (`all`), those of one namespace, or those of one tier."""

    model_config = _STRICT
    scope: Literal["all", "namespace", "tier"]
    namespace: HexKey | None = Field(None, description="namespace fingerprint (hex), for scope=namespace")
    tier: TierName | None = Field(None, description="tier name (l1, l2, remote, a plug-in tier), for scope=tier")

    @model_validator(mode="after")
    def _consistent(self) -> ClearRequest:
        if (self.scope == "namespace") != (self.namespace is not None):
            raise ValueError("namespace is required with scope=namespace and not allowed otherwise")
        if (self.scope == "tier") != (self.tier is not None):
            raise ValueError("tier is required with scope=tier and not allowed otherwise")
        return self


class PinRequest(BaseModel):
    """Chunks to (un)pin: by chunk keys, or by namespace + token ids (every full and partial chunk of the prefix)."""

    model_config = _STRICT
    keys: list[HexKey] | None = Field(None, max_length=MAX_KEYS, description="chunk or block-prefix keys (hex)")
    namespace: HexKey | None = Field(None, description="namespace fingerprint (hex)")
    token_ids: list[TokenId] | None = Field(None, max_length=MAX_TOKENS, description="the prefix's token ids")

    @model_validator(mode="after")
    def _one_form(self) -> PinRequest:
        by_keys = self.keys is not None
        by_tokens = self.namespace is not None or self.token_ids is not None
        if by_keys == by_tokens:
            raise ValueError("give either keys, or namespace and token_ids")
        if by_tokens and (self.namespace is None or self.token_ids is None):
            raise ValueError("namespace and token_ids go together")
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
    l2_tenant_quotas: str | None = Field(None, max_length=MAX_TABLE_TEXT, description="the L2 tenant quota table "
                                         "(NAME=GUARANTEED[:MAXIMUM],...; empty: none; docs/l2.md, Tenants)")

    @model_validator(mode="after")
    def _something(self) -> ReconfigureRequest:
        if self.l1_size_bytes is not None and self.l1_size_gb is not None:
            raise ValueError("give l1_size_bytes or l1_size_gb, not both")
        if self.eviction_policy is None and self.log_level is None and self.l1_size_bytes is None \
                and self.l1_size_gb is None and self.l2_tenant_quotas is None:
            raise ValueError("nothing to change: give eviction_policy, l1_size_bytes/l1_size_gb, log_level or "
                             "l2_tenant_quotas")
        return self
