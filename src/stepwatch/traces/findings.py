"""Findings from a trace summary (analyse.py), with the reference sheet's diagnosis and action.

One summary gives at most one finding per kind: the dense GPU row (healthy), idle gaps > 1 ms
(by cause: data loading, host sync, a wait on a collective, or launch overhead / CPU work),
communication not hidden behind compute (overlap below the 80% target: the ``allreduce_not_overlapped`` kind the live
comm analysis uses too), many tiny kernels, and a host sync inside the step. ``across_ranks``
joins the summaries of one capture's ranks (``capture_groups`` says which files are one
capture): which rank's GPU idled while the others computed.
"""

from __future__ import annotations

import os
import re
import statistics
from typing import Any

from ..analysis.kinds import make_finding
from ..record import Finding
from .analyse import RANK_NAME_RE

DENSE_IDLE_PCT = 10.0
OVERLAP_TARGET_PCT = 80.0  # B.2 'Measure overlap fraction -- target > 80%'
TINY_SHARE_PCT = 50.0
RANK_IDLE_POINTS = 10.0
# A CPU job's trace (no GPU row): its gaps are the training thread running no op, so the kinds'
# GPU wording (CUDA Graphs, pin_memory) does not apply; these replace the kind's text there.
CPU_TEXT = {
    "trace_idle_gaps": (
        "The training thread runs no op for more than 1 ms at a time inside the captured steps (a CPU "
        "job's trace: no GPU row): Python work between ops (logging, I/O, a sleep, host-side "
        "preprocessing) or an op too short to be named; the summary names the op or annotation "
        "spanning the largest gap, if any.",
        "Find that Python work (profile with with_stack=True for the call site, or py-spy) and move it "
        "off the step, or do it every N steps.",
    ),
    "trace_data_stall": (
        "The captured steps wait on data loading: the training thread runs no op while it is "
        "inside the DataLoader (a CPU job's trace).",
        "Increase num_workers (and prefetch_factor), or move decoding off the critical path.",
    ),
}

# A gap the training thread spent waiting on a collective (cause ``communication``: a gloo/NCCL
# range or a c10d op covers it, on any thread of the process): not Python work to move off the step.
COMM_TEXT = (
    "The training thread runs no op for more than 1 ms at a time while a collective (named) runs: it "
    "waits on communication (DDP's gradient AllReduce, or a collective of yours), not on Python work. "
    "A wait that is long on one rank only means it waits for a slower rank; long on every rank, the "
    "transfer itself.",
    "Compare the ranks' step and communication times (stepwatch report: a straggler makes the others "
    "wait); otherwise overlap the communication with backward (DDP bucket_cap_mb, "
    "gradient_as_bucket_view=True) or send less (gradient accumulation with no_sync, fp16/bf16 "
    "compression hooks).",
)


def _fmt_us(us: float) -> str:
    return f"{us / 1000:.1f} ms" if us >= 1000 else f"{us:.0f} µs"


def _gap_text(g: dict[str, Any]) -> str:
    where = f"step {g['step']}" if g.get("step") is not None else "the trace"
    op = g.get("host_sync") if g.get("cause") == "host_sync" else g.get("cpu_op")
    s = f"{_fmt_us(g['dur_us'])} in {where}"
    if op and g.get("cause") == "communication":
        s += f" while the CPU waited on {op} (communication)"
    elif op:
        s += f" while the CPU was in {op}"
    elif g.get("cause") == "python":
        s += " while the CPU ran no op (Python)"
    if g.get("call_site"):
        s += f" (called from {g['call_site']})"
    return s


def findings_for(summary: dict[str, Any], *, step: int | None = None, when: float | None = None,
                 context: dict[str, Any] | None = None) -> list[Finding]:
    """The findings of one rank's summary; ``step`` for those not tied to one step (the capture's
    first step), ``context`` merged into each finding's data (capture number, reason, trace).
    A trace whose rank is unknown (``stepwatch trace`` on a file without ``distributedInfo`` or
    a rank in its name) gives findings of rank None, whose summaries name the file instead."""
    rank = summary.get("rank") if isinstance(summary.get("rank"), int) else None
    ctx = dict(context or {})
    ctx.setdefault("trace", summary.get("trace"))
    out: list[Finding] = []

    gpu = summary.get("temporal") is not None

    def add(kind: str, text: str, data: dict[str, Any], at: int | None = None, severity: str | None = None,
            why: tuple[str, str] | None = None) -> None:
        f = make_finding(kind, rank=rank, step=at if at is not None else step, when=when,
                         summary=text, data={**ctx, **data}, severity=severity)
        if why is not None:
            f.diagnosis, f.action = why
        elif not gpu and kind in CPU_TEXT:
            f.diagnosis, f.action = CPU_TEXT[kind]
        out.append(f)

    gaps = summary.get("gaps") or []
    big = [g for g in gaps if g["dur_us"] > 1000.0]
    over = summary.get("gaps_over_1ms") or {}
    lead = f"rank {rank}: " if rank is not None else f"{os.path.basename(str(summary.get('trace') or 'trace'))}: "
    if gpu:
        t = summary["temporal"]
        if (t["idle_pct"] or 0) < DENSE_IDLE_PCT and not big:
            add("trace_dense", f"{lead}GPU busy {100 - (t['idle_pct'] or 0):.1f}% of the captured span "
                f"({t['compute_pct']}% compute), no idle gap over 1 ms", {"temporal": t})
    by_cause: dict[str, dict[str, Any]] = {}
    for g in big:
        by_cause.setdefault(g.get("cause") or "cpu", g)  # gaps are largest first
    what = "GPU idle" if gpu else "training thread without an op"
    n_over = over.get("count", len(big))
    tot = over.get("total_us", sum(g["dur_us"] for g in big))
    for cause, g in by_cause.items():
        data = {"gap": g, "gaps_over_1ms": n_over, "gaps_over_1ms_us": tot}
        if gpu:
            data["idle_pct"] = summary["temporal"]["idle_pct"]
        head = f"{lead}{n_over} gap(s) over 1 ms ({_fmt_us(tot)} {what} in all); the largest of this kind: "
        if cause == "data_loading":
            add("trace_data_stall", head + _gap_text(g) + ": waiting on data loading", data, g.get("step"))
        elif cause == "host_sync":
            add("trace_host_sync", head + _gap_text(g) + ": a host sync", data, g.get("step"))
        elif cause == "communication":
            add("trace_idle_gaps", head + _gap_text(g), data, g.get("step"), why=COMM_TEXT)
        else:
            add("trace_idle_gaps", head + _gap_text(g), data, g.get("step"))
    ov = summary.get("comm_comp_overlap_pct")
    if ov is not None and ov < OVERLAP_TARGET_PCT:
        add("allreduce_not_overlapped", f"{lead}only {ov:.1f}% of the communication kernels' time overlaps "
            f"computation kernels in the trace (target > {OVERLAP_TARGET_PCT:.0f}%)",
            {"comm_comp_overlap_pct": ov, "source": "trace"})
    k = summary.get("kernels")
    if k and k.get("tiny_time_pct") is not None and k["tiny_time_pct"] >= TINY_SHARE_PCT:
        add("trace_tiny_kernels", f"{lead}{k['tiny_time_pct']:.0f}% of kernel time is in {k['tiny_count']} "
            f"kernels under 50 µs (of {k['count']})", {"tiny_time_pct": k["tiny_time_pct"],
                                                     "tiny_count": k["tiny_count"], "kernels": k["count"]})
    if "trace_host_sync" not in {f.kind for f in out}:
        for s in summary.get("host_syncs") or []:
            # A sync that causes no gap over 1 ms is named only when it blocks 1 ms or more inside a step.
            if s.get("in_step") is not False and s["longest_us"] >= 1000.0:
                site = f" (called from {s['call_site']})" if s.get("call_site") else ""
                add("trace_host_sync", f"{lead}{s['op']} inside the step: {s['count']} call(s), the longest "
                    f"{_fmt_us(s['longest_us'])}{site}", {"sync": s}, s.get("step"))
                break
    return out


CAPTURE_NAME_RE = re.compile(r"^(capture-\d+-steps-?\d+--?\d+)\.rank\d+\.trace\.json(?:\.gz)?$")


def group_key(path: str) -> tuple[str, str]:
    """Which traces are one capture's ranks (compared by ``across_ranks``): (directory, label).

    * stepwatch's ``capture-<n>-steps<a>-<b>.rank<R>.trace.json[.gz]``: capture n of steps a-b;
    * another name with a rank in it (``rank<N>``, ``rank-<N>``, ... as the rank is read):
      the name with that number replaced by ``*`` (``job-rank0.json``, ``job-rank1.json``);
    * a name without one (the rank in ``distributedInfo`` only, as torch's
      tensorboard_trace_handler writes ``<host>_<pid>.<ms>.pt.trace.json``): every such file of
      the directory, as HTA reads a trace directory as one run's ranks.

    Files in different directories are never one group."""
    d, name = os.path.split(os.path.abspath(path))
    m = CAPTURE_NAME_RE.match(name)
    if m:
        return d, m.group(1)
    m = RANK_NAME_RE.search(name)
    if m:
        return d, name[:m.start(1)] + "*" + name[m.end(1):]
    return d, "*"


def capture_groups(summaries: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The summaries grouped by ``group_key`` of their trace, in the order first seen; each
    group's label (the label alone when every group is in one directory, else with it)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for s in summaries:
        groups.setdefault(group_key(str(s.get("trace", ""))), []).append(s)
    one_dir = len({d for d, _ in groups}) <= 1
    return [(lab if one_dir else os.path.join(d, lab), g) for (d, lab), g in groups.items()]


def across_ranks(summaries: list[dict[str, Any]], *, step: int | None = None, when: float | None = None,
                 context: dict[str, Any] | None = None, label: str | None = None) -> list[Finding]:
    """Which rank's GPU idled while the others computed; ``summaries`` are one capture's ranks
    (the same steps: ``capture_groups``). Nothing when a rank comes twice (which of its traces
    covers the others' steps is unknown) or fewer than two ranks have a GPU row. ``label`` (the
    group's) leads the summary."""
    idle: dict[int, float] = {}
    trace: dict[int, Any] = {}
    for s in summaries:
        r = s.get("rank")
        if not isinstance(r, int) or not s.get("temporal") or s["temporal"].get("idle_pct") is None:
            continue
        if r in idle:
            return []
        idle[r] = s["temporal"]["idle_pct"]
        trace[r] = s.get("trace")
    if len(idle) < 2:
        return []
    worst = max(idle, key=lambda r: idle[r])
    others = statistics.median(v for r, v in idle.items() if r != worst)
    if idle[worst] - others < RANK_IDLE_POINTS:
        return []
    lead = f"{label}: " if label else ""
    return [make_finding(
        "trace_rank_idle", rank=worst, step=step, when=when,
        summary=(f"{lead}rank {worst}'s GPU idled {idle[worst]:.1f}% of the captured span while the other "
                 f"{len(idle) - 1} rank(s) idled {others:.1f}% (median)"),
        data={"trace": trace[worst], **(context or {}), "idle_pct": idle},
    )]
