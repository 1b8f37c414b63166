"""Trace summaries as the report's tables (terminal and HTML): one per rank, and the ranks side by side."""

from __future__ import annotations

import os
from typing import Any

from .._table import Table


def _n(x: Any, unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.2f}{unit}" if abs(x) < 100 else f"{x:.0f}{unit}"
    return f"{x}{unit}"


def _ms(us: Any) -> str:
    return "-" if us is None else f"{us / 1000:.2f} ms"


_SUFFIXES = (".trace.json.gz", ".trace.json", ".json.gz", ".json")


def _short(path: Any) -> str:
    """A trace file's name without its directory and trace suffix (the table's ``trace`` column)."""
    name = os.path.basename(str(path))
    for suf in _SUFFIXES:
        if name.endswith(suf) and len(name) > len(suf):
            return name[: -len(suf)]
    return name


def _file(s: dict[str, Any]) -> str:
    return _short(s.get("trace", "?"))


def _who(s: dict[str, Any], files: bool = False) -> str:
    """The rank, or the file's name for a trace that does not say its rank; with ``files``, the
    rank and the file (`stepwatch trace` on several captures: one rank has several files)."""
    if s.get("rank") is None:
        return _file(s)
    return f"{s['rank']} ({_file(s)})" if files else str(s["rank"])


def ranks_table(summaries: list[dict[str, Any]], title: str = "Trace analysis: ranks", files: bool = False) -> Table:
    """One row per summary; ``files`` adds the trace file's name (which capture the row is)."""
    rows, tags = [], []
    for s in summaries:
        t = s.get("temporal") or {}
        la = (s.get("launch") or {})
        k = s.get("kernels") or {}
        over = s.get("gaps_over_1ms") or {}
        rows.append([_who(s), _n(t.get("idle_pct"), "%"), _n(t.get("compute_pct"), "%"),
                     _n(t.get("non_compute_pct"), "%"), _n(s.get("comm_comp_overlap_pct"), "%"),
                     _n(k.get("count")), _n(k.get("tiny_time_pct"), "%"),
                     _n((la.get("delay_us") or {}).get("median"), " µs"), _n(la.get("queue_empty_pct"), "%"),
                     f"{over.get('count', 0)} ({_ms(over.get('total_us'))})", s.get("note") or ""])
        if files:
            rows[-1][1:1] = [_file(s)]
        tags.append("warn" if (t.get("idle_pct") or 0) >= 10 or over.get("count") else "")
    return Table(title, ["rank"] + (["trace"] if files else []) + [
                         "idle", "compute", "non-compute", "comm overlap", "kernels", "< 50 µs time",
                         "launch delay p50", "queue empty", "gaps > 1 ms", "note"], rows, tags,
                 notes=["HTA's definitions (docs/traces.md): % of the GPU span from first to last kernel; "
                        "overlap = comm time under compute / comm time."])


def gaps_table(summary: dict[str, Any], files: bool = False) -> Table:
    rows = []
    for g in summary.get("gaps") or []:
        rows.append([_ms(g["dur_us"]), _n(g.get("step")), _ms(g.get("start_us")), g.get("cause") or "",
                     (g.get("host_sync") if g.get("cause") == "host_sync" else g.get("cpu_op")) or "(no op)",
                     g.get("call_site") or ""])
    where = "GPU idle" if summary.get("temporal") is not None else "training thread without an op"
    return Table(f"Rank {_who(summary, files)}: largest gaps ({where})",
                 ["gap", "step", "at", "cause", "CPU op", "call site"], rows, ["warn" if r[0] else "" for r in rows])


def kernels_table(summary: dict[str, Any], files: bool = False) -> Table:
    k = summary.get("kernels") or {}
    rows = [[c, _n(v["count"]), _ms(v["time_us"]), _n(v["time_pct"], "%")] for c, v in (k.get("classes") or {}).items()]
    ib = summary.get("idle_breakdown") or {}
    notes = [f"stream {s}: idle {_ms(v['host_wait_us'] + v['kernel_wait_us'] + v['other_us'])} = host wait "
             f"{_n(v['host_wait_pct'], '%')}, kernel wait {_n(v['kernel_wait_pct'], '%')}, other {_n(v['other_pct'], '%')}"
             for s, v in ib.items()]
    return Table(f"Rank {_who(summary, files)}: kernels by class", ["class", "count", "time", "share"], rows,
                 notes=notes)


def findings_table(findings: list[Any], title: str = "Trace findings", files: bool = False) -> Table:
    """``files`` adds the trace each finding is about (``data.trace``): one rank has several."""
    rows, tags = [], []
    for f in findings:
        d = f.to_dict() if hasattr(f, "to_dict") else f
        rows.append([d["severity"], d["kind"], _n(d.get("step")), d["summary"], d["action"]])
        if files:
            tr = (d.get("data") or {}).get("trace")
            rows[-1][3:3] = [_short(tr) if tr else ""]
        tags.append(d["severity"] if d["severity"] != "info" else "good" if d["kind"] == "trace_dense" else "info")
    return Table(title, ["severity", "kind", "step"] + (["trace"] if files else []) + ["summary", "action"], rows,
                 tags, fold_last=1)


def all_tables(summaries: list[dict[str, Any]], findings: list[Any], title: str = "Trace analysis",
               files: bool = False) -> list[Table]:
    out = [ranks_table(summaries, f"{title}: ranks", files)]
    for s in summaries:
        if s.get("kernels"):
            out.append(kernels_table(s, files))
        if s.get("gaps"):
            out.append(gaps_table(s, files))
    ranks = [s.get("rank") for s in summaries]
    out.append(findings_table(findings, f"{title}: findings", files and len(set(ranks)) < len(ranks)))
    return out
