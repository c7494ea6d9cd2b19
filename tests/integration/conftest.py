"""Integration fixtures: a real `kvtier server` process (real ZeroMQ, real /dev/shm) and client processes.

* ``kvtier_server`` is a factory: ``kvtier_server(l1_gb=..., extra=[...])`` starts a server on a free port
  with a unique segment name, waits for "kvtier server ready", and kills its process group at teardown.
* ``_support.run_client(fn, **kwargs)`` runs ``client_worker.<fn>(**kwargs)`` in a fresh interpreter and
  returns its JSON result; the ``start_client`` fixture starts one and returns the Popen (to signal it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _support import REPO, ServerProc, free_port, worker_cmd  # noqa: E402


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture
def kvtier_server(tmp_path):
    servers: list[ServerProc] = []

    def start(l1_gb: float = 0.25, extra: list[str] | None = None, port: int | None = None,
              shm_name: str | None = None, wait: bool = True, env: dict[str, str] | None = None) -> ServerProc:
        port = port or free_port()
        name = shm_name or f"kvtier-test-{port}-{uuid.uuid4().hex[:8]}"
        srv = ServerProc(port, name, ["--l1-size-gb", str(l1_gb), *(extra or [])],
                         tmp_path / f"server-{port}-{len(servers)}.log", env=env)
        srv.log_path.touch()
        servers.append(srv)
        srv.start(wait=wait)
        return srv

    yield start
    for srv in servers:
        srv.kill()
    for srv in servers:  # a killed or stopped server leaves its segment and journal, killed clients lock files
        for path in [srv.shm_path, srv.shm_path.with_name(f"{srv.shm_name}.journal"),
                     srv.shm_path.with_name(f"{srv.shm_name}.lock"),
                     srv.shm_path.with_name(f"{srv.shm_name}.tenants"),
                     srv.shm_path.with_name(f"{srv.shm_name}.presence"),
                     *srv.shm_path.parent.glob(f"{srv.shm_name}.client-*")]:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


@pytest.fixture
def start_client():
    procs: list[subprocess.Popen] = []

    def start(fn: str, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(worker_cmd(fn, kwargs), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=REPO, start_new_session=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream:
                stream.close()


