"""Shared helpers of the `kvtier bench` tools: a server subprocess, /proc memory readings, stats, output.

No torch here (the benches must start without it); numpy only.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from kvtier.shm.segment import SHM_DIR, SegmentInUse, remove_stale

READY_LINE = "kvtier server ready"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    port: int
    startup_s: float
    log: list[str] = field(default_factory=list)
    shm_name: str = ""
    shm_dir: str = SHM_DIR

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then remove the L1 it kept for a next start (a bench's server is throwaway)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for name in (f"{self.shm_name}.journal", self.shm_name):  # the journal first, as the server does
            with contextlib.suppress(SegmentInUse, OSError):
                remove_stale(name, self.shm_dir)


def start_server(l1_size_gb: float, extra: Sequence[str] = (), timeout: float = 60.0,
                 http_port: int | None = 0, port: int = 0) -> ServerProcess:
    """Start `kvtier server` on `port` (default: a free one) with its own shm name and wait for its ready line
    on stderr. Its journal is on or off as `extra` or the environment say (KVTIER_L1_ADOPT); a restart on the
    same port adopts what it left unless `stop()` removed it."""
    port = port or free_port()
    shm_name = f"kvtier-bench-{port}"
    cmd = [sys.executable, "-m", "kvtier.server.cli", "server", "--port", str(port),
           "--l1-size-gb", repr(float(l1_size_gb)), "--shm-name", shm_name, *extra]
    if http_port is not None:
        cmd += ["--http-port", str(http_port)]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ready = threading.Event()
    lines: list[str] = []

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line.rstrip())
            if READY_LINE in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    while not ready.wait(0.005):
        if proc.poll() is not None or time.perf_counter() - started > timeout:
            proc.kill()
            raise RuntimeError("kvtier server did not become ready:\n" + "\n".join(lines[-20:]))
    shm_dir = extra[list(extra).index("--shm-dir") + 1] if "--shm-dir" in extra else SHM_DIR
    return ServerProcess(proc, f"tcp://127.0.0.1:{port}", port, time.perf_counter() - started, lines, shm_name,
                         shm_dir)


@contextlib.contextmanager
def server_or_url(url: str | None, l1_size_gb: float, extra: Sequence[str] = ()) -> Iterator[ServerProcess | None]:
    """Yield a started server (stopped afterwards), or None when the caller gave `--url`."""
    if url:
        yield None
        return
    server = start_server(l1_size_gb, extra)
    try:
        yield server
    finally:
        server.stop()


def memory(pid: int) -> dict[str, int]:
    """VmRSS / RssAnon / RssFile / RssShmem / VmHWM from /proc/PID/status and Pss from smaps_rollup, bytes."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM", "Threads"):
                value = int(rest.split()[0])
                out[name] = value if name == "Threads" else value * 1024
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            if name in ("Pss", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty"):
                out[name] = int(rest.split()[0]) * 1024
    return out


def percentiles(samples_s: Sequence[float]) -> dict[str, float]:
    """p50/p99/mean in microseconds."""
    a = np.asarray(samples_s, dtype=np.float64) * 1e6
    return {"p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)),
            "mean_us": float(a.mean()), "n": int(a.size)}


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def emit(result: dict[str, Any], as_json: bool, text: str) -> None:
    print(json.dumps(result, indent=2, sort_keys=True) if as_json else text)


def plotting(path: str):  # noqa: ANN201 - matplotlib.pyplot or None
    """matplotlib.pyplot with a file backend, ready to save at `path` (its directory made), or None, said on
    stdout, when matplotlib is not installed (plots are optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib not installed: no plot written to {path})")
        return None
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return plt


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": sys.version.split()[0], "numpy": np.__version__}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        info["kernel"] = os.uname().release
    return info
