"""stepwatch's cost on the training thread, measured side by side in one run.

    python benchmarks/overhead.py [--blocks 10] [--steps 200]

The same CPU training loop (DataLoader -> model -> loss module -> backward -> AdamW) runs in
interleaved blocks with stepwatch off and on, for three step sizes (~0.5 ms, ~2 ms, ~20 ms). For
each size it prints the median step time off and on, the added microseconds per step and the
ratio. A second table times stepwatch's own bookkeeping alone: the exact hook sequence of one
step (fetch, two root forwards, backward, optimizer, log) against a no-op loop, which is what the
20 us budget is about, free of the model's noise.

Everything stepwatch does off the training thread (building records, writing files) still
competes for the GIL and shows up in the first table; that is deliberate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import stepwatch  # noqa: E402

SIZES = {"~0.5 ms": (8, 4), "~2 ms": (256, 64), "~20 ms": (768, 192)}


def make_loop(width: int, batch: int, steps: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
    lossf = nn.MSELoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = batch * 4
    data = TensorDataset(torch.randn(rows, width), torch.randn(rows, width))
    order = [i % rows for i in range(batch * steps)]  # many steps over a small dataset

    def run_block() -> tuple[float, float]:
        """(median wall time per step, training-thread CPU time per step), in seconds."""
        times = []
        t_prev = time.perf_counter()
        cpu0 = 0
        for i, (x, y) in enumerate(DataLoader(data, batch_size=batch, sampler=order)):
            if i == 5:  # the block's first steps include discovery and warm-up
                cpu0 = time.thread_time_ns()
            loss = lossf(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            stepwatch.log(loss=loss)
            t = time.perf_counter()
            times.append(t - t_prev)
            t_prev = t
        cpu = (time.thread_time_ns() - cpu0) / 1e9 / (len(times) - 5)
        return statistics.median(times[5:]), cpu

    return run_block


# What runs "on": the foundation alone (step/phase timing, NVTX, records, detectors), and every
# default feature on top (FLOPs/tokens/grad-norm are real work on CPU: see flops_gradnorm.py).
VARIANTS = {
    "foundation": dict(training_metrics=False, comm=False, gpu_telemetry=False, memory=False),
    "+ memory": dict(training_metrics=False, comm=False, gpu_telemetry=False),
    "all defaults": dict(),
}
# The bookkeeping table: the foundation, and the memory feature on top of it at its default read
# interval and reading every step (on CPU one read is a pread of /proc/self/statm; on a GPU it adds
# one call of the allocator's statistics: scripts/gpu_check_session.py prints its cost).
BOOKKEEPING = {
    "foundation": VARIANTS["foundation"],
    "+ memory (every 10)": VARIANTS["+ memory"],
    "+ memory (every 1)": dict(VARIANTS["+ memory"], memory_every=1),
}


def side_by_side(blocks: int, steps: int, run_dir: str) -> None:
    print("wall = median step time; cpu = the training thread's own CPU time per step (immune to other")
    print("processes on the machine, and what stepwatch adds to the training thread)")
    print(f"{'step size':>10} {'stepwatch':>13} {'wall off':>9} {'wall on':>9} {'added':>9} {'ratio':>6} | "
          f"{'cpu off':>9} {'cpu on':>9} {'added':>9} {'ratio':>6}")
    for label, (width, batch) in SIZES.items():
        run_block = make_loop(width, batch, steps)
        run_block()  # warm torch up
        off: list[tuple[float, float]] = []
        on: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
        for i in range(blocks):  # interleaved: off, then each variant, every block
            off.append(run_block())
            for name, cfg in VARIANTS.items():
                stepwatch.init(dir=os.path.join(run_dir, f"{label.strip('~ ')}-{name}-{i}"), console="off", **cfg)
                on[name].append(run_block())
                stepwatch.shutdown()
        w_off, c_off = statistics.median(x[0] for x in off), statistics.median(x[1] for x in off)
        for name in VARIANTS:
            w_on = statistics.median(x[0] for x in on[name])
            c_on = statistics.median(x[1] for x in on[name])
            print(
                f"{label:>10} {name:>13} {w_off * 1e3:7.3f}ms {w_on * 1e3:7.3f}ms {(w_on - w_off) * 1e6:7.1f}us "
                f"{w_on / w_off:6.3f} | {c_off * 1e3:7.3f}ms {c_on * 1e3:7.3f}ms {(c_on - c_off) * 1e6:7.1f}us "
                f"{c_on / c_off:6.3f}"
            )


def hook_sequence(tr):
    """What the hooks call on the training thread in one step of the loop above: a fetch, two root
    forwards (model, loss module), a backward, an optimizer step and a log()."""
    loss = torch.ones(())

    def one_step() -> None:
        t0 = tr.data_begin()
        tr.data_end(t0)
        tr.forward_begin(True)
        tr.forward_end()
        tr.forward_begin(True)  # the loss module
        tr.forward_end()
        tr.backward_begin()
        tr.backward_end()
        tr.optimizer_begin()
        tr.optimizer_end()
        stepwatch.log(loss=loss)

    return one_step


def bookkeeping(n: int, run_dir: str) -> None:
    print(f"\nbookkeeping per step, training thread (hook sequence of one step, CPU time, best of 3 x {n}),")
    print("and the background thread per record (build, enrich, detect, write the records file):")
    first = None
    for name, cfg in BOOKKEEPING.items():
        cost, base, bg = bookkeeping_of(n, os.path.join(run_dir, name.replace(" ", "_")), cfg)
        first = first or (cost, bg)
        print(f"  {name:>20}: stepwatch {cost / 1e3:6.2f} us vs empty loop {base / 1e3:.2f} us -> "
              f"{(cost - base) / 1e3:6.2f} us added ({(cost - first[0]) / 1e3:+.2f} us vs foundation); "
              f"background {bg / 1e3:6.2f} us/record ({(bg - first[1]) / 1e3:+.2f})")


def memory_read_cost(n: int = 20000) -> None:
    """The memory collector's take() alone, hot (no loop around it): what a read costs and what it
    costs per step at the default interval (on CPU: one pread of /proc/self/statm)."""
    from stepwatch.memory.probe import MemoryProbe

    print("memory collector alone, hot (training thread CPU time per step end, best of 5):")
    for every in (1, 10):
        take = MemoryProbe(every=every).take
        best = float("inf")
        for _ in range(5):
            t = time.thread_time_ns()
            for _ in range(n):
                take()
            best = min(best, (time.thread_time_ns() - t) / n)
        print(f"  every {every:>2}: {best / 1e3:.2f} us per step")


def bookkeeping_of(n: int, run_dir: str, cfg: dict) -> tuple[float, float, float]:
    """The tracker's per-step work in isolation: the hook sequence of one step, n times, timed as
    the training thread's own CPU time (the background thread runs as in a job, but its work is
    not counted here); then the background pass over a batch of records, timed on its own."""
    s = stepwatch.init(dir=run_dir, console="off", queue_size=n + 16, **cfg)
    one_step = hook_sequence(s.tracker)

    def timed(fn, reps: int) -> float:
        best = float("inf")
        for _ in range(reps):
            t = time.thread_time_ns()
            for _ in range(n):
                fn()
            best = min(best, (time.thread_time_ns() - t) / n)
        return best

    base = timed(lambda: None, 3)
    cost = timed(one_step, 3)
    # The background side alone: pause the pipeline, queue m steps, time one pass over them.
    s._stop.set()
    s._thread.join()
    s._pass(final=False)  # drain what the timed loops queued
    m = min(n, 2000)
    for _ in range(m):
        one_step()
    t = time.thread_time_ns()
    s._pass(final=True)
    bg = (time.thread_time_ns() - t) / m
    stepwatch.shutdown()
    return cost, base, bg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--steps", type=int, default=120)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        side_by_side(args.blocks, args.steps, d)
        bookkeeping(20000, d)
        memory_read_cost()


if __name__ == "__main__":
    main()
