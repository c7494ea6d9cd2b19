"""deploy/: the systemd unit verifies, the Kubernetes manifests pass an offline schema check, compose parses.

* systemd: `systemd-analyze verify` on a copy of the unit whose ExecStart points at this checkout's
  `kvtier` (verify insists the binary exists), and `systemd-analyze security --offline=yes` for the
  hardening score. Skipped where systemd-analyze is missing, except in CI (CI=true), where that fails.
* Kubernetes: `kubernetes-validate --strict` (schemas of Kubernetes 1.37 shipped in the package, no cluster
  or network needed) plus the cross-checks below (shared host paths, uid, memory >= L1 + overhead), for the
  CPU manifests (deploy/kubernetes/*.yaml) and the GPU ones (deploy/kubernetes/gpu/: host IPC and PID
  namespaces, every GPU visible to kvtier without a GPU request, one GPU requested by vLLM).
* Docker: compose.yaml and compose.gpu.yaml parse and wire vllm into kvtier's namespaces; the Dockerfiles
  copy every package folder.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest
from kvtier.server import config as server_config

pytestmark = pytest.mark.unit

IN_CI = os.environ.get("CI") == "true"
if IN_CI:
    import yaml  # PyYAML comes with kubernetes-validate (dev extra); missing in CI is an error
else:
    yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "systemd" / "kvtier.service"
ENV_FILE = DEPLOY / "systemd" / "kvtier.env"
K8S = DEPLOY / "kubernetes"
K8S_GPU = K8S / "gpu"
DOCKER = DEPLOY / "docker"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# The top folders of the packages (pyproject.toml [tool.setuptools.package-dir]): what an image must copy.
PACKAGE_FOLDERS = sorted({d.split("/")[0] for d in PYPROJECT["tool"]["setuptools"]["package-dir"].values()})


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        if IN_CI:
            pytest.fail(f"{name} is missing in CI: install it (see the report / scripts/test.sh)")
        pytest.skip(f"{name} not installed")
    return path


def _unit_values(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z]+)=(.*)$", line)
        if m:
            out.setdefault(m.group(1), []).append(m.group(2))
    return out


# --------------------------------------------------------------------------- systemd


def _verifiable_unit(tmp_path: Path) -> Path:
    kvtier = Path(sys.executable).parent / "kvtier"
    assert kvtier.exists(), kvtier
    text = UNIT.read_text().replace("/opt/kvtier/venv/bin/kvtier", str(kvtier))
    unit = tmp_path / "kvtier.service"
    unit.write_text(text)
    return unit


def test_systemd_analyze_verify(tmp_path):
    tool = _tool("systemd-analyze")
    unit = _verifiable_unit(tmp_path)
    r = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "kvtier.service" not in r.stderr, r.stdout + r.stderr


def test_systemd_hardening_score(tmp_path):
    tool = _tool("systemd-analyze")
    unit = _verifiable_unit(tmp_path)
    r = subprocess.run([tool, "security", "--offline=yes", "--threshold=30", str(unit)], capture_output=True,
                       text=True, timeout=60)
    if "--offline" in r.stderr and "unrecognized" in r.stderr:  # systemd < 250
        pytest.skip("systemd-analyze security --offline unsupported")
    m = re.search(r"Overall exposure level for kvtier\.service: ([\d.]+)", r.stdout)
    assert m, r.stdout + r.stderr
    assert float(m.group(1)) <= 3.0, r.stdout


def test_unit_settings():
    v = _unit_values(UNIT.read_text())
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                       "PrivateDevices": "no", "User": "kvtier", "RemoveIPC": "no"}.items():
        assert v.get(key) == [value], key
    assert "DynamicUser" not in v  # a dynamic uid cannot be shared with vLLM
    assert "/dev/shm" in v["ReadWritePaths"][0]
    assert "PrivateIPC" not in v or v["PrivateIPC"] == ["no"]
    assert v["EnvironmentFile"] == ["/etc/kvtier/kvtier.env"]
    # MemoryMax covers L1 plus at least 512 MiB of headroom.
    env = dict(line.split("=", 1) for line in ENV_FILE.read_text().splitlines() if line and not line.startswith("#"))
    l1_gib = float(env["KVTIER_L1_SIZE_GB"])
    mem = v["MemoryMax"][0]
    assert mem.endswith("G"), mem
    assert float(mem[:-1]) >= l1_gib + 0.5


def test_env_file_names_real_settings():
    import dataclasses

    from kvtier.server.config import ServerConfig, env_name, from_args

    known = {env_name(f.name) for f in dataclasses.fields(ServerConfig)}
    names = re.findall(r"^#?(KVTIER_[A-Z0-9_]+)=", ENV_FILE.read_text(), re.M)
    assert names and set(names) <= known, set(names) - known
    env = dict(line.split("=", 1) for line in ENV_FILE.read_text().splitlines() if line and not line.startswith("#"))

    class Args:
        config = None

    from_args(Args(), env).validate()  # the shipped environment is a valid configuration


# --------------------------------------------------------------------------- Kubernetes


def _k8s_docs(folder: Path = K8S) -> list[dict]:
    docs = []
    for path in sorted(folder.glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def _by_kind(kind: str, folder: Path = K8S) -> list[dict]:
    return [d for d in _k8s_docs(folder) if d["kind"] == kind]


def _validate_strict(tool: str, folder: Path) -> None:
    """Every document of every manifest in `folder` passes the strict schema check."""
    files = sorted(str(p) for p in folder.glob("*.yaml"))
    r = subprocess.run([tool, "--strict", *files], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("passed") == len(_k8s_docs(folder)), r.stdout


def _rejected(tool: str, doc: dict, tmp_path: Path) -> bool:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    r = subprocess.run([tool, "--strict", str(bad)], capture_output=True, text=True, timeout=120)
    return r.returncode != 0


def test_kubernetes_schema(tmp_path):
    tool = _tool("kubernetes-validate")
    assert len(list(K8S.glob("*.yaml"))) >= 3
    _validate_strict(tool, K8S)
    # The check is real: an unknown field fails.
    ds = _by_kind("DaemonSet")[0]
    ds["spec"]["template"]["spec"]["containers"][0]["memoryLimit"] = "1Gi"
    assert _rejected(tool, ds, tmp_path)


def test_kubernetes_gpu_schema(tmp_path):
    tool = _tool("kubernetes-validate")
    assert {p.name for p in K8S_GPU.glob("*.yaml")} == {"kvtier-daemonset.yaml", "vllm-deployment.yaml"}
    _validate_strict(tool, K8S_GPU)
    # A misspelt GPU setting is an unknown field, not a silently ignored one.
    ds = _by_kind("DaemonSet", K8S_GPU)[0]
    ds["spec"]["template"]["spec"]["hostIpc"] = ds["spec"]["template"]["spec"].pop("hostIPC")
    assert _rejected(tool, ds, tmp_path)


def _mem_gib(q: str) -> float:
    units = {"Gi": 1.0, "Mi": 1 / 1024, "G": 1e9 / 2**30, "M": 1e6 / 2**30}
    for suffix, factor in units.items():
        if q.endswith(suffix):
            return float(q[: -len(suffix)]) * factor
    raise AssertionError(q)


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _check_wiring(ds: dict, deploy: dict) -> None:
    """kvtier's DaemonSet and vLLM's Deployment share the segment, the socket, the uid and the token."""
    ds_spec, vllm_spec = ds["spec"]["template"]["spec"], deploy["spec"]["template"]["spec"]
    kvtier = next(c for c in ds_spec["containers"] if c["name"] == "kvtier")
    vllm = vllm_spec["containers"][0]
    env = _env(kvtier)
    l1 = float(env["KVTIER_L1_SIZE_GB"])

    def host_mounts(spec: dict, container: dict) -> dict[str, str]:
        paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
        return {m["mountPath"]: paths[m["name"]] for m in container["volumeMounts"] if m["name"] in paths}

    kv_mounts, vllm_mounts = host_mounts(ds_spec, kvtier), host_mounts(vllm_spec, vllm)
    assert kv_mounts["/dev/shm"] == vllm_mounts["/dev/shm"]  # the L1 segment
    sock_dir = os.path.dirname(env["KVTIER_IPC_PATH"])
    assert kv_mounts[sock_dir] == vllm_mounts[sock_dir]  # the ipc:// socket
    cfg = json.loads(next(a.split("=", 1)[1] for a in vllm["args"] if a.startswith("--kv-transfer-config=")))
    assert cfg["kv_connector"] == "KVTierConnector" and cfg["kv_connector_module_path"] == "kvtier.connector.vllm"
    assert cfg["kv_connector_extra_config"]["kvtier.url"] == "ipc://" + env["KVTIER_IPC_PATH"]
    # Same uid on both sides (owner-only segment and socket).
    assert kvtier["securityContext"]["runAsUser"] == vllm_spec["securityContext"]["runAsUser"]
    # A non-loopback admin API has a token, and vLLM presents the same Secret.
    assert env["KVTIER_HTTP_HOST"] == "0.0.0.0"
    token_refs = [e["valueFrom"]["secretKeyRef"]["name"] for c in (kvtier, vllm) for e in c["env"]
                  if e["name"] == "KVTIER_ADMIN_TOKEN"]
    assert len(token_refs) == 2 and len(set(token_refs)) == 1
    assert any(s["metadata"]["name"] == token_refs[0] for s in _by_kind("Secret"))
    # Memory: kvtier >= L1 + overhead; vLLM >= L1 + its own memory (it writes the L1 pages it stores).
    for c, floor in ((kvtier, l1 + 0.5), (vllm, l1 + 4)):
        res = c["resources"]
        assert _mem_gib(res["requests"]["memory"]) >= floor, c["name"]
        assert _mem_gib(res["limits"]["memory"]) >= _mem_gib(res["requests"]["memory"]), c["name"]
    assert ds_spec["nodeSelector"] == vllm_spec["nodeSelector"]
    assert ds["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == env["KVTIER_HTTP_PORT"]
    _check_remote_secret(ds_spec, kvtier)


def _check_remote_secret(spec: dict, kvtier: dict) -> None:
    """The remote tier's URL comes from a Secret (optional: no Secret, no remote tier) and its password is a file
    of the same Secret, mounted as a directory (a subPath mount is never updated: no rotation), readable by the
    container's uid only through the pod's fsGroup; kvtier accepts the pair as its configuration."""
    (url_ref,) = [e["valueFrom"]["secretKeyRef"] for e in kvtier["env"] if e["name"] == "KVTIER_REMOTE_URL"]
    assert url_ref["optional"] is True
    (secret,) = [s for s in _by_kind("Secret") if s["metadata"]["name"] == url_ref["name"]]
    password_file = _env(kvtier)["KVTIER_REMOTE_PASSWORD_FILE"]
    (mount,) = [m for m in kvtier["volumeMounts"] if m["mountPath"] == os.path.dirname(password_file)]
    assert mount.get("readOnly") is True and "subPath" not in mount
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == url_ref["name"] and volume["secret"]["optional"] is True
    (item,) = volume["secret"]["items"]
    assert item["path"] == os.path.basename(password_file)
    assert volume["secret"]["defaultMode"] & 0o007 == 0  # not world-readable
    assert spec["securityContext"]["fsGroup"] == kvtier["securityContext"]["runAsGroup"]
    values = secret["stringData"]
    assert {url_ref["key"], item["key"]} <= set(values)
    with tempfile.TemporaryDirectory() as tmp:  # what the pod's kvtier sees: it must start with it
        local = Path(tmp) / "password"
        local.write_text(values[item["key"]])
        config = server_config.from_args(argparse.Namespace(), environ={
            "KVTIER_REMOTE_URL": values[url_ref["key"]], "KVTIER_REMOTE_PASSWORD_FILE": str(local)})
    assert config.remote_access.password_file == str(local)


def test_kubernetes_wiring():
    (ds,) = _by_kind("DaemonSet")
    (deploy,) = _by_kind("Deployment")
    _check_wiring(ds, deploy)


def _gpu_requests(container: dict) -> list[str]:
    res = container.get("resources", {})
    return [str(q) for part in ("requests", "limits") for k, q in res.get(part, {}).items() if k == "nvidia.com/gpu"]


def test_kubernetes_gpu_wiring():
    (ds,) = _by_kind("DaemonSet", K8S_GPU)
    (deploy,) = _by_kind("Deployment", K8S_GPU)
    _check_wiring(ds, deploy)  # segment, socket, uid, token, memory as on CPU nodes
    ds_spec, vllm_spec = ds["spec"]["template"]["spec"], deploy["spec"]["template"]["spec"]
    # CUDA IPC: both pods in the node's IPC and PID namespaces, under the NVIDIA runtime.
    for spec in (ds_spec, vllm_spec):
        assert spec["hostIPC"] is True and spec["hostPID"] is True
        assert spec["runtimeClassName"] == "nvidia"
    # kvtier sees every GPU but takes none (a GPU request would withdraw a GPU from vLLM).
    for c in ds_spec["containers"] + ds_spec.get("initContainers", []):
        assert _gpu_requests(c) == [], c["name"]
    kvtier = next(c for c in ds_spec["containers"] if c["name"] == "kvtier")
    env = _env(kvtier)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert set(env["NVIDIA_DRIVER_CAPABILITIES"].split(",")) >= {"compute", "utility"}
    (vllm,) = vllm_spec["containers"]
    assert _gpu_requests(vllm) == ["1", "1"]  # requests and limits: one GPU
    cfg = json.loads(next(a.split("=", 1)[1] for a in vllm["args"] if a.startswith("--kv-transfer-config=")))
    assert cfg["kv_connector_module_path"] == "kvtier.connector.vllm"
    # Otherwise the CPU DaemonSet: same volumes, mounts, probes, ports, KVTIER_ settings and hardening.
    (cpu_ds,) = _by_kind("DaemonSet")
    cpu_spec = cpu_ds["spec"]["template"]["spec"]
    cpu_kvtier = next(c for c in cpu_spec["containers"] if c["name"] == "kvtier")
    assert ds_spec["volumes"] == cpu_spec["volumes"]
    for key in ("volumeMounts", "ports", "readinessProbe", "livenessProbe", "securityContext"):
        assert kvtier[key] == cpu_kvtier[key], key
    assert {k: v for k, v in env.items() if k.startswith("KVTIER_")} == _env(cpu_kvtier)
    assert ds["metadata"]["name"] == cpu_ds["metadata"]["name"]  # applied instead of the CPU one
    # The images are the ones compose.gpu.yaml builds (kvtier's from gpu.Dockerfile).
    services = yaml.safe_load((DOCKER / "compose.gpu.yaml").read_text())["services"]
    assert {c["image"] for c in ds_spec["containers"] + ds_spec["initContainers"]} == {services["kvtier"]["image"]}
    assert vllm["image"] == services["vllm"]["image"]


# --------------------------------------------------------------------------- Docker


def test_compose_wiring():
    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"kvtier", "vllm"}
    kv, vllm = services["kvtier"], services["vllm"]
    assert kv["build"]["dockerfile"] == "deploy/docker/Dockerfile"
    assert (DEPLOY / "docker" / Path(vllm["build"]["dockerfile"]).name).exists()
    assert kv["ipc"] == "shareable"
    assert vllm["ipc"] == "service:kvtier" and vllm["network_mode"] == "service:kvtier"
    assert "ports" not in vllm  # published on kvtier, whose network namespace vllm uses
    assert vllm["depends_on"]["kvtier"]["condition"] == "service_healthy"
    l1 = float(kv["environment"]["KVTIER_L1_SIZE_GB"])
    assert float(kv["shm_size"].rstrip("gb")) > l1  # Docker's default /dev/shm is 64 MiB
    assert kv["environment"]["KVTIER_HOST"] == "127.0.0.1"
    cfg_arg = next(a for a in vllm["command"] if a.startswith("--kv-transfer-config="))
    cfg = json.loads(cfg_arg.split("=", 1)[1])
    assert cfg["kv_connector_extra_config"]["kvtier.url"] == f"tcp://127.0.0.1:{kv['environment']['KVTIER_PORT']}"


def test_dockerfile():
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    assert re.search(r"^USER 10001", text, re.M)
    assert 'ENTRYPOINT ["kvtier", "server"]' in text
    for folder in ("server", "connector", "shm", "admin_api"):  # every package-dir of pyproject.toml
        assert f"COPY {folder} /src/{folder}" in text


def test_gpu_dockerfile():
    text = (DOCKER / "gpu.Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    assert re.search(r"^USER 10001", text, re.M)
    assert 'ENTRYPOINT ["kvtier", "server"]' in text
    for folder in PACKAGE_FOLDERS:
        assert f"COPY {folder} /src/{folder}" in text
    assert re.search(r'^RUN pip install "/src\[gpu\]"', text, re.M)
    assert any(d.startswith("cupy-cuda") for d in PYPROJECT["project"]["optional-dependencies"]["gpu"])
    ignore = (DOCKER / "gpu.Dockerfile.dockerignore").read_text()
    assert ignore == (DOCKER / "Dockerfile.dockerignore").read_text()


def test_compose_gpu_wiring():
    compose = yaml.safe_load((DOCKER / "compose.gpu.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"kvtier", "vllm"}
    kv, vllm = services["kvtier"], services["vllm"]
    assert (REPO / kv["build"]["dockerfile"]) == DOCKER / "gpu.Dockerfile"
    # One IPC and one PID namespace for CUDA IPC; vllm in kvtier's network namespace (loopback TCP).
    for svc in (kv, vllm):
        assert svc["ipc"] == "host" and svc["pid"] == "host"
    assert vllm["network_mode"] == "service:kvtier" and "ports" not in vllm
    assert vllm["depends_on"]["kvtier"]["condition"] == "service_healthy"

    def gpus(svc: dict) -> dict:
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
        return dev

    assert gpus(kv)["count"] == "all"  # every GPU of the host
    assert gpus(vllm)["count"] == 1
    assert kv["environment"]["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert kv["ulimits"]["memlock"] == -1  # page-locking L1
    # Both mount one tmpfs volume at /dev/shm: larger than L1, owned by vllm's uid as well.
    for svc in (kv, vllm):
        assert "kvtier-shm:/dev/shm" in svc["volumes"]
    opts = compose["volumes"]["kvtier-shm"]["driver_opts"]
    assert opts["type"] == "tmpfs"
    o = dict(item.split("=", 1) for item in opts["o"].split(","))
    l1 = float(kv["environment"]["KVTIER_L1_SIZE_GB"])
    assert float(o["size"].rstrip("g")) > l1
    assert o["uid"] == vllm["user"].split(":")[0]
    cfg = json.loads(next(a.split("=", 1)[1] for a in vllm["command"] if a.startswith("--kv-transfer-config=")))
    assert cfg["kv_connector_module_path"] == "kvtier.connector.vllm"
    assert cfg["kv_connector_extra_config"]["kvtier.url"] == f"tcp://127.0.0.1:{kv['environment']['KVTIER_PORT']}"
    # vLLM's image installs the connector from every package folder of this checkout.
    inline = vllm["build"]["dockerfile_inline"]
    for folder in PACKAGE_FOLDERS:
        assert f"COPY {folder} /opt/kvtier-src/{folder}" in inline
    assert "pip install --no-cache-dir /opt/kvtier-src" in inline


def test_prometheus_config():
    cfg = yaml.safe_load((DEPLOY / "observability" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["kvtier"]["metrics_path"] == "/metrics"
    assert jobs["kvtier"]["static_configs"][0]["targets"] == ["127.0.0.1:8080"]
    assert "kvtier-kubernetes" in jobs
