"""Tenant quota tables over restarts (issue 32, Done-when 3): a table changed through /reconfigure is the one
a warm-restarted server runs with, after a SIGKILL and after a clean stop; an operator who changes the
configured table gets the new one; `kvtier segments` counts the kept tables as part of their segment and
removes them with it. A real server process, real shared memory, the admin API over HTTP."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from _support import REPO, free_port
from test_warm_restart import admin, kill

pytestmark = pytest.mark.integration


def reconfigure(http_port: int, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{http_port}/reconfigure", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def table(http_port: int) -> str:
    return json.loads(admin(http_port, "/status"))["l1"]["tenant_quotas"]


def segments(shm_name: str, *args: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "kvtier.server.cli", "segments", "--json", *args], cwd=REPO,
                         capture_output=True, text=True, check=True)
    return [s for s in json.loads(out.stdout) if s["name"] == shm_name]


def test_a_reconfigured_table_survives_warm_restarts_and_a_changed_configuration_wins(kvtier_server):
    http_port = free_port()
    srv = kvtier_server(l1_gb=0.0625, extra=["--http-port", str(http_port), "--l1-tenant-quotas", "A=10%"])
    assert table(http_port) == "A=10%"
    status, result = reconfigure(http_port, {"tenant_quotas": "A=20%,B=30%:50%"})
    assert status == 200, result
    assert table(http_port) == "A=20%,B=30%:50%"
    status, result = reconfigure(http_port, {"tenant_quotas": "A=90%,B=30%"})  # over 100%: nothing changes
    assert status == 422 and "100%" in json.dumps(result)
    assert table(http_port) == "A=20%,B=30%:50%"

    kill(srv)
    srv.start()
    assert table(http_port) == "A=20%,B=30%:50%"
    srv.signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=15) == 0
    srv.start()
    assert table(http_port) == "A=20%,B=30%:50%"
    assert (srv.shm_path.parent / (srv.shm_name + ".tenants")).exists()
    assert len(segments(srv.shm_name)) == 1  # the kept tables are its sidecar, not a segment of their own

    srv.signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=15) == 0
    srv.args[srv.args.index("A=10%")] = "A=5%"  # the operator changed the configuration: it wins
    srv.start()
    assert table(http_port) == "A=5%"
    status, _ = reconfigure(http_port, {"tenant_quotas": ""})  # no table at all
    assert status == 200 and table(http_port) == ""

    srv.signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=15) == 0
    removed = segments(srv.shm_name, "--remove-unused")
    assert len(removed) == 1
    assert not (srv.shm_path.parent / (srv.shm_name + ".tenants")).exists()
    assert not srv.shm_path.exists()
