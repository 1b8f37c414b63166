"""Findings from a trace summary (analyse.py), with the reference sheet's diagnosis and action.

One summary gives at most one finding per kind: the dense GPU row (healthy), idle gaps > 1 ms
(by cause: data loading, host sync, or launch overhead / CPU work), communication not hidden
behind compute (overlap below the 80% target: the ``allreduce_not_overlapped`` kind the live
comm analysis uses too), many tiny kernels, and a host sync inside the step. ``across_ranks``
joins the summaries of one capture's ranks: which rank's GPU idled while the others computed.
"""

from __future__ import annotations

import statistics
from typing import Any

from ..analysis.kinds import make_finding
from ..record import Finding

DENSE_IDLE_PCT = 10.0
OVERLAP_TARGET_PCT = 80.0  # B.2 'Measure overlap fraction -- target > 80%'
TINY_SHARE_PCT = 50.0
RANK_IDLE_POINTS = 10.0


def _fmt_us(us: float) -> str:
    return f"{us / 1000:.1f} ms" if us >= 1000 else f"{us:.0f} µs"


def _gap_text(g: dict[str, Any]) -> str:
    where = f"step {g['step']}" if g.get("step") is not None else "the trace"
    op = g.get("host_sync") if g.get("cause") == "host_sync" else g.get("cpu_op")
    s = f"{_fmt_us(g['dur_us'])} in {where}"
    if op:
        s += f" while the CPU was in {op}"
    elif g.get("cause") == "python":
        s += " while the CPU ran no op (Python)"
    if g.get("call_site"):
        s += f" (called from {g['call_site']})"
    return s


def findings_for(summary: dict[str, Any], *, step: int | None = None, when: float | None = None,
                 context: dict[str, Any] | None = None) -> list[Finding]:
    """The findings of one rank's summary; ``step`` for those not tied to one step (the capture's
    first step), ``context`` merged into each finding's data (capture number, reason, trace)."""
    rank = summary.get("rank") if isinstance(summary.get("rank"), int) else 0
    ctx = dict(context or {})
    ctx.setdefault("trace", summary.get("trace"))
    out: list[Finding] = []

    def add(kind: str, text: str, data: dict[str, Any], at: int | None = None, severity: str | None = None) -> None:
        out.append(make_finding(kind, rank=rank, step=at if at is not None else step, when=when,
                                summary=text, data={**ctx, **data}, severity=severity))

    gpu = summary.get("temporal") is not None
    gaps = summary.get("gaps") or []
    big = [g for g in gaps if g["dur_us"] > 1000.0]
    over = summary.get("gaps_over_1ms") or {}
    lead = f"rank {rank}: "
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


def across_ranks(summaries: list[dict[str, Any]], *, step: int | None = None, when: float | None = None,
                 context: dict[str, Any] | None = None) -> list[Finding]:
    """Which rank's GPU idled while the others computed (same captured steps, several ranks)."""
    idle = {s["rank"]: s["temporal"]["idle_pct"] for s in summaries
            if s.get("temporal") and s["temporal"].get("idle_pct") is not None and isinstance(s.get("rank"), int)}
    if len(idle) < 2:
        return []
    worst = max(idle, key=lambda r: idle[r])
    others = statistics.median(v for r, v in idle.items() if r != worst)
    if idle[worst] - others < RANK_IDLE_POINTS:
        return []
    return [make_finding(
        "trace_rank_idle", rank=worst, step=step, when=when,
        summary=(f"rank {worst}'s GPU idled {idle[worst]:.1f}% of the captured span while the other "
                 f"{len(idle) - 1} rank(s) idled {others:.1f}% (median)"),
        data={**(context or {}), "idle_pct": idle},
    )]
