#!/usr/bin/env bash
# Fetch, on a machine with a package registry, the wheels the GPU machine lacks (tests/gpu/run.sh installs them
# there without one): kvtier's runtime dependencies (pyproject.toml) and their dependencies, as binary wheels
# for its CPython 3.12 on x86-64 Linux, less every package its image already has (IMAGE_HAS: the device
# image's package list, /work/.library/device/KINDS.md, 2026-11-17; torch 2.11 on CUDA 13 and cupy-cuda13x
# among them). Into tests/gpu/wheels/ (git-ignored), replacing what is there; lists what it kept.
#
#   bash tests/gpu/fetch_wheels.sh          # PYTHON picks the interpreter whose pip downloads (default python3)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="${PYTHON:-python3}"
wheels="$here/wheels"

mapfile -t requirements < <("$py" - "$here/../../pyproject.toml" <<'PY'
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["dependencies"]))
PY
)
rm -rf "$wheels"
"$py" -m pip download --quiet --disable-pip-version-check --dest "$wheels" --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any "${requirements[@]}"
"$py" - "$wheels" <<'PY'
import re
import sys
from pathlib import Path

IMAGE_HAS = {"numpy", "msgpack", "uvloop", "xxhash", "prometheus-client", "anyio", "idna", "h11", "click", "annotated-doc",
             "typing-extensions", "typing-inspect", "httpx", "httpcore", "certifi", "packaging", "protobuf",
             "pyyaml", "requests", "urllib3", "charset-normalizer", "attrs", "psutil", "rich", "pygments"}
for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    name = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
    if name in IMAGE_HAS:
        wheel.unlink()
    else:
        print(wheel.name)
PY
du -sh "$wheels"
