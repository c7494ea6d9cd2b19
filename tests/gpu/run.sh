#!/usr/bin/env bash
# The GPU check (tests/gpu/check.py; not yet run on a GPU): on a machine with an NVIDIA GPU, torch, cupy,
# numpy, msgpack, uvloop, xxhash and prometheus-client but no package registry. It installs the wheels that
# tests/gpu/fetch_wheels.sh fetched beforehand into tests/gpu/wheels/ (--no-index), puts this checkout on the
# path as the kvtier package (no install), runs the check and prints its one JSON summary as the last line.
# With $OUT set, the daemon's log is copied there too. PYTHON picks the interpreter (default python3).
#
#   bash tests/gpu/run.sh
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
py="${PYTHON:-python3}"
wheels="$repo/tests/gpu/wheels"
work="$(mktemp -d /tmp/kvtier-gpu-check.XXXXXX)"
site="$work/site"

if ! compgen -G "$wheels/*.whl" >/dev/null; then
    echo "run.sh: no wheels in $wheels: run tests/gpu/fetch_wheels.sh first (on a machine with a registry)" >&2
    exit 2
fi
"$py" -m pip install --quiet --no-index --no-deps --disable-pip-version-check --target "$site" "$wheels"/*.whl

# kvtier is a namespace package mapped onto the checkout's folders (pyproject.toml's package-dir)
mkdir -p "$site/kvtier"
for folder in server connector shm admin_api; do
    ln -s "$repo/$folder" "$site/kvtier/$folder"
done
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

status=0
timeout -k 10 350 "$py" "$repo/tests/gpu/check.py" --work "$work" || status=$?
if [[ -n "${OUT:-}" ]]; then
    cp "$work/daemon.log" "$OUT/" 2>/dev/null || true
fi
exit "$status"
