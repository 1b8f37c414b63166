#!/usr/bin/env bash
# The test suite: installs what it needs (venv, Debian's prometheus), then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# The framework support matrix (tests/frameworks): pinned, cached by pip when already satisfied.
.venv/bin/python -m pip install -q -r requirements-frameworks.txt
bash scripts/install_prometheus.sh
# The vLLM CPU server for the serving tests: a cached venv (~2 min and ~3.4 GB the first time).
# If it cannot be installed, the serving integration tests skip and say why (pytest's summary).
bash scripts/setup_vllm.sh >/dev/null || echo "run_tests: vLLM set-up failed; serving integration tests will skip" >&2
# pytest exits 5 when it ran no test: that is a failure here too (set -e).
# --durations: the slowest tests, so the suite's 15-minute budget can be kept in view.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 "$@"
