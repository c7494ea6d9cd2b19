"""Write a random PEFT-format LoRA adapter for the tiny Llama of ``tiny_model.py`` (no ``peft`` needed).

Stdlib only (the safetensors file is written by hand), so it runs with any Python: the vLLM venv's or
the project's, which has no torch. The adapter targets ``q_proj``, ``k_proj`` and ``v_proj`` of every
layer, so its KV differs from the base model's for the same tokens; its weights are random but
deterministic from ``seed`` and large enough (``scale``, the std of every A and B entry) that greedy
output clearly differs from the base model's:

    python tests/e2e/lora_adapter.py --out DIR --seed N [--rank 8] [--alpha 16] [--scale 0.1]

prints the adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``). Serve it with
``vllm serve ... --enable-lora --max-lora-rank 8 --lora-modules NAME=DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys
import tempfile
from pathlib import Path

# tests/e2e/tiny_model.py's architecture.
HIDDEN = 256
NUM_LAYERS = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 64
TARGETS = {  # module -> output features
    "q_proj": NUM_HEADS * HEAD_DIM,
    "k_proj": NUM_KV_HEADS * HEAD_DIM,
    "v_proj": NUM_KV_HEADS * HEAD_DIM,
}
DEFAULT_SCALE = 0.1


def adapter_config(rank: int, alpha: int, base_model: str = "") -> dict:
    """The adapter_config.json PEFT writes for a plain LoRA on q/k/v (the fields vLLM's PEFTHelper reads)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def _tensors(seed: int, rank: int, scale: float) -> dict[str, tuple[list[int], list[float]]]:
    """name -> (shape, row-major float32 values), in PEFT's naming (lora_A: (r, in), lora_B: (out, r))."""
    rng = random.Random(seed)
    out: dict[str, tuple[list[int], list[float]]] = {}
    for layer in range(NUM_LAYERS):
        for module, out_features in sorted(TARGETS.items()):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = [rng.gauss(0.0, scale) for _ in range(rank * HIDDEN)]
            b = [rng.gauss(0.0, scale) for _ in range(out_features * rank)]
            out[f"{prefix}.lora_A.weight"] = ([rank, HIDDEN], a)
            out[f"{prefix}.lora_B.weight"] = ([out_features, rank], b)
    return out


def _write_safetensors(path: Path, tensors: dict[str, tuple[list[int], list[float]]]) -> None:
    """A safetensors file of float32 tensors: u64 header length, JSON header, then the raw data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        shape, values = tensors[name]
        blob = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def write_adapter(
    out_dir: str | os.PathLike,
    seed: int,
    rank: int = 8,
    alpha: int = 16,
    scale: float = DEFAULT_SCALE,
    base_model: str = "",
) -> Path:
    """Write the adapter into ``out_dir`` (created; existing files replaced) and return its absolute path.

    Same arguments, same bytes. ``scale`` is the std of every A and B entry: with the defaults
    (rank 8, alpha 16, so PEFT's scaling alpha/r = 2) the q/k/v deltas are about 3x the base
    projections' outputs, so greedy output differs clearly from the base model's.
    """
    out = Path(out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "adapter_config.json": lambda p: p.write_text(json.dumps(adapter_config(rank, alpha, base_model), indent=2)),
        "adapter_model.safetensors": lambda p: _write_safetensors(p, _tensors(seed, rank, scale)),
    }
    for name, write in files.items():
        fd, tmp = tempfile.mkstemp(prefix=name + ".tmp-", dir=out)
        os.close(fd)
        try:
            write(Path(tmp))
            os.chmod(tmp, 0o644)
            os.replace(tmp, out / name)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="adapter directory (created)")
    ap.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank r (default 8)")
    ap.add_argument("--alpha", type=int, default=16, help="lora_alpha (default 16)")
    ap.add_argument("--scale", type=float, default=DEFAULT_SCALE, help=f"std of A and B (default {DEFAULT_SCALE})")
    ap.add_argument("--base-model", default="", help="base_model_name_or_path to record (informational)")
    args = ap.parse_args(argv)
    print(write_adapter(args.out, args.seed, args.rank, args.alpha, args.scale, args.base_model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
