"""Training-thread cost of FLOPs tracking and of the grad-norm probe, next to a bare loop.

    PYTHONPATH=src python benchmarks/flops_gradnorm.py [--steps 200] [--rounds 5]

Three loops run interleaved (a few steps each, round-robin, so drift in the machine's load hits
all of them alike) on CPU MLPs of ~0.2 M and ~0.9 M parameters:
  baseline      forward, backward, optimizer step
  grad_norm     + the optimizer pre-hook calling GradNormProbe.on_optimizer_step (on CPU the
                norm is real compute on the training thread; on GPU it is a few kernel launches)
  flops_lookup  + the forward pre-hook calling FlopCache.get (a cache hit: the signature of the
                call and one dict lookup; the one-time fake-tensor count is done in warm-up)
It prints the median step time of each loop and the median time spent inside the hook itself.
These are stepwatch's FLOPs/grad-norm costs alone, separate from the foundation's bookkeeping.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="steps per loop per model (default 200)")
    ap.add_argument("--rounds", type=int, default=10, help="round-robin rounds (default 10)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    a = ap.parse_args()

    import torch
    import torch.nn as nn
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from stepwatch.metrics.flops import FlopCache
    from stepwatch.metrics.grads import GradNormProbe

    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s), {a.steps} steps x {a.rounds} rounds per loop\n")
    print(f"{'params':>8} {'loop':<13} {'step p50 us':>12} {'vs base us':>11} {'in hook p50 us':>15}")
    for hidden in (256, 720):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 256))
        n_params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        x, y = torch.randn(32, 256), torch.randn(32, 256)

        probe = GradNormProbe().install()
        cache = FlopCache()
        mode = ["baseline"]
        hook_ns: dict[str, list[int]] = {"grad_norm": [], "flops_lookup": []}
        pending: list = []

        def opt_pre(o, args, kwargs):
            if mode[0] == "grad_norm":
                t0 = time.perf_counter_ns()
                pending.append(probe.on_optimizer_step(o))
                hook_ns["grad_norm"].append(time.perf_counter_ns() - t0)

        def fwd_pre(m, args, kwargs):
            if mode[0] == "flops_lookup":
                t0 = time.perf_counter_ns()
                cache.get(m, args, kwargs)
                hook_ns["flops_lookup"].append(time.perf_counter_ns() - t0)

        h1 = register_optimizer_step_pre_hook(opt_pre)
        h2 = model.register_forward_pre_hook(fwd_pre, with_kwargs=True)
        cache.get(model, (x,), {})  # the one-time count, outside the measurement

        def step() -> int:
            t0 = time.perf_counter_ns()
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            return time.perf_counter_ns() - t0

        loops = ("baseline", "grad_norm", "flops_lookup")
        times: dict[str, list[int]] = {k: [] for k in loops}
        for k in loops:  # warm-up
            mode[0] = k
            for _ in range(20):
                step()
        hook_ns = {"grad_norm": [], "flops_lookup": []}
        per_round = max(1, a.steps // a.rounds)
        for _ in range(a.rounds):
            for k in loops:
                mode[0] = k
                for _ in range(per_round):
                    times[k].append(step())
                pending.clear()
        h1.remove()
        h2.remove()
        probe.uninstall()

        base = statistics.median(times["baseline"]) / 1e3
        for k in loops:
            med = statistics.median(times[k]) / 1e3
            hook = f"{statistics.median(hook_ns[k]) / 1e3:15.1f}" if k in hook_ns else f"{'-':>15}"
            print(f"{n_params / 1e6:7.2f}M {k:<13} {med:12.1f} {med - base:+11.1f} {hook}")
    print("\n'in hook' is the training-thread cost of each feature; 'vs base' also shows noise.")


if __name__ == "__main__":
    main()
