"""Two kvtier "nodes" behind a prefix-aware router: round robin vs engine KV events vs kvtier's events too.

Not a pytest module (no ``test_`` prefix). Run from the project venv::

    .venv/bin/python tests/e2e/bench_router.py [--policies rr,engine,kvtier] [--rounds 2] [--docs 8] [--questions 3]

A node = a kvtier server (its own L1, ``--events-endpoint``) and a vLLM (CPU build, tiny random Llama) with the
kvtier connector, ``--kv-events-config`` on an ipc:// endpoint and a small KV cache
(``--num-gpu-blocks-override 33``, 4,224 tokens: the engine's own prefix cache holds two documents,
kvtier's L1 all of them). The router is tests/e2e/kv_router.py (vLLM's ``KVEventBatch`` and block hashes, the
same PYTHONHASHSEED as the engines). Policies, each on fresh nodes in the same run:

* ``rr``: the router's round robin;
* ``engine``: longest prefix by the engines' own KV events (the connector's ``engine_events`` off);
* ``kvtier``: the same router, the connector's ``"engine_events": true``: kvtier's L1 blocks (medium CPU) are
  in each engine's stream too.

Workload: ``--docs`` documents of ``--doc-tokens`` token ids, each asked ``--questions`` times with a different
``--question-tokens`` suffix, in a seeded random order, one request at a time, streamed (TTFT = first token).
Figures per policy: kvtier hit rate (kvtier_hit_tokens / kvtier_requested_tokens, both servers), the share of
prompt tokens computed (vLLM's ``prompt_tokens_by_source``), mean TTFT over repeats (a document's 2nd+ request)
and over all, how many repeats went to a node that had served the document before, and whether every prompt's
greedy output equals the other policies'.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

ROUTER_SCRIPT = Path(__file__).resolve().parent / "kv_router.py"
HASH_SEED = "0"  # the engines' and the router's PYTHONHASHSEED
BLOCK = 128  # vLLM's CPU block size
GPU_BLOCKS = 33  # the least vLLM accepts for max_model_len 4,096 (32 blocks estimate 3,968)
L1_GB = 0.25
POLICIES = {"rr": ("rr", False), "engine": ("prefix", False), "kvtier": ("prefix", True)}


@dataclass
class Cluster:
    nodes: list[tuple[harness.Proc, harness.Proc]]  # (kvtier server, vLLM) per node
    router: harness.Proc

    def stop(self) -> None:
        self.router.stop()
        for server, vllm in self.nodes:
            vllm.stop()
            server.stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def engine_cores(i: int, n_nodes: int) -> dict[str, str]:
    """Node i's engine bound to its own core where the machine has one per engine. vLLM's CPU worker binds its
    OpenMP threads by itself ("auto": the same cores for every engine on the machine), and two engines whose
    spinning OpenMP threads share a core stall each other's requests by 0.3-1.1 s."""
    cpus = os.cpu_count() or 1
    return {"VLLM_CPU_OMP_THREADS_BIND": str(i)} if cpus >= n_nodes else {}


def start_cluster(policy: str, engine_events: bool, py: Path, model: Path, logdir: Path, tag: str,
                  n_nodes: int = 2) -> Cluster:
    """Start `n_nodes` (kvtier server + vLLM) and kv_router.py in front of them."""
    servers, vllms, specs = [], [], []
    sockets = tempfile.mkdtemp(prefix="kvr-")  # ipc paths must stay short (about 100 bytes)
    for i in range(n_nodes):
        port, http_port = harness.free_port(), harness.free_port()
        servers.append(harness.start_kvtier(
            port, http_port, L1_GB, ["--shm-name", f"kvtier-router-{tag}-{i}-{port}",
                                     "--events-endpoint", f"ipc://{sockets}/feed-{tag}-{i}.sock"],
            python=py, logdir=logdir, env_extra={"PYTHONHASHSEED": HASH_SEED}, name=f"kvtier-{tag}-{i}"))
        events = f"ipc://{sockets}/{tag}-{i}.sock"  # ipc binds, on this machine only
        kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events, "topic": "kv-events"}
        options = {"engine_events": True} if engine_events else {}
        vport = harness.free_port()
        vllms.append(harness.start_vllm(
            model, vport, harness.kvtier_connector_config(port, **options), {"PYTHONHASHSEED": HASH_SEED,
                                                                              **engine_cores(i, n_nodes)},
            python=py, logdir=logdir, name=f"vllm-{tag}-{i}", wait=False,
            extra_args=["--kv-events-config", json.dumps(kv_events), "--num-gpu-blocks-override", str(GPU_BLOCKS)]))
        specs += ["--node", f"http://127.0.0.1:{vport}={events}"]
    for v in vllms:
        harness._wait_ready(v, lambda p=v.port: harness.health(p), 300, f"GET :{v.port}/health")
    rport = harness.free_port()
    router = harness.Proc(f"router-{tag}", [str(py), str(ROUTER_SCRIPT), "--port", str(rport), "--policy", policy,
                                            "--block-size", str(BLOCK), "--tokenizer", str(model), *specs],
                          logdir / f"router-{tag}.log", env={**os.environ, "PYTHONHASHSEED": HASH_SEED},
                          port=rport)
    harness._wait_ready(router, lambda: harness.health(rport), 120, f"router GET :{rport}/health")
    return Cluster(list(zip(servers, vllms, strict=True)), router)


def workload(docs: int, doc_tokens: int, questions: int, question_tokens: int, seed: int) -> list[tuple[int, list[int]]]:
    """(document index, prompt) for each question of each document, in a seeded random order."""
    texts = [harness.prompt_ids(doc_tokens, seed=seed * 1000 + d) for d in range(docs)]
    reqs = [(d, texts[d] + harness.prompt_ids(question_tokens, seed=seed * 1000 + 500 + d * questions + q))
            for d in range(docs) for q in range(questions)]
    random.Random(seed).shuffle(reqs)
    return reqs


def sum_metric(ports: list[int], name: str, **labels: str) -> float:
    return sum(harness.metric(harness.metrics(p), name, **labels) for p in ports)


def run_policy(name: str, reqs: list[tuple[int, list[int]]], py: Path, model: Path, logdir: Path,
               max_tokens: int) -> dict[str, Any]:
    policy, engine_events = POLICIES[name]
    with start_cluster(policy, engine_events, py, model, logdir, name) as cluster:
        for _, vllm in cluster.nodes:  # first-request costs out of the figures
            harness.complete(vllm.port, harness.prompt_ids(200, seed=999), 1)
        kv_ports = [s.http_port for s, _ in cluster.nodes]  # type: ignore[attr-defined]
        v_ports = [v.port for _, v in cluster.nodes]
        base = {k: sum_metric(kv_ports, k) for k in ("kvtier_requested_tokens_total", "kvtier_hit_tokens_total")}
        base_src = {s: sum_metric(v_ports, "vllm:prompt_tokens_by_source_total", source=s)
                    for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
        outputs, ttfts = [], []
        for _, prompt in reqs:
            out, ttft, _ = harness.complete_stream(cluster.router.port, prompt, max_tokens)
            outputs.append(out)
            ttfts.append(ttft)
        time.sleep(1.0)
        stats = harness.http_json(cluster.router.port, "/router/stats")
        requested = sum_metric(kv_ports, "kvtier_requested_tokens_total") - base["kvtier_requested_tokens_total"]
        hit = sum_metric(kv_ports, "kvtier_hit_tokens_total") - base["kvtier_hit_tokens_total"]
        src = {s: sum_metric(v_ports, "vllm:prompt_tokens_by_source_total", source=s) - base_src[s]
               for s in base_src}
    decisions = stats["decisions"]
    served: dict[int, set[str]] = {}
    repeat_ttft, repeats, to_holder, matched = [], 0, 0, 0
    for (doc, _), d, ttft in zip(reqs, decisions, ttfts, strict=True):
        if doc in served:
            repeats += 1
            to_holder += d["node"] in served[doc]
            repeat_ttft.append(ttft)
            matched += d["matched_blocks"] > 0
        served.setdefault(doc, set()).add(d["node"])
    total = sum(src.values())
    per_request = [{"doc": doc, "node": d["node"], "matched_blocks": d["matched_blocks"], "ttft_ms": 1000 * t}
                   for (doc, _), d, t in zip(reqs, decisions, ttfts, strict=True)]
    return {
        "policy": name, "requests": len(reqs), "repeats": repeats, "repeats_to_a_holder": to_holder,
        "repeats_with_matched_prefix": matched,
        "kvtier_requested_tokens": requested, "kvtier_hit_tokens": hit,
        "kvtier_hit_rate": hit / requested if requested else 0.0,
        "prompt_tokens": total, "computed_share": src["local_compute"] / total if total else 0.0,
        "gpu_hit_tokens": src["local_cache_hit"], "kvtier_loaded_tokens": src["external_kv_transfer"],
        "ttfts": ttfts, "repeat_ttfts": repeat_ttft, "events": stats["events"], "index": stats["index"],
        "per_request": per_request, "outputs": outputs,
    }


def combine(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's rounds: token and request counts summed, TTFT over all requests of all rounds."""
    out: dict[str, Any] = {"policy": rows[0]["policy"], "rounds": len(rows)}
    for k in ("requests", "repeats", "repeats_to_a_holder", "repeats_with_matched_prefix",
              "kvtier_requested_tokens", "kvtier_hit_tokens", "prompt_tokens", "gpu_hit_tokens",
              "kvtier_loaded_tokens"):
        out[k] = sum(r[k] for r in rows)
    out["kvtier_hit_rate"] = out["kvtier_hit_tokens"] / out["kvtier_requested_tokens"] \
        if out["kvtier_requested_tokens"] else 0.0
    out["computed_share"] = sum(r["computed_share"] * r["prompt_tokens"] for r in rows) / out["prompt_tokens"]
    ttfts = [t for r in rows for t in r["ttfts"]]
    repeats = [t for r in rows for t in r["repeat_ttfts"]]
    out["ttft_mean_ms"], out["ttft_median_ms"] = 1000 * statistics.fmean(ttfts), 1000 * statistics.median(ttfts)
    out["ttft_repeat_mean_ms"] = 1000 * statistics.fmean(repeats) if repeats else 0.0
    out["ttft_mean_ms_per_round"] = [1000 * statistics.fmean(r["ttfts"]) for r in rows]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="rr,engine,kvtier")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=1920)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2, help="policies run interleaved, each on fresh nodes")
    ap.add_argument("--out", default="/tmp/kvtier-bench-router")
    a = ap.parse_args()
    names = a.policies.split(",")
    unknown = set(names) - set(POLICIES)
    if unknown:
        ap.error(f"unknown policies {sorted(unknown)}; known: {sorted(POLICIES)}")
    out_dir, py, model = harness.prepare_bench(a.out)
    reqs = workload(a.docs, a.doc_tokens, a.questions, a.question_tokens, a.seed)
    runs = [run_policy(n, reqs, py, model, out_dir / "logs", a.max_tokens) for _ in range(a.rounds) for n in names]
    same = all(r["outputs"] == runs[0]["outputs"] for r in runs)
    rows = [combine([r for r in runs if r["policy"] == n]) for n in names]
    print(f"{len(reqs)} requests ({a.docs} documents x {a.questions} questions, {a.doc_tokens}+{a.question_tokens}"
          f" tokens), 2 nodes, GPU cache {GPU_BLOCKS} blocks of {BLOCK}; greedy outputs identical across "
          f"policies: {same}; {a.rounds} round(s), policies interleaved")
    print(f"{'policy':8} {'kvtier hit rate':>15} {'computed':>9} {'repeats to holder':>18} "
          f"{'TTFT mean ms':>13} {'median':>7} {'repeats':>8}  per round")
    for r in rows:
        per_round = " / ".join(f"{t:.0f}" for t in r["ttft_mean_ms_per_round"])
        print(f"{r['policy']:8} {r['kvtier_hit_rate']:15.1%} {r['computed_share']:9.1%} "
              f"{r['repeats_to_a_holder']:>11}/{r['repeats']:<6} {r['ttft_mean_ms']:13.1f} "
              f"{r['ttft_median_ms']:7.1f} {r['ttft_repeat_mean_ms']:8.1f}  {per_round}")
    json_path = out_dir / "bench_router.json"
    json_path.write_text(json.dumps({"args": vars(a), "outputs_identical": same, "rows": rows,
                                     "runs": runs},
                                    indent=1))
    print(f"json: {json_path}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
