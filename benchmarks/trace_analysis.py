"""Seconds and peak memory of `stepwatch trace` on growing traces, side by side with HTA.

    PYTHONPATH=src python benchmarks/trace_analysis.py [--sizes 1 10 50] [--hta-python PY] [--hta-max 10]

What runs: v100-single-rank0 (../shared/traces/, 68,692 events) is replicated x1, x10 and x50 into
one trace each (a temporary folder, gzip level 1): replica k is shifted in time by k spans (plus
1 ms) and its correlation ids by k x 10^7, so each replica's kernels keep their own launches.
Then each size is analysed in a fresh process, and its wall time and maximum RSS (``os.wait4``:
that child's own) are printed:

* stepwatch: ``python -m stepwatch trace FILE --json`` (the whole analysis: temporal breakdown,
  overlap, idle breakdown, kernels, launch, gaps with their CPU ops, findings);
* HTA 0.5.0, where a Python with ``hta`` importable is given (``--hta-python``, default: this
  interpreter if it has it, else /tmp/hta-venv/bin/python when present): ``TraceAnalysis`` on the
  file, then ``get_temporal_breakdown``, ``get_comm_comp_overlap`` and ``get_idle_time_breakdown``.
  Only up to ``--hta-max`` (x10 by default: at x50 HTA needs several GB).

Targets (issue 17): x50 under 300 MB; at x10 at least 3x faster and 5x less memory than HTA.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")
TRACE = os.path.join(os.path.dirname(ROOT), "shared", "traces", "v100-single-rank0.json.gz")
CORR_STRIDE = 10_000_000

HTA_SCRIPT = r"""
import sys
from hta.trace_analysis import TraceAnalysis
import os
p = sys.argv[1]
ta = TraceAnalysis(trace_files={0: p}, trace_dir=os.path.dirname(p))
ta.get_temporal_breakdown(visualize=False)
ta.get_comm_comp_overlap(visualize=False)
ta.get_idle_time_breakdown(ranks=[0], visualize=False)
"""


def replicate(src: str, n: int, dst: str) -> int:
    with gzip.open(src, "rt") as f:
        d = json.load(f)
    events = d.pop("traceEvents")
    tss = [e["ts"] for e in events if isinstance(e.get("ts"), (int, float))]
    ends = [e["ts"] + e.get("dur", 0) for e in events if isinstance(e.get("ts"), (int, float))]
    shift = max(ends) - min(tss) + 1000.0
    count = 0
    with gzip.open(dst, "wt", compresslevel=1) as out:
        out.write(json.dumps(d)[:-1] + ', "traceEvents": [\n')
        first = True
        for k in range(n):
            for e in events:
                if k:
                    e = dict(e)
                    if isinstance(e.get("ts"), (int, float)):
                        e["ts"] = e["ts"] + k * shift
                    a = e.get("args")
                    if isinstance(a, dict) and isinstance(a.get("correlation"), int):
                        e["args"] = dict(a, correlation=a["correlation"] + k * CORR_STRIDE)
                out.write(("" if first else ",\n") + json.dumps(e))
                first = False
                count += 1
        out.write("\n]}\n")
    return count


def measure(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float, int]:
    """(wall seconds, CPU seconds, peak RSS in MB, exit code) of one child process. CPU seconds
    (user + system) compare fairly on a shared machine, where wall time depends on the load."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - t, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024, p.returncode


def find_hta(given: str | None) -> str | None:
    for py in ([given] if given else [sys.executable, "/tmp/hta-venv/bin/python"]):
        if py and os.path.exists(py):
            r = subprocess.run([py, "-c", "import hta"], capture_output=True)
            if r.returncode == 0:
                return py
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 10, 50])
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--hta-python", default=None)
    ap.add_argument("--hta-max", type=int, default=10)
    ap.add_argument("--keep", default=None, help="folder to keep the replicas in")
    args = ap.parse_args()
    hta = find_hta(args.hta_python)
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    tmp = args.keep or tempfile.mkdtemp(prefix="sw-trace-bench-")
    os.makedirs(tmp, exist_ok=True)
    print(f"trace: {args.trace}; HTA: {hta or 'not installed (pass --hta-python)'}")
    print(f"{'size':>5} {'events':>10} {'MB gz':>6} | {'stepwatch wall s':>16} {'cpu s':>6} {'MB':>5} | "
          f"{'HTA wall s':>10} {'cpu s':>6} {'MB':>5} | {'faster (cpu)':>12} {'less mem':>8}")
    try:
        for n in args.sizes:
            path = os.path.join(tmp, f"v100x{n}.pt.trace.json.gz")
            count = replicate(args.trace, n, path)
            mb = os.path.getsize(path) / 2**20
            s_t, s_c, s_m, rc = measure([sys.executable, "-m", "stepwatch", "trace", path, "--json"], env)
            if rc != 0:
                print(f"x{n}: stepwatch trace failed (exit {rc})")
            h = None
            if hta and n <= args.hta_max:
                h = measure([hta, "-c", HTA_SCRIPT, path], dict(os.environ))
            ht = f"{h[0]:10.1f} {h[1]:6.1f} {h[2]:5.0f}" if h else f"{'-':>10} {'-':>6} {'-':>5}"
            ratio = f"{h[1] / s_c:11.1f}x {h[2] / s_m:7.1f}x" if h else f"{'-':>12} {'-':>8}"
            print(f"{'x' + str(n):>5} {count:>10,} {mb:6.1f} | {s_t:16.1f} {s_c:6.1f} {s_m:5.0f} | {ht} | {ratio}",
                  flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
