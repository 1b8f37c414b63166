"""The numbers of a report: percentiles, phase shares, throughput, per-rank comparison, findings.

Unknown stays ``None`` all the way to the page: a field that no step recorded is not a zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..record import SEVERITIES, StepRecord
from .load import Run

PHASES = ("data_wait_s", "forward_s", "backward_s", "optimizer_s", "other_s")
PHASE_LABELS = {
    "data_wait_s": "data wait",
    "forward_s": "forward",
    "backward_s": "backward",
    "optimizer_s": "optimizer",
    "other_s": "other",
}
PERCENTILES = (50, 90, 99)
# stepwatch's choice, not a published threshold: ranks of one job differ by a few percent from
# noise alone, so a rank is singled out only when its mean is above the lowest rank's by more
# than this share of the median rank's mean step time.
STANDOUT_SPREAD = 0.05


@dataclass(slots=True)
class Stats:
    """Summary of one rank, or of all ranks together (``rank is None``)."""

    rank: int | None
    steps: int = 0
    skipped: int = 0
    first_step: int | None = None
    last_step: int | None = None
    wall_s: float | None = None  # first to last record time
    step_p: dict[int, float | None] = field(default_factory=dict)
    step_mean: float | None = None
    step_max: float | None = None
    step_total: float | None = None
    phase_share: dict[str, float | None] = field(default_factory=dict)
    phase_mean: dict[str, float | None] = field(default_factory=dict)
    user_phase_mean: dict[str, float] = field(default_factory=dict)
    user_phase_share: dict[str, float | None] = field(default_factory=dict)
    eval_total: float | None = None
    checkpoint_total: float | None = None
    steps_per_s: float | None = None
    tokens_per_s: float | None = None
    mfu_mean: float | None = None
    # MFU's denominator, as the records state it: the matmul dtype(s) and the peak TFLOP/s.
    mfu_dtypes: tuple[str, ...] = ()
    peak_tflops: float | None = None
    hfu_mean: float | None = None
    grad_norm_last: float | None = None
    grad_norm_max: float | None = None  # of the finite ones
    grad_norm_nonfinite: int = 0  # NaN or inf: overflow or divergence
    comm_mean: float | None = None
    comm_exposed_mean: float | None = None
    overlap_mean: float | None = None
    allreduce_mean: float | None = None
    mem_peak_max: int | None = None
    scalars_last: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class FindingGroup:
    kind: str
    severity: str  # the worst seen
    count: int
    ranks: list[int]
    first_step: int | None
    last_step: int | None
    summary: str  # the latest
    diagnosis: str
    action: str


@dataclass(slots=True)
class Summary:
    run: Run
    overall: Stats
    per_rank: dict[int, Stats]
    findings: list[FindingGroup]
    slowest_rank: int | None  # highest mean step time
    slowest_compute_rank: int | None  # highest forward+backward+optimizer less exposed comm
    most_data_wait_rank: int | None


def column(recs: list[StepRecord], name: str) -> np.ndarray:
    """One field as floats, NaN where unknown (numpy turns None into NaN for a float array)."""
    return np.array([getattr(r, name) for r in recs], dtype=float)


def _nanmean(a: np.ndarray) -> float | None:
    a = a[~np.isnan(a)]
    return float(a.mean()) if a.size else None


def _nansum(a: np.ndarray) -> float | None:
    a = a[~np.isnan(a)]
    return float(a.sum()) if a.size else None


def stats_for(recs: list[StepRecord], rank: int | None) -> Stats:
    s = Stats(rank=rank, steps=len(recs))
    if not recs:
        s.step_p = {p: None for p in PERCENTILES}
        s.phase_share = {k: None for k in PHASES}
        s.phase_mean = {k: None for k in PHASES}
        return s
    skipped = np.fromiter((r.skipped for r in recs), dtype=bool, count=len(recs))
    s.skipped = int(skipped.sum())
    steps = [r.step for r in recs]
    s.first_step, s.last_step = min(steps), max(steps)
    times = column(recs, "time")
    s.wall_s = float(times.max() - times.min()) if len(recs) > 1 else None

    step_s = column(recs, "step_s")
    # A skipped step did no optimizer work; its time is real but it is not a training step's
    # time, so it is counted but kept out of the distribution.
    timed = step_s[~skipped & ~np.isnan(step_s)]
    if timed.size:
        s.step_p = {p: float(v) for p, v in zip(PERCENTILES, np.percentile(timed, PERCENTILES))}
        s.step_mean, s.step_max = float(timed.mean()), float(timed.max())
    else:
        s.step_p = {p: None for p in PERCENTILES}
    s.step_total = _nansum(step_s)

    for k in PHASES:
        ph = column(recs, k)
        known = ~np.isnan(ph) & ~np.isnan(step_s)
        denom = step_s[known].sum()
        s.phase_share[k] = float(ph[known].sum() / denom) if known.any() and denom > 0 else None
        s.phase_mean[k] = _nanmean(ph)
    user: dict[str, float] = {}
    for r in recs:
        for name, v in r.phases.items():
            user[name] = user.get(name, 0.0) + v
    total = s.step_total
    for name, v in sorted(user.items()):
        s.user_phase_mean[name] = v / len(recs)
        s.user_phase_share[name] = v / total if total else None
    s.eval_total = _nansum(column(recs, "eval_s"))
    s.checkpoint_total = _nansum(column(recs, "checkpoint_s"))

    # Throughput over training time only: eval and checkpoint time are already out of step_s.
    if total and total > 0:
        s.steps_per_s = len(recs) / total
        tok = column(recs, "tokens")
        known = ~np.isnan(tok) & ~np.isnan(step_s)
        if known.any() and step_s[known].sum() > 0:
            s.tokens_per_s = float(tok[known].sum() / step_s[known].sum())

    s.mfu_mean = _nanmean(column(recs, "mfu"))
    s.mfu_dtypes = tuple(sorted({r.mfu_dtype for r in recs if r.mfu_dtype}))
    peaks = [r.peak_tflops for r in recs if r.peak_tflops]
    s.peak_tflops = float(peaks[-1]) if peaks else None
    s.hfu_mean = _nanmean(column(recs, "hfu"))
    norms = [r.grad_norm for r in recs if r.grad_norm is not None]
    if norms:
        s.grad_norm_last = float(norms[-1])
        finite = [g for g in norms if math.isfinite(g)]
        s.grad_norm_max = max(finite) if finite else None
        s.grad_norm_nonfinite = len(norms) - len(finite)
    s.comm_mean = _nanmean(column(recs, "comm_s"))
    s.comm_exposed_mean = _nanmean(column(recs, "comm_exposed_s"))
    s.overlap_mean = _nanmean(column(recs, "overlap"))
    s.allreduce_mean = _nanmean(column(recs, "allreduce_s"))
    mem = [r.mem_peak_bytes for r in recs if r.mem_peak_bytes is not None]
    s.mem_peak_max = int(max(mem)) if mem else None
    for r in recs:
        s.scalars_last.update(r.scalars)
    return s


def _overall(per_rank: dict[int, Stats], recs: list[StepRecord]) -> Stats:
    """All ranks pooled for the distributions; throughput is the job's, not a sum of steps.

    Every rank runs every step of a data-parallel job, so the job advances at the pace of its
    slowest rank (the lowest steps/s), while tokens are each rank's own batch and add up.
    """
    o = stats_for(recs, None)
    # Records pooled over ranks count each step once per rank; the job ran each step once.
    o.steps = max((s.steps for s in per_rank.values()), default=0)
    o.skipped = max((s.skipped for s in per_rank.values()), default=0)
    evals = [s.eval_total for s in per_rank.values() if s.eval_total is not None]
    o.eval_total = max(evals) if evals else None
    ckpts = [s.checkpoint_total for s in per_rank.values() if s.checkpoint_total is not None]
    o.checkpoint_total = max(ckpts) if ckpts else None
    rates = [s.steps_per_s for s in per_rank.values() if s.steps_per_s is not None]
    o.steps_per_s = min(rates) if rates else None
    toks = [s.tokens_per_s for s in per_rank.values() if s.tokens_per_s is not None]
    o.tokens_per_s = sum(toks) if toks else None
    return o


def _worst(a: str, b: str) -> str:
    rank = {s: i for i, s in enumerate(SEVERITIES)}
    return a if rank.get(a, -1) >= rank.get(b, -1) else b


def group_findings(run: Run) -> list[FindingGroup]:
    groups: dict[str, FindingGroup] = {}
    for f in run.findings:  # ordered by time: the last one seen is the latest
        g = groups.get(f.kind)
        if g is None:
            groups[f.kind] = FindingGroup(
                f.kind, f.severity, 1, [f.rank], f.step, f.step, f.summary, f.diagnosis, f.action
            )
            continue
        g.count += 1
        g.severity = _worst(f.severity, g.severity)
        if f.rank not in g.ranks:
            g.ranks.append(f.rank)
        if f.step is not None:
            g.first_step = f.step if g.first_step is None else min(g.first_step, f.step)
            g.last_step = f.step if g.last_step is None else max(g.last_step, f.step)
        g.summary = f.summary or g.summary
        g.diagnosis = f.diagnosis or g.diagnosis
        g.action = f.action or g.action
    sev = {s: i for i, s in enumerate(SEVERITIES)}
    out = sorted(groups.values(), key=lambda g: (-sev.get(g.severity, -1), -g.count, g.kind))
    for g in out:
        g.ranks.sort()
    return out


def _argmax(per_rank: dict[int, Stats], key) -> int | None:
    vals = [(v, r) for r, s in per_rank.items() if (v := key(s)) is not None]
    means = [s.step_mean for s in per_rank.values() if s.step_mean is not None]
    if len(vals) < 2 or not means:
        return None
    # Measured against the step, not against the phase itself: a 1 ms phase that varies by 20%
    # between ranks costs nothing, a 5% of a step difference is a straggler.
    if max(vals)[0] - min(vals)[0] <= STANDOUT_SPREAD * float(np.median(means)):
        return None
    return max(vals)[1]


def _compute_mean(s: Stats) -> float | None:
    """forward + backward + optimizer less the communication the rank sat waiting in.

    Without the exposed-communication figure this is unknown, not the plain sum: in DDP the
    AllReduce wait lands in backward, so the fast rank, which waits for the slow one, would show
    the longest "compute".
    """
    parts = [s.phase_mean.get(k) for k in ("forward_s", "backward_s", "optimizer_s")]
    if any(p is None for p in parts) or s.comm_exposed_mean is None:
        return None
    return sum(parts) - s.comm_exposed_mean


def summarize(run: Run) -> Summary:
    per_rank = {r: stats_for(recs, r) for r, recs in sorted(run.records.items())}
    pooled = [r for recs in run.records.values() for r in recs]
    pooled.sort(key=lambda r: r.time)
    return Summary(
        run=run,
        overall=_overall(per_rank, pooled),
        per_rank=per_rank,
        findings=group_findings(run),
        slowest_rank=_argmax(per_rank, lambda s: s.step_mean),
        slowest_compute_rank=_argmax(per_rank, _compute_mean),
        most_data_wait_rank=_argmax(per_rank, lambda s: s.phase_mean.get("data_wait_s")),
    )


# --- comparison -------------------------------------------------------------------------------

# (label, getter, unit, higher_is_better); None: a change that is neither better nor worse.
COMPARE_ROWS: tuple[tuple[str, Any, str, bool | None], ...] = (
    ("steps", lambda s: s.steps, "count", None),
    ("skipped steps", lambda s: s.skipped, "count", False),
    ("step p50", lambda s: s.step_p.get(50), "s", False),
    ("step p90", lambda s: s.step_p.get(90), "s", False),
    ("step p99", lambda s: s.step_p.get(99), "s", False),
    ("step mean", lambda s: s.step_mean, "s", False),
    *(
        (f"{PHASE_LABELS[k]} share", (lambda k: lambda s: s.phase_share.get(k))(k), "share",
         False if k == "data_wait_s" else None)
        for k in PHASES
    ),
    ("eval total", lambda s: s.eval_total, "s", None),
    ("checkpoint total", lambda s: s.checkpoint_total, "s", False),
    ("steps/s", lambda s: s.steps_per_s, "rate", True),
    ("tokens/s", lambda s: s.tokens_per_s, "rate", True),
    ("MFU mean", lambda s: s.mfu_mean, "share", True),
    ("comm exposed mean", lambda s: s.comm_exposed_mean, "s", False),
    ("overlap mean", lambda s: s.overlap_mean, "share", True),
    ("peak memory", lambda s: s.mem_peak_max, "bytes", False),
)
# stepwatch's choice: run-to-run noise of a few tenths of a percent is not "better" or "worse".
COMPARE_NOISE_REL = 0.02  # of A's value
COMPARE_NOISE_PP = 0.01  # for shares: one percentage point


@dataclass(slots=True)
class CompareRow:
    label: str
    unit: str
    a: float | None
    b: float | None
    delta: float | None  # b - a
    rel: float | None  # (b - a) / a
    better: bool | None  # is B better than A on this row; None: no matter, or within noise


def compare(a: Summary, b: Summary) -> list[CompareRow]:
    rows = []
    for label, get, unit, higher in COMPARE_ROWS:
        va, vb = get(a.overall), get(b.overall)
        delta = rel = better = None
        if va is not None and vb is not None:
            delta = vb - va
            rel = delta / va if va else None
            if unit == "share":
                noise = abs(delta) <= COMPARE_NOISE_PP
            else:
                noise = delta == 0 or (rel is not None and abs(rel) <= COMPARE_NOISE_REL)
            better = None if higher is None or noise else (delta > 0) == higher
        rows.append(CompareRow(label, unit, va, vb, delta, rel, better))
    fa = {g.kind: g.count for g in a.findings}
    fb = {g.kind: g.count for g in b.findings}
    for kind in sorted(set(fa) | set(fb)):
        ca, cb = fa.get(kind, 0), fb.get(kind, 0)
        rows.append(CompareRow(
            f"findings: {kind}", "count", ca, cb, cb - ca, (cb - ca) / ca if ca else None,
            None if ca == cb else cb < ca,
        ))
    return rows
