"""Chunk keys: deterministic across processes, prefix-chained, namespace-sensitive, block-granular."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import blake3
import numpy as np
import pytest
from kvtier.server.keys import KEY_BYTES, Namespace, chunk_keys, digest

pytestmark = pytest.mark.unit

NS = Namespace(
    model="org/model", dtype="bfloat16", num_layers=4, kv_heads=2, head_size=64, block_size=16,
    layout="NHD", chunk_size=256, tp_size=2, tp_rank=0,
)
CPU_NS = dataclasses.replace(NS, block_size=128)


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**32 - 1, size=n, dtype=np.uint64).astype(np.int64)


def _all_keys(chunks) -> list[bytes]:
    return [k for c in chunks for k in c.block_keys]


def test_keys_are_deterministic_across_processes():
    tokens = _tokens(1000, seed=7)
    script = (
        "import json, sys\n"
        "from kvtier.server.keys import Namespace, chunk_keys\n"
        "ns = Namespace(**json.loads(sys.argv[1]))\n"
        "toks = json.loads(sys.argv[2])\n"
        "print(json.dumps([[k.hex() for k in c.block_keys] for c in chunk_keys(ns, toks)]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(NS.to_dict()), json.dumps(tokens.tolist())],
        capture_output=True, text=True, check=True, timeout=60,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
    )
    theirs = json.loads(out.stdout)
    ours = [[k.hex() for k in c.block_keys] for c in chunk_keys(NS, tokens)]
    assert len(ours) == 4
    assert theirs == ours
    # And the fingerprint too (it seeds the chain).
    fp = subprocess.run(
        [sys.executable, "-c",
         "import json,sys; from kvtier.server.keys import Namespace; "
         "print(Namespace(**json.loads(sys.argv[1])).fingerprint().hex())", json.dumps(NS.to_dict())],
        capture_output=True, text=True, check=True, timeout=60, env={"PYTHONHASHSEED": "999", "PATH": "/usr/bin:/bin"},
    )
    assert fp.stdout.strip() == NS.fingerprint().hex()


def test_key_chain_matches_the_documented_definition():
    tokens = _tokens(600, seed=3)
    chunks = chunk_keys(NS, tokens)
    prev = digest(NS.fingerprint())
    data = tokens.astype("<u4").tobytes()
    for c in chunks:
        for j, key in enumerate(c.block_keys, start=1):
            end = c.start_token + j * NS.block_size
            expect = blake3.blake3(prev + data[c.start_token * 4 : end * 4]).digest(length=KEY_BYTES)
            assert key == expect
        prev = c.key
    assert all(len(k) == KEY_BYTES for k in _all_keys(chunks))


@pytest.mark.parametrize("position", [0, 255, 256, 700, 1023])
def test_changing_a_token_changes_its_chunk_and_all_later_ones(position):
    tokens = _tokens(1024, seed=1)
    base = chunk_keys(NS, tokens)
    changed = tokens.copy()
    changed[position] = (changed[position] + 1) % 2**32
    other = chunk_keys(NS, changed)
    k = position // NS.chunk_size
    block_in_chunk = (position % NS.chunk_size) // NS.block_size
    assert len(base) == len(other) == 4
    for i in range(4):
        if i < k:
            assert base[i].block_keys == other[i].block_keys
        elif i == k:
            # Leading blocks before the changed one are shared (aliases); the rest differ.
            for j in range(NS.blocks_per_chunk):
                same = base[i].block_keys[j] == other[i].block_keys[j]
                assert same == (j < block_in_chunk)
        else:
            assert not set(base[i].block_keys) & set(other[i].block_keys)


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": "float16"},
        {"tp_rank": 1},
        {"tp_size": 4},
        {"block_size": 32},
        {"model": "org/other-model"},
        {"cache_salt": "tenant-a"},
        {"revision": "abc123"},
        {"num_layers": 5},
        {"kv_heads": 4},
        {"head_size": 128},
        {"layout": "HND"},
        {"chunk_size": 512},
    ],
)
def test_every_namespace_field_changes_fingerprint_and_keys(change):
    other = dataclasses.replace(NS, **change)
    assert other.fingerprint() != NS.fingerprint()
    tokens = _tokens(512, seed=2)
    assert not set(_all_keys(chunk_keys(NS, tokens))) & set(_all_keys(chunk_keys(other, tokens)))


def test_equal_namespaces_have_equal_fingerprints():
    assert Namespace.from_dict(NS.to_dict()).fingerprint() == NS.fingerprint()
    assert dataclasses.replace(NS).fingerprint() == NS.fingerprint()


def test_partial_last_chunk_at_block_granularity():
    tokens = _tokens(1020, seed=4)
    chunks = chunk_keys(CPU_NS, tokens)
    assert [len(c.block_keys) for c in chunks] == [2, 2, 2, 1]
    assert [c.start_token for c in chunks] == [0, 256, 512, 768]
    assert chunks[-1].num_blocks == 2 and not chunks[-1].full
    assert all(c.full for c in chunks[:-1])
    # 7 whole blocks of 128 are reloadable (896 tokens); the 124 trailing tokens are not keyed.
    assert sum(len(c.block_keys) for c in chunks) * CPU_NS.block_size == 896
    # The trailing partial block does not affect any key.
    tail = tokens.copy()
    tail[900:] = 0
    assert _all_keys(chunk_keys(CPU_NS, tail)) == _all_keys(chunks)
    # Fewer tokens than one block: nothing to key.
    assert chunk_keys(CPU_NS, tokens[:127]) == []


def test_aliases_are_the_keys_of_shorter_prompts():
    tokens = _tokens(1024, seed=5)
    full = chunk_keys(NS, tokens)
    for cut in range(NS.block_size, 1024 + 1, NS.block_size * 3):
        shorter = chunk_keys(NS, tokens[:cut])
        last = shorter[-1]
        # Every chunk of the shorter prompt is a prefix of the same chunk of the full one.
        for s in shorter:
            f = full[s.index]
            assert f.block_keys[: len(s.block_keys)] == s.block_keys
        # The shorter prompt's last key is an alias (or the key) of the full prompt's chunk.
        f = full[last.index]
        if last.full:
            assert last.key == f.key
        else:
            assert last.key in f.aliases
            assert f.aliases == f.block_keys[:-1]
            assert last.aliases == f.block_keys[: len(last.block_keys) - 1]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"chunk_size": 0},
        {"block_size": -16},
        {"chunk_size": 100},  # not a multiple of 16
        {"tp_rank": 2},
        {"tp_rank": -1},
    ],
)
def test_invalid_namespaces_raise(kwargs):
    with pytest.raises(ValueError):
        dataclasses.replace(NS, **kwargs)


def test_from_dict_rejects_unknown_fields_and_non_maps():
    with pytest.raises(ValueError):
        Namespace.from_dict({**NS.to_dict(), "extra": 1})
    with pytest.raises(ValueError):
        Namespace.from_dict([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "tokens",
    [
        [-1, 2, 3],
        [2**32] + [0] * 20,
        np.zeros((2, 16), dtype=np.int64),
    ],
)
def test_invalid_tokens_raise(tokens):
    with pytest.raises(ValueError):
        chunk_keys(NS, tokens)
