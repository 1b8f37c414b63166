#!/usr/bin/env bash
# Install Debian's `prometheus` package (it ships both `prometheus` and `promtool`) when either
# binary is missing. Idempotent: does nothing when both are on PATH. Used by the test fixtures
# (tests/integration/test_prometheus*.py, tests/unit/test_rules*.py) and the README's test command.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install_prometheus.sh: prometheus/promtool missing and not root (no sudo); install Debian's 'prometheus' package" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
# --no-install-recommends: the package recommends node-exporter and friends, which tests do not use.
$SUDO apt-get install -y -q --no-install-recommends prometheus

# The Debian package starts a system service on :9090 where an init system runs; tests start their
# own Prometheus on a random port, so the service is left as the package set it.
command -v prometheus >/dev/null && command -v promtool >/dev/null
