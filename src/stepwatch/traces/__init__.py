"""Trace analysis: read a Kineto / torch.profiler Chrome trace as a stream and say what it shows.

``stepwatch trace PATH...`` (cli.py) for any trace; every capture stepwatch takes is analysed
the same way in a low-priority process of its own (worker.py), beside the trace it wrote. The
definitions follow Holistic Trace Analysis 0.5.0 (analyse.py); docs/traces.md has the schema.
Nothing here imports torch.
"""

from __future__ import annotations

import os
from typing import Any

from .analyse import analyse
from .reader import TraceFormatError

__all__ = ["analyse", "analyse_with_findings", "trace_files", "TraceFormatError", "ANALYSIS_SUFFIX"]

ANALYSIS_SUFFIX = ".analysis.json"  # beside captures/<stem>.trace.json.gz: <stem>.analysis.json


def trace_files(paths: list[str]) -> list[str]:
    """The trace files named by ``paths``: files as given; in a directory, its ``*.trace.json[.gz]``
    files (a stepwatch ``captures/`` folder, torch's tensorboard_trace_handler output) or, when it
    has none, every ``*.json[.gz]`` file. A stepwatch run directory (its ``run.json``) is its
    ``captures/`` folder's traces: its own ``*.json`` files are its manifests, which were each
    "not a profiler trace". Raises FileNotFoundError naming a missing path, or a run directory
    without captures."""
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p) and os.path.isfile(os.path.join(p, "run.json")):
            from .._files import job_dir

            caps = os.path.join(job_dir(p), "captures")
            if not os.path.isdir(caps):
                raise FileNotFoundError(f"PATH {p!r} is a stepwatch run directory without captures/: "
                                        f"`stepwatch capture {p}` takes one from a live job")
            p = caps
        if os.path.isdir(p):
            names = sorted(os.listdir(p))
            pick = [n for n in names if n.endswith((".trace.json", ".trace.json.gz"))]
            if not pick:
                pick = [n for n in names if n.endswith((".json", ".json.gz")) and not n.endswith(ANALYSIS_SUFFIX)]
            out.extend(os.path.join(p, n) for n in pick)
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise FileNotFoundError(f"PATH {p!r}: no such file or directory")
    return out


def analyse_with_findings(path: str, *, rank: int | None = None, step: int | None = None, when: float | None = None,
                          context: dict[str, Any] | None = None,
                          step_ends: dict[int, float] | None = None) -> dict[str, Any]:
    """``analyse`` plus its ``findings`` (as dicts): the ``--json`` object of one rank."""
    from .findings import findings_for

    s = analyse(path, rank=rank, step_ends=step_ends)
    s["findings"] = [f.to_dict() for f in findings_for(s, step=step, when=when, context=context)]
    return s
