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
# Bytecode for our own sources, written once: where PYTHONDONTWRITEBYTECODE is set (this VM's
# environment sets it) every process the tests start -- each job, rank and watchdog sidecar --
# compiled stepwatch's modules again (~0.14 s of a job's ~5.8 s of CPU, measured side by side);
# the packages' bytecode was written by pip.
.venv/bin/python -m compileall -q -j 0 src tests examples benchmarks >/dev/null
# pytest exits 5 when it ran no test: that is a failure here too.
# --durations: the slowest tests, so the suite's 15-minute budget can be kept in view.
if [ "$#" -gt 0 ]; then  # the tests asked for, in one run
    exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 "$@"
fi
# The whole suite in two runs. First the unit and framework tests, with the integration tests
# whose module says they share cores (tests/integration/conftest.py), on pytest-xdist workers: they
# hold no timing bound a test beside them could break. Then the other integration tests one at a
# time: real multi-process jobs whose bounds (hang timeouts, shutdown within 2 s, stragglers named
# within a second of evidence) are about load, and a second test beside them would be load.
rc=0
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -n 2 --dist worksteal -m "not alone" \
  tests/unit tests/frameworks tests/integration || rc=$?
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 -m alone tests/integration || rc=$((rc ? rc : $?))
exit "$rc"
