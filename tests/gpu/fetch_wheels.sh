#!/usr/bin/env bash
# Fetch, on a machine with a package registry, the wheels the GPU check machine lacks (tests/gpu/run.sh
# installs them there without one): kvtier's runtime dependencies (pyproject.toml) other than those that
# machine has (numpy, msgpack, uvloop, xxhash, prometheus-client; torch and cupy are the check's own), with
# their dependencies, as binary wheels for its CPython 3.12 on x86-64 Linux. Into tests/gpu/wheels/
# (git-ignored), replacing what is there. Like the check itself, not yet used on a GPU machine.
#
#   bash tests/gpu/fetch_wheels.sh          # PYTHON picks the interpreter whose pip downloads (default python3)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="${PYTHON:-python3}"
wheels="$here/wheels"

mapfile -t requirements < <("$py" - "$here/../../pyproject.toml" <<'PY'
import re
import sys
import tomllib

ON_THE_GPU_MACHINE = {"numpy", "msgpack", "uvloop", "xxhash", "prometheus-client"}
with open(sys.argv[1], "rb") as f:
    for requirement in tomllib.load(f)["project"]["dependencies"]:
        if re.match(r"[A-Za-z0-9_.-]+", requirement)[0].lower() not in ON_THE_GPU_MACHINE:
            print(requirement)
PY
)
rm -rf "$wheels"
"$py" -m pip download --quiet --disable-pip-version-check --dest "$wheels" --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any "${requirements[@]}"
ls "$wheels"
