#!/usr/bin/env bash
# The main job: a 2-rank DDP GPT on synthetic tokens (gloo on CPU), stepwatch on through
# `import stepwatch.auto`, then the run report. Extra arguments go to examples/ddp_train.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export STEPWATCH_DIR=${STEPWATCH_DIR:-stepwatch-runs/main-job-$(date +%Y%m%d-%H%M%S)}
.venv/bin/torchrun --standalone --nproc-per-node 2 examples/ddp_train.py --steps 80 "$@"
.venv/bin/stepwatch report "$STEPWATCH_DIR"
