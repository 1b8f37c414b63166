"""Memory and time of ``stepwatch report`` as a run grows: 2 ranks x 25,000 and x 250,000 steps.

    PYTHONPATH=src python benchmarks/report_scale.py [--steps 25000 250000] [--ranks 2]
        [--template RUN_DIR] [--keep DIR]

What runs: for each size, a synthetic run directory is written to a temporary folder by cycling
the step lines of a real run (``--template``, default the newest ``stepwatch-runs/main-job-*``;
without one, or for a rank it lacks, 80 lines made here with the records writer's own
serializer) and rewriting
each line's step and time, so the lines have the real writer's fields and sizes. Its run.json,
rank<R>.json, findings and comm timeline are copied along. Then ``python -m stepwatch report``
runs on it in a subprocess (HTML written to the temporary folder, terminal text discarded), and
its maximum RSS (from ``os.wait4``: that child's own, not the largest child so far) and wall time
are printed. "B/rec above first" is (RSS - the first row's RSS) / (records - the first row's
records): the cost of one more record, without the interpreter, numpy and rich.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")
sys.path.insert(0, SRC)

# The records writer puts step, rank and time first (StepRecord's field order); the rest of the
# line is kept as it is.
_HEAD = re.compile(r'^\{"step":-?\d+,"rank":(-?\d+),"time":([^,]+),')
# Files of the template run carried over unchanged: the report reads them besides the steps.
_CARRY = re.compile(r"^(run(\.\d+)?\.json|rank\d+\.json|findings\.rank\d+.*|comm_timeline\..*)$")


def default_template() -> str | None:
    runs = sorted(glob.glob(os.path.join(ROOT, "stepwatch-runs", "main-job-*")))
    return runs[-1] if runs else None


def _made_up_lines(rank: int, n: int = 80) -> list[str]:
    """A template without a real run: what a 2-rank DDP job on CPU writes, from a fixed seed."""
    import random

    from stepwatch.exporters.records import dumps
    from stepwatch.record import StepRecord

    rng, t, out = random.Random(rank), 1.7e9, []
    for i in range(n):
        dw, fw, bw, op, ot = (rng.uniform(0.0005, 0.02) for _ in range(5))
        comm = rng.uniform(0.002, 0.03)
        t += dw + fw + bw + op + ot
        out.append(dumps(StepRecord(
            step=i, rank=rank, time=t, step_s=dw + fw + bw + op + ot, data_wait_s=dw,
            forward_s=fw, backward_s=bw, optimizer_s=op, other_s=ot,
            scalars={"loss": 6.4 - i / 100}, mem_peak_bytes=357920768, flops=452984832.0,
            tokens=512, grad_norm=rng.uniform(0.2, 0.3), comm_s=comm, comm_exposed_s=comm,
            overlap=0.0, allreduce_s=comm, mfu_dtype="fp32", samples=8,
            algbw_gbps=rng.uniform(0.02, 0.1), busbw_gbps=rng.uniform(0.02, 0.1),
        ).to_dict()))
    return out


def _template_lines(template: str | None, ranks: int) -> dict[int, list[str]]:
    out = {}
    for r in range(ranks):
        path = template and os.path.join(template, f"steps.rank{r}.jsonl")
        if path and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                lines = [x.rstrip("\n") for x in f if _HEAD.match(x)]
        else:
            lines = _made_up_lines(r)
        if not lines:
            raise SystemExit(f"{path}: no step lines in the records writer's format")
        out[r] = lines
    return out


def make_run_dir(out_dir: str, steps: int, ranks: int = 2, template: str | None = None) -> int:
    """Write a run directory of ``ranks`` x ``steps`` step lines; returns the bytes of JSONL."""
    os.makedirs(out_dir, exist_ok=True)
    if template:
        for name in os.listdir(template):
            if _CARRY.match(name):
                shutil.copyfile(os.path.join(template, name), os.path.join(out_dir, name))
    size = 0
    for r, lines in _template_lines(template, ranks).items():
        heads = [_HEAD.match(x) for x in lines]
        times = [float(m.group(2)) for m in heads]
        bodies = [x[m.end():] for x, m in zip(lines, heads)]
        t0 = times[0]
        # One pass over the template takes its own time span plus one mean step.
        span = (times[-1] - t0) * len(times) / max(len(times) - 1, 1) or 1.0
        path = os.path.join(out_dir, f"steps.rank{r}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            buf = []
            for i in range(steps):
                k = i % len(lines)
                t = t0 + (i // len(lines)) * span + (times[k] - t0)
                buf.append(f'{{"step":{i},"rank":{r},"time":{t!r},{bodies[k]}\n')
                if len(buf) == 10_000:
                    f.write("".join(buf))
                    buf.clear()
            f.write("".join(buf))
        size += os.path.getsize(path)
    return size


def measure(run_dir: str, html: str) -> tuple[float, float]:
    """Max RSS (bytes) and wall seconds of ``python -m stepwatch report run_dir``."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               COLUMNS="140")
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "stepwatch", "report", run_dir, "--html", html],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"report failed ({p.returncode}): {p.stderr.read().decode()}")
    p.stderr.close()
    # ru_maxrss is in KiB on Linux.
    return usage.ru_maxrss * 1024.0, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, nargs="+", default=[25_000, 250_000],
                    help="steps per rank of each run directory, smallest first")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--template", default=default_template(),
                    help="a run directory whose step lines are cycled (default: newest "
                         "stepwatch-runs/main-job-*; none: lines made up here)")
    ap.add_argument("--keep", metavar="DIR", help="write the run directories here and keep them")
    a = ap.parse_args()

    base = a.keep or tempfile.mkdtemp(prefix="report_scale.")
    print(f"template: {a.template or 'made up (no run directory found)'}")
    print(f"{'records':>10} {'JSONL MB':>9} {'max RSS MiB':>12} {'B/rec above first':>18} "
          f"{'wall s':>7}")
    first = None
    try:
        for n in sorted(a.steps):
            d = os.path.join(base, f"run-{a.ranks}x{n}")
            size = make_run_dir(d, n, a.ranks, a.template)
            rss, wall = measure(d, os.path.join(base, f"report-{a.ranks}x{n}.html"))
            recs = n * a.ranks
            per = "" if first is None else f"{(rss - first[1]) / (recs - first[0]):.0f}"
            first = first or (recs, rss)
            print(f"{recs:>10,} {size / 1e6:>9.0f} {rss / 2**20:>12.0f} {per:>18} {wall:>7.1f}",
                  flush=True)
            if not a.keep:
                shutil.rmtree(d)
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
