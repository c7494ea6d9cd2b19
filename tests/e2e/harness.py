"""Process and HTTP helpers for end-to-end tests and benchmarks with a real (CPU) vLLM.

Pytest-independent and stdlib-only: it runs from the project venv (no vllm/torch there) and launches
vLLM and the kvtier server with the vLLM venv's python (see ``scripts/vllm_env.sh``).

Typical use::

    py = vllm_python()                       # builds/caches the vLLM venv
    model = build_tiny_model(py)             # builds/caches the tiny random Llama
    with start_vllm(model, free_port(), None, logdir=Path("/tmp/logs")) as v:
        ids, ttft = complete(v.port, list(range(10, 2010)), 8)
        print(metrics(v.port)["vllm:prefix_cache_hits_total"])

Every process is started in its own session/process group; ``Proc.stop()`` kills the whole group
(SIGTERM, then SIGKILL after a grace), and an atexit hook kills every group still running.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[2]
VLLM_ENV_SCRIPT = REPO / "scripts" / "vllm_env.sh"
TINY_MODEL_SCRIPT = Path(__file__).resolve().parent / "tiny_model.py"
SERVED_MODEL_NAME = "tiny"
MAX_MODEL_LEN = 4096
KVTIER_READY_LINE = "kvtier server ready"
T = TypeVar("T")

VLLM_BASE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB -> 4096 blocks of 128 tokens
    "VLLM_SERVER_DEV_MODE": "1",  # enables POST /reset_prefix_cache
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # Equal compute cores with and without a kv-transfer-config (see reference/vllm-on-cpu.md).
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
}


def cache_dir() -> Path:
    return Path(os.environ.get("KVTIER_CACHE_DIR") or Path.home() / ".cache" / "kvtier")


def default_logdir() -> Path:
    d = Path(os.environ.get("KVTIER_E2E_LOGDIR") or Path(tempfile.gettempdir()) / "kvtier-e2e-logs")
    d.mkdir(parents=True, exist_ok=True)
    return d


# --------------------------------------------------------------------------- environment


def vllm_python(timeout: float = 1800) -> Path:
    """Run scripts/vllm_env.sh (cached, idempotent) and return the vLLM venv's python.

    Raises RuntimeError with the script's output tail when it fails.
    """
    r = subprocess.run(
        ["bash", str(VLLM_ENV_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    if r.returncode != 0 or not lines:
        raise RuntimeError(
            f"scripts/vllm_env.sh failed (rc={r.returncode}):\n{_tail(r.stdout + r.stderr, 60)}"
        )
    py = Path(lines[-1].strip())
    if not py.exists():
        raise RuntimeError(f"scripts/vllm_env.sh printed {py}, which does not exist")
    return py


def prepare_bench(out: str) -> tuple[Path, Path, Path]:
    """A bench's output directory (with logs/), the vLLM venv's python and the tiny model: (out, python, model)."""
    out_dir = Path(out)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    py = vllm_python()
    return out_dir, py, build_tiny_model(py)


def build_tiny_model(python: str | os.PathLike, seed: int = 0, out: str | os.PathLike | None = None) -> Path:
    """Build (or reuse) the tiny random Llama with the vLLM venv's python; return its directory."""
    cmd = [str(python), str(TINY_MODEL_SCRIPT), "--seed", str(seed)]
    if out is not None:
        cmd += ["--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"tiny_model.py failed (rc={r.returncode}):\n{_tail(r.stdout + r.stderr, 60)}")
    return Path(lines[-1].strip())


def default_vllm_python() -> Path:
    """The vLLM venv's python without running the env script (KVTIER_VLLM_PYTHON overrides)."""
    if os.environ.get("KVTIER_VLLM_PYTHON"):
        return Path(os.environ["KVTIER_VLLM_PYTHON"])
    venv = os.environ.get("KVTIER_VLLM_VENV") or cache_dir() / "vllm-0.32.0-venv"
    return Path(venv) / "bin" / "python"


# --------------------------------------------------------------------------- processes


def options_of(text: str) -> dict[str, str]:
    """A benchmark's ``KEY=VALUE,...`` connector options (``kvtier.KEY``)."""
    return dict(pair.split("=", 1) for pair in text.split(",") if pair)


def kvtier_connector_config(port: int, **options: object) -> dict:
    """vLLM's --kv-transfer-config for the kvtier connector; `options` become `kvtier.<name>` keys.

    With `kv_load_failure_policy` "recompute", as docs/quickstart.md and deploy/ set it: blocks the connector
    reports as not loaded are recomputed (vLLM's default, "fail", answers those requests with HTTP 500).
    """
    extra = {"kvtier.url": f"tcp://127.0.0.1:{port}", **{f"kvtier.{k}": v for k, v in options.items()}}
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.connector.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(text: str, n: int = 40) -> str:
    return "\n".join(text.splitlines()[-n:])


_LIVE: set[Proc] = set()
_LIVE_LOCK = threading.Lock()


class ProcessDied(RuntimeError):
    pass


class Proc:
    """A child process running in its own process group, logging to ``log_path``."""

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.port = port
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab", buffering=0)  # noqa: SIM115 (closed in stop())
        self._log.write(f"$ {' '.join(self.cmd)}\n".encode())
        self.popen = subprocess.Popen(
            self.cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
        self.pid = self.popen.pid
        self.pgid = self.pid  # start_new_session: the child leads its own group
        with _LIVE_LOCK:
            _LIVE.add(self)

    # -- state
    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 60) -> str:
        return _tail(self.log_text(), n)

    def check_alive(self) -> None:
        if not self.alive():
            raise ProcessDied(
                f"{self.name} (pid {self.pid}) exited with rc={self.returncode}; log {self.log_path}:\n"
                f"{self.log_tail()}"
            )

    # -- termination
    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM the whole process group, SIGKILL it after ``grace`` seconds; return the exit code."""
        if self._group_alive():
            self._signal_group(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                self.popen.poll()
                if not self._group_alive():
                    break
                time.sleep(0.1)
            else:
                self._signal_group(signal.SIGKILL)
        return self._reap()

    def kill9(self) -> int | None:
        """SIGKILL the whole process group immediately."""
        self._signal_group(signal.SIGKILL)
        return self._reap()

    def _reap(self) -> int | None:
        try:
            rc = self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            rc = None
        # Children of the group that outlive the leader (vLLM's engine core) get SIGKILL too.
        deadline = time.monotonic() + 10
        while self._group_alive() and time.monotonic() < deadline:
            self._signal_group(signal.SIGKILL)
            time.sleep(0.1)
        with contextlib.suppress(Exception):
            self._log.close()
        with _LIVE_LOCK:
            _LIVE.discard(self)
        return rc

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Proc({self.name!r}, pid={self.pid}, port={self.port}, alive={self.alive()})"


def kill_all() -> None:
    """Kill every process group this module started and that is still running."""
    with _LIVE_LOCK:
        procs = list(_LIVE)
    for p in procs:
        p._signal_group(signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(Exception):
            p._reap()


atexit.register(kill_all)


def _wait_ready(proc: Proc, check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        proc.check_alive()
        if check():
            return
        if time.monotonic() > deadline:
            tail = proc.log_tail()
            proc.kill9()
            raise TimeoutError(
                f"{proc.name} not ready ({what}) after {timeout:.0f} s; log {proc.log_path}:\n{tail}"
            )
        time.sleep(0.25)


def tcp_open(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def start_kvtier(
    port: int,
    http_port: int,
    l1_size_gb: float,
    extra_args: Iterable[str] = (),
    *,
    python: str | os.PathLike | None = None,
    logdir: str | os.PathLike | None = None,
    env_extra: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    name: str | None = None,
    adopt: bool = False,
    wrapper: Sequence[str] = (),
) -> Proc:
    """Start ``kvtier server`` and wait until it is ready.

    `wrapper`: a command line the server runs under (e.g. ``strace ... --`` to inject faults), in the same
    process group, so that ``Proc.stop`` ends both.

    `adopt`: let it adopt the L1 a previous server on this port left (warm restart). Off by default, so each
    test's server starts empty and a clean stop removes its segment instead of keeping it for a successor.

    Ready = a log line containing "kvtier server ready" (preferred) or, failing that, a TCP connect to
    ``port`` succeeding.  Raises ProcessDied/TimeoutError with the log tail.
    """
    py = Path(python) if python is not None else default_vllm_python()
    cmd = [
        *wrapper,
        str(py),
        "-m",
        "kvtier.server.cli",
        "server",
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--l1-size-gb",
        str(l1_size_gb),
        *([] if adopt else ["--no-l1-adopt"]),
        *extra_args,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DO_NOT_TRACK": "1", **(env_extra or {})}
    name = name or f"kvtier-{port}"
    log = Path(logdir or default_logdir()) / f"{name}-{int(time.time())}.log"
    proc = Proc(name, cmd, log, env=env, port=port, cwd=REPO)
    proc.http_port = http_port  # type: ignore[attr-defined]

    # Prefer the ready line; accept an open port only after a short head start for the line, so a
    # server that binds before it is fully initialised is not used too early.
    t0 = time.monotonic()

    def ready() -> bool:
        if KVTIER_READY_LINE in proc.log_text():
            return True
        return time.monotonic() - t0 > 5.0 and tcp_open(port)

    _wait_ready(proc, ready, timeout, f"'{KVTIER_READY_LINE}' or tcp :{port}")
    return proc


def start_vllm(
    model_dir: str | os.PathLike,
    port: int,
    kv_transfer_config: dict | None,
    env_extra: Mapping[str, str] | None = None,
    *,
    python: str | os.PathLike | None = None,
    logdir: str | os.PathLike | None = None,
    extra_args: Iterable[str] = (),
    timeout: float = 180.0,
    name: str | None = None,
    wait: bool = True,
) -> Proc:
    """Start ``vllm serve`` on the CPU backend and wait for GET /health == 200.

    Fails fast (ProcessDied with the log tail) if the process exits during startup.
    """
    py = Path(python) if python is not None else default_vllm_python()
    cmd = [
        str(py),
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--served-model-name",
        SERVED_MODEL_NAME,
    ]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    cmd += list(extra_args)
    env = {**os.environ, **VLLM_BASE_ENV, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    name = name or f"vllm-{port}"
    log = Path(logdir or default_logdir()) / f"{name}-{int(time.time())}.log"
    proc = Proc(name, cmd, log, env=env, port=port, cwd=REPO)
    if wait:
        _wait_ready(proc, lambda: health(port), timeout, f"GET :{port}/health")
    return proc


# --------------------------------------------------------------------------- HTTP


def _url(port: int, path: str) -> str:
    return f"http://127.0.0.1:{port}{path}"


def http_json(
    port: int, path: str, body: Any | None = None, timeout: float = 120.0, method: str | None = None
) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(_url(port, path), data=data, method=method or ("POST" if data else "GET"))
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{req.method} {path} -> {e.code}: {e.read()[:2000]!r}") from e
    return json.loads(raw) if raw else None


def health(port: int, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(_url(port, "/health"), timeout=timeout) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _completion_body(prompt_token_ids: Sequence[int], max_tokens: int, stream: bool, **extra: Any) -> dict:
    body = {
        "model": SERVED_MODEL_NAME,
        "prompt": [int(t) for t in prompt_token_ids],
        "max_tokens": int(max_tokens),
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return body


def complete_full(
    port: int, prompt_token_ids: Sequence[int], max_tokens: int, timeout: float = 300.0, **extra: Any
) -> dict:
    """POST /v1/completions (non-streaming, greedy); return the JSON response plus ``latency_s``."""
    t0 = time.perf_counter()
    resp = http_json(
        port, "/v1/completions", _completion_body(prompt_token_ids, max_tokens, False, **extra), timeout
    )
    resp["latency_s"] = time.perf_counter() - t0
    return resp


def complete(
    port: int, prompt_token_ids: Sequence[int], max_tokens: int, timeout: float = 300.0, **extra: Any
) -> tuple[list[int] | str, float]:
    """Greedy completion of a token-id prompt.

    Returns ``(output token ids, latency_s)``; the token ids come from vLLM's ``return_token_ids``
    (falls back to the text when the server does not return ids).
    """
    resp = complete_full(port, prompt_token_ids, max_tokens, timeout, **extra)
    choice = resp["choices"][0]
    out = choice.get("token_ids")
    return (list(out) if out is not None else choice.get("text", "")), resp["latency_s"]


def complete_stream(
    port: int, prompt_token_ids: Sequence[int], max_tokens: int, timeout: float = 300.0, **extra: Any
) -> tuple[list[int] | str, float, float]:
    """Streaming greedy completion; returns ``(output token ids or text, ttft_s, total_s)``.

    TTFT = time from sending the request to the first chunk that carries generated output.
    """
    body = json.dumps(_completion_body(prompt_token_ids, max_tokens, True, **extra)).encode()
    req = urllib.request.Request(_url(port, "/v1/completions"), data=body, method="POST")
    req.add_header("Content-Type", "application/json")
    ids: list[int] = []
    text: list[str] = []
    ttft: float | None = None
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            msg = json.loads(payload)
            for ch in msg.get("choices") or []:
                got = ch.get("token_ids") or []
                if ttft is None and (got or ch.get("text")):
                    ttft = time.perf_counter() - t0
                ids.extend(got)
                text.append(ch.get("text") or "")
    total = time.perf_counter() - t0
    if ttft is None:
        ttft = total
    return (ids if ids else "".join(text)), ttft, total


def kvtier_status(http_port: int) -> dict:
    """kvtier's admin `GET /status` (open without the admin token): L1 and L2 figures, clients, namespaces."""
    return http_json(http_port, "/status", timeout=10.0)


def wait_for(get: Callable[[], T], done: Callable[[T], bool], timeout: float, what: str) -> T:
    """Poll `get` every 0.2 s until `done` holds for what it returns (returned); RuntimeError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = get()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} after {timeout} s: {value}")
        time.sleep(0.2)


def wait_l2_drained(http_port: int, timeout: float = 60.0) -> dict:
    """Wait until kvtier's L2 writes are all on disk (`l2_inflight` 0, something written); its L2 stats."""
    return wait_for(lambda: kvtier_status(http_port)["l2"],
                    lambda s: s.get("l2_inflight") == 0 and s.get("l2_written", 0) > 0, timeout,
                    "L2 writes not drained")


def wait_remote_drained(http_port: int, timeout: float = 60.0) -> dict:
    """Wait until kvtier's remote-tier writes are all in the store (none queued or in flight, something
    written); its remote stats."""
    return wait_for(lambda: kvtier_status(http_port)["remote"],
                    lambda s: (s.get("remote_inflight") == 0 and s.get("remote_queue_depth") == 0
                               and s.get("remote_written", 0) > 0), timeout, "remote writes not drained")


def mapped_bytes(pid: int, path: str) -> int:
    """How much of the file `path` process `pid` has in its page tables now (its mappings' Rss, smaps)."""
    total, inside = 0, False
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header: range perms offset dev inode [path]
                inside = len(fields) >= 6 and fields[5] == path
            elif inside and fields[:1] == ["Rss:"]:
                total += int(fields[1]) * 1024
    return total


def cached_tokens(http_port: int, model: str | os.PathLike, tokens: Sequence[int]) -> int:
    """The most of `tokens` kvtier holds in one namespace of `model` (admin `POST /cache/lookup`, no token set)."""
    answer = http_json(http_port, "/cache/lookup", {"tokens": list(tokens), "model": str(model)}, timeout=10.0)
    return max(ns["cached_tokens"] for ns in answer["namespaces"])


def wait_cached(http_port: int, model: str | os.PathLike, tokens: Sequence[int], at_least: int,
                timeout: float = 30.0) -> int:
    """Wait until kvtier holds at least `at_least` tokens of `tokens` in one namespace of `model`: a store still
    in flight when its vLLM stops is lost, so a test that stops a vLLM and expects its prompt back waits for it
    first. The tokens held."""
    return wait_for(lambda: cached_tokens(http_port, model, tokens), lambda n: n >= at_least, timeout,
                    f"kvtier holds fewer than {at_least} tokens")


def reset_prefix_cache(port: int, reset_external: bool = False, timeout: float = 30.0) -> None:
    """POST /reset_prefix_cache (needs VLLM_SERVER_DEV_MODE=1); ``reset_external`` also resets the connector.

    vLLM answers ``{"success": false}`` while blocks are still held, e.g. by a finished request whose
    asynchronous store (kvtier's default) is not reported yet; as its docs say, retry: once it succeeds, every
    store of the requests before it is done."""
    path = "/reset_prefix_cache" + ("?reset_external=true" if reset_external else "")
    deadline = time.monotonic() + timeout
    while True:
        req = urllib.request.Request(_url(port, path), data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            if r.status != 200:
                raise RuntimeError(f"POST {path} -> {r.status}")
            if json.loads(r.read() or b"{}").get("success", True):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"POST {path}: vLLM still refused the reset after {timeout:.0f} s")
        time.sleep(0.05)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str, drop_labels: Iterable[str] = ("model_name", "engine")) -> dict[str, float]:
    """Parse Prometheus text into ``{name or name{k="v",...}: value}``.

    Labels in ``drop_labels`` are removed (the per-model/engine labels vLLM adds), and samples that
    then collide are summed.  For a metric with labels both the labelled keys and the plain name
    (summed over all its samples) are present, e.g. ``vllm:prompt_tokens_by_source_total`` and
    ``vllm:prompt_tokens_by_source_total{source="local_compute"}``.
    """
    drop = set(drop_labels)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2), m.group(3)
        try:
            v = float(value)
        except ValueError:
            continue
        kv = [(k, val) for k, val in _LABEL.findall(labels or "") if k not in drop]
        if kv:
            key = name + "{" + ",".join(f'{k}="{val}"' for k, val in sorted(kv)) + "}"
            out[key] = out.get(key, 0.0) + v
        # The plain name sums all samples; histogram buckets (label "le") would double count.
        if not any(k in ("le", "quantile") for k, _ in kv):
            out[name] = out.get(name, 0.0) + v
    return out


def metrics_text(port: int, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(_url(port, "/metrics"), timeout=timeout) as r:
        return r.read().decode()


def metrics(port: int) -> dict[str, float]:
    """vLLM's (or kvtier's) /metrics as a dict, see :func:`parse_metrics`."""
    return parse_metrics(metrics_text(port))


def metric(m: Mapping[str, float], name: str, **labels: str) -> float:
    """Look up one sample; ``metric(m, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")``."""
    if labels:
        key = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        return m.get(key, 0.0)
    return m.get(name, 0.0)


def prompt_ids(n: int, seed: int = 0, vocab: int = 4096, low: int = 10) -> list[int]:
    """A deterministic pseudo-random token-id prompt of exactly ``n`` tokens (ids in [low, vocab))."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(low, vocab) for _ in range(n)]


def warm_up(port: int) -> None:
    """Four unrelated streamed requests (500-3,000 tokens): a fresh vLLM's first requests are 2-3x slower, so
    benches send these before they measure."""
    for k, n in enumerate((500, 2000, 1000, 3000)):
        complete_stream(port, prompt_ids(n, seed=91000 + k), 4, timeout=120)


if __name__ == "__main__":  # tiny CLI for manual use: python tests/e2e/harness.py env|model
    what = sys.argv[1] if len(sys.argv) > 1 else "env"
    py = vllm_python()
    print(py if what == "env" else build_tiny_model(py))
