"""The vLLM connector's identity facts (connector/vllm/identity.py, namespace.py, policy.py): each fact that
makes KV differ changes the keys or the namespace, each fact that cannot be established makes the request (or
the connector) skip, and the failure policy and unsupported layers are settled at start.

Needs torch and vLLM: the dev venv skips it; tests/e2e/test_torch_unit_tests.py runs it in vLLM's venv.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvtier.connector.vllm import identity as ident  # noqa: E402
from kvtier.connector.vllm.namespace import namespace_for, page_bytes  # noqa: E402
from kvtier.connector.vllm.policy import recompute_failed_loads, unsupported_layers  # noqa: E402
from kvtier.server import protocol as p  # noqa: E402
from kvtier.server.keys import Namespace, RequestIdentity, chunk_keys  # noqa: E402

pytestmark = pytest.mark.unit

BS = 16
PROMPT = list(range(1000, 1000 + 8 * BS))
NS = Namespace(model="m", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=8, block_size=BS,
               layout="paged", chunk_size=64)


def keys(identity: RequestIdentity) -> list[bytes]:
    return [k for c in chunk_keys(NS, PROMPT, identity) for k in c.block_keys]


def write_weights(d: Path, seed: int, config: dict | None = None, size: int = 4096) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config or {"hidden_size": 8}))
    (d / "model.safetensors").write_bytes(np.random.default_rng(seed).bytes(size))
    return d


def request(**fields) -> SimpleNamespace:
    base = {"lora_request": None, "mm_features": None, "prompt_embeds": None, "prompt_is_token_ids": None}
    return SimpleNamespace(**{**base, **fields})


def lora(path: Path, name: str = "a") -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=str(path))


def feature(identifier: str | None, offset: int, length: int) -> SimpleNamespace:
    return SimpleNamespace(identifier=identifier, modality="image",
                           mm_position=SimpleNamespace(offset=offset, length=length))


def identity_of(req: SimpleNamespace, loras: ident.LoraFingerprints | None = None) -> RequestIdentity | str:
    return ident.request_identity(req, BS, PROMPT, loras or ident.LoraFingerprints())


# -- request identity ---------------------------------------------------------------------------------------


def test_a_plain_request_has_the_plain_identity():
    assert identity_of(request()) == RequestIdentity()


def test_lora_weights_not_names_make_the_identity(tmp_path: Path):
    a, b = write_weights(tmp_path / "a", 1), write_weights(tmp_path / "b", 2)
    loras = ident.LoraFingerprints()
    id_a, id_b = identity_of(request(lora_request=lora(a)), loras), identity_of(request(lora_request=lora(b)), loras)
    assert isinstance(id_a, RequestIdentity) and id_a.root and id_a != id_b
    assert not set(keys(id_a)) & set(keys(RequestIdentity())) and not set(keys(id_a)) & set(keys(id_b))
    # another name for the same files shares KV; the same name re-pointed at new weights does not
    assert identity_of(request(lora_request=lora(a, name="other")), loras) == id_a
    # the engine's LoRA precision (--lora-dtype) changes the KV an adapter gives
    assert identity_of(request(lora_request=lora(a)), ident.LoraFingerprints("torch.float32")) != id_a
    (a / "model.safetensors").write_bytes(np.random.default_rng(3).bytes(4096))  # same size, new weights
    assert identity_of(request(lora_request=lora(a)), loras) != id_a


@pytest.mark.parametrize("path", ["", "/nonexistent/adapter", "some-hub/adapter-id"])
def test_an_adapter_that_cannot_be_read_makes_the_request_skip(path: str):
    assert identity_of(request(lora_request=SimpleNamespace(lora_name="x", lora_int_id=1, lora_path=path))) \
        == p.SKIP_LORA


def test_images_change_the_keys_from_their_first_block(tmp_path: Path):
    at_40 = identity_of(request(mm_features=[feature("img-a", 40, 30)]))
    other = identity_of(request(mm_features=[feature("img-b", 40, 30)]))
    moved = identity_of(request(mm_features=[feature("img-a", 41, 30)]))
    plain = keys(RequestIdentity())
    assert isinstance(at_40, RequestIdentity) and [b for b, _ in at_40.blocks] == [2, 3, 4]  # tokens 40..69
    assert keys(at_40)[:2] == plain[:2] and keys(at_40)[2] != plain[2]
    assert keys(other)[:2] == plain[:2] and keys(other)[2] != keys(at_40)[2]
    assert keys(moved)[2] != keys(at_40)[2]
    assert identity_of(request(mm_features=[feature("img-a", 40, 30)])) == at_40  # deterministic


@pytest.mark.parametrize("bad", [feature(None, 0, 10), feature("", 0, 10), feature("x", -1, 10),
                                 SimpleNamespace(identifier="x", mm_position=None)])
def test_an_item_without_hash_or_position_makes_the_request_skip(bad):
    assert identity_of(request(mm_features=[feature("ok", 0, 4), bad])) == p.SKIP_MM


def test_prompt_embeddings_change_the_keys_of_their_blocks():
    rows = torch.randn(len(PROMPT), 8, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    changed = rows.clone()
    changed[5 * BS + 3] += 1
    a, b = identity_of(request(prompt_embeds=rows)), identity_of(request(prompt_embeds=changed))
    assert isinstance(a, RequestIdentity) and len(a.blocks) == len(PROMPT) // BS
    assert keys(a)[:5] == keys(b)[:5] and keys(a)[5] != keys(b)[5]
    mixed = identity_of(request(prompt_embeds=rows, prompt_is_token_ids=[True] * BS + [False] * (len(PROMPT) - BS)))
    assert keys(mixed)[0] != keys(a)[0]
    assert identity_of(request(prompt_embeds="not a tensor")) == p.SKIP_EMBEDS


# -- the model's identity -----------------------------------------------------------------------------------


def config(model: Path | str, **model_fields) -> SimpleNamespace:
    hf = SimpleNamespace(to_dict=lambda: {"hidden_size": 8, "rope_scaling": model_fields.pop("rope", None),
                                          "_name_or_path": str(model), "transformers_version": "x"})
    fields = {"model": str(model), "revision": None, "dtype": torch.bfloat16, "quantization": None,
              "hf_overrides": None, "hf_config": hf, **model_fields}
    return SimpleNamespace(model_config=SimpleNamespace(**fields))


def test_the_model_fingerprint_follows_weights_and_config(tmp_path: Path):
    a = write_weights(tmp_path / "a", 1)
    first = ident.model_fingerprint(config(a))
    assert first == ident.model_fingerprint(config(a)) and first.startswith("w:")
    # a copy of the same files elsewhere is the same model (shared across nodes and paths)
    assert ident.model_fingerprint(config(write_weights(tmp_path / "copy", 1))) == first
    assert ident.model_fingerprint(config(a, rope={"type": "linear", "factor": 2.0})) != first
    assert ident.model_fingerprint(config(a, quantization="fp8")) != first
    assert ident.model_fingerprint(config(a, dtype=torch.float16)) != first
    write_weights(a, 2)  # a rolling update: new weights under the same path
    assert ident.model_fingerprint(config(a)) != first


def test_large_weight_files_are_sampled(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(ident, "FULL_HASH_LIMIT", 1024)
    a = write_weights(tmp_path / "a", 1, size=1 << 20)
    first = ident.model_fingerprint(config(a))
    data = bytearray((a / "model.safetensors").read_bytes())
    data[len(data) // 2 + 10] ^= 1  # a fine-tune changes weights everywhere, so a sample sees it
    (a / "model.safetensors").write_bytes(bytes(data))
    assert ident.model_fingerprint(config(a)) != first


def test_a_model_without_files_needs_a_model_id(tmp_path: Path):
    with pytest.raises(ident.IdentityUnknown):
        ident.model_fingerprint(config("no-such-org/no-such-model"))
    with pytest.raises(ident.IdentityUnknown):
        ident.model_fingerprint(config(tmp_path))  # a directory without weights
    named = ident.model_fingerprint(config("no-such-org/no-such-model"), model_id="llama-3-8b@2024-06")
    assert named.startswith("id:") and named != ident.model_fingerprint(config("x"), model_id="other")


def vllm_config(cache_dtype: str = "auto", pp: int = 1) -> SimpleNamespace:
    model = SimpleNamespace(model="/m", revision=None, dtype=torch.bfloat16, get_num_layers=lambda _: 4,
                            get_num_kv_heads=lambda _: 2, get_head_size=lambda: 64)
    return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=BS),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=pp))


def test_namespace_carries_stage_weights_dtype_and_page_bytes():
    base = namespace_for(vllm_config(), 64, 0, model_fingerprint="w:1")
    assert base.dtype == "bfloat16" and base.layout.endswith(f"-p{2 * 2 * 64 * BS * 2}")
    assert namespace_for(vllm_config(pp=2), 64, 0, pp_rank=1, model_fingerprint="w:1").fingerprint() \
        != namespace_for(vllm_config(pp=2), 64, 0, pp_rank=0, model_fingerprint="w:1").fingerprint()
    assert namespace_for(vllm_config(), 64, 0, model_fingerprint="w:2").fingerprint() != base.fingerprint()
    assert namespace_for(vllm_config("fp8_e4m3"), 64, 0, model_fingerprint="w:1").dtype == "fp8_e4m3"


def test_page_bytes_come_from_vllms_spec_for_any_dtype():
    spec = SimpleNamespace(page_size_bytes=12345)
    kv = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["a"])])
    assert page_bytes(vllm_config("nvfp4"), kv) == 12345
    with pytest.raises(ident.IdentityUnknown):
        page_bytes(vllm_config("nvfp4"))  # no spec and no element size: never a guess


# -- the engine's policy and layers ---------------------------------------------------------------------------


def test_a_fail_policy_is_switched_to_recompute_with_a_warning(caplog):
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both")
    assert config.kv_load_failure_policy == "fail"  # vLLM 0.32's default
    vc = SimpleNamespace(kv_transfer_config=config)
    with caplog.at_level(logging.WARNING, logger="kvtier.connector"):
        assert recompute_failed_loads(vc)
    assert config.kv_load_failure_policy == "recompute"
    assert '"kv_load_failure_policy": "recompute"' in caplog.text
    assert not recompute_failed_loads(vc)


def test_only_full_attention_kv_is_accepted():
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128)
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.bfloat16,))

    def cfg(*specs):
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])

    assert unsupported_layers(cfg(full)) == []
    assert unsupported_layers(cfg(full, window)) == ["1 layers of SlidingWindowSpec"]
    assert unsupported_layers(cfg(full, mamba)) == ["1 layers of MambaSpec"]
