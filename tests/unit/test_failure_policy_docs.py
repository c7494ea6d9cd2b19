"""Every shipped --kv-transfer-config sets `"kv_load_failure_policy": "recompute"` (issue 26).

vLLM 0.32 defaults the policy to "fail": a block the connector reports in `get_block_ids_with_load_errors` (a
damaged L2 file, a lapsed lease, a promotion past its deadline, a server gone between lookup and load) ends the
request with HTTP 500. So every config a user may copy must say "recompute", at the top level beside
"kv_connector":

* every JSON object with a "kv_connector" key in the docs (docs/**/*.md, README.md) and in deploy/ (compose
  files, Kubernetes manifests, Dockerfiles), found in the raw text, so that a new page or manifest is covered
  without being listed here;
* the manifests' and compose files' vLLM arguments as YAML gives them to vLLM;
* docs/quickstart.md's KV_CONFIG as bash evaluates it (tests/e2e/test_quickstart.py runs that page);
* every dict literal with a "kv_connector" key in the e2e tests, benches and scripts (ast), and what
  `harness.kvtier_connector_config` returns (the config of every e2e test).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
DEPLOY = REPO / "deploy"
QUICKSTART = DOCS / "quickstart.md"
POLICY, RECOMPUTE = "kv_load_failure_policy", "recompute"

KEY = re.compile(r'"kv_connector"\s*:')
BASH_DEFAULT = re.compile(r"""'"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}"']*)\}"'""")  # '"${VAR:-default}"' -> default


def _text_files() -> list[Path]:
    files = [REPO / "README.md", *DOCS.rglob("*.md")]
    files += [p for p in DEPLOY.rglob("*") if p.is_file() and (p.suffix in (".yaml", ".yml", ".env", ".json")
                                                                or "Dockerfile" in p.name)]
    return sorted(set(files))


def _object_at(text: str, start: int) -> str:
    """The balanced {...} that opens at `start`."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start: i + 1]
    raise AssertionError(f"unbalanced object at offset {start}: {text[start: start + 200]!r}")


def _configs_in(path: Path) -> list[tuple[int, str]]:
    """(line, object text) of each JSON object in `path` that has a "kv_connector" key."""
    text = path.read_text(errors="replace")
    out = []
    for m in KEY.finditer(text):
        start = text.rfind("{", 0, m.start())
        assert start >= 0 and text[start + 1: m.start()].strip() == "", f"{path}: kv_connector is not a first key"
        out.append((text.count("\n", 0, m.start()) + 1, _object_at(text, start)))
    return out


def _parse(obj: str) -> dict:
    """A config as written in a doc: bash's '"${VAR:-default}"' splices become their default, a `{...}`
    placeholder an empty object."""
    return json.loads(BASH_DEFAULT.sub(r"\1", obj).replace("{...}", "{}"))


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


TEXT_CONFIGS = [(f"{_rel(path)}:{line}", obj) for path in _text_files() for line, obj in _configs_in(path)]


def test_the_scan_finds_the_shipped_configs():
    found = {where.split(":")[0] for where, _ in TEXT_CONFIGS}
    for shipped in ("docs/quickstart.md", "docs/vllm.md", "deploy/docker/compose.yaml", "deploy/docker/compose.gpu.yaml",
                    "deploy/kubernetes/vllm-deployment.yaml", "deploy/kubernetes/gpu/vllm-deployment.yaml"):
        assert shipped in found, (shipped, sorted(found))


@pytest.mark.parametrize(("where", "obj"), [pytest.param(w, o, id=w) for w, o in TEXT_CONFIGS])
def test_text_config_recomputes(where: str, obj: str):
    cfg = _parse(obj)
    assert cfg.get(POLICY) == RECOMPUTE, f"{where}: add \"{POLICY}\":\"{RECOMPUTE}\" beside \"kv_connector\": {obj}"


def _vllm_args() -> list[tuple[str, list[str]]]:
    yaml = pytest.importorskip("yaml")
    out = []
    for path in sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")]):
        for doc in yaml.safe_load_all(path.read_text()):
            stack = [doc]
            while stack:  # every list of strings anywhere in the document: container args, compose commands
                node = stack.pop()
                if isinstance(node, dict):
                    stack.extend(node.values())
                elif isinstance(node, list):
                    if any(isinstance(a, str) and a.startswith("--kv-transfer-config") for a in node):
                        out.append((_rel(path), [str(a) for a in node]))
                    stack.extend(node)
    return out


def test_deploy_args_recompute():
    found = _vllm_args()
    assert {where for where, _ in found} >= {
        "deploy/docker/compose.yaml", "deploy/docker/compose.gpu.yaml", "deploy/kubernetes/vllm-deployment.yaml",
        "deploy/kubernetes/gpu/vllm-deployment.yaml"}, found
    for where, args in found:
        for i, arg in enumerate(args):
            if not arg.startswith("--kv-transfer-config"):
                continue
            value = arg.split("=", 1)[1] if "=" in arg else args[i + 1]
            cfg = json.loads(value)
            assert cfg.get(POLICY) == RECOMPUTE, (where, cfg)
            assert cfg["kv_connector"] == "KVTierConnector", (where, cfg)


def test_quickstart_kv_config_as_bash_runs_it():
    lines = [ln for ln in QUICKSTART.read_text().splitlines() if ln.startswith("KV_CONFIG=")]
    assert len(lines) == 1, lines
    r = subprocess.run(["bash", "-c", f'{lines[0]}\nprintf %s "$KV_CONFIG"'], capture_output=True, text=True,
                       check=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "KVTIER_PORT": "6001"})
    cfg = json.loads(r.stdout)
    assert cfg[POLICY] == RECOMPUTE, cfg
    assert cfg["kv_connector_extra_config"]["kvtier.url"] == "tcp://127.0.0.1:6001", cfg


def _python_sources() -> list[Path]:
    roots = [REPO / "tests" / "e2e", REPO / "tests" / "gpu", REPO / "server" / "bench", REPO / "scripts"]
    return sorted(p for root in roots if root.is_dir() for p in root.rglob("*.py"))


def test_python_config_literals_recompute():
    seen = 0
    for path in _python_sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Dict):
                continue
            keys = {k.value: v for k, v in zip(node.keys, node.values, strict=True)
                    if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            if "kv_connector" not in keys:
                continue
            seen += 1
            value = keys.get(POLICY)
            assert isinstance(value, ast.Constant) and value.value == RECOMPUTE, \
                f"{_rel(path)}:{node.lineno}: a kv-transfer-config without \"{POLICY}\": \"{RECOMPUTE}\""
    assert seen >= 2  # harness.kvtier_connector_config and bench_vllm.lmcache_config at least


def test_harness_config_recomputes():
    spec = importlib.util.spec_from_file_location("_e2e_harness_for_policy", REPO / "tests" / "e2e" / "harness.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    cfg = harness.kvtier_connector_config(5555, async_transfers=True)
    assert cfg[POLICY] == RECOMPUTE and cfg["kv_connector"] == "KVTierConnector", cfg
    assert cfg["kv_connector_extra_config"] == {"kvtier.url": "tcp://127.0.0.1:5555", "kvtier.async_transfers": True}
