"""Real vLLM, the reread workload larger than L1: tokens loaded by each eviction policy against the replay.

Not a pytest module (no ``test_`` prefix). Run from the project venv::

    .venv/bin/python tests/e2e/bench_vllm_reread.py [--l1-gib 0.0526 0.0427 0.0311] [--policies reuse lru]

The workload of the published LMCache measurement (server/bench/trace_workloads.reread_trace): 40 documents of
1,020 token ids read in order four times, ``POST /reset_prefix_cache`` before every request, so every
reread is served by kvtier or recomputed. One real vLLM (CPU build, the tiny random Llama: 7 blocks of
256 KiB = 28 pages per document, 1,120 pages in all) and a fresh ``kvtier server --l1-size-gb X
--eviction-policy P`` per configuration. Tokens loaded = vLLM's ``external_kv_transfer`` prompt tokens;
the replay's figures (``kvtier bench trace --workload reread --l1-gib X``) are computed for the same L1.
Greedy outputs of the three rereads must equal the first (computed) pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from bench_vllm import ext_tokens  # noqa: E402
from kvtier.server.bench.trace import REREAD_L1_GIB  # noqa: E402
from kvtier.server.bench.trace_replay import BELADY, replay  # noqa: E402
from kvtier.server.bench.trace_workloads import (  # noqa: E402
    REREAD_DOCS,
    REREAD_PASSES,
    REREAD_TOKENS,
    Geometry,
    reread_trace,
    working_set_pages,
)
from kvtier.server.eviction import DEFAULT_POLICY  # noqa: E402

GEOMETRY = Geometry()  # 128-token blocks of 256 KiB (the tiny Llama on vLLM's CPU build), 64 KiB pages


def replay_tokens(policy: str, gib: float) -> int:
    capacity = int(gib * (1 << 30)) // GEOMETRY.page_bytes
    return replay(policy, reread_trace(), capacity, GEOMETRY).hit_blocks * GEOMETRY.block_tokens


def run_config(gib: float, policy: str, model: Path, args: argparse.Namespace, out_dir: Path,
               vllm_py: Path) -> dict[str, Any]:
    logdir = out_dir / "logs"
    kp, kh, port = harness.free_port(), harness.free_port(), harness.free_port()
    kv = harness.start_kvtier(kp, kh, gib, ["--eviction-policy", policy], python=vllm_py, logdir=logdir,
                              name=f"kvtier-{policy}-{gib:g}")
    try:
        with harness.start_vllm(model, port, harness.kvtier_connector_config(kp), python=vllm_py,
                                logdir=logdir, timeout=300, name=f"vllm-{policy}-{gib:g}"):
            harness.complete_stream(port, harness.prompt_ids(64, seed=7), args.max_tokens)  # < 1 block: no KV
            docs = [harness.prompt_ids(REREAD_TOKENS, seed=5000 + d) for d in range(REREAD_DOCS)]
            passes = []
            for _ in range(REREAD_PASSES):
                reads = []
                for doc in docs:
                    harness.reset_prefix_cache(port)
                    before = ext_tokens(port)
                    out, _, _ = harness.complete_stream(port, doc, args.max_tokens)
                    reads.append({"loaded": ext_tokens(port) - before, "out": out})
                passes.append(reads)
            refused = {k: v for k, v in harness.parse_metrics(harness.metrics_text(kh)).items()
                       if k.startswith("kvtier_refused_stores")}
    finally:
        kv.stop()
    loaded = int(sum(r["loaded"] for p in passes[1:] for r in p))
    belady = replay_tokens(BELADY, gib)
    return {
        "l1_gib": gib,
        "working_set_vs_l1": working_set_pages(reread_trace(), GEOMETRY) / (int(gib * (1 << 30)) // GEOMETRY.page_bytes),
        "policy": policy,
        "loaded_tokens": loaded,
        "loaded_per_pass": [int(sum(r["loaded"] for r in p)) for p in passes],
        "replay_tokens": replay_tokens(policy, gib),
        "belady_tokens": belady,
        "vs_belady": loaded / belady if belady else 0.0,
        "outputs_identical": all(passes[k][d]["out"] == passes[0][d]["out"]
                                 for k in range(1, REREAD_PASSES) for d in range(REREAD_DOCS)),
        "refused": refused,
    }


def table(rows: list[dict[str, Any]]) -> str:
    possible = (REREAD_PASSES - 1) * REREAD_DOCS * GEOMETRY.lookup_blocks(REREAD_TOKENS) * GEOMETRY.block_tokens
    lines = [f"| L1 GiB (working set / L1) | policy | tokens loaded of {possible:,} | replay, same policy | "
             "Belady (replay) | loaded / Belady | greedy output identical |", "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['l1_gib']:g} ({r['working_set_vs_l1']:.2f}x) | {r['policy']} | {r['loaded_tokens']:,} | "
                     f"{r['replay_tokens']:,} | {r['belady_tokens']:,} | {r['vs_belady']:.2f} | "
                     f"{'yes' if r['outputs_identical'] else 'NO'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--l1-gib", type=float, nargs="+", default=list(REREAD_L1_GIB))
    ap.add_argument("--policies", nargs="+", default=[DEFAULT_POLICY, "lru"])
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--out", default=str(Path(os.environ.get("TMPDIR", "/tmp")) / "kvtier-bench-vllm-reread"))
    args = ap.parse_args()
    out_dir, vllm_py, model = harness.prepare_bench(args.out)
    t0 = time.time()
    rows = []
    for gib in args.l1_gib:
        for policy in args.policies:
            print(f"[bench-reread] L1 {gib:g} GiB, {policy}", file=sys.stderr, flush=True)
            rows.append(run_config(gib, policy, model, args, out_dir, vllm_py))
            print(f"[bench-reread]   loaded {rows[-1]['loaded_tokens']} (replay {rows[-1]['replay_tokens']}, "
                  f"Belady {rows[-1]['belady_tokens']})", file=sys.stderr, flush=True)
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "wall_s": round(time.time() - t0, 1),
              "rows": rows}
    json_path = out_dir / "bench_vllm_reread.json"
    json_path.write_text(json.dumps(result, indent=1, default=str))
    print(table(rows))
    print(f"json: {json_path}")
    return 0 if all(r["outputs_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
