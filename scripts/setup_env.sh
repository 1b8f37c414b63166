#!/usr/bin/env bash
# Create (or reuse) ./.venv with stepwatch installed in editable mode and the pinned set-up.
# Idempotent: a stamp of the requirement files skips pip when nothing changed. The interpreter is
# $PYTHON when set, else the distribution's python3 (scripts/_python.sh says why); a .venv made
# from another interpreter is made again.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_python.sh
PY=$(pick_python "${PYTHON:-}")
if [ -e .venv ] && [ "$(base_python .venv/bin/python)" != "$(base_python "$PY")" ]; then
    echo "setup_env: .venv was made from $(base_python .venv/bin/python || echo "an interpreter that no longer runs"); making it again from $(base_python "$PY")" >&2
    rm -rf .venv
fi
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
