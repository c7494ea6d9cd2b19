"""End-to-end check that kvtier keeps the KV of different images apart (issue 26, check 2).

vLLM expands an image into placeholder token ids that are the same for every image, so two prompts that
differ only in their image have identical token ids. vLLM's own prefix cache separates them with the
image's identifier in its block hashes; kvtier must do the same, or a prompt with image B loads the KV
computed for image A.

The model is tests/e2e/tiny_vlm.py's tiny random Idefics3 (built once and cached). The prompt is text T
with one image in it, sent through ``/v1/chat/completions`` as a base64 PNG data URL:
``user: <167 words> <image> <500 words>\\nassistant: `` = 928 tokens, the image's 67 placeholder tokens at
225..291 (they straddle blocks 1 and 2 and kvtier's first chunk boundary at 256); 7 whole blocks (896 tokens).

1. Reference, a vLLM without connector: T+A cold, T+A again (vLLM's own prefix cache serves its 7 whole
   blocks: the like-for-like reference of a full reload), T+B (its prefix cache shares block 0, the only
   block before the image), T+B cold. The answers for A and B must differ, or the test proves nothing.
2. kvtier + a vLLM with the kvtier connector (``kv_load_failure_policy: recompute``): T+A (stores it),
   reset vLLM's prefix cache, T+B: must answer as the reference did for the same split (0 tokens loaded:
   the cold answer; block 0 loaded: the answer after vLLM's own block-0 hit), and must not load anything
   from the image's first block on. Reset again, T+A: loads all 7 whole blocks from kvtier and answers as
   the reference's prefix-cache hit did.

Each vLLM is started once (25-55 s each on a 2-core machine); the whole test takes 1-2 minutes, plus a few
seconds to build the model the first time.
"""

from __future__ import annotations

import base64
import subprocess
from dataclasses import dataclass
from pathlib import Path

import harness
import pytest
import tiny_vlm

pytestmark = pytest.mark.e2e

BLOCK = 128  # vLLM's CPU block size
MAX_TOKENS = 8
INTRO_WORDS = 167  # text before the image: puts its placeholders across blocks 1 and 2
TEXT_WORDS = 500  # text after the image
L1_GB = 0.25
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
VLM_ARGS = ("--limit-mm-per-prompt", '{"image": 1}')
FAKE_IMAGE_TOKEN_ID = tiny_vlm.tiny_model.VOCAB_SIZE + tiny_vlm.SPECIAL_TOKENS.index(
    tiny_vlm.FAKE_IMAGE_TOKEN
)


@pytest.fixture(scope="module")
def tiny_vlm_dir(vllm_python: Path) -> Path:
    """Build (or reuse) the tiny VLM with the vLLM venv's python; its directory."""
    r = subprocess.run(
        [str(vllm_python), str(Path(tiny_vlm.__file__).resolve())],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"tiny_vlm.py failed (rc={r.returncode}):\n{(r.stdout + r.stderr)[-4000:]}")
    return Path(lines[-1].strip())


def data_url(kind: str) -> str:
    return "data:image/png;base64," + base64.b64encode(tiny_vlm.png_bytes(kind)).decode()


def messages(image: str) -> list[dict]:
    text = (
        f"{tiny_vlm.sample_text(INTRO_WORDS, 2)} {tiny_vlm.IMAGE_TOKEN} {tiny_vlm.sample_text(TEXT_WORDS, 1)}"
    )
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": data_url(image)}},
            ],
        }
    ]


@dataclass
class Answer:
    """One greedy chat completion and where its prompt tokens came from (vLLM /metrics deltas)."""

    out: list[int]
    prompt: list[int]
    external: float
    local_hit: float
    computed: float


def ask(port: int, image: str, reset: bool = False) -> Answer:
    """T + ``image`` through /v1/chat/completions, greedy (after emptying vLLM's prefix cache if ``reset``)."""
    if reset:
        harness.reset_prefix_cache(port)
    body = {
        "model": harness.SERVED_MODEL_NAME,
        "messages": messages(image),
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    m0 = harness.metrics(port)
    resp = harness.http_json(port, "/v1/chat/completions", body, timeout=300)
    m1 = harness.metrics(port)
    out = resp["choices"][0]["token_ids"]
    assert isinstance(out, list) and len(out) == MAX_TOKENS, resp

    def delta(source: str) -> float:
        return harness.metric(m1, BY_SOURCE, source=source) - harness.metric(m0, BY_SOURCE, source=source)

    return Answer(
        out,
        resp["prompt_token_ids"],
        delta("external_kv_transfer"),
        delta("local_cache_hit"),
        delta("local_compute"),
    )


def image_range(prompt: list[int]) -> tuple[int, int]:
    """[start, end) of the image's placeholder tokens (``<fake_token_around_image>`` to the closing one)."""
    fakes = [i for i, t in enumerate(prompt) if t == FAKE_IMAGE_TOKEN_ID]
    assert len(fakes) == 2, fakes
    start, end = fakes[0], fakes[1] + 1
    assert end - start == tiny_vlm.PLACEHOLDER_TOKENS, (start, end)
    assert prompt[start + 2 : end - 1] == [tiny_vlm.IMAGE_TOKEN_ID] * tiny_vlm.IMAGE_TOKENS
    return start, end


def kvtier_hit_tokens(http_port: int) -> float:
    return harness.metric(harness.metrics(http_port), "kvtier_hit_tokens_total")


def test_different_images_never_share_kv(vllm_python, tiny_vlm_dir, logdir):
    # ---- 1. the reference: vLLM alone
    port = harness.free_port()
    with harness.start_vllm(
        tiny_vlm_dir, port, None, python=vllm_python, logdir=logdir, extra_args=VLM_ARGS, name="vllm-ref"
    ):
        a_cold = ask(port, "a")
        a_cached = ask(port, "a")
        b_shared = ask(port, "b")
        b_cold = ask(port, "b", reset=True)

    prompt = a_cold.prompt
    assert b_cold.prompt == prompt, "the two images must give identical prompt token ids"
    start, end = image_range(prompt)
    whole = (len(prompt) - 1) // BLOCK * BLOCK  # whole blocks vLLM and kvtier may reuse
    before_image = start // BLOCK * BLOCK  # whole blocks before the image's first block
    assert start // BLOCK != (end - 1) // BLOCK, ("the image should straddle a block boundary", start, end)
    assert before_image > 0 and whole >= before_image + 3 * BLOCK, (before_image, whole, len(prompt))
    assert a_cold.external == a_cold.local_hit == 0, a_cold
    assert a_cached.local_hit == whole, a_cached
    assert b_shared.local_hit == before_image, ("vLLM's own cache must stop at the image", b_shared)
    assert b_cold.local_hit == 0, b_cold
    assert a_cold.out != b_cold.out, ("the images give the same answer: the model ignores them", a_cold.out)
    assert a_cached.out != b_shared.out, (a_cached.out, b_shared.out)

    # ---- 2. kvtier and a vLLM with the kvtier connector
    kv_port, kv_http = harness.free_port(), harness.free_port()
    port = harness.free_port()
    config = {**harness.kvtier_connector_config(kv_port), "kv_load_failure_policy": "recompute"}
    with (
        harness.start_kvtier(kv_port, kv_http, L1_GB, python=vllm_python, logdir=logdir) as kv,
        harness.start_vllm(
            tiny_vlm_dir,
            port,
            config,
            python=vllm_python,
            logdir=logdir,
            extra_args=VLM_ARGS,
            name="vllm-kvtier",
        ) as v,
    ):
        a = ask(port, "a")
        assert a.prompt == prompt and a.external == 0 and a.local_hit == 0, a
        assert a.out == a_cold.out, ("the connector changed a cold answer", a.out, a_cold.out)

        b = ask(port, "b", reset=True)
        assert b.prompt == prompt
        # Like for like: the reference with the same split between reused and computed tokens.
        expected = b_shared.out if b.external == before_image else b_cold.out
        assert b.out == expected, (
            f"T+B answered {b.out}, the reference {expected}: it loaded {b.external:.0f} tokens from kvtier, "
            f"but only the {before_image} tokens before image B's first block (image placeholders at "
            f"{start}..{end - 1}) can be shared with T+A; T+A's answer is {a_cached.out} "
            "(image identity missing from kvtier's keys?)"
        )
        assert b.external in (0, before_image), (
            f"T+B loaded {b.external:.0f} tokens from kvtier: KV from image A's blocks (from {before_image} on)",
            b,
        )
        assert b.local_hit == 0, b

        hits_before = kvtier_hit_tokens(kv_http)
        a2 = ask(port, "a", reset=True)
        assert a2.local_hit == 0, a2
        assert a2.external >= whole, ("T+A not reloaded from kvtier", a2, v.log_tail(30), kv.log_tail(30))
        assert kvtier_hit_tokens(kv_http) - hits_before == a2.external
        assert a2.out == a_cached.out, (a2.out, a_cached.out)
        v.check_alive()
        kv.check_alive()
    print(
        f"prompt {len(prompt)} tokens, image placeholders {start}..{end - 1}; T+B loaded {b.external:.0f}, "
        f"T+A reloaded {a2.external:.0f} tokens from kvtier; answers A {a2.out}, B {b.out}"
    )
