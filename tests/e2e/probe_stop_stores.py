"""Whether `vllm serve`'s stop keeps a store that is still under way when vLLM is signalled.

Not a pytest module (no ``test_`` prefix). Run from the project venv::

    .venv/bin/python tests/e2e/probe_stop_stores.py [--tries 2] [--shutdown-timeout 10]

One kvtier server; per case (worker stores and ``server_stores``, each with vLLM's default stop and with
``--shutdown-timeout``) and try: a fresh CPU vLLM with the kvtier connector, one warm-up request, then a new
2,000-token prompt with ``max_tokens`` 1 (its store is deferred past the answer, or copied by the daemon after
it), SIGTERM to vLLM right after the answer, and the daemon's ``POST /cache/lookup`` for the prompt. Prints,
per case, the tokens kvtier holds after each try (1,920 = every whole block stored; 0 = the store was lost)
and how long the stop took (docs/vllm.md, "Asynchronous transfers").
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import harness

PROMPT_LEN = 2000


def one_try(model: Path, python: Path, kv_port: int, kv_http: int, logdir: Path, server_stores: bool,
            shutdown_timeout: int | None, seed: int) -> tuple[int, float]:
    """Tokens of the prompt kvtier holds after vLLM's stop, and the stop's seconds."""
    port = harness.free_port()
    extra = ("--shutdown-timeout", str(shutdown_timeout)) if shutdown_timeout is not None else ()
    vllm = harness.start_vllm(model, port, harness.kvtier_connector_config(kv_port, server_stores=server_stores),
                              python=python, logdir=logdir, name=f"vllm-{port}", extra_args=extra)
    harness.complete(port, harness.prompt_ids(300, seed=99), 2)  # warm-up, unrelated prefix
    prompt = harness.prompt_ids(PROMPT_LEN, seed=seed)
    harness.complete(port, prompt, 1)
    started = time.monotonic()
    vllm.stop()
    stop_s = time.monotonic() - started
    return harness.cached_tokens(kv_http, model, prompt), stop_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=2)
    parser.add_argument("--shutdown-timeout", type=int, default=10, help="vLLM's drain window in the drain cases")
    args = parser.parse_args()
    python = harness.vllm_python()
    model = harness.build_tiny_model(python)
    logdir = Path(tempfile.mkdtemp(prefix="kvtier-probe-stop-"))
    kv_port, kv_http = harness.free_port(), harness.free_port()
    kv = harness.start_kvtier(kv_port, kv_http, 0.5, python=python, logdir=logdir, name=f"kvtier-{kv_port}")
    seed = 5000
    try:
        for server_stores in (False, True):
            for timeout in (None, args.shutdown_timeout):
                got = []
                for _ in range(args.tries):
                    seed += 1
                    got.append(one_try(model, python, kv_port, kv_http, logdir, server_stores, timeout, seed))
                stop = "default stop" if timeout is None else f"--shutdown-timeout {timeout}"
                stores = "server_stores" if server_stores else "worker stores"
                print(f"{stores}, {stop}: tokens held {[n for n, _ in got]}, stop s "
                      f"{[round(s, 2) for _, s in got]}", flush=True)
    finally:
        kv.stop()
        harness.kill_all()


if __name__ == "__main__":
    main()
