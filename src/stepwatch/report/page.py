"""``report.html``: one file, inline CSS and SVG, nothing fetched: opens offline, mails well."""

from __future__ import annotations

import time
from html import escape

import numpy as np

from . import fmt, svg
from .columns import RankColumns
from .summary import PHASE_LABELS, PHASES, Summary, compare
from .tables import Table, all_tables, comparison

# Past this many ranks a stacked chart each would make the page long and heavy; the ranks that
# matter most (rank 0 and the marked ones) are drawn, the others listed.
MAX_STACKED_RANKS = 8
# One line chart holds every rank; the point budget is shared so 64 ranks stay a few MB.
LINE_POINT_BUDGET = 16000
MAX_POINTS_PER_SERIES = 2000
MAX_SCALAR_CHARTS = 4

PHASE_COLORS = {"data_wait_s": "#d62728", "forward_s": "#1f77b4", "backward_s": "#2ca02c",
                "optimizer_s": "#ff7f0e", "other_s": "#9e9e9e"}

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#222;
max-width:1840px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:14px;margin:16px 0 4px}
table{border-collapse:collapse;margin:6px 0;font-size:13px}
th,td{padding:3px 10px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
th{background:#f6f6f6} td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.warn td,tr.warning td{background:#fff8e1} tr.critical td{background:#fdecea}
tr.bad td{color:#b71c1c} tr.good td{color:#1b5e20} tr.info td{color:#01579b}
.note{color:#666;font-size:12px;margin:2px 0}
.legend{font-size:12px;margin:2px 0 10px} .legend span{margin-right:14px;white-space:nowrap}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle}
.row{display:flex;flex-wrap:wrap;gap:8px 40px} .row>div{flex:0 1 auto;max-width:460px}
.tw{overflow-x:auto} table.nowrap td{white-space:nowrap}
.runs{display:flex;flex-wrap:wrap;gap:32px} .runs>section{flex:1 1 880px;min-width:0}
svg.chart{max-width:100%;height:auto;background:#fff}
.sev-critical{color:#b71c1c;font-weight:bold} .sev-warning{color:#e65100;font-weight:bold}
"""


def _table(t: Table) -> str:
    out = [f"<h3>{escape(t.title)}</h3>"]
    if t.rows:
        # Columns of numbers stay on one line (the box scrolls); free text wraps.
        nowrap = any(t.headers) and not t.fold_last
        out.append('<div class="tw"><table class="nowrap">' if nowrap else
                   '<div class="tw"><table>')
        if any(t.headers):
            out.append("<tr>" + "".join(f"<th>{escape(h)}</th>" for h in t.headers) + "</tr>")
        for i, r in enumerate(t.rows):
            tag = t.tags[i] if i < len(t.tags) else ""
            cls = f' class="{escape(tag)}"' if tag else ""
            out.append(f"<tr{cls}>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>")
        out.append("</table></div>")
    out.extend(f'<p class="note">{escape(n)}</p>' for n in t.notes)
    return "\n".join(out)


def _legend(items: list[tuple[str, str]]) -> str:
    return '<div class="legend">' + "".join(
        f'<span><i style="background:{c}"></i>{escape(label)}</span>' for label, c in items
    ) + "</div>"


def _x_of(c: RankColumns) -> tuple[np.ndarray, str]:
    steps = c.step
    if len(steps) > 1 and (np.diff(steps) < 0).any():
        # A restart resumed from an earlier step: stacked areas need a monotonic axis.
        return np.arange(len(c), dtype=float), "record # (steps repeat after a restart)"
    return steps, "step"


def _charts(s: Summary, prefix: str = "") -> str:
    run = s.run
    ranks = run.ranks
    out = []
    if not ranks:
        return '<p class="note">No step records: nothing to chart.</p>'
    per_series = max(200, min(MAX_POINTS_PER_SERIES, LINE_POINT_BUDGET // len(ranks)))
    series, legend = [], []
    for i, r in enumerate(ranks):
        c = run.columns[r]
        color = svg.PALETTE[i % len(svg.PALETTE)]
        # Steps as stored: the chart makes each rank's floats in turn, not all ranks' at once.
        series.append((f"rank {r}", c.step, c.num("step_s"), color))
        legend.append((f"rank {r}", color))
    out.append(f"<h3>{escape(prefix)}Step time per step</h3>")
    out.append(svg.line_chart(series, title=f"{prefix}step time per step, per rank",
                              yfmt=fmt.dur, max_points=per_series, kind="step_time"))
    out.append(_legend(legend))
    if any(len(run.columns[r]) > per_series for r in ranks):
        out.append(f'<p class="note">Thinned to at most {per_series} points per rank, keeping '
                   "each bucket's fastest and slowest step.</p>")

    shown = _stacked_ranks(s)
    out.append(f"<h3>{escape(prefix)}Phases per step</h3>")
    out.append(_legend([(PHASE_LABELS[k], PHASE_COLORS[k]) for k in PHASES]))
    stacks = {}
    for r in shown:
        c = run.columns[r]
        x, xlabel = _x_of(c)
        stacks[r] = (x, xlabel, [(PHASE_LABELS[k], c.num(k), PHASE_COLORS[k]) for k in PHASES])
    # One y axis for all ranks, so the eye compares heights across the small multiples.
    y_max = max(svg.stacked_top(x, [y for _, y, _ in layers]) for x, _, layers in stacks.values())
    for r, (x, xlabel, layers) in stacks.items():
        out.append(f'<p class="note">rank {r}</p>')
        out.append(svg.stacked_chart(x, layers, title=f"{prefix}phases per step, rank {r}",
                                     yfmt=fmt.dur, xlabel=xlabel, kind="phases", y_max=y_max))
    if len(shown) < len(ranks):
        rest = [r for r in ranks if r not in shown]
        out.append(f'<p class="note">Phase charts for ranks {", ".join(map(str, rest))} left out '
                   f"to keep the page small; their means are in the per-rank table.</p>")
    if any(len(run.columns[r]) > svg.STACK_POINTS for r in shown):
        out.append('<p class="note">Long runs: each point of a phase chart is the mean of a '
                   "bucket of consecutive steps.</p>")

    out.append(_memory_charts(s, prefix))
    out.append(_scalar_charts(s, prefix))
    return "\n".join(out)


# (chart title, [(record field, label)]) -- memory is read every few steps: unknown steps are skipped.
MEMORY_CHARTS = (
    ("Device memory", [("mem_allocated_bytes", "allocated"), ("mem_reserved_bytes", "reserved"),
                       ("mem_peak_bytes", "peak")]),
    ("Host memory", [("host_rss_bytes", "trainer RSS"), ("workers_pss_bytes", "DataLoader workers PSS"),
                     ("workers_uss_bytes", "DataLoader workers USS")]),
)


def _memory_charts(s: Summary, prefix: str) -> str:
    """Memory of the lowest rank per step: the CUDA allocator's numbers, and the host's."""
    run = s.run
    r = run.ranks[0]
    c = run.columns[r]
    out = []
    for title, fields in MEMORY_CHARTS:
        if title == "Device memory" and not np.isfinite(c.num("mem_allocated_bytes")).any():
            continue  # on CPU mem_peak_bytes is the host's high-water mark: no device chart
        series, legend = [], []
        for i, (field, label) in enumerate(fields):
            y = c.num(field)
            known = np.isfinite(y)
            if not known.any():
                continue
            color = svg.PALETTE[i % len(svg.PALETTE)]
            series.append((label, c.step[known], y[known], color))
            legend.append((label, color))
        if not series:
            continue
        out.append(f"<h3>{escape(prefix)}{title} (rank {r})</h3>")
        out.append(svg.line_chart(series, title=f"{prefix}{title.lower()}, rank {r}", yfmt=fmt.nbytes,
                                  kind="memory"))
        out.append(_legend(legend))
    return "\n".join(out)


def _stacked_ranks(s: Summary) -> list[int]:
    ranks = s.run.ranks
    if len(ranks) <= MAX_STACKED_RANKS:
        return ranks
    first = [ranks[0], s.slowest_rank, s.slowest_compute_rank, s.most_data_wait_rank]
    chosen = list(dict.fromkeys(r for r in first if r is not None))
    by_mean = sorted(ranks, key=lambda r: -(s.per_rank[r].step_mean or 0))
    for r in by_mean:
        if len(chosen) >= MAX_STACKED_RANKS:
            break
        if r not in chosen:
            chosen.append(r)
    return sorted(chosen)


def _scalar_charts(s: Summary, prefix: str) -> str:
    """Logged scalars (loss, lr, ...) of the lowest rank: every rank logs the same loss in DDP."""
    run = s.run
    c = run.columns[run.ranks[0]]
    out = []
    for k in c.scalar_names[:MAX_SCALAR_CHARTS]:  # in order of first appearance
        # A recorded NaN and a step without the scalar both leave a gap.
        x, y = c.step, c.scalar(k).values
        out.append(f"<h3>{escape(prefix)}{escape(k)} (rank {run.ranks[0]})</h3>")
        out.append(svg.line_chart([(k, x, y, svg.PALETTE[0])], title=f"{prefix}{k}",
                                  yfmt=fmt.num, kind="scalar", from_zero=False))
    return "\n".join(out)


def _run_section(s: Summary, label: str = "") -> str:
    prefix = f"{label}: " if label else ""
    parts = [f"<h2>{escape(prefix + s.run.name)}</h2>"]
    ts = [_table(t) for t in all_tables(s)]
    # The short key-value tables side by side; the wide ones below at full width.
    parts.append('<div class="row">' + "".join(f"<div>{t}</div>" for t in ts[:3]) + "</div>")
    parts.extend(ts[3:])
    tl = comm_timeline(s.run.path)
    if tl:
        parts.append(f"<h3>{escape(prefix)}Communication in one step, per rank</h3><pre>{escape(tl)}</pre>")
    caps = capture_tables(s.run.path)
    if caps:
        parts.append(f"<h3>{escape(prefix)}Captures: what the traces show</h3>")
        parts.extend(_table(t) for t in caps)
    parts.append(_charts(s, prefix))
    return "<section>" + "\n".join(parts) + "</section>"


def capture_tables(run_dir: str) -> list[Table]:
    """A section per capture: its ranks' trace analyses side by side, gaps and findings ([] if none)."""
    from ..traces import rundir

    try:
        return rundir.capture_tables(run_dir)
    except (OSError, KeyError, TypeError, ValueError):  # a summary from another version
        return []


def comm_timeline(run_dir: str) -> str:
    """The per-rank one-step timeline the comm feature leaves in the run dir (text; '' if none)."""
    from ..comm import timeline

    try:
        return timeline.render(timeline.load(run_dir))
    except (OSError, KeyError, TypeError, ValueError):  # a run dir from another writer
        return ""


def _page(title: str, body: str) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<meta name=\"viewport\" content=\"width=device-width\"><title>{escape(title)}</title>"
        f"<style>{_CSS}</style></head><body>\n<h1>{escape(title)}</h1>"
        f'<p class="note">stepwatch report, made {stamp}. '
        f'Unknown values read "{fmt.UNKNOWN}".</p>\n'
        f"{body}\n</body></html>\n"
    )


def render_html(s: Summary) -> str:
    return _page(f"stepwatch report: {s.run.name}", _run_section(s))


def _job_series(s: Summary) -> tuple[np.ndarray, np.ndarray]:
    """Each step's slowest rank: the time the whole job spent on that step."""
    steps, times = [], []
    for c in s.run.columns.values():
        step_s = c.num("step_s")
        ok = ~np.isnan(step_s) & ~c.skipped & ~c.tail  # a tail record is no step
        # Time order: a step run again after a restart replaces the earlier run, so keep each
        # step's last record (np.unique on the reversed steps finds the last first).
        st, v = c.step[ok][::-1], step_s[ok][::-1]
        st, first = np.unique(st, return_index=True)
        steps.append(st)
        times.append(v[first])
    if not steps:
        return np.zeros(0), np.zeros(0)
    st, where = np.unique(np.concatenate(steps), return_inverse=True)
    slowest = np.full(len(st), -np.inf)
    np.maximum.at(slowest, where, np.concatenate(times))
    return st.astype(float), slowest


def render_compare_html(a: Summary, b: Summary) -> str:
    rows = compare(a, b)
    xa, ya = _job_series(a)
    xb, yb = _job_series(b)
    color_a, color_b = svg.PALETTE[0], svg.PALETTE[1]
    body = [
        "<h2>A against B</h2>",
        _table(comparison(rows, a.run.name, b.run.name)),
        "<h3>Step time per step (slowest rank), A and B</h3>",
        svg.line_chart([(f"A: {a.run.name}", xa, ya, color_a),
                        (f"B: {b.run.name}", xb, yb, color_b)],
                       title="step time per step, A and B", yfmt=fmt.dur, kind="compare"),
        _legend([(f"A: {a.run.name}", color_a), (f"B: {b.run.name}", color_b)]),
        '<div class="runs">', _run_section(a, "A"), _run_section(b, "B"), "</div>",
    ]
    return _page(f"stepwatch compare: {a.run.name} vs {b.run.name}", "\n".join(body))
