"""``python -m stepwatch.traces.worker --trace T --out O [...]``: analyse one capture, off the job.

The capture manager starts it after writing a trace (its export thread, never the training
thread). It lowers its own priority (nice 19), bounds its memory (RLIMIT_AS) and CPU time
(RLIMIT_CPU) before reading, and writes the summary with its findings to ``--out`` atomically,
0600. It imports no torch (the summary says so: ``torch_imported``), so it costs the node tens
of MB, not the trainer's hundreds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

NICE = 19
MEMORY_LIMIT_MB = 2048
CPU_LIMIT_S = 600


def _limit(memory_mb: int, cpu_s: int) -> None:
    try:
        os.nice(NICE)
    except OSError:
        pass
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    except (ImportError, ValueError, OSError):
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stepwatch.traces.worker")
    ap.add_argument("--trace", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--step", type=int, help="the capture's first step (findings not tied to a step)")
    ap.add_argument("--context", default="{}", help="JSON object merged into each finding's data")
    ap.add_argument("--step-ends", help="JSON object: step -> wall-clock seconds it ended (the capture's)")
    ap.add_argument("--memory-mb", type=int, default=MEMORY_LIMIT_MB)
    ap.add_argument("--cpu-s", type=int, default=CPU_LIMIT_S)
    a = ap.parse_args(argv)
    _limit(a.memory_mb, a.cpu_s)
    from .._files import write_private
    from . import analyse_with_findings

    t0 = time.time()
    try:
        ends = {int(k): float(v) for k, v in json.loads(a.step_ends).items()} if a.step_ends else None
        out = analyse_with_findings(a.trace, rank=a.rank, step=a.step, when=t0, context=json.loads(a.context),
                                    step_ends=ends)
    except (OSError, ValueError, MemoryError) as e:  # a bad or truncated trace: say so, do not crash
        out = {"rank": a.rank, "trace": a.trace, "error": f"{type(e).__name__}: {e}", "findings": []}
    out["torch_imported"] = "torch" in sys.modules
    try:
        import resource

        out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    except ImportError:
        pass
    write_private(a.out, json.dumps(out, indent=1))
    return 0 if "error" not in out else 1


if __name__ == "__main__":
    sys.exit(main())
