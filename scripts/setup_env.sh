#!/usr/bin/env bash
# Create (or reuse) ./.venv with stepwatch installed in editable mode and the pinned set-up.
# Idempotent: a stamp of the requirement files skips pip when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.stepwatch-setup
want=$(cat requirements-dev.txt pyproject.toml setup.py 2>/dev/null | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -r requirements-dev.txt
    .venv/bin/python -m pip install -q -e .
    echo "$want" > "$stamp"
fi
