"""What makes KV differ beyond token ids: the model's fingerprint (a namespace field) and a request's identity
(LoRA adapter, multimodal items at their positions, prompt embeddings: server/keys.py RequestIdentity).

Both are computed from files and request fields alone, so every process and node that holds the same
weights, adapter and inputs computes the same keys. A fact that cannot be established is never guessed: the
model's makes the connector a no-op (every request a counted miss), a request's makes that request skip
kvtier (a counted miss). docs/vllm.md ("What is in the key") lists every fact.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import blake3
import msgpack
from kvtier.server.keys import RequestIdentity, digest

# Skip reasons (counted per request by the scheduler, reported to the server's kvtier_identity_skips_total).
LORA_UNKNOWN = "lora_unknown"  # the adapter's files cannot be read, so its weights cannot be fingerprinted
MM_UNKNOWN = "mm_unknown"  # a multimodal item without a hash or position
EMBEDS_UNKNOWN = "prompt_embeds_unknown"  # prompt embeddings that cannot be read
SKIP_REASONS = (LORA_UNKNOWN, MM_UNKNOWN, EMBEDS_UNKNOWN)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLE_BYTES = 64 << 10  # bytes read at each sampled offset of a large weight file
FULL_HASH_LIMIT = 32 << 20  # files up to this size (configs, most LoRA adapters) are hashed whole
# hf_config keys that differ between nodes without changing the weights or the computation
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash")


class IdentityUnknown(ValueError):
    """A fact of the model's identity that cannot be established: set `kvtier.model_id`."""


def file_fingerprint(path: Path, hasher: Any) -> None:
    """Feed `path`'s name, size and contents into `hasher`: whole up to FULL_HASH_LIMIT, else its safetensors
    header (tensor names, dtypes, shapes, offsets) and fixed samples spread over the file. A fine-tuned
    checkpoint changes nearly every weight, so samples tell two with equal shapes apart at a read of a few
    hundred KiB per file."""
    size = path.stat().st_size
    hasher.update(msgpack.packb([path.name, size]))
    with path.open("rb") as f:
        if size <= FULL_HASH_LIMIT:
            while block := f.read(8 << 20):
                hasher.update(block)
            return
        head = f.read(8)
        header_len = int.from_bytes(head, "little") if path.suffix == ".safetensors" else 0
        hasher.update(head + f.read(min(header_len, 100 << 20)))
        for i in range(1, 8):
            f.seek(size * i // 8)
            hasher.update(f.read(SAMPLE_BYTES))
        f.seek(max(0, size - SAMPLE_BYTES))
        hasher.update(f.read(SAMPLE_BYTES))


def _weight_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    files = [p for p in root.iterdir() if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name.endswith(".json"))]
    if not any(p.suffix in WEIGHT_SUFFIXES for p in files):
        raise IdentityUnknown(f"no weight files in {root}")
    return sorted(files)


def local_model_path(model: str, revision: str | None) -> Path:
    """The directory (or single file) vLLM loads `model` from: a local path, or a hub id already in the local
    hub cache (never downloaded here)."""
    path = Path(model)
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as exc:  # not cached, no hub client, a bad id: nothing to fingerprint
        raise IdentityUnknown(f"model {model!r} is neither a local path nor in the local hub cache ({exc})") from exc


def canonical_config(hf_config: Any) -> bytes:
    """The model's config as vLLM uses it (overrides such as rope scaling applied), canonical JSON."""
    data = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    for key in _VOLATILE_CONFIG_KEYS:
        data.pop(key, None)
    return json.dumps(data, sort_keys=True, default=str).encode()


def model_fingerprint(vllm_config: Any, model_id: str = "") -> str:
    """A stable fingerprint of the weights and config vLLM runs; `model_id` (the operator's `kvtier.model_id`)
    stands for the weights instead. Raises IdentityUnknown when neither can be had."""
    model = vllm_config.model_config
    hasher = blake3.blake3(b"kvtier-model-v1\x00")
    hasher.update(canonical_config(model.hf_config))
    hasher.update(msgpack.packb([str(model.dtype), str(model.quantization or ""),
                                 json.dumps(getattr(model, "hf_overrides", None) or {}, sort_keys=True, default=str)]))
    if model_id:
        hasher.update(b"id\x00" + model_id.encode())
        return "id:" + hasher.hexdigest(length=16)
    for path in _weight_files(local_model_path(str(model.model), model.revision)):
        file_fingerprint(path, hasher)
    return "w:" + hasher.hexdigest(length=16)


class LoraFingerprints:
    """Weights fingerprint per adapter directory, recomputed when a file in it changes (size or mtime).
    `precision`: the engine's LoRA compute dtype (`--lora-dtype`), which changes the KV an adapter gives."""

    def __init__(self, precision: str = "") -> None:
        self._known: dict[tuple[str, tuple], bytes] = {}
        self._precision = precision

    def root(self, lora_request: Any) -> bytes | None:
        """The identity root of a LoRA request: a digest of the adapter's config and weights (not its name
        or int id: two names for the same files share KV, one name re-pointed at new files does not)."""
        # as vLLM resolves it: relative to the engine's working directory, "~" expanded (a hub id is not read)
        path = Path(str(getattr(lora_request, "lora_path", "") or "")).expanduser()
        try:
            files = _weight_files(path) if str(path) not in ("", ".") else []
            stamp = tuple((p.name, st.st_size, st.st_mtime_ns) for p in files for st in (p.stat(),))
        except (OSError, IdentityUnknown):
            return None
        if not files:
            return None
        key = (str(path), stamp)
        root = self._known.get(key)
        if root is None:
            hasher = blake3.blake3(b"kvtier-lora-v1\x00" + self._precision.encode() + b"\x00")
            try:
                for p in files:
                    file_fingerprint(p, hasher)
            except OSError:
                return None
            root = self._known[key] = hasher.digest(length=16)
        return root


def mm_block_digests(features: Iterable[Any], block_size: int, num_blocks: int) -> dict[int, bytes] | None:
    """Per engine block the multimodal items overlapping it, as (item hash, offset from the block's start)
    like vLLM's own block hashes; None when an item has no hash or position."""
    per_block: dict[int, list[list[Any]]] = {}
    for feature in features:
        identifier = getattr(feature, "identifier", None)
        position = getattr(feature, "mm_position", None)
        offset, length = getattr(position, "offset", None), getattr(position, "length", None)
        if not isinstance(identifier, str) or not identifier or not isinstance(offset, int) \
                or not isinstance(length, int) or offset < 0 or length <= 0:
            return None
        for b in range(offset // block_size, min(num_blocks, (offset + length - 1) // block_size + 1)):
            per_block.setdefault(b, []).append([identifier, offset - b * block_size])
    return {b: digest(msgpack.packb(items)) for b, items in per_block.items()}


def embeds_block_digests(embeds: Any, mask: Any, block_size: int, num_blocks: int) -> dict[int, bytes] | None:
    """Per engine block a digest of its prompt-embedding rows (and of which positions are token ids in a mixed
    prompt); None when they cannot be read."""
    try:
        import torch

        rows = embeds.detach().to("cpu").contiguous()
        raw = rows.view(torch.uint8).reshape(rows.shape[0], -1).numpy()
        flags = bytes(bool(x) for x in mask) if mask is not None else None
    except Exception:  # an unexpected type or device: the request is skipped, never keyed by token ids alone
        return None
    out = {}
    for b in range(min(num_blocks, -(-raw.shape[0] // block_size))):
        hasher = blake3.blake3(raw[b * block_size:(b + 1) * block_size].tobytes())
        if flags is not None:
            hasher.update(flags[b * block_size:(b + 1) * block_size])
        out[b] = hasher.digest(length=16)
    return out


def request_identity(request: Any, block_size: int, prompt: Sequence[int],
                     loras: LoraFingerprints) -> RequestIdentity | str:
    """The identity of a vLLM `Request` for its prompt's whole blocks, or the reason it cannot be had."""
    root = b""
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        lora_root = loras.root(lora)
        if lora_root is None:
            return LORA_UNKNOWN
        root = b"lora\x00" + lora_root
    num_blocks = len(prompt) // block_size
    blocks: dict[int, list[bytes]] = {}
    features = getattr(request, "mm_features", None)
    if features:
        mm = mm_block_digests(features, block_size, num_blocks)
        if mm is None:
            return MM_UNKNOWN
        for b, d in mm.items():
            blocks.setdefault(b, []).append(b"mm" + d)
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        rows = embeds_block_digests(embeds, getattr(request, "prompt_is_token_ids", None), block_size, num_blocks)
        if rows is None:
            return EMBEDS_UNKNOWN
        for b, d in rows.items():
            blocks.setdefault(b, []).append(b"pe" + d)
    if not root and not blocks:
        return RequestIdentity()
    return RequestIdentity(digest(root) if root else b"",
                           tuple((b, digest(b"".join(parts))) for b, parts in sorted(blocks.items())))

