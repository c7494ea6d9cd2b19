#!/usr/bin/env bash
# Set up the venv if needed and run the server on its embedded defaults (extra flags pass through).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
py="$(bash "$repo/scripts/dev_env.sh" | tail -n 1)"
exec "$(dirname "$py")/kvtier" server "$@"
