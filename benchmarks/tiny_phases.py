"""The whole tiny step of ``overhead.py`` (a Linear, an MSELoss, SGD, ``stepwatch.log``) timed
phase by phase: where stepwatch's added training-thread CPU time goes within one step.

    python benchmarks/tiny_phases.py [--rounds 5] [--steps 2000]

Each phase (model forward, loss module, backward, the loop's own grad-norm floor, optimizer
step, ``zero_grad``, ``log``) is timed with ``time.thread_time_ns`` around it, in interleaved
rounds of stepwatch off, off with the loop computing ``vector_norm(stack(_foreach_norm))`` itself
(the grad-norm floor), the foundation and all defaults (``overhead.py``'s cumulative "+ memory"),
the pipeline thread paused as in ``overhead.py``'s hot table; the medians per phase, and each
variant's difference from off. The clock's own cost is in every variant's phases alike.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import overhead  # noqa: E402 - the same step, features and foundation
import stepwatch  # noqa: E402
import torch  # noqa: E402

NAMES = ["forward", "loss", "backward", "norm", "optimizer", "zero_grad", "log"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2000)
    a = p.parse_args()
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})  # one CPU, as overhead.py's training thread
    model, lossf, opt, params, x, y = overhead.tiny_step_parts()
    clk = time.thread_time_ns

    def step(norm: bool, acc: list[list[int]]) -> None:
        t0 = clk()
        out = model(x)
        t1 = clk()
        loss = lossf(out, y)
        t2 = clk()
        loss.backward()
        t3 = clk()
        if norm:
            torch.linalg.vector_norm(torch.stack(torch._foreach_norm([q.grad for q in params], 2.0)), 2.0)
        t4 = clk()
        opt.step()
        t5 = clk()
        opt.zero_grad()
        t6 = clk()
        stepwatch.log(loss=loss)
        t7 = clk()
        ts = (t0, t1, t2, t3, t4, t5, t6, t7)
        for i in range(7):
            acc[i].append(ts[i + 1] - ts[i])

    configs = {"foundation": dict(overhead.FOUNDATION), "all defaults": dict(overhead.variants()[len(overhead.FEATURES)][1])}
    res: dict[str, list[list[int]]] = collections.defaultdict(lambda: [[] for _ in NAMES])
    for _ in range(a.rounds):
        for k in ("off", "floor"):
            for _ in range(a.steps):
                step(k == "floor", res[k])
        for k, cfg in configs.items():
            sess = stepwatch.init(dir=tempfile.mkdtemp(), console="off", **cfg)
            for _ in range(20):
                step(False, [[] for _ in NAMES])
            sess.pipeline.stop_thread()
            q = sess.pipeline._queue
            for _ in range(a.steps):
                step(False, res[k])
                if len(q) > 256:
                    q.clear()
            stepwatch.shutdown()
    med = {k: [statistics.median(v) / 1e3 for v in acc] for k, acc in res.items()}
    print(f"Thread CPU us per phase, median of {a.rounds} x {a.steps} steps (pipeline thread paused)")
    print(f"{'variant':>14} " + " ".join(f"{n:>9}" for n in NAMES) + "      sum")
    for k, vals in med.items():
        print(f"{k:>14} " + " ".join(f"{v:9.2f}" for v in vals) + f" {sum(vals):8.2f}")
    for k, vals in med.items():
        if k != "off":
            d = [v - o for v, o in zip(vals, med["off"])]
            print(f"{k + ' - off':>14} " + " ".join(f"{v:9.2f}" for v in d) + f" {sum(d):8.2f}")


if __name__ == "__main__":
    main()
