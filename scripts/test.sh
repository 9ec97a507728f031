#!/usr/bin/env bash
# The whole default test suite: set-up, ruff, mypy, pytest (without `slow`).
#   bash scripts/test.sh                 # default suite (~15 min on 2 cores)
#   bash scripts/test.sh -m slow         # the long tests
#   bash scripts/test.sh tests/unit -k codec   # any pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_prometheus.sh  # prometheus + promtool for tests/integration/test_prometheus.py
. .venv/bin/activate
echo "== ruff" && ruff check . && ruff format --check .
echo "== mypy" && mypy
echo "== pytest"
if [ "$#" -eq 0 ]; then
    exec python -m pytest -m "not slow" -q
fi
exec python -m pytest -q "$@"
