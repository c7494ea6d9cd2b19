"""Helpers shared by the integration tests and their client worker processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import blake3
import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKER = HERE / "client_worker.py"
READY = "kvtier server ready"
START_TIMEOUT_S = 30.0


def prompt(seed: int, n_tokens: int) -> np.ndarray:
    """A reproducible random prompt (token ids)."""
    return np.random.default_rng(seed).integers(0, 50_000, size=n_tokens, dtype=np.int64)


def payload_of(key: bytes, size: int) -> np.ndarray:
    """Bytes derived from a chunk's key: what a test stores for it and expects back."""
    return np.frombuffer(blake3.blake3(b"payload" + key).digest(length=size), dtype=np.uint8)


def holds_its_bytes(rc) -> bool:
    """Whether a read chunk's span holds payload_of its key (read out of the shared memory now)."""
    buf = np.empty(rc.span.size, dtype=np.uint8)
    rc.span.read(0, buf)
    return np.array_equal(buf, payload_of(rc.chunk.key, rc.span.size))


def read_checked(c, ns, hits) -> int:
    """Blocks copied out of the chunks a lookup found; raises if any byte differs from payload_of."""
    def read(rc) -> None:
        buf = np.empty(rc.span.size, dtype=np.uint8)
        rc.span.read(0, buf)
        assert np.array_equal(buf, payload_of(rc.chunk.key, rc.span.size)), "retrieved bytes differ"

    return c.retrieve_chunks(ns, hits, read)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProc:
    port: int
    shm_name: str
    args: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    history: list[subprocess.Popen] = field(default_factory=list)
    env: dict[str, str] | None = None  # added to this process's environment (e.g. PYTHONHASHSEED)

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def shm_path(self) -> Path:
        return Path("/dev/shm") / self.shm_name

    def command(self) -> list[str]:
        return [sys.executable, "-m", "kvtier.server.cli", "server", "--port", str(self.port), "--http-port", "0",
                "--shm-name", self.shm_name, *self.args]

    def start(self, wait: bool = True) -> subprocess.Popen:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        offset = self.log_path.stat().st_size
        proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True, env={**os.environ, **self.env} if self.env else None)
        log.close()
        self.proc = proc
        self.history.append(proc)
        if wait:
            self.wait_ready(proc, offset)
        return proc

    def wait_ready(self, proc: subprocess.Popen, offset: int = 0) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if READY in self.log_path.read_text(errors="replace")[offset:]:
                return
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{self.log_text()}")
            time.sleep(0.05)
        raise RuntimeError(f"server not ready within {START_TIMEOUT_S}s:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        for proc in self.history:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def worker_cmd(fn: str, kwargs: dict) -> list[str]:
    return [sys.executable, str(WORKER), fn, json.dumps(kwargs)]


def run_client(fn: str, timeout: float = 60.0, **kwargs) -> dict:
    """Run client code in another process; returns the JSON object it printed last."""
    out = subprocess.run(worker_cmd(fn, kwargs), capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"client worker {fn} failed ({out.returncode}):\n{out.stderr[-5000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    """Poll `predicate` until it returns a truthy value (returned) or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} not reached within {timeout}s (last: {last!r})")


def copier_pids(server_pid: int) -> list[int]:
    """The daemon's copier processes (its children running kvtier.server.transfer.copier)."""
    out = subprocess.run(["pgrep", "-P", str(server_pid), "-f", "kvtier.server.transfer.copier"],
                         capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]
