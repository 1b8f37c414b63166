#!/usr/bin/env bash
# The test suite: installs what it needs (venv, Debian's prometheus), then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
bash scripts/install_prometheus.sh
# pytest exits 5 when it ran no test: that is a failure here too (set -e).
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
