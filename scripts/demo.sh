#!/usr/bin/env bash
# The main job on the built-in default: set-up, then a whole local cluster (hypertrain up) on the
# embedded corpus (the Python standard library's source text).  Extra
# arguments go to `hypertrain up` (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/hypertrain up "$@"
