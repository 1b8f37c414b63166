"""HolisticTraceAnalysis 0.5.0's numbers for the traces in ../shared/traces/, as a JSON file.

    /tmp/hta-venv/bin/python benchmarks/hta_reference.py [--traces DIR] [--out FILE]

HTA is ~500 MB of dependencies (pandas, plotly, networkx, ...), so it is not a test dependency:
this script runs once, in a throwaway virtualenv of its own, and its output is kept beside the
test that compares stepwatch's trace analysis with it (tests/unit/data/hta_reference.json).
Set-up (HTA itself imports no torch; never pull a CUDA torch for it):

    python3 -m venv /tmp/hta-venv
    /tmp/hta-venv/bin/pip install --no-deps holistictraceanalysis==0.5.0
    /tmp/hta-venv/bin/pip install numpy pandas plotly networkx pydot pyyaml psutil

Each trace is analysed alone (one ``TraceAnalysis`` per file, as rank 0), with HTA's defaults:
``get_temporal_breakdown``, ``get_comm_comp_overlap``, ``get_idle_time_breakdown``
(``consecutive_kernel_delay=30``, all streams) and ``get_cuda_kernel_launch_stats`` (its launch
delays: their count and the quantiles stepwatch reports, taken the same way: the value at index
``int(q * n)`` of the sorted delays). A call that raises is stored as its error text.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.path.join(os.path.dirname(ROOT), "shared", "traces")
OUT = os.path.join(ROOT, "tests", "unit", "data", "hta_reference.json")


def _num(x: object) -> float | None:
    try:
        v = float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else round(v, 4)


def analyse(path: str) -> dict:
    from hta.trace_analysis import TraceAnalysis

    out: dict = {}
    t0 = time.perf_counter()
    try:
        ta = TraceAnalysis(trace_files={0: path}, trace_dir=os.path.dirname(path))
    except Exception as e:  # HTA raises on traces it cannot read; that is the reference too
        return {"error": f"{type(e).__name__}: {e}"}
    out["load_s"] = round(time.perf_counter() - t0, 2)
    try:
        df = ta.get_temporal_breakdown(visualize=False)
        row = df.iloc[0]
        out["temporal"] = {"idle_pct": _num(row["idle_time_pctg"]), "compute_pct": _num(row["compute_time_pctg"]),
                           "non_compute_pct": _num(row["non_compute_time_pctg"]),
                           "kernel_time_us": _num(row["kernel_time(us)"])}
    except Exception as e:
        out["temporal"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        df = ta.get_comm_comp_overlap(visualize=False)
        out["comm_comp_overlap_pct"] = _num(df.iloc[0]["comp_comm_overlap_pctg"])
    except Exception as e:
        out["comm_comp_overlap_pct"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        res = ta.get_idle_time_breakdown(ranks=[0], visualize=False)
        df = res[0] if isinstance(res, tuple) else res
        streams: dict = {}
        for _, r in df.iterrows():
            streams.setdefault(str(int(r["stream"])), {})[str(r["idle_category"])] = _num(r["idle_time"])
        out["idle_breakdown_us"] = streams
    except Exception as e:
        out["idle_breakdown_us"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        delays = sorted(float(d) for d in ta.get_cuda_kernel_launch_stats(ranks=[0], visualize=False)[0]["launch_delay"])
        at = lambda q: _num(delays[min(int(q * len(delays)), len(delays) - 1)]) if delays else None  # noqa: E731
        out["launch_delay_us"] = {"n": len(delays), "median": at(0.5), "p90": at(0.9), "p99": at(0.99),
                                  "max": _num(delays[-1]) if delays else None}
    except Exception as e:
        out["launch_delay_us"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=TRACES)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    import hta

    result = {"hta_version": getattr(hta, "__version__", "0.5.0"), "traces": {}}
    for name in sorted(os.listdir(args.traces)):
        if name.endswith((".json", ".json.gz")):
            print(f"{name} ...", file=sys.stderr, flush=True)
            result["traces"][name] = analyse(os.path.join(args.traces, name))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, sort_keys=True)
        f.write("\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
