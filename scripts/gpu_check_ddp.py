#!/usr/bin/env python3
"""GPU check of comm spans, a stepwatch-captured CUDA trace, MFU and memory reads under sync checks.

    python scripts/gpu_check_ddp.py --out DIR [--cpu]

Called by scripts/gpu_check.sh on a GPU machine (issue 20). One process, world size 1 over NCCL
(NCCL refuses two ranks on one GPU), a bf16 MLP wrapped in DDP, stepwatch on with captures:

1. comm spans on device events: every record from step 2 on has ``allreduce_s`` and ``comm_s``
   (DDP's gradient all-reduce through stepwatch's comm hook, timed by CUDA events) and
   ``clock: "device"``;
2. no sync: steps 5-59 run under ``torch.cuda.set_sync_debug_mode("error")`` with the memory probe
   reading the allocator every step (``memory_every=1``) and the loop itself calling
   ``torch.cuda.memory_stats()``: no internal error, no raise;
3. MFU against the real peak: the records' ``mfu``, ``mfu_dtype`` ("bf16") and ``peak_tflops``
   (the catalogue's peak for this device), and the MFU recomputed from the loop's own wall clock
   over steps 60-79 (synchronized at both ends only);
4. a real CUDA trace captured by stepwatch (an on-demand request dropped in ``requests/`` after
   step 79, as ``stepwatch capture`` does): the trace, stepwatch's analysis of it (``<stem>.analysis.json``) and
   ``stepwatch trace --json`` are copied to DIR, to be compared with HTA off the device (HTA is not
   in the device image: benchmarks/hta_reference.py runs it where it is installed).

``--cpu`` rehearses the same script with gloo on the CPU (fp32, no device-only checks), so a device
lease is not spent on the script's own bugs. Exit status: 0 passed, 1 a check failed, 2 could not run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

SYNC_CHECKED = range(5, 60)
WALL = range(60, 80)  # the loop's wall clock for MFU; the capture is asked for after these
DEADLINE_S = 90  # the loop runs until the capture is analysed, or this long


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="stepwatch comm/trace/MFU GPU check")
    ap.add_argument("--out", required=True, help="folder for the trace, the analyses and the observations")
    ap.add_argument("--cpu", action="store_true", help="rehearse on the CPU with gloo (device-only checks skipped)")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist
    import torch.nn as nn

    gpu = not args.cpu
    if gpu and not torch.cuda.is_available():
        print("gpu_check_ddp: SKIP: torch.cuda.is_available() is False")
        return 2
    import stepwatch
    from stepwatch.traces import rundir

    os.makedirs(args.out, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1,
                            **({"device_id": dev} if gpu else {}))
    width, layers, batch = (4096, 4, 4096) if gpu else (256, 2, 64)
    dtype = torch.bfloat16 if gpu else torch.float32
    torch.manual_seed(0)
    body = []
    for _ in range(layers):
        body += [nn.Linear(width, width, bias=False), nn.GELU()]
    model = nn.Sequential(*body).to(dev, dtype)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0] if gpu else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    xs = [torch.randn(batch, width, device=dev, dtype=dtype) for _ in range(4)]

    run = tempfile.mkdtemp(prefix="sw-ddp-")
    mem = stepwatch.InMemoryExporter()
    stepwatch.init(dir=run, console="off", watchdog="off", capture="on", capture_steps=3, exporters=[mem],
                   flush_interval_s=0.1, memory_every=1)
    sync_raised: list[str] = []
    step, t_start, wall, t_wall = 0, time.monotonic(), None, 0.0
    analysed_at = None
    analyses_before: int | None = None  # analyses in captures/ when the on-demand capture was asked for
    if gpu:
        torch.cuda.synchronize()
    while time.monotonic() - t_start < DEADLINE_S:
        if gpu and step == SYNC_CHECKED.start:
            torch.cuda.set_sync_debug_mode("error")
        if gpu and step == SYNC_CHECKED.stop:
            torch.cuda.set_sync_debug_mode("default")
        if step in (WALL[0], WALL[-1] + 1):  # the loop's own wall clock over WALL, synchronized at its ends
            if gpu:
                torch.cuda.synchronize()
            if step == WALL[0]:
                t_wall = time.perf_counter()
            else:
                wall = (time.perf_counter() - t_wall) / len(WALL)
                rundir.request_capture(run, 3)  # then the capture, as `stepwatch capture RUN_DIR --steps 3` asks
                # A spike's capture may have been analysed before (a busy machine): wait for this one's.
                analyses_before = len(glob.glob(os.path.join(run, "captures", "*.analysis.json")))
        try:
            loss = ddp(xs[step % len(xs)]).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            stepwatch.log(loss=loss.detach())
            if gpu and step in SYNC_CHECKED:
                torch.cuda.memory_stats()
        except RuntimeError as exc:  # a sync the loop itself made under "error" (not stepwatch's)
            sync_raised.append(f"step {step}: {exc}")
            torch.cuda.set_sync_debug_mode("default")
        step += 1
        if (analysed_at is None and analyses_before is not None
                and len(glob.glob(os.path.join(run, "captures", "*.analysis.json"))) > analyses_before):
            analysed_at = step
        if analysed_at is not None and step >= analysed_at + 5:
            break
    if gpu:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    stepwatch.shutdown()
    dist.destroy_process_group()

    failures: list[str] = list(sync_raised)
    recs = sorted(mem.records, key=lambda r: r.step)
    internal = [f.summary for f in mem.findings if f.kind == "internal_error"]
    if internal:
        failures.append(f"internal errors (a sync raises inside stepwatch's hooks): {internal}")
    print(f"steps run: {step}; records: {len(recs)}; capture analysed after step {analysed_at}")
    for r in recs:
        if r.step < 2:
            continue
        if not (r.allreduce_s and r.allreduce_s > 0 and r.comm_s and r.comm_s > 0):
            failures.append(f"step {r.step}: allreduce_s {r.allreduce_s}, comm_s {r.comm_s}")
        if gpu and r.clock != "device":
            failures.append(f"step {r.step}: clock {r.clock!r}")
        if gpu and r.mem_allocated_bytes is None:
            failures.append(f"step {r.step}: no memory read with memory_every=1")
    late = [r for r in recs if r.step in WALL and r.mfu is not None]
    # forward 2 per multiply-add, backward 4, except the first layer's: its input needs no gradient
    flop = (6 * layers - 2) * batch * width * width
    obs: dict = {"steps": step, "records": len(recs), "analysed_after_step": analysed_at}
    if late:
        med = sorted(late, key=lambda r: r.step_s)[len(late) // 2]
        obs["mean_step_s"] = sum(r.step_s for r in late) / len(late)  # like for like with the loop's mean
        obs.update(mfu=med.mfu, mfu_dtype=med.mfu_dtype, peak_tflops=med.peak_tflops, step_s=med.step_s,
                   forward_s=med.forward_s, backward_s=med.backward_s, allreduce_s=med.allreduce_s,
                   comm_s=med.comm_s, comm_exposed_s=med.comm_exposed_s, overlap=med.overlap,
                   clock=med.clock, loop_wall_s=wall,
                   mfu_from_loop_wall=(flop / wall / (med.peak_tflops * 1e12))
                   if wall and med.peak_tflops else None,
                   mem_allocated_bytes=med.mem_allocated_bytes, gpu=med.gpu)
        print(f"step_s of steps {WALL[0]}-{WALL[-1]} (ms):", [round(r.step_s * 1e3, 3) for r in late])
        print(f"median record (steps {WALL[0]}-{WALL[-1]}):", json.dumps(obs, default=str))
        if gpu and (med.mfu_dtype != "bf16" or not med.peak_tflops or not 0 < med.mfu <= 1):
            failures.append(f"MFU {med.mfu} ({med.mfu_dtype}, peak {med.peak_tflops})")
    elif gpu:
        failures.append(f"no record with an MFU in steps {WALL[0]}-{WALL[-1]}")
    with open(os.path.join(run, "run.json"), encoding="utf-8") as f:
        features = json.load(f).get("features", {})
    obs["features"] = features
    print("run.json features:", json.dumps(features, default=str))

    traces = sorted(glob.glob(os.path.join(run, "captures", "*.json*")))
    print("captures/:", [os.path.basename(t) for t in traces])
    trace = next((t for t in traces if t.endswith(".trace.json.gz")), None)  # capture/profiler.py's name
    if trace is None:
        failures.append(f"no capture trace in {run}/captures: {traces}")
    else:
        for t in traces:  # the trace and stepwatch's analysis of it (not the capture's small meta file)
            if t.endswith((".trace.json.gz", ".analysis.json")):
                shutil.copy(t, os.path.join(args.out, os.path.basename(t)))
        r = subprocess.run([sys.executable, "-m", "stepwatch", "trace", "--json", trace],
                           capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src")))
        with open(os.path.join(args.out, "stepwatch_trace.json"), "w") as f:
            f.write(r.stdout)
        print(f"stepwatch trace --json {os.path.basename(trace)}: exit {r.returncode}, {len(r.stdout)} chars"
              + (f"; stderr: {r.stderr[-1500:]}" if r.returncode else ""))
        if r.returncode != 0:
            failures.append(f"stepwatch trace exited {r.returncode}")
        else:
            for rank in json.loads(r.stdout):
                print("  temporal:", rank.get("temporal"), "| overlap:", rank.get("comm_comp_overlap_pct"),
                      "| note:", rank.get("note"))
    obs["failures"] = failures
    with open(os.path.join(args.out, "ddp.json"), "w") as f:
        json.dump(obs, f, indent=2, default=str)
    print("gpu_check_ddp: " + ("PASS" if not failures else "FAIL:\n  " + "\n  ".join(failures[:20])))
    return 0 if not failures else 1


if __name__ == "__main__":
    warnings.simplefilter("default")
    sys.exit(main())
