"""vLLM end-to-end benchmark: no connector vs kvtier vs LMCache 0.5.6 MP, one CPU vLLM at a time.

Not a pytest module (no ``test_`` prefix). Run from the project venv::

    .venv/bin/python tests/e2e/bench_vllm.py [--quick] [--json [PATH]] [--configs none,kvtier,lmcache]

Workload (the published LMCache MP measurement, see /work/shared/reference/vllm-on-cpu.md): documents of
1,020 / 2,000 / 3,000 / 3,500 tokens (token-id prompts, so lengths are exact) on the tiny random Llama,
``--enforce-eager``, one worker core in every configuration (``VLLM_CPU_NUM_OF_RESERVED_CPU=1``).
Per vLLM instance (a fresh cache daemon for each):

1. warm-up requests (unrelated prompts), then ``POST /reset_prefix_cache``;
2. **cold**: each document once (first time: the connector stores it);
3. **local hit**: each document again with no reset (vLLM's own prefix cache serves it);
4. **reload**: for each document ``POST /reset_prefix_cache`` then the document (the connector loads it;
   loaded tokens = delta of ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``);
5. **zipf**: after a reset, requests over the documents drawn Zipf(1.1), no resets; the requests that vLLM's
   own prefix cache serves (every occurrence after the first) give the connector's added latency.

TTFT = time to the first streamed token (``harness.complete_stream``). Configurations run interleaved
(none, kvtier, lmcache, none, ...) so slow drift of the shared machine hits all of them alike. Each
instance is one "round"; the table shows the mean over rounds and the per-round spread (min-max).
Goals checked: kvtier reload TTFT <= 1.3x the local-hit TTFT; kvtier cold TTFT <= 1.05x no connector;
zipf local-hit TTFT kvtier - none <= 1 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

REPO = harness.REPO
LENGTHS = (1020, 2000, 3000, 3500)
LMCACHE_ENV_SCRIPT = REPO / "scripts" / "lmcache_env.sh"
EXT = "external_kv_transfer"
PHASES = ("cold", "local", "reload", "zipf_local")
# kvtier's configurations: connector options of each ("kvtier-verify": the cost of 0.1 % sampled verification)
KVTIER_CONFIGS: dict[str, dict[str, object]] = {"kvtier": {}, "kvtier-verify": {"verify_fraction": 0.001}}


# --------------------------------------------------------------------------- configurations




def lmcache_config(port: int) -> dict:
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",  # as kvtier's (harness.kvtier_connector_config): like for like
        "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port},
    }


def lmcache_python() -> Path:
    r = subprocess.run(
        ["bash", str(LMCACHE_ENV_SCRIPT)], capture_output=True, text=True, timeout=3600, cwd=REPO
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    if r.returncode != 0 or not lines:
        raise RuntimeError(
            f"scripts/lmcache_env.sh failed (rc={r.returncode}):\n"
            + "\n".join((r.stdout + r.stderr).splitlines()[-40:])
        )
    return Path(lines[-1].strip())


def start_lmcache(
    py: Path, port: int, http_port: int, logdir: Path, l1_gb: float = 1.0, timeout: float = 120.0
) -> harness.Proc:
    exe = py.parent / "lmcache"
    cmd = [
        str(exe),
        "server",
        "--l1-size-gb",
        str(l1_gb),
        "--eviction-policy",
        "LRU",
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--supported-transfer-mode",
        "auto",
    ]
    env = {**os.environ, "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}
    proc = harness.Proc(
        f"lmcache-{port}",
        cmd,
        logdir / f"lmcache-{port}-{int(time.time())}.log",
        env=env,
        port=port,
        cwd=REPO,
    )
    deadline = time.monotonic() + timeout
    while True:
        proc.check_alive()
        if harness.tcp_open(http_port) and harness.tcp_open(port):
            return proc
        if time.monotonic() > deadline:
            tail = proc.log_tail()
            proc.kill9()
            raise TimeoutError(f"lmcache server not ready after {timeout:.0f} s:\n{tail}")
        time.sleep(0.25)


# --------------------------------------------------------------------------- workload


def documents(per_length: int) -> list[list[int]]:
    docs = []
    for i, n in enumerate(LENGTHS):
        for j in range(per_length):
            docs.append(harness.prompt_ids(n, seed=1000 + 100 * i + j))
    return docs


def zipf_sequence(n_docs: int, n_requests: int, s: float = 1.1, seed: int = 42) -> list[int]:
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** s for k in range(n_docs)]
    return rng.choices(range(n_docs), weights=weights, k=n_requests)


def ext_tokens(port: int) -> float:
    return harness.metric(harness.metrics(port), "vllm:prompt_tokens_by_source_total", source=EXT)


def timed(port: int, prompt: list[int], max_tokens: int, gap_s: float) -> dict[str, Any]:
    before = ext_tokens(port)
    out, ttft, total = harness.complete_stream(port, prompt, max_tokens)
    time.sleep(gap_s)  # lets an asynchronous store finish before the next request (fair to LMCache)
    after = ext_tokens(port)
    return {
        "len": len(prompt),
        "ttft_ms": ttft * 1e3,
        "total_ms": total * 1e3,
        "loaded": after - before,
        "out": out if isinstance(out, list) else str(out),
    }


def run_instance(
    config: str, model: Path, args: argparse.Namespace, logdir: Path, vllm_py: Path, lm_py: Path | None
) -> dict[str, Any]:
    daemon = None
    port = harness.free_port()
    try:
        if config in KVTIER_CONFIGS:
            kp, kh = harness.free_port(), harness.free_port()
            daemon = harness.start_kvtier(kp, kh, 1.0, python=vllm_py, logdir=logdir)
            kvc, py = harness.kvtier_connector_config(kp, **KVTIER_CONFIGS[config]), vllm_py
        elif config == "lmcache":
            assert lm_py is not None
            kp, kh = harness.free_port(), harness.free_port()
            daemon = start_lmcache(lm_py, kp, kh, logdir)
            kvc, py = lmcache_config(kp), lm_py
        else:
            kvc, py = None, vllm_py
        t0 = time.monotonic()
        v = harness.start_vllm(model, port, kvc, python=py, logdir=logdir, timeout=300, name=f"vllm-{config}")
        startup_s = time.monotonic() - t0
        try:
            binding = [
                ln.strip()[-200:]
                for ln in v.log_text().splitlines()
                if re.search(r"reserve_cpu_num|core ids|OMP threads binding", ln)
            ][:4]
            # Warm-up: unrelated prompts (the first requests after start are 2-3x slower).
            for k, n in enumerate((500, 2000, 3500, 1020)):
                harness.complete_stream(port, harness.prompt_ids(n, seed=90000 + k), args.max_tokens)
            harness.reset_prefix_cache(port)
            time.sleep(args.gap)
            docs = documents(args.docs_per_length)
            res: dict[str, Any] = {"config": config, "startup_s": startup_s, "binding": binding}
            res["cold"] = [timed(port, d, args.max_tokens, args.gap) for d in docs]
            res["local"] = [timed(port, d, args.max_tokens, args.gap) for d in docs]
            time.sleep(1.0)  # any store still in flight lands before the reloads
            reload = []
            for d in docs:
                harness.reset_prefix_cache(port)
                reload.append(timed(port, d, args.max_tokens, args.gap))
            res["reload"] = reload
            harness.reset_prefix_cache(port)
            seen: set[int] = set()
            zipf_first, zipf_local = [], []
            for idx in zipf_sequence(len(docs), args.zipf_requests):
                r = timed(port, docs[idx], args.max_tokens, args.zipf_gap)
                r["doc"] = idx
                (zipf_local if idx in seen else zipf_first).append(r)
                seen.add(idx)
            res["zipf_first"], res["zipf_local"] = zipf_first, zipf_local
            res["vllm_log"] = str(v.log_path)
            errs = [
                ln
                for ln in v.log_text().splitlines()
                if re.search(
                    r"Traceback|kvtier: \d+ of|store failed|"
                    r"load failed|Failed to",
                    ln,
                )
            ]
            res["log_errors"] = errs[:20]
            if daemon is not None:
                res["daemon_log"] = str(daemon.log_path)
            return res
        finally:
            v.stop()
    finally:
        if daemon is not None:
            daemon.stop()


# --------------------------------------------------------------------------- summary


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per config: for every phase the mean TTFT per round, overall mean and spread; per length too."""
    out: dict[str, Any] = {}
    by_cfg: dict[str, list[dict]] = {}
    for r in rounds:
        by_cfg.setdefault(r["config"], []).append(r)
    for cfg, rs in by_cfg.items():
        s: dict[str, Any] = {"rounds": len(rs)}
        for ph in PHASES:
            per_round = [mean([x["ttft_ms"] for x in r[ph]]) for r in rs if r.get(ph)]
            s[ph] = {
                "mean_ms": mean(per_round),
                "min_ms": min(per_round, default=float("nan")),
                "max_ms": max(per_round, default=float("nan")),
                "per_round_ms": per_round,
                "n_requests": sum(len(r.get(ph, [])) for r in rs),
            }
        for ph in ("cold", "local", "reload"):
            s[ph]["by_len"] = {}
            for n in LENGTHS:
                xs = [x for r in rs for x in r[ph] if x["len"] == n]
                s[ph]["by_len"][n] = {
                    "ttft_ms": mean([x["ttft_ms"] for x in xs]),
                    "loaded": mean([x["loaded"] for x in xs]),
                }
        s["reload"]["loaded_by_len"] = {n: s["reload"]["by_len"][n]["loaded"] for n in LENGTHS}
        s["zipf_local"]["loaded_total"] = sum(x["loaded"] for r in rs for x in r["zipf_local"])
        # identical greedy output across phases within the config
        same = all(a["out"] == b["out"] for r in rs for a, b in zip(r["cold"], r["reload"], strict=False))
        same &= all(a["out"] == b["out"] for r in rs for a, b in zip(r["cold"], r["local"], strict=False))
        s["outputs_identical_within"] = same
        s["startup_s"] = [round(r["startup_s"], 1) for r in rs]
        s["binding"] = rs[0].get("binding")
        s["log_errors"] = sorted({e for r in rs for e in r.get("log_errors", [])})[:10]
        out[cfg] = s
    if "none" in by_cfg:
        ref = by_cfg["none"][0]["cold"]
        for cfg, rs in by_cfg.items():
            out[cfg]["outputs_match_none"] = all(
                a["out"] == b["out"] for r in rs for a, b in zip(r["cold"], ref, strict=False)
            )
    goals: dict[str, Any] = {}
    if "kvtier" in out:
        k = out["kvtier"]
        goals["kvtier_reload_over_local"] = k["reload"]["mean_ms"] / k["local"]["mean_ms"]
        goals["kvtier_reload_over_local_per_len"] = {
            n: k["reload"]["by_len"][n]["ttft_ms"] / k["local"]["by_len"][n]["ttft_ms"] for n in LENGTHS
        }
        if "none" in out:
            nn = out["none"]
            goals["kvtier_cold_overhead"] = k["cold"]["mean_ms"] / nn["cold"]["mean_ms"] - 1
            goals["kvtier_cold_overhead_per_len"] = {
                n: k["cold"]["by_len"][n]["ttft_ms"] / nn["cold"]["by_len"][n]["ttft_ms"] - 1 for n in LENGTHS
            }
            goals["kvtier_zipf_local_added_ms"] = k["zipf_local"]["mean_ms"] - nn["zipf_local"]["mean_ms"]
            goals["kvtier_local_added_ms"] = k["local"]["mean_ms"] - nn["local"]["mean_ms"]
    if "kvtier" in out and "kvtier-verify" in out:  # sampled verification's cost, same run
        k, kv = out["kvtier"], out["kvtier-verify"]
        goals["verify_reload_ratio"] = kv["reload"]["mean_ms"] / k["reload"]["mean_ms"]
        goals["verify_cold_ratio"] = kv["cold"]["mean_ms"] / k["cold"]["mean_ms"]
        goals["verify_zipf_local_ratio"] = kv["zipf_local"]["mean_ms"] / k["zipf_local"]["mean_ms"]
    if "lmcache" in out and "none" in out:
        lm, nn = out["lmcache"], out["none"]
        goals["lmcache_cold_overhead"] = lm["cold"]["mean_ms"] / nn["cold"]["mean_ms"] - 1
        goals["lmcache_reload_over_local"] = lm["reload"]["mean_ms"] / lm["local"]["mean_ms"]
        goals["lmcache_zipf_local_added_ms"] = lm["zipf_local"]["mean_ms"] - nn["zipf_local"]["mean_ms"]
    out["goals"] = goals
    return out


def table(summary: dict[str, Any]) -> str:
    cfgs = [c for c in ("none", *KVTIER_CONFIGS, "lmcache") if c in summary]
    lines = []
    hdr = f"{'':34s}" + "".join(f"{c:>24s}" for c in cfgs)
    lines.append(hdr)

    def cell(ph: str, c: str) -> str:
        p = summary[c][ph]
        return f"{p['mean_ms']:8.1f} ({p['min_ms']:.1f}-{p['max_ms']:.1f})"

    names = {
        "cold": "cold TTFT ms (first time)",
        "local": "vLLM prefix-hit TTFT ms",
        "reload": "reload TTFT ms (after reset)",
        "zipf_local": "zipf prefix-hit TTFT ms",
    }
    for ph in PHASES:
        lines.append(f"{names[ph]:34s}" + "".join(f"{cell(ph, c):>24s}" for c in cfgs))
    for ph in ("cold", "reload"):
        for n in LENGTHS:
            lines.append(
                f"  {ph} {n:>5d} tok TTFT ms{'':13s}"[:34].ljust(34)
                + "".join(f"{summary[c][ph]['by_len'][n]['ttft_ms']:24.1f}" for c in cfgs)
            )
    for n in LENGTHS:
        lines.append(
            f"  loaded tokens / {n} (reload)".ljust(34)
            + "".join(f"{summary[c]['reload']['by_len'][n]['loaded']:24.0f}" for c in cfgs)
        )
    lines.append("rounds".ljust(34) + "".join(f"{summary[c]['rounds']:24d}" for c in cfgs))
    lines.append(
        "greedy output same as none".ljust(34)
        + "".join(f"{str(summary[c].get('outputs_match_none')):>24s}" for c in cfgs)
    )
    g = summary.get("goals", {})
    if g:
        lines.append("")
        if "kvtier_reload_over_local" in g:
            lines.append(
                f"kvtier reload / prefix-hit TTFT: {g['kvtier_reload_over_local']:.2f}x (goal <= 1.3x); "
                "per length "
                + ", ".join(f"{n}: {v:.2f}x" for n, v in g["kvtier_reload_over_local_per_len"].items())
            )
        if "kvtier_cold_overhead" in g:
            lines.append(
                f"kvtier first-time overhead vs none: {100 * g['kvtier_cold_overhead']:+.1f}% (goal <= 5%); "
                "per length "
                + ", ".join(f"{n}: {100 * v:+.1f}%" for n, v in g["kvtier_cold_overhead_per_len"].items())
            )
            lines.append(
                f"kvtier zipf prefix-hit added latency: {g['kvtier_zipf_local_added_ms']:+.2f} ms "
                f"(goal <= 1 ms); plain prefix-hit phase: {g['kvtier_local_added_ms']:+.2f} ms"
            )
        if "verify_reload_ratio" in g:
            lines.append(
                f"kvtier-verify (0.1 % sampled verification) / kvtier TTFT: reload {g['verify_reload_ratio']:.3f}x, "
                f"cold {g['verify_cold_ratio']:.3f}x, zipf prefix-hit {g['verify_zipf_local_ratio']:.3f}x"
            )
        if "lmcache_cold_overhead" in g:
            lines.append(
                f"lmcache first-time overhead: {100 * g['lmcache_cold_overhead']:+.1f}%; reload/prefix-hit "
                f"{g['lmcache_reload_over_local']:.2f}x; zipf prefix-hit added "
                f"{g['lmcache_zipf_local_added_ms']:+.2f} ms"
            )
    return "\n".join(lines)


PLOT_CODE = r"""
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
s = json.load(open(sys.argv[1]))["summary"]
cfgs = [c for c in ("none", "kvtier", "lmcache") if c in s]
lengths = [1020, 2000, 3000, 3500]
fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
ax = axes[0]
w = 0.8 / (2 * len(cfgs))
colors = {"none": "#888888", "kvtier": "#1f77b4", "lmcache": "#d62728"}
for i, c in enumerate(cfgs):
    for j, ph in enumerate(("cold", "reload")):
        xs = [k + (2 * i + j) * w - 0.4 + w / 2 for k in range(len(lengths))]
        ys = [s[c][ph]["by_len"][str(n)]["ttft_ms"] for n in lengths]
        ax.bar(xs, ys, w, color=colors[c], alpha=1.0 if ph == "cold" else 0.5,
               label=f"{c} {ph}", hatch=None if ph == "cold" else "//")
ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
ax.set_xlabel("document tokens"); ax.set_ylabel("mean TTFT (ms)")
ax.set_title("cold (first time) vs reload after prefix-cache reset")
ax.legend(fontsize=7)
ax = axes[1]
phs = ["local", "zipf_local"]
for i, c in enumerate(cfgs):
    xs = [k + i * 0.8 / len(cfgs) - 0.4 + 0.4 / len(cfgs) for k in range(len(phs))]
    ys = [s[c][ph]["mean_ms"] for ph in phs]
    lo = [s[c][ph]["mean_ms"] - s[c][ph]["min_ms"] for ph in phs]
    hi = [s[c][ph]["max_ms"] - s[c][ph]["mean_ms"] for ph in phs]
    ax.bar(xs, ys, 0.8 / len(cfgs), color=colors[c], yerr=[lo, hi], capsize=3, label=c)
ax.set_xticks(range(len(phs)), ["prefix hit (same doc)", "zipf(1.1) prefix hits"])
ax.set_ylabel("mean TTFT (ms), bars = per-round min-max")
ax.set_title("requests served by vLLM's own prefix cache")
ax.legend(fontsize=8)
fig.suptitle("vLLM 0.32 CPU, tiny Llama, 1 worker core: no connector vs kvtier vs LMCache 0.5.6 MP")
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
print(sys.argv[2])
"""


def plot(json_path: Path, png: Path, candidates: list[Path]) -> str | None:
    for py in candidates:
        if not py or not Path(py).exists():
            continue
        r = subprocess.run([str(py), "-c", "import matplotlib"], capture_output=True)
        if r.returncode != 0:
            continue
        png.parent.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            [str(py), "-c", PLOT_CODE, str(json_path), str(png)], capture_output=True, text=True
        )
        if r.returncode == 0:
            return str(png)
        print(f"plot failed with {py}: {r.stderr[-800:]}", file=sys.stderr)
    return None


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round, 1 document per length, 12 zipf requests")
    ap.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        help="also print the JSON result to stdout ('-') or write it to PATH",
    )
    ap.add_argument(
        "--out",
        default=str(Path(os.environ.get("TMPDIR", "/tmp")) / "kvtier-bench-vllm"),
        help="directory for the JSON result and logs",
    )
    ap.add_argument("--configs", default="none,kvtier,lmcache")
    ap.add_argument(
        "--rounds", type=int, default=None, help="instances per configuration (default 2; quick 1)"
    )
    ap.add_argument("--docs-per-length", type=int, default=None, help="default 2; quick 1")
    ap.add_argument("--zipf-requests", type=int, default=None, help="default 40; quick 12")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--gap", type=float, default=0.3, help="pause after each request (s)")
    ap.add_argument("--zipf-gap", type=float, default=0.1)
    ap.add_argument("--plot", default=str(REPO / "docs" / "plots" / "vllm_ttft.png"), help='PNG path ("": none)')
    args = ap.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.docs_per_length = args.docs_per_length or (1 if args.quick else 2)
    args.zipf_requests = args.zipf_requests or (12 if args.quick else 40)
    configs = [c for c in args.configs.split(",") if c]

    out_dir = Path(args.out)
    logdir = out_dir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    vllm_py = harness.vllm_python()
    model = harness.build_tiny_model(vllm_py)
    lm_py: Path | None = None
    failures: dict[str, str] = {}
    if "lmcache" in configs:
        try:
            lm_py = lmcache_python()
        except Exception as exc:  # recorded, the other configurations still run
            failures["lmcache"] = f"environment: {exc}"
            configs.remove("lmcache")
            print(f"LMCache unavailable: {exc}", file=sys.stderr)

    rounds: list[dict[str, Any]] = []
    t_start = time.time()
    for rnd in range(args.rounds):
        for cfg in configs:
            if cfg in failures:
                continue
            print(f"[bench] round {rnd + 1}/{args.rounds}: {cfg}", file=sys.stderr, flush=True)
            try:
                r = run_instance(cfg, model, args, logdir, vllm_py, lm_py)
            except Exception as exc:
                failures[cfg] = f"round {rnd + 1}: {type(exc).__name__}: {str(exc)[-3000:]}"
                print(f"[bench] {cfg} failed: {failures[cfg]}", file=sys.stderr, flush=True)
                continue
            r["round"] = rnd + 1
            rounds.append(r)
            # partial results survive an interrupted run
            (out_dir / "bench_vllm.partial.json").write_text(
                json.dumps({"failures": failures, "rounds": rounds}, indent=1, default=str)
            )
            print(
                f"[bench]   cold {mean([x['ttft_ms'] for x in r['cold']]):.1f} ms, local "
                f"{mean([x['ttft_ms'] for x in r['local']]):.1f} ms, reload "
                f"{mean([x['ttft_ms'] for x in r['reload']]):.1f} ms, zipf-local "
                f"{mean([x['ttft_ms'] for x in r['zipf_local']]):.1f} ms, loaded "
                f"{[x['loaded'] for x in r['reload']]}",
                file=sys.stderr,
                flush=True,
            )

    summary = summarize(rounds) if rounds else {}
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "wall_s": round(time.time() - t_start, 1),
        "params": {k: v for k, v in vars(args).items() if k not in ("json",)},
        "lengths": LENGTHS,
        "host_cpus": os.cpu_count(),
        "failures": failures,
        "summary": summary,
        "rounds": [{k: v for k, v in r.items()} for r in rounds],
    }
    json_path = out_dir / "bench_vllm.json"
    json_path.write_text(json.dumps(result, indent=1, default=str))
    if summary:
        print(table(summary))
    for cfg, why in failures.items():
        print(f"FAILED {cfg}: {why[:2000]}")
    print(f"json: {json_path}")
    if summary and args.plot:  # --plot "" skips the plot
        cands = [
            Path(sys.executable),
            vllm_py,
            *([lm_py] if lm_py else []),
            Path(os.environ.get("KVTIER_PLOT_PYTHON", "")) if os.environ.get("KVTIER_PLOT_PYTHON") else None,
            harness.cache_dir() / "plot-venv" / "bin" / "python",
        ]
        png = plot(json_path, Path(args.plot), [c for c in cands if c])
        print(f"plot: {png or 'skipped (no python with matplotlib; set KVTIER_PLOT_PYTHON)'}")
    if args.json == "-":
        print(json.dumps({"summary": summary, "failures": failures}, indent=1, default=str))
    elif args.json:
        shutil.copyfile(json_path, args.json)
    return 0 if rounds and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
