"""Build a tiny random Llama model + tokenizer for end-to-end tests (no model hub needed).

Run inside the vLLM venv (it has torch, transformers and tokenizers):

    python tests/e2e/tiny_model.py [--seed N] [--out DIR]

prints the model directory.  Default directory: ``$KVTIER_CACHE_DIR/tiny-llama`` (seed 0) or
``$KVTIER_CACHE_DIR/tiny-llama-s<N>`` for another seed; ``$KVTIER_CACHE_DIR`` defaults to
``~/.cache/kvtier``.  A directory is reused only when its stamp file matches the build parameters;
otherwise it is rebuilt (into a temporary sibling, then renamed, so an interrupted build never looks
complete).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

VOCAB_SIZE = 4096
FORMAT_VERSION = 1
STAMP = ".kvtier-tiny-model.json"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def cache_dir() -> Path:
    return Path(os.environ.get("KVTIER_CACHE_DIR") or Path.home() / ".cache" / "kvtier")


def default_dir(seed: int = 0) -> Path:
    return cache_dir() / ("tiny-llama" if seed == 0 else f"tiny-llama-s{seed}")


def _params(seed: int) -> dict:
    return {
        "format": FORMAT_VERSION,
        "seed": seed,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "dtype": "bfloat16",
    }


def is_complete(out: Path, seed: int) -> bool:
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return False
    needed = ("config.json", "tokenizer.json", "tokenizer_config.json")
    has_weights = any(out.glob("*.safetensors"))
    return stamp == _params(seed) and has_weights and all((out / f).is_file() for f in needed)


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghklmnprstvwz" for b in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    punct = [".", ",", "?", "!", ";", ":"]
    out = []
    for _ in range(lines):
        n = rng.randint(4, 20)
        toks = [rng.choice(words) for _ in range(n)]
        if rng.random() < 0.3:
            toks.append(str(rng.randint(0, 99999)))
        out.append(" ".join(toks) + rng.choice(punct))
    return out


def _build_tokenizer(seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 = LlamaConfig's default unk/bos/eos
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 64,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
    )
    missing = VOCAB_SIZE - len(fast)
    if missing < 0:
        raise RuntimeError(f"tokenizer has {len(fast)} ids, more than {VOCAB_SIZE}")
    if missing:
        fast.add_tokens([f"<extra_{i}>" for i in range(missing)], special_tokens=True)
    if len(fast) != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {len(fast)} ids, expected {VOCAB_SIZE}")
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 8192
    return fast


def publish(out: Path, fill: Callable[[Path], None]) -> Path:
    """Build a model directory by `fill`ing a temporary sibling of `out`, then renaming it to `out`: an
    interrupted build never looks complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        fill(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def build(out: Path | None = None, seed: int = 0, force: bool = False) -> Path:
    """Build (or reuse) the tiny model directory and return its path."""
    out = Path(out) if out is not None else default_dir(seed)
    out = out.expanduser().resolve()
    if not force and is_complete(out, seed):
        return out

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    p = _params(seed)

    def fill(tmp: Path) -> None:
        cfg = LlamaConfig(
            vocab_size=p["vocab_size"],
            hidden_size=p["hidden_size"],
            intermediate_size=p["intermediate_size"],
            num_hidden_layers=p["num_hidden_layers"],
            num_attention_heads=p["num_attention_heads"],
            num_key_value_heads=p["num_key_value_heads"],
            head_dim=p["head_dim"],
            max_position_embeddings=p["max_position_embeddings"],
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(tmp)
        _build_tokenizer(seed).save_pretrained(tmp)
        (tmp / STAMP).write_text(json.dumps(p, sort_keys=True))

    return publish(out, fill)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="weight/tokenizer seed (default 0)")
    ap.add_argument("--out", type=Path, default=None, help="model directory (default: cache dir)")
    ap.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = ap.parse_args(argv)
    path = build(args.out, args.seed, args.force)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
