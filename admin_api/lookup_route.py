"""POST /cache/lookup: how much of a prompt this server holds, per namespace and tier, for routers that ask.

Read-only (Cache.peek: no policy touch, promotion, lease or lookup metric); a POST, so it needs the admin token
when one is set, like every POST. Token ids only: the server has no tokenizer. Plain requests only: a LoRA
adapter, images or prompt embeddings change the key chain in ways only the engine's connector can compute.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException
from kvtier.admin_api.auth import authorized
from kvtier.admin_api.deps import CacheDep, DaemonDep
from kvtier.admin_api.models import MAX_LOOKUP_TOKENS, LookupRequest
from kvtier.server.cache import Cache
from kvtier.server.keys import Namespace, chunk_keys
from kvtier.server.metrics import L1

router = APIRouter()


@router.post("/cache/lookup", dependencies=[Depends(authorized)],
             summary="a prompt's cached prefix per namespace and tier (read-only)")
async def lookup(body: LookupRequest, cache: CacheDep, daemon: DaemonDep) -> dict:
    refused = daemon.metrics.admin_lookups_refused
    if len(body.tokens) > MAX_LOOKUP_TOKENS:
        refused.labels("too_many_tokens").inc()
        raise HTTPException(413, f"{len(body.tokens)} tokens: a lookup takes at most {MAX_LOOKUP_TOKENS}")
    chosen = [(fp, ns) for fp, ns in cache.store.namespaces.items() if _chosen(body, fp, ns)]
    if not chosen:
        refused.labels("not_registered").inc()
        what = f"namespace {body.namespace.lower()}" if body.namespace is not None else \
            f"a namespace of model {body.model!r} with cache_salt {body.cache_salt!r}"
        raise HTTPException(404, f"{what} is not registered")
    return {"tokens": len(body.tokens), "namespaces": [_answer(cache, fp, ns, body.tokens) for fp, ns in chosen]}


def _chosen(body: LookupRequest, fp: bytes, ns: Namespace) -> bool:
    if body.namespace is not None:
        return fp == bytes.fromhex(body.namespace)
    return ns.model == body.model and ns.cache_salt == body.cache_salt


def _answer(cache: Cache, fp: bytes, ns: Namespace, tokens: list[int]) -> dict:
    peeked = cache.peek(fp, [list(c.block_keys) for c in chunk_keys(ns, tokens)])
    tiers = dict.fromkeys([L1, *(t.name for t in cache.tiers)], 0)
    for blocks, tier in zip(peeked.blocks, peeked.tiers, strict=True):
        tiers[tier] += blocks * ns.block_size
    return {"namespace": fp.hex(), "model": ns.model, "tp_rank": ns.tp_rank, "pp_rank": ns.pp_rank,
            "block_size": ns.block_size, "chunk_size": ns.chunk_size, "cached_tokens": sum(tiers.values()),
            "tiers": tiers, "pending": peeked.pending}
