#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv.
#
#   bash scripts/setup.sh            # CPU torch (the build that lies on this machine's disk)
#   HYPERTRAIN_TORCH_INDEX=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh   # GPU hosts
#
# torch is installed first, pinned: a bare "torch" requirement may pull a
# CUDA build of several GB.  Idempotent and quick when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HYPERTRAIN_VENV:-.venv}"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
fi
pipq() { "$PY" -m pip install --disable-pip-version-check -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: installing torch (pinned, see requirements/constraints.txt)" >&2
    if [ -n "${HYPERTRAIN_TORCH_INDEX:-}" ]; then
        pipq --index-url "$HYPERTRAIN_TORCH_INDEX" "torch==2.13.0"
    else
        pipq "torch==2.13.0"
    fi
fi
# The editable install is a link tree (strict mode) so that mypy and the
# package-dir mapping both see the real layout.  It must be refreshed when a
# module is added, so the stamp covers the list of files as well as pyproject.
stamp_now=$( { cat pyproject.toml requirements/constraints.txt; \
               { find entry common services proto experiments -name '*.py' 2>/dev/null || true; } | sort; } \
             | sha256sum | cut -c1-16 )
stamp_file="$VENV/.hypertrain-stamp"
# The link tree lives in build/, which a clean of ignored files removes: reinstall then too.
if [ "$(cat "$stamp_file" 2>/dev/null)" != "$stamp_now" ] || ! "$PY" -c "import hypertrain.common" 2>/dev/null; then
    echo "setup: installing hypertrain and its dependencies into $VENV" >&2
    pipq -c requirements/constraints.txt -e ".[dev]" --config-settings editable_mode=strict
    "$PY" -c "import hypertrain.common" || { echo "setup: install failed" >&2; exit 1; }
    echo "$stamp_now" > "$stamp_file"
fi
