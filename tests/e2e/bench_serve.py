"""vLLM's own benchmark client (`vllm bench serve`) against no connector, kvtier and LMCache 0.5.6 MP.

Not a pytest module (no ``test_`` prefix). Run from the project venv::

    .venv/bin/python tests/e2e/bench_serve.py [--quick] [--modes saturation,rate,fits]
        [--configs none,kvtier,lmcache|null|kvtier-nostore] [--rounds 2] [--kvtier-options KEY=VALUE,...] [--hook-times]
        [--thread-cpu]
        [--json [PATH]]

Workload: ``vllm bench serve --dataset-name prefix_repetition`` (text prompts built by the client from the
tiny model's tokenizer, ``tests/e2e/tiny_model.py``): 32 prefixes of 2,000 tokens, each followed by a
100-token suffix, 320 prompts in a shuffled order (10 per prefix), 32 output tokens (``--ignore-eos``,
greedy), on one CPU vLLM 0.32 (``--enforce-eager``, one worker core in every configuration,
``VLLM_CPU_NUM_OF_RESERVED_CPU=1``, as bench_vllm.py). Modes:

- ``saturation``: ``--max-concurrency 16 --request-rate inf``, vLLM's KV cache forced to 160 blocks of 128
  tokens (``--num-gpu-blocks-override 160``: about 9 of the 32 prefixes fit), so most prefixes come back
  after vLLM evicted them: the connector has something to load;
- ``rate``: the same cache, Poisson arrivals at 10 requests/s, no concurrency limit;
- ``fits``: vLLM's default cache (``VLLM_CPU_KVCACHE_SPACE=1``: 4,096 blocks), every prefix stays in vLLM's
  own prefix cache, 10 requests/s: nothing to load, every new prompt still stored (the connector's cost).

Configurations (a fresh vLLM, and a fresh ``kvtier server --l1-size-gb 1`` or ``lmcache server
--l1-size-gb 1``, for each run; both stopped after it): ``none`` (no kv-transfer-config), ``kvtier`` (the
kv-transfer-config of docs/quickstart.md, ``harness.kvtier_connector_config``, with ``--kvtier-options``), ``lmcache``
(``LMCacheMPConnector``, ``scripts/lmcache_env.sh``'s separate venv), and, only when named, ``null``
(null_connector.py, a connector that does nothing: vLLM's own cost of having one, to split a connector's cost)
and ``kvtier-nostore`` (kvtier, every request sent with the hint ``store: false``: its lookups and per-step hooks
without its stores, to split kvtier's own cost).
Per mode they run interleaved ``--rounds`` times, in the listed order in odd rounds and the reverse in even
ones (none, kvtier, kvtier, none, none, ...), so a slow drift of the machine hits all of them alike.

Each run: 4 unrelated warm-up requests, ``POST /reset_prefix_cache``, then the client (same seed, so the
same prompts in the same order for every configuration). The figures come from the client's
``--save-result`` JSON: mean / p50 / p99 TTFT, mean TPOT, p99 ITL, request throughput; vLLM's
``/metrics`` gives where the prompt tokens came from (computed, vLLM's prefix cache, the connector).
Output: a table per mode with the mean over rounds, each configuration's noise band (the spread of its
rounds, (max - min) / mean), and the ratio to ``none`` (mean over mean, and the range of the per-round
ratios), and to ``null`` too when it ran (a connector's cost beyond vLLM's own); from 3 rounds on, also the
geometric mean of the per-round ratios (each round's two runs are neighbours) with its 95 %
percentile-bootstrap interval: the figure to hold against a margin such as "within 5 %". A difference inside
the noise bands is not a result. ``--hook-times`` also times the kvtier
connector's hooks inside vLLM (``KVTIER_HOOK_TIMES``, connector/vllm/hook_times.py) and adds them to the table:
calls, totals and the hooks' own CPU time of the client's requests (the warm-up's subtracted), p99 over all
calls; the wrappers cost a little, so leave it off for the figures that compare configurations.
``--thread-cpu`` adds, per configuration, the CPU seconds and involuntary context switches of each thread of
vLLM and the daemon during the client's run (thread_cpu.py): where the cores went.

Every wait is bounded (startup, warm-up, the client: ``--client-timeout``); vLLM, the daemons and the
client each run in their own process group and are killed on error or exit (harness.Proc).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_vllm  # noqa: E402  (LMCache's venv, server and connector config)
import harness  # noqa: E402
import thread_cpu  # noqa: E402

REPO = harness.REPO
CONFIGS = ("none", "null", "kvtier", "kvtier-nostore", "lmcache")
DEFAULT_CONFIGS = ("none", "kvtier", "lmcache")
# ratios to each of these that ran; to null: a connector's cost beyond vLLM's own
BASELINES = ("none", "null")
NULL_CONNECTOR = {  # null_connector.py: vLLM's own cost of a configured connector
    "kv_connector": "NullConnector",
    "kv_connector_module_path": "null_connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",  # as kvtier's config (it never loads)
}
# kvtier-nostore: kvtier with every request's hint `store: false` (docs/hints.md): its lookups and per-step hooks
# without its stores, so that kvtier's own cost splits into the two
NO_STORE_BODY = '{"kv_transfer_params": {"kvtier": {"store": false}}}'
BLOCKS_SMALL = 160  # vLLM KV cache blocks (128 tokens) in saturation and rate: the prefixes do not fit
MODES: dict[str, dict[str, Any]] = {
    "saturation": {"max_concurrency": 16, "request_rate": "inf", "blocks": BLOCKS_SMALL},
    "rate": {"max_concurrency": None, "request_rate": "10", "blocks": BLOCKS_SMALL},
    "fits": {
        "max_concurrency": None,
        "request_rate": "10",
        "blocks": None,
    },  # VLLM_CPU_KVCACHE_SPACE=1: 4,096
}
# (key in the client's --save-result JSON, row label, higher is better)
METRICS = (
    ("mean_ttft_ms", "mean TTFT ms", False),
    ("p50_ttft_ms", "p50 TTFT ms", False),
    ("p99_ttft_ms", "p99 TTFT ms", False),
    ("mean_tpot_ms", "mean TPOT ms", False),
    ("p99_itl_ms", "p99 ITL ms", False),
    ("request_throughput", "requests/s (higher=better)", True),
)
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
HOOKS = ("get_num_new_matched_tokens", "build_connector_meta", "start_load_kv", "wait_for_save")
ERROR_LINES = re.compile(r"Traceback|kvtier: \d+ of|store failed|load failed|Failed to|ERROR")


# --------------------------------------------------------------------------- one run


def vllm_counters(port: int) -> dict[str, float]:
    m = harness.metrics(port)
    out = {s: harness.metric(m, "vllm:prompt_tokens_by_source_total", source=s) for s in SOURCES}
    out["preemptions"] = harness.metric(m, "vllm:num_preemptions_total")
    return out


def client_cmd(
    vllm_py: Path, model: Path, port: int, mode: str, config: str, args: argparse.Namespace, result: Path
) -> list[str]:
    m = MODES[mode]
    cmd = [
        str(vllm_py), "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--backend", "vllm", "--host", "127.0.0.1", "--port", str(port), "--endpoint", "/v1/completions",
        "--model", str(model), "--served-model-name", harness.SERVED_MODEL_NAME,
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(args.prefix_len),
        "--prefix-repetition-suffix-len", str(args.suffix_len),
        "--prefix-repetition-num-prefixes", str(args.prefixes),
        "--prefix-repetition-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts),
        "--seed", str(args.seed),
        "--ignore-eos", "--temperature", "0",
        "--request-rate", str(m["request_rate"]),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name,
        "--disable-tqdm",
    ]  # fmt: skip
    if m["max_concurrency"]:
        cmd += ["--max-concurrency", str(m["max_concurrency"])]
    if config == "kvtier-nostore":
        cmd += ["--extra-body", NO_STORE_BODY]
    return cmd


def run_client(cmd: list[str], log: Path, result: Path, timeout: float) -> dict[str, Any]:
    env = {**os.environ, **harness.VLLM_BASE_ENV, "PYTHONUNBUFFERED": "1"}
    proc = harness.Proc("bench-client", cmd, log, env=env, cwd=REPO)
    deadline = time.monotonic() + timeout
    try:
        while proc.alive():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"vllm bench serve still running after {timeout:.0f} s; log {log}:\n{proc.log_tail(30)}"
                )
            time.sleep(0.5)
    finally:
        rc = proc.stop() if proc.alive() else proc.kill9()  # reaps; kills what is left of its group
    if rc != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed (rc={rc}); log {log}:\n{proc.log_tail(40)}")
    return json.loads(result.read_text())


def load_hook_times(directory: Path) -> dict[str, dict[str, Any]]:
    """Merge connector/vllm/hook_times.py's files: per hook the calls, the total and its CPU time over every
    process, the means, and the largest p50 / p99 / max of any one process (percentiles do not merge)."""
    merged: dict[str, dict[str, Any]] = {}
    for f in sorted(directory.glob("hook-times-*.json")):
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        for hook, h in data.get("hooks", {}).items():
            m = merged.setdefault(
                hook,
                {"calls": 0, "total_ms": 0.0, "cpu_ms": 0.0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0},
            )
            m["calls"] += h["calls"]
            m["total_ms"] += h["total_ms"]
            m["cpu_ms"] += h.get("cpu_ms", 0.0)
            for k in ("p50_ms", "p99_ms", "max_ms"):
                m[k] = max(m[k], h[k])
    for m in merged.values():
        _means(m)
    return merged


def _means(m: dict[str, Any]) -> None:
    m["mean_ms"] = m["total_ms"] / m["calls"] if m["calls"] else float("nan")
    m["cpu_mean_ms"] = m["cpu_ms"] / m["calls"] if m["calls"] else float("nan")


def run_once(
    config: str,
    mode: str,
    rnd: int,
    model: Path,
    args: argparse.Namespace,
    out_dir: Path,
    vllm_py: Path,
    lm_py: Path | None,
) -> dict[str, Any]:
    logdir = out_dir / "logs"
    tag = f"{mode}-{config}-r{rnd}"
    daemon = None
    port = harness.free_port()
    env_extra: dict[str, str] = {}
    hook_dir = out_dir / "hooks" / tag
    try:
        if config in ("kvtier", "kvtier-nostore"):
            kp, kh = harness.free_port(), harness.free_port()
            daemon = harness.start_kvtier(kp, kh, args.l1_gb, python=vllm_py, logdir=logdir, timeout=120)
            kvc, py = harness.kvtier_connector_config(kp, **harness.options_of(args.kvtier_options)), vllm_py
            if args.hook_times:
                shutil.rmtree(hook_dir, ignore_errors=True)
                env_extra["KVTIER_HOOK_TIMES"] = str(hook_dir)
        elif config == "lmcache":
            assert lm_py is not None
            kp, kh = harness.free_port(), harness.free_port()
            daemon = bench_vllm.start_lmcache(lm_py, kp, kh, logdir, l1_gb=args.l1_gb)
            kvc, py = bench_vllm.lmcache_config(kp), lm_py
        elif config == "null":
            kvc, py = NULL_CONNECTOR, vllm_py
            env_extra["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")) if p
            )
        else:
            kvc, py = None, vllm_py
        blocks = MODES[mode]["blocks"]
        extra = ["--num-gpu-blocks-override", str(blocks)] if blocks else []
        t0 = time.monotonic()
        v = harness.start_vllm(
            model,
            port,
            kvc,
            env_extra,
            python=py,
            logdir=logdir,
            extra_args=extra,
            timeout=args.startup_timeout,
            name=f"vllm-{tag}",
        )
        res: dict[str, Any] = {
            "config": config,
            "mode": mode,
            "round": rnd,
            "startup_s": round(time.monotonic() - t0, 1),
        }
        try:
            text = v.log_text()
            res["binding"] = [
                ln.strip()[-160:]
                for ln in text.splitlines()
                if re.search(r"reserve_cpu_num|OMP threads binding", ln)
            ][:2]
            res["kv_cache"] = [
                ln.strip()[-160:]
                for ln in text.splitlines()
                if re.search(r"Overriding num_gpu_blocks|KV cache size", ln)
            ][:3]
            harness.warm_up(v.port)
            harness.reset_prefix_cache(v.port)
            time.sleep(1.5)  # hook_times.py rewrites its files once a second
            before = vllm_counters(v.port)
            hooks_before = load_hook_times(hook_dir) if "KVTIER_HOOK_TIMES" in env_extra else {}
            result = out_dir / "results" / f"{tag}.json"
            result.parent.mkdir(parents=True, exist_ok=True)
            result.unlink(missing_ok=True)
            cmd = client_cmd(vllm_py, model, v.port, mode, config, args, result)
            pgids = {v.pgid: "vllm"} | ({daemon.pgid: "daemon"} if daemon is not None else {})
            threads_before = thread_cpu.snapshot(pgids) if args.thread_cpu else {}
            res["client"] = run_client(cmd, logdir / f"client-{tag}.log", result, args.client_timeout)
            if args.thread_cpu:
                res["threads"] = [
                    asdict(u) for u in thread_cpu.usage(threads_before, thread_cpu.snapshot(pgids))
                ]
            after = vllm_counters(v.port)
            res["prompt_tokens"] = {k: after[k] - before[k] for k in (*SOURCES, "preemptions")}
            if daemon is not None and config != "lmcache":  # chunks kvtier committed (none in kvtier-nostore)
                res["kvtier_stores"] = harness.metric(harness.metrics(kh), "kvtier_stores_total")
            res["log_errors"] = [ln[-300:] for ln in v.log_text().splitlines() if ERROR_LINES.search(ln)][:20]
            res["vllm_log"] = str(v.log_path)
        finally:
            v.stop(grace=20)  # the connector's shutdown writes its final hook times
        if "KVTIER_HOOK_TIMES" in env_extra:  # the client's requests' calls and totals; percentiles: all
            res["hooks"] = hooks = load_hook_times(hook_dir)
            for h, x in hooks.items():
                b = hooks_before.get(h, {"calls": 0, "total_ms": 0.0, "cpu_ms": 0.0})
                for k in ("calls", "total_ms", "cpu_ms"):
                    x[k] -= b[k]
                _means(x)
        return res
    finally:
        if daemon is not None:
            daemon.stop()


# --------------------------------------------------------------------------- summary


def band(xs: list[float]) -> float:
    """Spread of the rounds, (max - min) / mean (0 for one round)."""
    m = statistics.fmean(xs)
    return (max(xs) - min(xs)) / m if m else float("nan")


def ratio_interval(ratios: list[float], resamples: int = 10_000) -> tuple[float, float, float]:
    """Geometric mean of paired per-round ratios and its 95 % percentile-bootstrap interval (rounds resampled
    with replacement, a fixed seed so a result file is reproducible); no interval under 3 rounds."""
    logs = np.log(np.asarray(ratios, dtype=float))
    gm = float(np.exp(logs.mean())) if logs.size else math.nan
    if logs.size < 3:
        return gm, math.nan, math.nan
    means = logs[np.random.default_rng(0).integers(0, logs.size, (resamples, logs.size))].mean(axis=1)
    lo, hi = np.exp(np.percentile(means, [2.5, 97.5]))
    return gm, float(lo), float(hi)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode and configuration: each metric's per-round values, mean and band; ratios to `none` and, when it
    ran, to `null` (`ratio_to_none`, `ratio_to_null`)."""
    out: dict[str, Any] = {}
    for mode in MODES:
        by_cfg: dict[str, list[dict[str, Any]]] = {}
        for r in runs:
            if r["mode"] == mode:
                by_cfg.setdefault(r["config"], []).append(r)
        if not by_cfg:
            continue
        ms: dict[str, Any] = {}
        for cfg, rs in by_cfg.items():
            rs.sort(key=lambda r: r["round"])
            s: dict[str, Any] = {"rounds": len(rs)}
            for key, _, _ in METRICS:
                xs = [float(r["client"].get(key, math.nan)) for r in rs]
                s[key] = {"mean": statistics.fmean(xs), "band": band(xs), "per_round": xs}
            total = {src: sum(r["prompt_tokens"][src] for r in rs) for src in SOURCES}
            all_tokens = sum(total.values()) or math.nan
            s["prompt_token_share"] = {src: total[src] / all_tokens for src in SOURCES}
            s["preemptions"] = [r["prompt_tokens"]["preemptions"] for r in rs]
            s["failed"] = [r["client"].get("failed", 0) for r in rs]
            s["completed"] = [r["client"].get("completed", 0) for r in rs]
            s["startup_s"] = [r["startup_s"] for r in rs]
            s["log_errors"] = sorted({e for r in rs for e in r.get("log_errors", [])})[:10]
            hooks = [r["hooks"] for r in rs if r.get("hooks")]
            if hooks:
                s["hooks"] = {
                    h: {
                        "calls_per_round": statistics.fmean(x[h]["calls"] for x in hooks if h in x),
                        "mean_ms": statistics.fmean(x[h]["mean_ms"] for x in hooks if h in x),
                        "cpu_mean_ms": statistics.fmean(x[h]["cpu_mean_ms"] for x in hooks if h in x),
                        "p99_ms": max(x[h]["p99_ms"] for x in hooks if h in x),
                        "total_ms_per_round": statistics.fmean(x[h]["total_ms"] for x in hooks if h in x),
                    }
                    for h in HOOKS
                    if any(h in x for x in hooks)
                }
            threads = [r["threads"] for r in rs if r.get("threads")]
            if threads:
                s["threads"] = thread_cpu.mean_rows(threads)
            ms[cfg] = s
        for base_cfg in BASELINES:
            if base_cfg not in ms:
                continue
            base = ms[base_cfg]
            for s in ms.values():
                s[f"ratio_to_{base_cfg}"] = {}
                for key, _, _ in METRICS:
                    per_round = [
                        a / b for a, b in zip(s[key]["per_round"], base[key]["per_round"], strict=False) if b
                    ]
                    gm, lo, hi = ratio_interval(per_round)
                    s[f"ratio_to_{base_cfg}"][key] = {
                        "ratio": s[key]["mean"] / base[key]["mean"] if base[key]["mean"] else math.nan,
                        "per_round_min": min(per_round, default=math.nan),
                        "per_round_max": max(per_round, default=math.nan),
                        "per_round_geomean": gm,
                        "interval_95": [lo, hi],
                    }
        out[mode] = ms
    return out


def describe(mode: str, args: argparse.Namespace) -> str:
    m = MODES[mode]
    cache = f"{m['blocks']} blocks" if m["blocks"] else "default (4,096 blocks)"
    conc = f"max concurrency {m['max_concurrency']}, " if m["max_concurrency"] else ""
    return (
        f"{mode}: {args.prefixes} prefixes x {args.prefix_len} + {args.suffix_len} tokens, {args.num_prompts} "
        f"prompts, output {args.output_len}, {conc}request rate {m['request_rate']}, vLLM KV cache {cache}"
    )


def table(summary: dict[str, Any], args: argparse.Namespace) -> str:
    lines: list[str] = []
    w, lw = 24, 28

    def band_txt(c: dict[str, Any], key: str) -> str:
        return f"±{50 * c[key]['band']:.1f}%" if c["rounds"] > 1 else "1 round"

    for mode, ms in summary.items():
        cfgs = [c for c in CONFIGS if c in ms]
        lines += ["", describe(mode, args), f"{'':{lw}s}" + "".join(f"{c:>{w}s}" for c in cfgs)]
        lines.append(f"{'':{lw}s}" + "".join(f"{'mean (band)':>{w}s}" for _ in cfgs))
        for key, label, _ in METRICS:
            cells = [f"{ms[c][key]['mean']:.2f} ({band_txt(ms[c], key)})" for c in cfgs]
            lines.append(f"{label:{lw}s}" + "".join(f"{x:>{w}s}" for x in cells))
        for base_cfg in BASELINES:
            if base_cfg not in ms:
                continue
            rk = f"ratio_to_{base_cfg}"
            lines.append(f"ratio to {base_cfg} (per-round range)")
            for key, label, _ in METRICS:
                cells = []
                for c in cfgs:
                    r = ms[c][rk][key]
                    cells.append(f"{r['ratio']:.2f}x ({r['per_round_min']:.2f}-{r['per_round_max']:.2f})")
                lines.append(f"  {label:{lw - 2}s}" + "".join(f"{x:>{w}s}" for x in cells))
            if min(ms[c]["rounds"] for c in cfgs) >= 3:
                lines.append(f"geomean of per-round ratios to {base_cfg} [95 % bootstrap interval]")
                for key, label, _ in METRICS:
                    cells = []
                    for c in cfgs:
                        r = ms[c][rk][key]
                        lo, hi = r["interval_95"]
                        cells.append(f"{r['per_round_geomean']:.3f}x [{lo:.3f}-{hi:.3f}]")
                    lines.append(f"  {label:{lw - 2}s}" + "".join(f"{x:>{w}s}" for x in cells))
        for src, label in (
            ("local_compute", "prompt tok computed"),
            ("local_cache_hit", "prompt tok vLLM cache"),
            ("external_kv_transfer", "prompt tok connector"),
        ):
            lines.append(
                f"{label:{lw}s}"
                + "".join(f"{100 * ms[c]['prompt_token_share'][src]:>{w - 1}.1f}%" for c in cfgs)
            )
        lines.append(
            f"{'preemptions / round':{lw}s}"
            + "".join(f"{statistics.fmean(ms[c]['preemptions']):>{w}.0f}" for c in cfgs)
        )
        lines.append(
            f"{'failed / completed':{lw}s}"
            + "".join(f"{sum(ms[c]['failed']):>{w - 8}d} / {sum(ms[c]['completed']):<5d}" for c in cfgs)
        )
        lines.append(f"{'rounds':{lw}s}" + "".join(f"{ms[c]['rounds']:>{w}d}" for c in cfgs))
        for c in cfgs:
            for t in ms[c].get("threads", [])[:12]:
                lines.append(
                    f"  {c} thread {t['process']}/{t['thread']} ({t['threads']}): {t['cpu_s']:.2f} CPU s/run, "
                    f"{t['involuntary']:.0f} involuntary switches/run, cores {t['cores']}"
                )
            for h, x in ms[c].get("hooks", {}).items():
                lines.append(
                    f"  {c} hook {h}: {x['calls_per_round']:.0f} calls/round, mean {x['mean_ms']:.3f} ms "
                    f"(CPU {x['cpu_mean_ms']:.3f} ms), p99 {x['p99_ms']:.3f} ms (warm-up included), "
                    f"{x['total_ms_per_round']:.0f} ms/round"
                )
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke: 64 prompts, 1 round")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument(
        "--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}"
    )
    ap.add_argument(
        "--rounds", type=int, default=None, help="runs per configuration and mode (default 2; quick 1)"
    )
    ap.add_argument("--num-prompts", type=int, default=None, help="default 320; quick 64")
    ap.add_argument("--prefixes", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--suffix-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--l1-gb", type=float, default=1.0, help="kvtier's and LMCache's L1")
    ap.add_argument("--kvtier-options", default="", help="KEY=VALUE,... connector options of the kvtier runs")
    ap.add_argument("--seed", type=int, default=0, help="the client's dataset seed (same for every run)")
    ap.add_argument(
        "--hook-times", action="store_true", help="time the kvtier connector's hooks (KVTIER_HOOK_TIMES)"
    )
    ap.add_argument(
        "--thread-cpu",
        action="store_true",
        help="per-thread CPU and involuntary switches of vLLM and the daemon during the client (thread_cpu.py)",
    )
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument(
        "--client-timeout", type=float, default=1200.0, help="bound on one `vllm bench serve` (s)"
    )
    ap.add_argument(
        "--out",
        default=str(Path(os.environ.get("TMPDIR", "/tmp")) / "kvtier-bench-serve"),
        help="directory for the JSON result, the client's results and the logs",
    )
    ap.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        help="also print the JSON summary to stdout ('-') or copy the result to PATH",
    )
    args = ap.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.num_prompts = args.num_prompts or (64 if args.quick else 320)
    modes = [m for m in args.modes.split(",") if m]
    configs = [c for c in args.configs.split(",") if c]
    for name, known in (("mode", MODES), ("config", CONFIGS)):
        bad = [x for x in (modes if name == "mode" else configs) if x not in known]
        if bad:
            ap.error(f"unknown {name}(s): {', '.join(bad)}")

    out_dir, vllm_py, model = harness.prepare_bench(args.out)
    lm_py: Path | None = None
    failures: dict[str, str] = {}
    if "lmcache" in configs:
        try:
            lm_py = bench_vllm.lmcache_python()
        except Exception as exc:  # recorded; the other configurations still run
            failures["lmcache"] = f"environment: {exc}"
            configs.remove("lmcache")
            print(f"LMCache unavailable: {exc}", file=sys.stderr)

    runs: list[dict[str, Any]] = []
    t_start = time.time()
    try:
        for mode in modes:
            for rnd in range(1, args.rounds + 1):
                for cfg in configs if rnd % 2 else configs[::-1]:
                    key = f"{mode}/{cfg}"
                    if key in failures:
                        continue
                    print(
                        f"[bench_serve] {mode} round {rnd}/{args.rounds}: {cfg}", file=sys.stderr, flush=True
                    )
                    try:
                        r = run_once(cfg, mode, rnd, model, args, out_dir, vllm_py, lm_py)
                    except Exception as exc:
                        failures[key] = f"round {rnd}: {type(exc).__name__}: {str(exc)[-3000:]}"
                        print(f"[bench_serve] {key} failed: {failures[key]}", file=sys.stderr, flush=True)
                        continue
                    runs.append(r)
                    c = r["client"]
                    print(
                        f"[bench_serve]   TTFT mean {c['mean_ttft_ms']:.1f} p99 {c['p99_ttft_ms']:.1f} ms, "
                        f"TPOT {c['mean_tpot_ms']:.1f} ms, {c['request_throughput']:.2f} req/s, "
                        f"failed {c.get('failed')}, tokens {r['prompt_tokens']}",
                        file=sys.stderr,
                        flush=True,
                    )
                    (out_dir / "bench_serve.partial.json").write_text(
                        json.dumps({"failures": failures, "runs": runs}, indent=1, default=str)
                    )
    finally:
        harness.kill_all()  # nothing of ours outlives the bench

    summary = summarize(runs) if runs else {}
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
        "wall_s": round(time.time() - t_start, 1),
        "load_avg_at_end": os.getloadavg(),
        "params": {k: v for k, v in vars(args).items() if k != "json"},
        "modes": {m: MODES[m] for m in modes},
        "host_cpus": os.cpu_count(),
        "failures": failures,
        "summary": summary,
        "runs": runs,
    }
    json_path = out_dir / "bench_serve.json"
    json_path.write_text(json.dumps(result, indent=1, default=str))
    if summary:
        print(table(summary, args))
        print(
            "\nband: spread of a configuration's rounds, ±(max-min)/2/mean; ratio ranges: per-round ratios. "
            "Differences inside the bands are noise."
        )
    for key, why in failures.items():
        print(f"FAILED {key}: {why[:2000]}")
    print(f"json: {json_path}")
    if args.json == "-":
        print(json.dumps({"summary": summary, "failures": failures}, indent=1, default=str))
    elif args.json:
        shutil.copyfile(json_path, args.json)
    return 0 if runs and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
