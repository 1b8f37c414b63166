"""CPU cost of timing a region: ns per begin+end pair and per poll, for every timer backend.

    python benchmarks/timing.py [--pairs 200000] [--repeat 5] [--json out.json]

Side by side in one run: the native host ring, the pure-Python host ring, and where a GPU is
present the native CUDA/HIP ring, the pure-Python torch.cuda.Event ring and bare
torch.cuda.Event records (with and without an explicit stream). Each figure is the best of
--repeat runs of the median chunk of 512 pairs, measured from a Python loop (the loop's own cost is printed separately, not
subtracted). Target (issue 8): <= 150 ns per pair on the native host ring.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from time import perf_counter_ns
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import stepwatch.cuda_ext as cuda_ext  # noqa: E402
from stepwatch.cuda_ext import _testing  # noqa: E402
from stepwatch.cuda_ext._python import PyHostRing, TorchEventRing  # noqa: E402

CHUNK = 512  # pairs between polls: half the ring, so nothing is dropped


def best(fn: Callable[[], float], repeat: int) -> float:
    return min(fn() for _ in range(repeat))


def loop_overhead(n: int) -> float:
    t0 = perf_counter_ns()
    for _ in range(n):
        pass
    return (perf_counter_ns() - t0) / n


def pair_ns(ring: Any, stream: Any, n: int, sync: Callable[[], None] = lambda: None) -> float:
    """Median over chunks of CHUNK pairs: a chunk the scheduler preempted does not move it."""
    b, e, p = ring.begin, ring.end, ring.poll
    tag = "forward"
    chunks = []
    for _ in range(max(n // CHUNK, 1)):
        t0 = perf_counter_ns()
        for _ in range(CHUNK):
            e(b(stream, tag), stream)
        chunks.append((perf_counter_ns() - t0) / CHUNK)
        sync()
        p()
    assert ring.dropped == 0, "benchmark overflowed the ring"
    return statistics.median(chunks)


def poll_ns(ring: Any, stream: Any, sync: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """(ns per poll of an empty ring, ns per resolved interval in a poll of CHUNK intervals)."""
    p = ring.poll
    p()
    n = 2000
    t0 = perf_counter_ns()
    for _ in range(n):
        p()
    empty = (perf_counter_ns() - t0) / n
    per_interval = []
    for _ in range(20):
        for _ in range(CHUNK):
            ring.end(ring.begin(stream, "x"), stream)
        sync()
        t0 = perf_counter_ns()
        got = p()
        per_interval.append((perf_counter_ns() - t0) / max(len(got), 1))
    return empty, min(per_interval)


def torch_event_pair_ns(torch: Any, stream: Any, n: int) -> float:
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(CHUNK)]
    total = 0
    done = 0
    while done < n:
        t0 = perf_counter_ns()
        if stream is None:
            for a, z in evs:
                a.record()
                z.record()
        else:
            for a, z in evs:
                a.record(stream)
                z.record(stream)
        total += perf_counter_ns() - t0
        done += CHUNK
    torch.cuda.synchronize()
    return total / done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    n, rep = args.pairs, args.repeat
    rows: list[dict[str, Any]] = []

    def add(name: str, ring: Any, stream: Any, sync: Callable[[], None] = lambda: None) -> None:
        pair = best(lambda: pair_ns(ring, stream, n, sync), rep)
        empty, per = poll_ns(ring, stream, sync)
        rows.append({"timer": name, "pair_ns": pair, "poll_empty_ns": empty, "poll_per_interval_ns": per})
        ring.close()

    with tempfile.TemporaryDirectory() as tmp:
        native = None
        try:
            native = _testing.load_native(tmp)
        except RuntimeError as exc:
            print(f"native extension unavailable: {exc}", file=sys.stderr)
        if native is not None:
            add("native host", cuda_ext.native_ring_class(native)(1024, "host"), 0)
        add("python host", PyHostRing(1024), 0)

        try:
            import torch

            gpu = torch.cuda.is_available()
        except ImportError:
            gpu = False
        if gpu:
            stream = torch.cuda.current_stream()
            raw = stream.cuda_stream
            sync = torch.cuda.synchronize
            if native is not None:
                ring = cuda_ext.native_ring_class(native)(1024, "device")
                add(f"native {ring.backend}", ring, raw, sync)
            add("python torch.cuda.Event ring", TorchEventRing(1024), raw, sync)
            for label, s in (("torch.cuda.Event x2, no stream", None), ("torch.cuda.Event x2, stream", stream)):
                rows.append({"timer": label, "pair_ns": best(lambda: torch_event_pair_ns(torch, s, n), rep),
                             "poll_empty_ns": None, "poll_per_interval_ns": None})

    loop = best(lambda: loop_overhead(n), rep)
    fmt = lambda v: "-" if v is None else f"{v:10.1f}"  # noqa: E731
    print(f"{'timer':34s} {'ns/pair':>10s} {'ns/poll(empty)':>15s} {'ns/interval(poll)':>18s}")
    for r in rows:
        print(f"{r['timer']:34s} {fmt(r['pair_ns'])} {fmt(r['poll_empty_ns']):>15s} {fmt(r['poll_per_interval_ns']):>18s}")
    print(f"(python loop overhead per iteration, included above: {loop:.1f} ns; {n} pairs, best of {rep})")
    host = next((r for r in rows if r["timer"] == "native host"), None)
    if host is not None:
        verdict = "meets" if host["pair_ns"] <= 150 else "MISSES"
        print(f"native host pair: {host['pair_ns']:.1f} ns {verdict} the 150 ns target")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "loop_ns": loop, "pairs": n, "repeat": rep}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
