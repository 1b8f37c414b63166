"""The FLOPs/tokens collector's cost per root forward when input signatures take turns.

    PYTHONPATH=src python benchmarks/signatures.py [--calls 3000] [--rounds 7]

One ``nn.Linear`` root called through ``ThroughputCollector.on_forward`` (and the step's
``take``), as stepwatch's forward hook calls it, with 1, 2 and 3 input shapes in turn (the
counts are made in warm-up; what is timed is the lookup). A root keeps its last two signatures
(since the thirty-fifth session): one shape and two in turn stay on the C path; three in turn
miss every call and take the full Python path (the cache key built, looked up, the signature
made again), which is what two in turn cost before. Printed: the best of ``--rounds`` rounds, in
µs per call, side by side, and the ratio of each to one shape.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))


def per_call(model, shapes, calls: int, rounds: int) -> float:
    from stepwatch.metrics import tokens
    from stepwatch.metrics.flops import FlopCache

    best = float("inf")
    for _ in range(rounds):
        col = tokens.ThroughputCollector(cache=FlopCache())
        for x in shapes * 3:  # the counts, once per shape
            col.on_forward(model, (x,), {})
            col.take()
        t0 = time.perf_counter_ns()
        for i in range(calls):
            col.on_forward(model, (shapes[i % len(shapes)],), {})
            col.take()
        best = min(best, (time.perf_counter_ns() - t0) / calls / 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000, help="timed calls per round (default 3000)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds; the best is printed (default 7)")
    a = ap.parse_args()
    import torch
    import torch.nn as nn

    torch.set_num_threads(1)
    model = nn.Linear(6, 6)
    shapes = [torch.randn(n, 6) for n in (3, 5, 7)]
    got = [(k, per_call(model, shapes[:k], a.calls, a.rounds)) for k in (1, 2, 3)]
    base = got[0][1]
    print(f"torch {torch.__version__}; on_forward + take, best of {a.rounds} x {a.calls} calls")
    for k, us in got:
        print(f"  {k} shape(s) in turn: {us:7.2f} us a call ({us / base:5.1f}x one shape)")


if __name__ == "__main__":
    main()
