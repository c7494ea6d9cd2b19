"""Request identity in the chunk keys (server/keys.py): every fact that changes KV for the same token ids
changes the keys from the first block it touches on, and nothing else does."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from kvtier.server.keys import PAYLOAD_FORMAT, PLAIN, Namespace, RequestIdentity, chunk_keys, digest

pytestmark = pytest.mark.unit

NS = Namespace(model="m", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=8, block_size=16,
               layout="paged", chunk_size=64)
TOKENS = np.arange(100, 100 + 5 * 64)  # 5 chunks of 4 blocks
IMAGE_A, IMAGE_B = digest(b"image a"), digest(b"image b")


def keys(identity: RequestIdentity = PLAIN, tokens=TOKENS, ns: Namespace = NS) -> list[bytes]:
    return [k for c in chunk_keys(ns, tokens, identity) for k in c.block_keys]


def first_difference(a: list[bytes], b: list[bytes]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def test_a_plain_identity_keeps_the_token_keys():
    assert keys(RequestIdentity()) == [k for c in chunk_keys(NS, TOKENS) for k in c.block_keys]


def test_a_root_changes_every_key():
    lora_a, lora_b = RequestIdentity(root=digest(b"adapter a")), RequestIdentity(root=digest(b"adapter b"))
    plain, a, b = keys(), keys(lora_a), keys(lora_b)
    assert not set(plain) & set(a) and not set(a) & set(b) and not set(plain) & set(b)
    assert keys(RequestIdentity(root=digest(b"adapter a"))) == a  # deterministic


@pytest.mark.parametrize("block", [0, 3, 4, 9, 19])
def test_a_block_extra_changes_the_keys_from_that_block_on(block: int):
    plain = keys()
    with_a = keys(RequestIdentity(blocks=((block, IMAGE_A),)))
    with_b = keys(RequestIdentity(blocks=((block, IMAGE_B),)))
    assert first_difference(plain, with_a) == block
    assert first_difference(with_a, with_b) == block
    assert not set(plain[block:]) & set(with_a[block:])


def test_the_same_item_at_another_block_is_another_key():
    assert first_difference(keys(RequestIdentity(blocks=((2, IMAGE_A),))),
                            keys(RequestIdentity(blocks=((3, IMAGE_A),)))) == 2


def test_extras_cannot_be_forged_with_token_ids():
    """The extra follows the marker word 0xFFFFFFFF, which no token id may take: a prompt whose next tokens
    spell the marker and the digest is refused, so the hashed stream decodes one way only."""
    identity = RequestIdentity(blocks=((0, IMAGE_A),))
    forged = np.concatenate([TOKENS[:16], [0xFFFFFFFF], np.frombuffer(IMAGE_A, "<u4"), TOKENS[21:]])
    with pytest.raises(ValueError, match="reserved"):
        chunk_keys(NS, forged)
    assert keys(identity)[0] != keys(tokens=np.concatenate([TOKENS[:16], TOKENS[16:]]))[0]


@pytest.mark.parametrize("change", [
    {"pp_size": 2, "pp_rank": 1}, {"pp_size": 2, "pp_rank": 0}, {"model_fingerprint": "w:1"},
    {"payload_format": PAYLOAD_FORMAT + 1}, {"dtype": "fp8_e4m3"}, {"dtype": "nvfp4"}, {"tp_size": 2},
    {"cache_salt": "tenant"}, {"revision": "abc"},
])
def test_every_namespace_fact_changes_every_key(change: dict):
    other = dataclasses.replace(NS, **change)
    assert other.fingerprint() != NS.fingerprint()
    assert not set(keys(ns=other)) & set(keys())


def test_namespace_refuses_a_stage_outside_the_pipeline():
    with pytest.raises(ValueError, match="pp_rank"):
        dataclasses.replace(NS, pp_size=2, pp_rank=2)
    assert Namespace.from_dict({**NS.to_dict(), "pp_size": 4, "pp_rank": 3}).pp_rank == 3
    with pytest.raises(ValueError):
        Namespace.from_dict({**NS.to_dict(), "model_fingerprint": 7})
