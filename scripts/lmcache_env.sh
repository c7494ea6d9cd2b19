#!/usr/bin/env bash
# Create (once) and cache a separate vLLM venv with LMCache 0.5.6 installed, for the reference
# measurements in tests/e2e/bench_vllm.py (LMCache MP mode, see /work/shared/reference/vllm-on-cpu.md).
#
#   scripts/lmcache_env.sh          # prints the venv's python as the last line
#   KVTIER_LMCACHE_VENV=/path scripts/lmcache_env.sh
#
# Location: ${KVTIER_LMCACHE_VENV:-${KVTIER_CACHE_DIR:-$HOME/.cache/kvtier}/lmcache-0.5.6-venv}
# It is a *separate* venv: `pip install lmcache==0.5.6` downgrades numpy, protobuf and prometheus_client
# and pulls cupy-cuda13x, which must not leak into the kvtier test venv.  The vLLM part is built by
# scripts/vllm_env.sh (pointed at this location with KVTIER_VLLM_VENV), then lmcache is added.
# A stamp file marks a complete environment; a rerun is a fast no-op.  Not safe to run concurrently.
set -euo pipefail

LMCACHE_VERSION="0.5.6"
REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE_DIR="${KVTIER_CACHE_DIR:-$HOME/.cache/kvtier}"
VENV="${KVTIER_LMCACHE_VENV:-$CACHE_DIR/lmcache-${LMCACHE_VERSION}-venv}"
STAMP="$VENV/.kvtier-lmcache-complete"
PY="$VENV/bin/python"

log() { echo "[lmcache_env] $*" >&2; }

if [[ -f "$STAMP" && -x "$PY" ]]; then
    echo "$PY"
    exit 0
fi

start=$SECONDS
# vllm_env.sh removes an incomplete venv at this path and rebuilds it (its own stamp is separate).
if [[ -e "$VENV" && ! -f "$VENV/.kvtier-env-complete" ]]; then
    log "removing incomplete environment $VENV"
    rm -rf "$VENV"
fi
if [[ -f "$VENV/.kvtier-env-complete" ]]; then
    log "vLLM part already present in $VENV"
else
    log "building the vLLM part with scripts/vllm_env.sh into $VENV"
    KVTIER_VLLM_VENV="$VENV" bash "$REPO_DIR/scripts/vllm_env.sh" >/dev/null
fi

log "installing lmcache==$LMCACHE_VERSION (downgrades numpy/protobuf/prometheus_client)"
"$PY" -m pip install --no-input --progress-bar off "lmcache==$LMCACHE_VERSION" >&2
# The PyPI torchvision & co. may come back as dependencies; they fail to import beside CPU torch.
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec triton >&2 2>/dev/null || true

"$PY" - <<'PYEOF' >&2
import importlib.metadata as md
import torch, vllm  # noqa: F401
import lmcache  # noqa: F401
from lmcache.integration.vllm import lmcache_mp_connector  # noqa: F401
print(f"[lmcache_env] ok: vllm {md.version('vllm')} torch {md.version('torch')} lmcache {md.version('lmcache')} "
      f"numpy {md.version('numpy')}")
PYEOF
[[ -x "$VENV/bin/lmcache" ]] || { log "no lmcache command in $VENV/bin"; exit 1; }
printf 'lmcache=%s\n' "$LMCACHE_VERSION" >"$STAMP"
log "environment ready in $((SECONDS - start)) s"
echo "$PY"
