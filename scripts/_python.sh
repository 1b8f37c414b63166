# Sourced by the set-up scripts: which interpreter their venvs are made from.
#
# pick_python [override]  prints the override when it is given; else the distribution's
#   /usr/bin/python3 when it is 3.10 or newer and can make a venv; else the first python3 on PATH.
#   Debian builds its python3 with PGO and LTO. pyenv's default build (first on PATH on our
#   machines) has neither, and a shared libpython: it ran pure Python ~1.9x slower and imported
#   torch ~20% slower, measured side by side, and the test suite -- hundreds of processes that
#   import torch -- paid that in full.
# base_python PY  prints the real path of the interpreter PY is, or was made from (a venv's base).
pick_python() {
    if [ -n "${1:-}" ]; then
        echo "$1"
    elif /usr/bin/python3 -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        echo /usr/bin/python3
    else
        echo python3
    fi
}
base_python() {
    "$1" -c 'import os, sys; print(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))' 2>/dev/null
}
