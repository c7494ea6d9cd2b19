"""Build a tiny random vision-language model (Idefics3) for end-to-end tests (no model hub needed).

Run inside the vLLM venv (it has torch, transformers, tokenizers and PIL):

    python tests/e2e/tiny_vlm.py [--seed N] [--out DIR] [--force] [--check]

prints the model directory as its last stdout line.  Default directory: ``$KVTIER_CACHE_DIR/tiny-vlm``
(seed 0) or ``$KVTIER_CACHE_DIR/tiny-vlm-s<N>``; ``$KVTIER_CACHE_DIR`` defaults to ``~/.cache/kvtier``.
As with tests/e2e/tiny_model.py, a directory is reused only when its stamp file matches the build
parameters, and a build goes into a temporary sibling that is renamed when complete.

Why Idefics3 and not LLaVA: vLLM 0.32's ``llava.py`` imports ``pixtral.py``, which imports transformers'
Pixtral image processor, which needs torchvision; torchvision does not import beside the CPU torch of the
vLLM venv, so no LLaVA model can be inspected there.  ``Idefics3ForConditionalGeneration`` imports cleanly,
runs with the PIL ("slow") image processor, is causal (vLLM runs PaliGemma as a prefix-LM, bidirectional over
the image, which its CPU attention backend does not offer) and places the image where ``<image>`` stands in
the text.

The model: a tiny Idefics3 vision transformer (56 px images, 7 px patches: 8x8 = 64 patches,
``scale_factor`` 1, no image splitting) + a linear projector + the tiny Llama of tiny_model.py (256
hidden, 4 layers), bf16, 9 MB of weights, built in 3-12 s.  Each image becomes
``<fake_token_around_image><global-img>`` + 64 x ``<image>`` + ``<fake_token_around_image>``: **67
placeholder tokens**, the same ids for every image;
vLLM's placeholder range (``mm_position``) covers all 67, with an ``is_embed`` mask on the 64 ``<image>``
positions.  The tokenizer is tiny_model.py's (4,096 ids) plus the four special tokens above.

Random weights hardly look at the image: the projector is initialised with a large std
(``PROJECTOR_STD``) so that two different images give different greedy continuations (``--check``
verifies it with transformers; the end-to-end test checks it again with vLLM).

Module level is stdlib-only so that tests running in the project venv can import the constants,
``sample_text`` and ``png_bytes`` (numpy, imported when called).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_model  # noqa: E402  (stdlib-only at module level; builds the tokenizer)

FORMAT_VERSION = 1
STAMP = ".kvtier-tiny-vlm.json"
IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
SPECIAL_TOKENS = [FAKE_IMAGE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE, GLOBAL_IMAGE_TOKEN]
VOCAB_SIZE = tiny_model.VOCAB_SIZE + len(SPECIAL_TOKENS)
IMAGE_TOKEN_ID = tiny_model.VOCAB_SIZE + SPECIAL_TOKENS.index(IMAGE_TOKEN)  # 4097
IMAGE_SIZE = 56
PATCH_SIZE = 7
SCALE_FACTOR = 1
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # 64 <image> tokens per image
PLACEHOLDER_TOKENS = IMAGE_TOKENS + 3  # + <fake><global-img> before and <fake> after
PROJECTOR_STD = 1.0  # init std of the projector (transformers' default is 0.02)
CHAT_TEMPLATE = tiny_model.CHAT_TEMPLATE


def default_dir(seed: int = 0) -> Path:
    return tiny_model.cache_dir() / ("tiny-vlm" if seed == 0 else f"tiny-vlm-s{seed}")


def _params(seed: int) -> dict:
    text = tiny_model._params(seed)
    return {
        "format": FORMAT_VERSION,
        "seed": seed,
        "architecture": "Idefics3ForConditionalGeneration",
        "text": {k: v for k, v in text.items() if k not in ("format", "seed")} | {"vocab_size": VOCAB_SIZE},
        "tokenizer_format": text["format"],
        "special_tokens": SPECIAL_TOKENS,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
        "scale_factor": SCALE_FACTOR,
        "vision_hidden_size": 64,
        "vision_intermediate_size": 128,
        "vision_layers": 2,
        "vision_heads": 2,
        "projector_std": PROJECTOR_STD,
    }


def is_complete(out: Path, seed: int) -> bool:
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return False
    needed = ("config.json", "tokenizer.json", "tokenizer_config.json", "processor_config.json")
    has_weights = any(out.glob("*.safetensors"))
    return stamp == _params(seed) and has_weights and all((out / f).is_file() for f in needed)


def sample_text(n_words: int, seed: int) -> str:
    """Deterministic filler text in the tiny tokenizer's language (about 1.3 tokens per word)."""
    rng = random.Random(seed)
    words = " ".join(tiny_model._corpus(0, lines=1000)).split()
    return " ".join(rng.choice(words) for _ in range(n_words))


def _build(seed: int, tmp: Path) -> None:
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    p = _params(seed)
    t = p["text"]
    text_cfg = {
        "model_type": "llama",
        "vocab_size": t["vocab_size"],
        "hidden_size": t["hidden_size"],
        "intermediate_size": t["intermediate_size"],
        "num_hidden_layers": t["num_hidden_layers"],
        "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t["num_key_value_heads"],
        "head_dim": t["head_dim"],
        "max_position_embeddings": t["max_position_embeddings"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "tie_word_embeddings": False,
    }
    vision_cfg = {
        "hidden_size": p["vision_hidden_size"],
        "intermediate_size": p["vision_intermediate_size"],
        "num_hidden_layers": p["vision_layers"],
        "num_attention_heads": p["vision_heads"],
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
    }
    cfg = Idefics3Config(
        vision_config=vision_cfg,
        text_config=text_cfg,
        image_token_id=IMAGE_TOKEN_ID,
        scale_factor=SCALE_FACTOR,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "connector" in name and name.endswith("weight"):
                param.normal_(0.0, PROJECTOR_STD)
    model.to(torch.bfloat16).save_pretrained(tmp)

    tok = tiny_model._build_tokenizer(seed)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    ids = tok.convert_tokens_to_ids(SPECIAL_TOKENS)
    if ids != list(range(tiny_model.VOCAB_SIZE, VOCAB_SIZE)) or len(tok) != VOCAB_SIZE:
        raise RuntimeError(f"special tokens got ids {ids}, vocabulary {len(tok)}")
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
        do_image_splitting=False,
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        image_seq_len=IMAGE_TOKENS,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(tmp)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(tmp)
    # No torchvision in the vLLM venv: make the PIL image processor explicit.
    f = tmp / "processor_config.json"
    d = json.loads(f.read_text())
    d.setdefault("image_processor", {})["use_fast"] = False
    f.write_text(json.dumps(d, indent=2, sort_keys=True))
    (tmp / STAMP).write_text(json.dumps(p, sort_keys=True))


def build(out: Path | None = None, seed: int = 0, force: bool = False) -> Path:
    """Build (or reuse) the tiny VLM directory and return its path."""
    out = Path(out) if out is not None else default_dir(seed)
    out = out.expanduser().resolve()
    if not force and is_complete(out, seed):
        return out
    return tiny_model.publish(out, lambda tmp: _build(seed, tmp))


def image_pixels(kind: str, size: int = IMAGE_SIZE):
    """A deterministic RGB test image as a ``(size, size, 3)`` uint8 numpy array.

    ``"a"``: a red/green gradient; ``"b"``: a blue/green checkerboard.
    """
    import numpy as np

    y, x = np.mgrid[0:size, 0:size]
    if kind == "a":
        arr = np.stack([x * 255 // (size - 1), y * 255 // (size - 1), np.full_like(x, 40)], axis=-1)
    elif kind == "b":
        cell = ((x // 7) + (y // 7)) % 2
        arr = np.stack([np.full_like(x, 20), cell * 200, 255 - cell * 200], axis=-1)
    else:
        raise ValueError(f"unknown test image {kind!r}")
    return arr.astype(np.uint8)


def png_bytes(kind: str, size: int = IMAGE_SIZE) -> bytes:
    """:func:`image_pixels` encoded as PNG with the standard library (8-bit RGB, no filter)."""
    import struct
    import zlib

    arr = image_pixels(kind, size)
    raw = b"".join(b"\x00" + arr[row].tobytes() for row in range(arr.shape[0]))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)
        )

    header = struct.pack(">IIBBBBB", arr.shape[1], arr.shape[0], 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def check(path: Path, n_words: int = 500, max_new_tokens: int = 8) -> list[list[int]]:
    """Greedy continuations (transformers, bf16) of the same text with the two test images."""
    import io

    import torch
    from PIL import Image
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(path)
    model = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).eval()
    text = processor.apply_chat_template(
        [{"role": "user", "content": f"{sample_text(100, 2)} {IMAGE_TOKEN} {sample_text(n_words, 1)}"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    outs = []
    for kind in ("a", "b"):
        image = Image.open(io.BytesIO(png_bytes(kind)))
        inputs = processor(images=[image], text=text, return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        ids = inputs["input_ids"][0]
        n = ids.shape[0]
        outs.append(gen[0, n:].tolist())
        where = (ids == IMAGE_TOKEN_ID).nonzero().flatten().tolist()
        print(
            f"image {kind}: prompt {n} tokens, <image> at {where[0]}..{where[-1]} ({len(where)}), "
            f"output {outs[-1]}",
            file=sys.stderr,
        )
    return outs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="weight/tokenizer seed (default 0)")
    ap.add_argument("--out", type=Path, default=None, help="model directory (default: cache dir)")
    ap.add_argument("--force", action="store_true", help="rebuild even if complete")
    ap.add_argument("--check", action="store_true", help="also check (transformers) that two images differ")
    args = ap.parse_args(argv)
    path = build(args.out, args.seed, args.force)
    if args.check:
        a, b = check(path)
        if a == b:
            print("check failed: two different images give the same greedy output", file=sys.stderr)
            return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
