#!/usr/bin/env bash
# The device check in one command (tests/gpu/check.py): on the GPU machine (an H200 whose image has torch 2.11
# on CUDA 13 and cupy-cuda13x, no package registry) it installs the wheels tests/gpu/fetch_wheels.sh fetched
# into tests/gpu/wheels/ (carried: docs/performance.md gives the command line), puts this checkout on the path
# as the kvtier package (no install), and runs the check: its JSON summary, rewritten after every phase, and
# the daemon's log go to $OUT (else the work folder); its table is printed last. Exit 0 when every check held.
# With --rehearse (automatic without CUDA) the same on CPU with the fake engine, no wheels needed.
#
#   bash tests/gpu/run.sh [--rehearse]       # PYTHON picks the interpreter (default python3)
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
py="${PYTHON:-python3}"
wheels="$repo/tests/gpu/wheels"
work="$(mktemp -d /tmp/kvtier-gpu-check.XXXXXX)"
site="$work/site"
out="${OUT:-$work}"

mkdir -p "$site/kvtier"
if [[ "${1:-}" != "--rehearse" ]]; then  # the rehearsal runs on the interpreter's own packages
    if ! compgen -G "$wheels/*.whl" >/dev/null; then
        echo "run.sh: no wheels in $wheels (run tests/gpu/fetch_wheels.sh where there is a registry; see" \
            "docs/performance.md), or pass --rehearse" >&2
        exit 2
    fi
    "$py" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check --target "$site" \
        "$wheels"/*.whl
fi
# kvtier is a namespace package mapped onto the checkout's folders (pyproject.toml's package-dir)
for folder in server connector shm admin_api; do
    ln -s "$repo/$folder" "$site/kvtier/$folder"
done
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# should the check die first: end the daemon's process group (its copiers too), remove the run's /dev/shm files
cleanup() {
    if [[ -f "$work/daemon.pid" ]]; then kill -KILL -- "-$(cat "$work/daemon.pid")" 2>/dev/null || true; fi
    if [[ -f "$work/shm_prefix" ]]; then rm -f /dev/shm/"$(cat "$work/shm_prefix")"-*; fi
    if [[ "$out" != "$work" ]]; then rm -rf "$work"; fi  # what it holds of use was copied to $OUT
}
trap cleanup EXIT
status=0
timeout -k 10 330 "$py" "$repo/tests/gpu/check.py" --work "$work" --out "$out/summary.json" "$@" || status=$?
if [[ "$out" != "$work" ]]; then
    cp "$work/daemon.log" "$out/" 2>/dev/null || true
fi
exit "$status"
