"""vLLM end-to-end benchmark of the L2 tier: TTFT of prompts reloaded from L2 after a kvtier restart.

Not a pytest module (no ``test_`` prefix). Run from the project venv::

    .venv/bin/python tests/e2e/bench_vllm_l2.py [--rounds 2] [--odirect] [--out DIR]

One real vLLM (CPU build, the tiny random Llama, the same settings and documents as bench_vllm.py) with
kvtier (``--l1-size-gb 1 --l2-path DIR``). Per round, a fresh kvtier, L2 directory and vLLM:

1. warm-up requests (unrelated prompts), then ``POST /reset_prefix_cache``;
2. **cold**: each document once (computed; the connector stores it, L2 is written behind);
3. the L2 queue drained; **L1 reload**: for each document a prefix-cache reset, then the document;
4. kvtier SIGKILLed and restarted on the same port and L2 directory (L1 starts empty, L2 is rescanned);
   with ``--drop-cache`` the L2 files are dropped from the page cache meanwhile (buffered writes leave
   them there: without it a buffered L2 reload reads memory, as after a kvtier upgrade on a live node);
5. **L2 reload**: for each document a prefix-cache reset, then the document (every chunk promoted from
   L2: the lookup starts the reads, the worker's acquire waits for them);
6. **L1 again**: the same once more (the promoted chunks are L1 entries now).

TTFT = time to the first streamed token; loaded tokens = vLLM's ``external_kv_transfer`` prompt tokens.
Greedy outputs must be identical across phases. The baseline is the same run's cold TTFT (recompute).
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
from bench_vllm import LENGTHS, documents, mean, timed  # noqa: E402
from kvtier.server.bench import common as bc  # noqa: E402
from kvtier.server.bench.l2 import drop_page_cache  # noqa: E402

PHASES = ("cold", "l1_reload", "l2_reload", "l1_again")
OPTIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--rounds", {"type": int, "default": 2, "help": "fresh kvtier + vLLM instances (default 2)"}),
    ("--docs-per-length", {"type": int, "default": 2, "help": "documents per length (default 2)"}),
    ("--max-tokens", {"type": int, "default": 4}),
    ("--gap", {"type": float, "default": 0.3, "help": "pause after each request (s)"}),
    ("--odirect", {"action": "store_true", "help": "run kvtier with --l2-odirect"}),
    ("--drop-cache", {"action": "store_true", "help": "drop the L2 files from the page cache while kvtier is down "
                      "(buffered L2 reads then come from the disk; with --odirect they do anyway)"}),
    ("--plot", {"default": "", "help": "also write a PNG bar chart here (needs matplotlib)"}),
    ("--out", {"default": str(Path(os.environ.get("TMPDIR", "/tmp")) / "kvtier-bench-vllm-l2")}),
)
RETRY_BACKOFF_S = 0.2


def reloads(port: int, docs: list[list[int]], args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for d in docs:
        harness.reset_prefix_cache(port)
        out.append(timed(port, d, args.max_tokens, args.gap))
    return out


def run_round(rnd: int, model: Path, args: argparse.Namespace, out_dir: Path, vllm_py: Path) -> dict[str, Any]:
    logdir = out_dir / "logs"
    l2 = out_dir / f"l2-{rnd}"
    kp, kh, port = harness.free_port(), harness.free_port(), harness.free_port()
    kv_args = ["--l2-path", str(l2), "--l2-size-gb", "4", *(["--l2-odirect"] if args.odirect else [])]

    def start_kvtier() -> harness.Proc:
        return harness.start_kvtier(kp, kh, 1.0, kv_args, python=vllm_py, logdir=logdir, name=f"kvtier-{kp}")

    kv = start_kvtier()
    try:
        connector = harness.kvtier_connector_config(kp, retry_backoff_s=RETRY_BACKOFF_S)
        with harness.start_vllm(model, port, connector, python=vllm_py, logdir=logdir, timeout=300,
                                name=f"vllm-l2-{rnd}") as v:
            for k, n in enumerate((500, 2000, 3500, 1020)):  # warm-up, unrelated prefixes
                harness.complete_stream(port, harness.prompt_ids(n, seed=90000 + k), args.max_tokens)
            harness.reset_prefix_cache(port)
            docs = documents(args.docs_per_length)
            res: dict[str, Any] = {"round": rnd}
            res["cold"] = [timed(port, d, args.max_tokens, args.gap) for d in docs]
            res["l2_drained"] = harness.wait_l2_drained(kh, timeout=120.0)
            res["l1_reload"] = reloads(port, docs, args)
            kv.kill9()
            if args.drop_cache:  # as after a node reboot: the L2 reads come from the disk
                res["cache_drop"] = drop_page_cache([str(p) for p in l2.iterdir() if p.name.endswith(".kv")])
            kv = start_kvtier()
            res["l2_after_restart"] = harness.kvtier_status(kh)["l2"]
            time.sleep(4 * RETRY_BACKOFF_S)  # the connector's backoff after its last failure
            harness.complete_stream(port, harness.prompt_ids(300, seed=98), args.max_tokens)  # reconnect
            res["l2_reload"] = reloads(port, docs, args)
            res["l1_again"] = reloads(port, docs, args)
            res["kvtier_status"] = harness.kvtier_status(kh)
            res["vllm_log"] = str(v.log_path)
            return res
    finally:
        kv.stop()


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for ph in PHASES:
        per_round = [mean([x["ttft_ms"] for x in r[ph]]) for r in rounds]
        out[ph] = {
            "mean_ttft_ms": mean(per_round), "min_ms": min(per_round), "max_ms": max(per_round),
            "by_length_ms": {n: mean([x["ttft_ms"] for r in rounds for x in r[ph] if x["len"] == n])
                             for n in LENGTHS},
            "loaded_by_length": {n: mean([x["loaded"] for r in rounds for x in r[ph] if x["len"] == n])
                                 for n in LENGTHS},
        }
    out["outputs_identical"] = all(
        len({json.dumps(r[ph][i]["out"]) for ph in PHASES}) == 1 for r in rounds for i in range(len(r["cold"]))
    )
    return out


def table(s: dict[str, Any]) -> str:
    names = {"cold": "cold (computed, stored)", "l1_reload": "reload from L1",
             "l2_reload": "reload from L2 after a kvtier restart", "l1_again": "reload from L1 again"}
    lines = [f"| mean TTFT, ms (round min-max) | all | {' / '.join(str(n) for n in LENGTHS)} tokens | "
             "tokens loaded per length |", "|---|---:|---:|---:|"]
    for ph in PHASES:
        row = s[ph]
        ttft = " / ".join(f"{row['by_length_ms'][n]:.0f}" for n in LENGTHS)
        loaded = " / ".join(f"{row['loaded_by_length'][n]:.0f}" for n in LENGTHS)
        lines.append(f"| {names[ph]} | {row['mean_ttft_ms']:.0f} ({row['min_ms']:.0f}-{row['max_ms']:.0f}) | "
                     f"{ttft} | {loaded} |")
    lines.append(f"greedy output identical across phases: {'yes' if s['outputs_identical'] else 'NO'}")
    return "\n".join(lines)


def plot(s: dict[str, Any], path: str, title: str) -> None:
    """Mean TTFT per document length, one bar per phase."""
    plt = bc.plotting(path)
    if plt is None:
        return
    names = {"cold": "cold (computed)", "l1_reload": "reload from L1",
             "l2_reload": "reload from L2 after a kvtier restart", "l1_again": "reload from L1 again"}
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.2
    for k, ph in enumerate(PHASES):
        xs = [i + (k - 1.5) * width for i in range(len(LENGTHS))]
        ax.bar(xs, [s[ph]["by_length_ms"][n] for n in LENGTHS], width, label=names[ph])
    ax.set_xticks(range(len(LENGTHS)), [f"{n} tokens" for n in LENGTHS])
    ax.set_ylabel("mean TTFT, ms")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, options in OPTIONS:
        ap.add_argument(flag, **options)
    args = ap.parse_args()
    out_dir, vllm_py, model = harness.prepare_bench(args.out)
    t0 = time.time()
    rounds = []
    for rnd in range(1, args.rounds + 1):
        print(f"[bench-l2] round {rnd}/{args.rounds}", file=sys.stderr, flush=True)
        r = run_round(rnd, model, args, out_dir, vllm_py)
        rounds.append(r)
        print("[bench-l2]   " + ", ".join(f"{ph} {mean([x['ttft_ms'] for x in r[ph]]):.1f} ms" for ph in PHASES),
              file=sys.stderr, flush=True)
    summary = summarize(rounds)
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "wall_s": round(time.time() - t0, 1),
              "params": vars(args), "summary": summary, "rounds": rounds}
    json_path = out_dir / "bench_vllm_l2.json"
    json_path.write_text(json.dumps(result, indent=1, default=str))
    print(table(summary))
    print(f"json: {json_path}")
    if args.plot:
        mode = "O_DIRECT" if args.odirect else "buffered" + (", page cache dropped" if args.drop_cache else "")
        plot(summary, args.plot, f"vLLM (CPU) + kvtier with L2 ({mode}), {args.rounds} rounds")
        print(f"plot: {args.plot}")
    return 0 if summary["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
