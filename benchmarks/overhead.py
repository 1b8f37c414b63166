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

    def run_block() -> list[float]:
        times = []
        t_prev = time.perf_counter()
        for x, y in DataLoader(data, batch_size=batch, sampler=order):
            loss = lossf(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            stepwatch.log(loss=loss)
            t = time.perf_counter()
            times.append(t - t_prev)
            t_prev = t
        return times[5:]  # the block's first steps include discovery and warm-up

    return run_block


def side_by_side(blocks: int, steps: int, run_dir: str) -> None:
    print(f"{'step size':>10} {'off (ms)':>10} {'on (ms)':>10} {'added (us)':>11} {'ratio':>7}")
    for label, (width, batch) in SIZES.items():
        run_block = make_loop(width, batch, steps)
        run_block()  # warm torch up
        off, on = [], []
        for i in range(blocks):
            off.append(statistics.median(run_block()))
            stepwatch.init(dir=os.path.join(run_dir, f"{label.strip('~ ')}-{i}"), console="off")
            on.append(statistics.median(run_block()))
            stepwatch.shutdown()
        m_off, m_on = statistics.median(off), statistics.median(on)
        print(f"{label:>10} {m_off * 1e3:10.3f} {m_on * 1e3:10.3f} {(m_on - m_off) * 1e6:11.1f} {m_on / m_off:7.3f}")


def bookkeeping(n: int, run_dir: str) -> None:
    """The tracker's per-step work in isolation: the hook sequence of one step, n times."""
    s = stepwatch.init(dir=os.path.join(run_dir, "bookkeeping"), console="off", queue_size=n + 16)
    tr = s.tracker
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

    def noop() -> None:
        pass

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter_ns()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter_ns() - t) / n)
        return best

    base = timed(noop)
    cost = timed(one_step)
    stepwatch.shutdown()
    print(f"\nbookkeeping per step (hook sequence of one step, best of 5 x {n}):")
    print(f"  stepwatch {cost / 1e3:.2f} us  vs empty loop {base / 1e3:.2f} us  -> {(cost - base) / 1e3:.2f} us added")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--steps", type=int, default=120)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        side_by_side(args.blocks, args.steps, d)
        bookkeeping(20000, d)


if __name__ == "__main__":
    main()
