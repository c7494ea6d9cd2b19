#!/usr/bin/env bash
# The test command: sets up everything the tests need, then runs unit, integration and e2e tests.
# Extra arguments go to pytest (e.g. `scripts/test.sh -m unit`).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
py="$(bash scripts/dev_env.sh | tail -n 1)"
# systemd-analyze checks the shipped unit (tests/unit/test_deploy.py).
if ! command -v systemd-analyze >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq --no-install-recommends systemd >/dev/null
fi
# strace slows the L2 reads of tests/e2e/test_load_failures.py past the promotion deadline (fault injection).
if ! command -v strace >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq --no-install-recommends strace >/dev/null
fi
# redis-server and redis-cli for the remote-tier tests (tests/integration/redis_servers.py starts them).
bash scripts/redis_env.sh install
"$py" -m ruff check .
if [ "$#" -gt 0 ]; then
  exec "$py" -m pytest "$@"
fi
"$py" -m pytest -q -m "unit" tests/unit
"$py" -m pytest -q -m "integration" tests/unit tests/integration
"$py" -m pytest -q -m "e2e" tests/e2e
