#!/usr/bin/env bash
# GPU check for maintainers: run on a real NVIDIA machine (Hopper or newer for GPM).
# Exercises the real sampler (NVML + GPM + XID thread), checks it creates no CUDA context,
# loads the GPU with BF16 matmuls and prints what the sampler saw, runs `stepwatch doctor`, then
# checks the native timing extension (gpu_check_timing.py), a whole session (gpu_check_session.py),
# comm spans over NCCL with a captured CUDA trace and MFU (gpu_check_ddp.py) and the overhead on the
# GPU (gpu_check_overhead.py).
# Usage: scripts/gpu_check.sh            (PYTHON=... to pick the interpreter)
# Needs on that machine: torch with CUDA, numpy, nvidia-ml-py and rich (no venv of ours: without
# .venv it uses python3), and a C compiler with Python headers, because gpu_check_timing.py builds
# the native extension for that Python. opentelemetry, nvtx and py-spy are optional here.
# Took 97-107 s on an NVIDIA H200 (2026-12-04); exit 0 = every check passed, 1 = a
# check failed, 2 = the timing or session check could not run. GPU_CHECK_JSON=path keeps its observations;
# GPU_CHECK_OUT=dir keeps the captured trace, its analyses and the overhead figures.
# In a timed lease:
#   PYTHONUNBUFFERED=1 bash scripts/gpu_check.sh 2>&1 | tee "$OUT/gpu_check.log"
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
status=0

echo "== nvidia-smi -L"
nvidia-smi -L || echo "(nvidia-smi failed)"

echo "== sampler under load"
timeout 120 "$PY" - <<'EOF' || status=1
import os, sys, time
import pynvml
from stepwatch.telemetry import TelemetrySource, summarize_window
from stepwatch.telemetry.diagnose import classify

problems = []
src = TelemetrySource(rank=0, hz=2)
src.start()
src.wait_ready(15)
print("status:", src.status)
if not src.status.get("running"):
    sys.exit("sampler did not start: %s" % src.status.get("error"))

# The sampler must not have created a CUDA context. Asked of the driver itself (NVML's process
# list shows host pids, which a container's pid namespace hides): is device 0's primary context
# active in this process? cuInit creates none.
import ctypes
cu = ctypes.CDLL("libcuda.so.1")
dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
rc = (cu.cuInit(0), cu.cuDeviceGet(ctypes.byref(dev), 0),
      cu.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)))
print("driver calls", rc, "-> device 0 primary context active before torch touches CUDA:", bool(active.value))
if any(rc):
    problems.append(f"could not ask the driver about contexts: {rc}")
elif active.value:
    problems.append("sampler created a CUDA context")
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByUUID(src.status["uuid"])
print("compute pids on our GPU (NVML, host pid namespace):", [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)])

import torch
torch.cuda.set_device(0)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
uuid = "GPU-" + str(torch.cuda.get_device_properties(0).uuid)
print("torch device 0 uuid:", uuid, "| sampler matched:", src.status["uuid"], "by", src.status["matched_by"])
if uuid != src.status["uuid"]:
    problems.append("sampler matched another GPU than torch's device 0")
src.drain()  # what came before (imports, context creation) is not the loaded window
t0 = time.time()
smi = None
while time.time() - t0 < 6:
    for _ in range(20):
        a @ b
    if smi is None and time.time() - t0 > 3:  # nvidia-smi's reading of the same load, beside NVML's
        import subprocess
        q = "temperature.gpu,power.draw,clocks.sm,clocks.mem,utilization.gpu,utilization.memory,memory.used"
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=" + q, "--format=csv,noheader,nounits", "-i", "0"],
                                 capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            smi = f"(nvidia-smi failed: {e})"
        print(f"nvidia-smi under load ({q}):", smi)
    torch.cuda.synchronize()
busy = src.drain()
time.sleep(3)  # idle
idle = src.drain()
src.stop()

keys = ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_SM_CLOCK", "clocks_event_reasons",
        "DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE",
        "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_NVLINK_TX_BYTES")
for tag, ss in (("busy", busy), ("idle", idle)):
    print(f"-- {tag}: {len(ss)} samples")
    for s in ss:
        print("  ", {k.replace("DCGM_FI_", ""): (round(s[k], 3) if isinstance(s.get(k), float) else s.get(k))
                     for k in keys if k in s})
print("all fields seen:", sorted({k for s in busy + idle for k in s}))
g = summarize_window(busy)
print("busy window gpu object:", g)
print("idle window gpu object:", summarize_window(idle))
if src.status.get("gpm"):
    if not g or g.get("sm_active") is None:
        problems.append("GPM supported but no SM activity in the samples")
    elif g["sm_active"] < 0.5 or (g.get("tensor_active") or 0) < 0.1:
        problems.append(f"BF16 matmul load but sm_active={g.get('sm_active')} tensor={g.get('tensor_active')}")
    print("matrix row (busy):", classify(g.get("sm_active"), g.get("tensor_active"), g.get("dram_active"),
                                         g.get("fp64_active")))
else:
    print("GPM not supported on this GPU: profiling fields absent (expected before Hopper)")
print("findings:", [(f.kind, f.summary) for f in src.analyze(busy + idle)])
print("xid watcher:", "on" if src.status.get("xid") else f"off ({src.status.get('xid_error')})")
for p in problems:
    print("PROBLEM:", p)
sys.exit(1 if problems else 0)
EOF

echo "== stepwatch doctor --storage (256 MiB in \${TMPDIR:-/tmp})"
timeout 90 "$PY" -m stepwatch doctor --storage "${TMPDIR:-/tmp}" --storage-size-mb 256 || status=1

echo "== timing extension (scripts/gpu_check_timing.py)"
timeout 180 "$PY" scripts/gpu_check_timing.py ${GPU_CHECK_JSON:+--json "$GPU_CHECK_JSON"}
rc=$?
# 2 = could not run (no compiler or Python headers to build the extension): not a pass.
if [ $rc = 2 ]; then incomplete=1; elif [ $rc != 0 ]; then status=1; fi

echo "== a whole session on the GPU (scripts/gpu_check_session.py)"
timeout 180 "$PY" scripts/gpu_check_session.py
rc=$?
if [ $rc = 2 ]; then incomplete=1; elif [ $rc != 0 ]; then status=1; fi

echo "== comm spans over NCCL, a captured CUDA trace, MFU (scripts/gpu_check_ddp.py)"
timeout 240 "$PY" scripts/gpu_check_ddp.py --out "${GPU_CHECK_OUT:-${TMPDIR:-/tmp}}/ddp"
rc=$?
if [ $rc = 2 ]; then incomplete=1; elif [ $rc != 0 ]; then status=1; fi

echo "== overhead on the GPU (scripts/gpu_check_overhead.py)"
timeout 240 "$PY" scripts/gpu_check_overhead.py --blocks 6 --steps 150 \
    ${GPU_CHECK_OUT:+--json "$GPU_CHECK_OUT/overhead.json"} || status=1

if [ $status != 0 ]; then verdict=PROBLEMS; elif [ -n "${incomplete:-}" ]; then verdict=INCOMPLETE; status=2; else verdict=OK; fi
echo "== gpu_check: $verdict"
exit $status
