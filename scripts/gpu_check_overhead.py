#!/usr/bin/env python3
"""stepwatch's cost on a GPU: host us per step and step time, stepwatch off and on, in one run.

    python scripts/gpu_check_overhead.py [--blocks 8] [--steps 200] [--json out.json] [--cpu]

Called by scripts/gpu_check.sh on a GPU machine (issue 20). Two loops on cuda:0, each run in
interleaved blocks (off, foundation, all defaults; every round), the batches already on the device:

* launch-bound: a 16-layer MLP of width 256, batch 64, AdamW -- each step is ~200 small kernels,
  so the host's launch rate sets the step time and every host microsecond stepwatch adds can show;
* compute-bound: 4 layers of width 4096 in bf16, batch 4096 -- the GPU sets the step time.

Per block: the training thread's CPU time per step (``time.thread_time``; on CUDA the backward
runs on autograd's device thread, so this leaves it out), all threads' CPU time per step
(``time.process_time``: the backward, stepwatch's pipeline thread and NCCL's/CUDA's own threads
too) and the wall time per step (one ``torch.cuda.synchronize`` at the block's end only, so the
loop runs as a job's does). Each variant's figure is the median over blocks of (on - off of the
same round), with the inter-quartile range. The variants: benchmarks/overhead.py's "foundation"
with host timing (``device_timing=False``) and as it is (CUDA events), its cumulative "+ memory"
(every default feature), and the grad-norm floor (stepwatch off, the loop computing
``vector_norm(stack(_foreach_norm(grads)))``). ``--cpu`` rehearses it on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="stepwatch overhead on a GPU")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--cpu", action="store_true", help="rehearse on the CPU")
    ap.add_argument("--loops", help="comma-separated: launch-bound, compute-bound (default both)")
    ap.add_argument("--variants", help="semicolon-separated variant names (default all)")
    args = ap.parse_args(argv)

    import torch
    import torch.nn as nn

    gpu = not args.cpu
    if gpu and not torch.cuda.is_available():
        print("gpu_check_overhead: SKIP: torch.cuda.is_available() is False")
        return 2
    import overhead  # benchmarks/overhead.py: the same variants and statistics as the CPU benchmark
    import stepwatch

    variants = dict(overhead.variants())
    chosen = [("foundation, host clock", {**variants["foundation"], "device_timing": False}),
              ("foundation", variants["foundation"]), ("all defaults", variants["+ memory"])]
    if args.variants:  # these, or any of benchmarks/overhead.py's (e.g. "gpu telemetry alone")
        named = dict(chosen, **variants)
        chosen = [(v, named[v]) for v in args.variants.split(";")]
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    loops = {"launch-bound": (256, 16, 64, torch.float32), "compute-bound": (4096, 4, 4096, torch.bfloat16)}
    if args.loops:
        loops = {k: v for k, v in loops.items() if k in args.loops.split(",")}
    if not gpu:
        loops = {"launch-bound": (64, 4, 8, torch.float32)}
    run_dir = tempfile.mkdtemp(prefix="sw-gpu-overhead-")
    out: dict = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "torch": torch.__version__, "loops": {}}
    for name, (width, layers, batch, dtype) in loops.items():
        torch.manual_seed(0)
        body = []
        for _ in range(layers):
            body += [nn.Linear(width, width), nn.GELU()]
        model = nn.Sequential(*body).to(dev, dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        xs = [torch.randn(batch, width, device=dev, dtype=dtype) for _ in range(4)]

        params = list(model.parameters())

        def block(steps: int = args.steps, norm: bool = False) -> tuple[float, float, float]:
            """(training thread's CPU us, all threads' CPU us, wall us) per step. ``norm``: stepwatch
            off, the loop computes vector_norm(stack(_foreach_norm(grads))) itself (the grad-norm floor)."""
            for i in range(steps + 5):
                if i == 5:  # the first steps include root discovery and warm-up
                    if gpu:
                        torch.cuda.synchronize()
                    c0, p0, w0 = time.thread_time_ns(), time.process_time_ns(), time.perf_counter_ns()
                loss = model(xs[i % 4]).float().pow(2).mean()
                loss.backward()
                if norm:
                    torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in params], 2.0)), 2.0)
                opt.step()
                opt.zero_grad()
                stepwatch.log(loss=loss.detach())
            c1 = time.thread_time_ns()
            if gpu:
                torch.cuda.synchronize()
            w1, p1 = time.perf_counter_ns(), time.process_time_ns()
            return (c1 - c0) / 1e3 / steps, (p1 - p0) / 1e3 / steps, (w1 - w0) / 1e3 / steps

        block()  # warm-up: cuBLAS handles, the allocator, kernels' first launches
        offs: list[tuple[float, float, float]] = []
        added: dict[str, list[tuple[float, ...]]] = {v: [] for v, _ in [(overhead.FLOOR, None)] + chosen}
        for b in range(args.blocks):  # interleaved: off, the floor, then each variant, every round
            off = block()
            offs.append(off)
            added[overhead.FLOOR].append(tuple(x - y for x, y in zip(block(norm=True), off)))
            for v, cfg in chosen:
                stepwatch.init(dir=os.path.join(run_dir, f"{name}-{b}-{v.replace(' ', '_')}"), console="off", **cfg)
                on = block()
                stepwatch.shutdown()
                added[v].append(tuple(x - y for x, y in zip(on, off)))
        row = {f"off_{k}_us": overhead._q([o[i] for o in offs]) for i, k in enumerate(("host", "cpu", "wall"))}
        print(f"{name} ({layers} x {width}, batch {batch}, {str(dtype)[6:]}), "
              f"{args.blocks} blocks of {args.steps} steps; us per step, median [IQR]")
        print(f"   {'off':>22}: training thread {row['off_host_us'][0]:.1f} [{row['off_host_us'][1]:.1f}], "
              f"all threads {row['off_cpu_us'][0]:.1f} [{row['off_cpu_us'][1]:.1f}], "
              f"wall {row['off_wall_us'][0]:.1f} [{row['off_wall_us'][1]:.1f}]")
        for v in added:
            h, c, w = (overhead._q([a[k] for a in added[v]]) for k in range(3))
            row[v] = {"host_us": h, "cpu_us": c, "wall_us": w}
            print(f"   {v:>22}: training thread +{h[0]:.1f} [{h[1]:.1f}], all threads +{c[0]:.1f} [{c[1]:.1f}], "
                  f"wall +{w[0]:.1f} [{w[1]:.1f}] ({100 * w[0] / row['off_wall_us'][0]:+.2f} %)")
        out["loops"][name] = row
        del model, opt, xs
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print("gpu_check_overhead: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
