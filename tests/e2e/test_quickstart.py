"""docs/quickstart.md works as written (issue #6, check 3).

Every fenced ```bash block of the page is run, literally and in order, in one bash (`set -euo pipefail`),
from the repository root. The only substitution is the one the page provides for: the ports are environment
variables with defaults (KVTIER_PORT, KVTIER_HTTP_PORT, VLLM_PORT), set here to free ports. The run must end
with a vLLM request served with kvtier hits: the page's own `/metrics` greps print kvtier's hit tokens and
vLLM's tokens from the connector, which must cover the prompt.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path

import harness
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "quickstart.md"
BLOCK = re.compile(r"^```bash\n(.*?)^```$", re.M | re.S)


def bash_blocks(text: str) -> list[str]:
    return BLOCK.findall(text)


def test_blocks_are_found():
    blocks = bash_blocks(PAGE.read_text())
    assert len(blocks) >= 6
    script = "\n".join(blocks)
    for needed in ("scripts/run_server.sh", "scripts/vllm_env.sh", "tests/e2e/tiny_model.py", "KVTierConnector",
                   "kvtier status", "/v1/completions"):
        assert needed in script, needed
    assert "5555" in script and "${KVTIER_PORT:-5555}" in script  # ports only through defaulted variables


def _value(out: str, pattern: str) -> float:
    m = re.search(pattern + r"\s+([0-9.e+]+)\s*$", out, re.M)
    assert m, f"{pattern!r} not in output:\n{out[-4000:]}"
    return float(m.group(1))


def test_quickstart_commands(vllm_python, tiny_model, logdir):
    # vllm_python/tiny_model: build the cached environment first, so the page's own calls are fast no-ops.
    script = "set -euo pipefail\n" + "\n".join(bash_blocks(PAGE.read_text()))
    (logdir / "quickstart.sh").write_text(script)
    env = {
        **os.environ,
        "KVTIER_PORT": str(harness.free_port()),
        "KVTIER_HTTP_PORT": str(harness.free_port()),
        "VLLM_PORT": str(harness.free_port()),
        "PYTHONUNBUFFERED": "1",
    }
    for name in ("KVTIER_HOST", "KVTIER_HTTP_HOST", "KVTIER_ADMIN_TOKEN", "KVTIER_SHM_NAME", "KVTIER_L1_SIZE_GB"):
        env.pop(name, None)
    log = logdir / "quickstart.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(["bash", "-c", script], cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=2100)
        finally:
            # Whatever the page left running (it stops its own processes in its last block).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text(errors="replace")
    assert rc == 0, f"quickstart failed (rc={rc}); log {log}:\n{out[-6000:]}"
    assert '"choices"' in out, out[-4000:]
    hit = _value(out, r'^kvtier_hit_tokens_total\{tier="l1"\}')
    requested = _value(out, r"^kvtier_requested_tokens_total")
    external = _value(out, r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\}')
    assert hit >= 2048, out[-4000:]  # the 2,819-token prompt, in whole 128-token blocks, minus at most one
    assert external == hit, (external, hit)
    assert requested >= hit
