#!/usr/bin/env bash
# Create (or refresh) the project venv at .venv with kvtier installed editable plus test tools.
# Prints the venv's python as the last line.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="$repo/.venv"
stamp="$venv/.kvtier-stamp"
want="$(sha256sum "$repo/pyproject.toml" | cut -c1-16)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -e "$repo[dev]"
  echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
