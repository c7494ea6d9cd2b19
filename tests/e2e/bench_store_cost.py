"""What a store costs the first token of the request that makes it, measured inside one vLLM.

Not a pytest module (no ``test_`` prefix). Run from the project venv::

    .venv/bin/python tests/e2e/bench_store_cost.py [--runs 4] [--requests 200] [--alternate async_stores=false]
        [--json PATH]

One CPU vLLM 0.32 with the kvtier connector (a fresh ``kvtier server --l1-size-gb 1``), vLLM's default cache,
the prompts of bench_serve.py's ``fits`` mode: 32 prefixes of 2,000 tokens, each first sent once so that vLLM's
own cache holds it, then ``--requests`` prompts of one prefix and a new 100-token suffix, 32 output tokens,
one at a time. The requests alternate, ABBA, between two kinds: stored (the chunk holding the suffix is
stored, as every new prompt is) and not stored (the request hint ``{"kvtier": {"store": false}}``,
docs/hints.md); everything else, the lookup included, is the same. Both kinds share the process, the machine's
moment and vLLM's state, so the difference of their median TTFT is the store's cost to its own request's first
token, which the machine's drift between vLLM instances would drown. Each run checks that the stored
requests, and only they, added a chunk to L1 (the daemon's /status).

``--alternate KEY=VALUE,...`` adds runs with those connector options (``kvtier.KEY``), interleaved with the
default runs (default, alternate, alternate, default, ...). Output: per run the median TTFT of both kinds and
their difference; per configuration the median of the runs' differences. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

NO_STORE = {"kv_transfer_params": {"kvtier": {"store": False}}}
PREFIXES, PREFIX_LEN, SUFFIX_LEN, OUTPUT = 32, 2000, 100, 32


def entries(admin_port: int) -> int:
    return int(harness.kvtier_status(admin_port)["l1"]["entries"])


def run(options: dict[str, str], requests: int, out_dir: Path, py: Path, model: Path) -> dict[str, Any]:
    logdir = out_dir / "logs"
    kp, kh, port = harness.free_port(), harness.free_port(), harness.free_port()
    daemon = harness.start_kvtier(kp, kh, 1, python=py, logdir=logdir, timeout=120)
    try:
        v = harness.start_vllm(
            model,
            port,
            harness.kvtier_connector_config(kp, **options),
            {},
            python=py,
            logdir=logdir,
            timeout=300,
            name="vllm-store-cost",
        )
        try:
            harness.warm_up(v.port)
            prefixes = [harness.prompt_ids(PREFIX_LEN, seed=7000 + i) for i in range(PREFIXES)]
            for i, prefix in enumerate(prefixes):
                harness.complete_stream(
                    v.port, prefix + harness.prompt_ids(SUFFIX_LEN, seed=900 + i), 2, timeout=120
                )
            time.sleep(1.0)
            before = entries(kh)
            ttft: dict[str, list[float]] = {"stored": [], "not_stored": []}
            for i in range(requests):
                kind = "stored" if (i // 2) % 2 == i % 2 else "not_stored"  # ABBA
                prompt = prefixes[i % PREFIXES] + harness.prompt_ids(SUFFIX_LEN, seed=500000 + i)
                _, first, _ = harness.complete_stream(
                    v.port, prompt, OUTPUT, timeout=120, **(NO_STORE if kind == "not_stored" else {})
                )
                ttft[kind].append(1000 * first)
            time.sleep(1.0)
            stored_chunks = entries(kh) - before  # one new chunk (the one with the suffix) per stored request
        finally:
            v.stop(grace=20)
    finally:
        daemon.stop()
    stored, plain = (statistics.median(ttft[k]) for k in ("stored", "not_stored"))
    if stored_chunks != len(ttft["stored"]):
        raise RuntimeError(
            f"{stored_chunks} chunks stored for {len(ttft['stored'])} stored requests: the two "
            "kinds did not differ by their store alone"
        )
    return {
        "options": options,
        "p50_ttft_stored_ms": stored,
        "p50_ttft_not_stored_ms": plain,
        "store_cost_ms": stored - plain,
        "stored_chunks": stored_chunks,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=4, help="runs per configuration")
    ap.add_argument("--requests", type=int, default=200, help="measured requests per run (half of each kind)")
    ap.add_argument(
        "--alternate", default="", help="connector options of an interleaved second configuration"
    )
    ap.add_argument("--out", default="/tmp/kvtier-bench-store-cost", help="logs")
    ap.add_argument("--json", default="", help="write the runs and the summary here")
    args = ap.parse_args()
    out_dir, py, model = harness.prepare_bench(args.out)
    configs = ["default"] + (["alternate"] if args.alternate else [])
    options = {"default": {}, "alternate": harness.options_of(args.alternate)}
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for r in range(args.runs):
        for c in configs if r % 2 == 0 else configs[::-1]:
            res = run(options[c], args.requests, out_dir, py, model)
            runs[c].append(res)
            print(
                f"run {r + 1} {c} {options[c] or ''}: p50 TTFT stored {res['p50_ttft_stored_ms']:.2f} ms, "
                f"not stored {res['p50_ttft_not_stored_ms']:.2f} ms, store cost {res['store_cost_ms']:+.2f} ms",
                flush=True,
            )
    summary = {c: statistics.median(x["store_cost_ms"] for x in runs[c]) for c in configs}
    for c in configs:
        costs = ", ".join(f"{x['store_cost_ms']:+.2f}" for x in runs[c])
        print(
            f"{c} {options[c] or ''}: store cost, median of {len(runs[c])} runs {summary[c]:+.2f} ms ({costs})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
