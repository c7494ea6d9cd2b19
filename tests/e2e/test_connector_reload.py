"""End-to-end checks of the vLLM connector (issue 3) against a real kvtier server and real CPU vLLMs.

One kvtier server and one vLLM ("A", bf16, ``tiny_model``) are shared by the whole module, because a
vLLM start costs ~40 s; each test sets up its own prompts (fresh seeds), so none relies on another
test's data. At most two vLLMs run at once (A plus one more).

* check 1 ``test_reload_after_prefix_cache_reset``: a prompt comes back from kvtier after vLLM's own
  prefix cache is emptied.
* check 2 ``test_second_instance_loads_what_first_served``: a second vLLM on the same server loads a
  prompt the first one served, on its very first request, with identical greedy output.
* check 3 ``test_restarted_vllm_loads_old_prompt``: after A is stopped and started again (same
  server), its first request for an old prompt loads from kvtier, identical output.
* check 4 ``test_kvtier_killed_and_restarted_while_vllm_serves``: SIGKILL of kvtier while vLLM serves:
  requests keep succeeding with unchanged output; kvtier restarted on the same port (taking over its
  stale /dev/shm segment) serves hits again without restarting vLLM. Runs last: it replaces the server.
* check 5 ``test_document_reused_across_questions``: a 1,020-token document followed by different
  questions reuses all 7 whole document blocks (896 tokens) per question, outputs equal to a
  no-reuse reference (the same prompt under a fresh ``cache_salt``: no vLLM or kvtier sharing).
* check 6 ``test_other_dtype_or_model_never_hits``: a vLLM with another dtype (float16) or another
  model directory on the same server never gets a hit from A's entries, while A still hits.

The module's vLLMs store through the server (``kvtier.server_stores``: the daemon's copier reads each store's
blocks out of the worker, server/transfer/host.py), so every check here also proves that those stores are the
bytes vLLM loads back; check 1 asserts that the copier did the stores. The other e2e modules cover the default
(the worker copies its stores itself).

Output references are like for like: a reload of n tokens is compared with vLLM's own prefix-cache hit
of the same n tokens (same split between cached and computed tokens), which must be bit-identical if
the loaded KV is right. A cold (full) prefill is not always a valid reference: for some prompts vLLM
itself gives a different greedy continuation after a local prefix-cache hit than after a cold prefill
(seen with vLLM alone, no connector, e.g. ``prompt_ids(2000, seed=201)``), a numerical effect of the
prefill split, not of the cache. Where the cold output is used (check 5's no-reuse reference), it is
asserted only when vLLM's own prefix cache reproduces it.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import harness
import pytest

pytestmark = pytest.mark.e2e

BLOCK = 128
L1_GB = 0.5
PROMPT_LEN = 2000
FULL_RELOAD = (PROMPT_LEN - 1) // BLOCK * BLOCK  # 1920: every whole block but the one with the last token
RETRY_BACKOFF_S = 0.25  # the connector's client backoff after a failure (default 2 s)
BY_SOURCE = "vllm:prompt_tokens_by_source_total"




def source_tokens(m: dict, source: str) -> float:
    return harness.metric(m, BY_SOURCE, source=source)


def external_tokens(m: dict) -> float:
    return source_tokens(m, "external_kv_transfer")


def kvtier_hit_tokens(http_port: int) -> float:
    return harness.metric(harness.parse_metrics(harness.metrics_text(http_port)), "kvtier_hit_tokens_total", tier="l1")


def segment_path(kv_port: int) -> Path:
    return Path("/dev/shm") / f"kvtier-{kv_port}"


@dataclass
class Served:
    """One completion and what it took from each source (deltas of vLLM's /metrics around it)."""

    out: list[int]
    external: float
    local_hit: float
    computed: float


def serve(port: int, prompt: list[int], max_tokens: int = 16, reset: bool = False, **extra) -> Served:
    """Complete ``prompt`` greedily (after emptying vLLM's prefix cache if ``reset``)."""
    if reset:
        harness.reset_prefix_cache(port)
    m0 = harness.metrics(port)
    out, _ = harness.complete(port, prompt, max_tokens, **extra)
    m1 = harness.metrics(port)
    assert isinstance(out, list) and len(out) == max_tokens, out

    def delta(source: str) -> float:
        return source_tokens(m1, source) - source_tokens(m0, source)

    return Served(out, delta("external_kv_transfer"), delta("local_cache_hit"), delta("local_compute"))


def serve_cold_and_cached(port: int, prompt: list[int], max_tokens: int = 16, **extra) -> tuple[Served, Served]:
    """Serve ``prompt`` cold (it must not be cached anywhere yet), then again from vLLM's own prefix cache:
    the second output is the reference for a reload of the same whole blocks from kvtier."""
    cold = serve(port, prompt, max_tokens, **extra)
    assert cold.external == 0 and cold.local_hit == 0, cold
    cached = serve(port, prompt, max_tokens, **extra)
    assert cached.local_hit == (len(prompt) - 1) // BLOCK * BLOCK and cached.external == 0, cached
    return cold, cached


@dataclass
class Cluster:
    """The module's kvtier server and vLLM A (both replaceable by tests that restart them)."""

    python: Path
    model: Path
    logdir: Path
    kv_port: int = field(default_factory=harness.free_port)
    kv_http: int = field(default_factory=harness.free_port)
    kv: harness.Proc | None = None
    a: harness.Proc | None = None

    def start_kvtier(self) -> harness.Proc:
        self.kv = harness.start_kvtier(self.kv_port, self.kv_http, L1_GB, python=self.python, logdir=self.logdir,
                                       name=f"kvtier-{self.kv_port}")
        return self.kv

    def start_vllm(self, model: Path | None = None, extra_args: tuple[str, ...] = (), name: str = "vllm"
                   ) -> harness.Proc:
        port = harness.free_port()
        return harness.start_vllm(model or self.model, port, harness.kvtier_connector_config(
            self.kv_port, retry_backoff_s=RETRY_BACKOFF_S, server_stores=True), python=self.python,
                                  logdir=self.logdir, extra_args=extra_args, name=f"{name}-{port}")

    def start_a(self) -> harness.Proc:
        self.a = self.start_vllm(name="vllm-a")
        return self.a

    def kv_hits(self) -> float:
        return kvtier_hit_tokens(self.kv_http)

    def procs(self) -> set[harness.Proc]:
        return {p for p in (self.kv, self.a) if p is not None}

    def stop(self) -> None:
        for p in (self.a, self.kv):
            if p is not None:
                p.stop()


@pytest.fixture(scope="module")
def cluster(vllm_python, tiny_model, tmp_path_factory):
    base = os.environ.get("KVTIER_E2E_LOGDIR")
    logdir = Path(base) / "connector" if base else tmp_path_factory.mktemp("logs-connector")
    logdir.mkdir(parents=True, exist_ok=True)
    c = Cluster(vllm_python, tiny_model, logdir)
    try:
        c.start_kvtier()
        c.start_a()
        harness.complete(c.a.port, harness.prompt_ids(300, seed=99), 2)  # warm-up, unrelated prefix
        yield c
    finally:
        c.stop()
        harness.kill_all()


@pytest.fixture(autouse=True)
def _kill_leftovers(request):
    """Overrides conftest's: kill what a test started, but keep the module's shared server and vLLM."""
    yield
    keep = request.getfixturevalue("cluster").procs() if "cluster" in request.fixturenames else set()
    with harness._LIVE_LOCK:
        leftovers = [p for p in harness._LIVE if p not in keep]
    for p in leftovers:
        p.kill9()


def assert_alive(c: Cluster) -> None:
    assert c.kv is not None and c.a is not None
    c.kv.check_alive()
    c.a.check_alive()


# ------------------------------------------------------------------------------------------ check 1


def test_reload_after_prefix_cache_reset(cluster):
    c = cluster
    assert_alive(c)
    prompt = harness.prompt_ids(PROMPT_LEN, seed=7)
    cold, cached = serve_cold_and_cached(c.a.port, prompt)
    hits_before = c.kv_hits()
    copied = harness.metric(harness.parse_metrics(harness.metrics_text(c.kv_http)), "kvtier_gpu_copied_bytes_total",
                            direction="store")
    assert copied > 0, "the server's copier stored nothing: the worker copied by itself"
    again = serve(c.a.port, prompt, reset=True)
    assert again.external >= FULL_RELOAD, (again, c.a.log_tail())
    assert again.local_hit == 0, again
    assert again.out == cached.out
    assert c.kv_hits() - hits_before == again.external


# ------------------------------------------------------------------------------------------ check 5


def test_document_reused_across_questions(cluster):
    c = cluster
    assert_alive(c)
    doc = harness.prompt_ids(1020, seed=500)
    doc_blocks = len(doc) // BLOCK * BLOCK  # 896
    # The first question stores the document (with its own tail); the others must reuse the 7 whole
    # document blocks, the 7th of which sits inside a stored 256-token chunk that ends in question tokens.
    first_q = doc + harness.prompt_ids(100, seed=510)
    warm = serve(c.a.port, first_q)
    assert warm.external == 0, warm
    for i, q_len in enumerate((60, 130, 200)):
        prompt = doc + harness.prompt_ids(q_len, seed=520 + i)
        # No reuse at all: a fresh cache_salt shares nothing with vLLM's cache or kvtier.
        no_reuse = serve(c.a.port, prompt, cache_salt=f"noreuse-{uuid.uuid4().hex}")
        assert no_reuse.external == 0 and no_reuse.local_hit == 0, (q_len, no_reuse)
        # Like-for-like reference: the same document blocks reused from vLLM's own prefix cache.
        salt = f"local-{uuid.uuid4().hex}"
        serve(c.a.port, first_q, cache_salt=salt)
        local = serve(c.a.port, prompt, cache_salt=salt)
        assert local.local_hit == doc_blocks and local.external == 0, (q_len, local)

        hits_before = c.kv_hits()
        got = serve(c.a.port, prompt, reset=True)
        assert got.local_hit == 0, (q_len, got)
        assert got.external >= doc_blocks, (q_len, got, c.a.log_tail())
        assert c.kv_hits() - hits_before == got.external, q_len
        assert got.out == local.out, (q_len, got.out, local.out)
        if local.out == no_reuse.out:  # vLLM's own reuse reproduces the full prefill here
            assert got.out == no_reuse.out, (q_len, got.out, no_reuse.out)


# ------------------------------------------------------------------------------------------ check 2


def test_second_instance_loads_what_first_served(cluster):
    c = cluster
    assert_alive(c)
    prompt = harness.prompt_ids(PROMPT_LEN, seed=200)
    on_a, on_a_cached = serve_cold_and_cached(c.a.port, prompt)
    with c.start_vllm(name="vllm-b") as b:
        hits_before = c.kv_hits()
        on_b = serve(b.port, prompt)  # B's very first request
        assert on_b.external >= FULL_RELOAD, (on_b, b.log_tail())
        assert on_b.local_hit == 0, on_b
        assert c.kv_hits() - hits_before == on_b.external
        assert on_b.out == on_a_cached.out, (on_b.out, on_a_cached.out)
        # And the other way round: A loads what only B computed.
        prompt_b = harness.prompt_ids(PROMPT_LEN, seed=201)
        _, b_cached = serve_cold_and_cached(b.port, prompt_b)
        harness.wait_cached(c.kv_http, c.model, prompt_b, FULL_RELOAD)  # before B stops (see check 3)
    on_a2 = serve(c.a.port, prompt_b, reset=True)
    assert on_a2.external >= FULL_RELOAD, on_a2
    assert on_a2.out == b_cached.out, (on_a2.out, b_cached.out)


# ------------------------------------------------------------------------------------------ check 6


@pytest.mark.parametrize("other", ["dtype-float16", "model-b"])
def test_other_dtype_or_model_never_hits(cluster, other, request):
    c = cluster
    assert_alive(c)
    if other == "model-b":
        model, extra, name = request.getfixturevalue("tiny_model_b"), (), "vllm-model-b"
        assert model != c.model
    else:
        model, extra, name = c.model, ("--dtype", "float16"), "vllm-fp16"
    prompt = harness.prompt_ids(PROMPT_LEN, seed=600 if other == "model-b" else 610)
    _, on_a_cached = serve_cold_and_cached(c.a.port, prompt)
    with c.start_vllm(model, extra, name=name) as o:
        if other == "dtype-float16":
            assert "dtype=torch.float16" in o.log_text(), "the --dtype override did not take effect"
        hits_before = c.kv_hits()
        first = serve(o.port, prompt)
        assert first.external == 0 and first.local_hit == 0, (first, o.log_tail())
        assert c.kv_hits() == hits_before, "kvtier reported a hit for the other instance's lookup"
        # The other instance's connector works: it reloads what it stored itself.
        cached = serve(o.port, prompt)
        assert cached.local_hit >= FULL_RELOAD, cached
        again = serve(o.port, prompt, reset=True)
        assert again.external >= FULL_RELOAD, (again, o.log_tail())
        assert again.out == cached.out
        # A's entries are intact and still A's: A reloads its prompt with its own output.
        on_a_again = serve(c.a.port, prompt, reset=True)
        assert on_a_again.external >= FULL_RELOAD, on_a_again
        assert on_a_again.out == on_a_cached.out
        # A gets nothing from what only the other instance stored.
        only_other = harness.prompt_ids(PROMPT_LEN, seed=620 if other == "model-b" else 630)
        serve(o.port, only_other)
        from_other = serve(c.a.port, only_other)
        assert from_other.external == 0, from_other


# ------------------------------------------------------------------------------------------ check 3


def test_restarted_vllm_loads_old_prompt(cluster):
    c = cluster
    assert_alive(c)
    prompt = harness.prompt_ids(PROMPT_LEN, seed=300)
    _, before = serve_cold_and_cached(c.a.port, prompt)
    # The daemon copies a store out of the worker after the engine answered (server_stores; on a busy CPU only
    # once the engine idles), and vLLM's stop kills its worker at once: a copy still under way is lost (a miss).
    harness.wait_cached(c.kv_http, c.model, prompt, FULL_RELOAD)
    c.a.stop()
    assert not c.a.alive()
    c.start_a()
    hits_before = c.kv_hits()
    after = serve(c.a.port, prompt)  # the restarted vLLM's very first request
    assert after.external >= FULL_RELOAD, (after, c.a.log_tail())
    assert after.local_hit == 0, after
    assert c.kv_hits() - hits_before == after.external
    assert after.out == before.out


# ------------------------------------------------------------------------------------------ check 4


def test_kvtier_killed_and_restarted_while_vllm_serves(cluster):
    c = cluster
    assert_alive(c)
    port = c.a.port
    old = harness.prompt_ids(PROMPT_LEN, seed=400)
    ref_old, ref_old_cached = serve_cold_and_cached(port, old)
    reload_old = serve(port, old, reset=True)
    assert reload_old.external >= FULL_RELOAD and reload_old.out == ref_old_cached.out, reload_old

    # Kill kvtier while a long cold request is in flight (its lookup or its store meets a dead server;
    # wherever the kill lands, the request must complete).
    inflight_prompt = harness.prompt_ids(3000, seed=401)
    inflight: dict = {}

    def run_inflight() -> None:
        try:
            inflight["out"], _ = harness.complete(port, inflight_prompt, 32)
        except Exception as exc:  # reported below
            inflight["error"] = exc

    t = threading.Thread(target=run_inflight)
    t.start()
    time.sleep(0.2)
    c.kv.kill9()
    assert not c.kv.alive()
    t.join(timeout=300)
    assert not t.is_alive() and "error" not in inflight, inflight
    stale = segment_path(c.kv_port)
    assert stale.exists(), "a SIGKILLed server cannot remove its segment; the restart test needs it stale"
    stale_inode = stale.stat().st_ino

    # While kvtier is down: every request succeeds, nothing comes from kvtier, output unchanged
    # (cold prefills, compared with the cold prefill made while kvtier was up).
    for _ in range(3):
        down = serve(port, old, reset=True)
        assert down.external == 0 and down.local_hit == 0, down
        assert down.out == ref_old.out
    down_inflight = serve(port, inflight_prompt, 32, reset=True)
    assert down_inflight.external == 0, down_inflight
    assert down_inflight.out == inflight["out"]
    c.a.check_alive()

    # Restart on the same port: the server takes over its stale segment; vLLM keeps running.
    c.start_kvtier()
    assert stale.exists() and stale.stat().st_ino != stale_inode, "the stale segment was not replaced"
    time.sleep(4 * RETRY_BACKOFF_S)  # let the clients' backoff after their last failure pass
    # The new server starts empty: the old prompt is a miss (no stale data), still correct.
    empty = serve(port, old, reset=True)
    assert empty.external == 0, empty
    assert empty.out == ref_old.out
    # Hits resume: a new prompt is stored after the restart and reloaded.
    new = harness.prompt_ids(PROMPT_LEN, seed=402)
    harness.reset_prefix_cache(port)
    _, new_cached = serve_cold_and_cached(port, new)
    hits_before = c.kv_hits()
    reload_new = serve(port, new, reset=True)
    assert reload_new.external >= FULL_RELOAD, (reload_new, c.a.log_tail(), c.kv.log_tail())
    assert c.kv_hits() - hits_before == reload_new.external
    assert reload_new.out == new_cached.out
    # The old prompt, stored again by the miss above, reloads too.
    reload_old2 = serve(port, old, reset=True)
    assert reload_old2.external >= FULL_RELOAD, reload_old2
    assert reload_old2.out == ref_old_cached.out
