"""The numbers of a report: percentiles, phase shares, throughput, per-rank comparison, findings.

Unknown stays ``None`` all the way to the page: a field that no step recorded is not a zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..record import SEVERITIES, Finding
from .columns import PooledColumns, RankColumns, Series, pool
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
    # What the per-rank marks judge (``_argmax``): the mean step time without the rank's first
    # timed step (start-up: one-off work, and waits for the other ranks' one-off work), the mean
    # data wait without the rank's first step (start-up: the loader's workers starting), and the
    # median over steps of the rank's own work, step time less data wait and exposed comm (the
    # straggler detector's measure, comm/stragglers.py); None without exposed comm recorded.
    steady_step_mean: float | None = None
    steady_data_wait_mean: float | None = None
    work_p50: float | None = None


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
    slowest_compute_rank: int | None  # most work: step time less data wait and exposed comm (median)
    most_data_wait_rank: int | None


Columns = RankColumns | PooledColumns


def _where(a: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``a[mask]``, without the copy when every element is chosen (the same numbers in the same
    order: the sums come out the same). A long run's column is megabytes."""
    return a if mask.all() else a[mask]


def _nanmean(a: np.ndarray) -> float | None:
    a = _where(a, ~np.isnan(a))
    return float(a.mean()) if a.size else None


def _nansum(a: np.ndarray) -> float | None:
    a = _where(a, ~np.isnan(a))
    return float(a.sum()) if a.size else None


def stats_for(c: Columns, rank: int | None) -> Stats:
    """The statistics of records in time order (one rank's, or all ranks' pooled).

    A tail record (evaluation and checkpoints after the last step: ``tail``, ``step_s`` 0) is no
    training step: it counts in the evaluation and checkpoint totals, the wall time and the last
    logged values, and in nothing per step (step count and range, steps/s, means, shares)."""
    n = len(c)
    tail = c.tail
    keep = ~tail if tail.any() else None

    def train(a: np.ndarray) -> np.ndarray:
        return a if keep is None else a[keep]

    s = Stats(rank=rank, steps=n - int(tail.sum()))
    del tail
    if not n:
        s.step_p = {p: None for p in PERCENTILES}
        s.phase_share = {k: None for k in PHASES}
        s.phase_mean = {k: None for k in PHASES}
        return s
    skipped = train(c.skipped)
    s.skipped = int(skipped.sum())
    steps = train(c.step)
    if steps.size:
        s.first_step, s.last_step = int(steps.min()), int(steps.max())
    times = c.time
    s.wall_s = float(times.max() - times.min()) if n > 1 else None
    del steps, times  # a pooled column is a copy: hold few at a time

    step_s = train(c.num("step_s"))
    # A skipped step did no optimizer work; its time is real but it is not a training step's
    # time, so it is counted but kept out of the distribution.
    timed = step_s[~skipped & ~np.isnan(step_s) & (step_s > 0)]
    exposed = train(c.num("comm_exposed_s"))
    s.comm_exposed_mean = _nanmean(exposed)
    data_wait = train(c.num("data_wait_s"))
    s.work_p50 = _work_p50(step_s, data_wait, exposed, skipped)
    s.steady_data_wait_mean = _nanmean(data_wait[1:] if data_wait.size > 1 else data_wait)
    del skipped, exposed, data_wait
    if timed.size:
        s.step_mean, s.step_max = float(timed.mean()), float(timed.max())
        s.steady_step_mean = float(timed[1:].mean()) if timed.size > 1 else s.step_mean
        # After the mean (it sums in array order): the percentiles may reorder the array, which
        # is this function's own copy, instead of copying it once more.
        pcts = np.percentile(timed, PERCENTILES, overwrite_input=True)
        s.step_p = {p: float(v) for p, v in zip(PERCENTILES, pcts)}
    else:
        s.step_p = {p: None for p in PERCENTILES}
    del timed
    s.step_total = _nansum(step_s)

    for k in PHASES:
        s.phase_share[k], s.phase_mean[k] = _phase(train(c.num(k)), step_s)
    total = s.step_total
    for name in sorted(c.phase_names):
        v = _running_sum(c.phase(name), keep)
        if v is not None and s.steps:
            s.user_phase_mean[name] = v / s.steps
            s.user_phase_share[name] = v / total if total else None
    s.eval_total = _nansum(c.num("eval_s"))
    s.checkpoint_total = _nansum(c.num("checkpoint_s"))

    # Throughput over training time only: eval and checkpoint time are already out of step_s.
    if total and total > 0:
        s.steps_per_s = s.steps / total
        tok = train(c.num("tokens"))
        known = ~np.isnan(tok) & ~np.isnan(step_s)
        if known.any() and _where(step_s, known).sum() > 0:
            s.tokens_per_s = float(_where(tok, known).sum() / _where(step_s, known).sum())
    del step_s

    s.mfu_mean = _nanmean(train(c.num("mfu")))
    s.mfu_dtypes = tuple(sorted(c.mfu_dtypes))
    peaks = c.num("peak_tflops")
    peaks = peaks[~np.isnan(peaks) & (peaks != 0)]  # unknown or 0: no peak to name
    s.peak_tflops = float(peaks[-1]) if peaks.size else None
    s.hfu_mean = _nanmean(train(c.num("hfu")))
    _grad_norm(s, c.grad_norm)
    s.comm_mean = _nanmean(train(c.num("comm_s")))
    s.overlap_mean = _nanmean(train(c.num("overlap")))
    s.allreduce_mean = _nanmean(train(c.num("allreduce_s")))
    mem = c.num("mem_peak_bytes")
    mem = mem[~np.isnan(mem)]
    s.mem_peak_max = int(mem.max()) if mem.size else None
    for name in c.scalar_names:  # in order of first appearance
        sc = c.scalar(name)
        i = _last(sc.known())
        if i is not None:
            s.scalars_last[name] = sc.item(i)
    return s


def _last(mask: np.ndarray) -> int | None:
    """Index of the last True (argmax finds the first, so look from the end)."""
    if not mask.any():
        return None
    return len(mask) - 1 - int(np.argmax(mask[::-1]))


def _phase(ph: np.ndarray, step_s: np.ndarray) -> tuple[float | None, float | None]:
    """Share of step time and mean of one phase (a function: its arrays go when it returns)."""
    known = ~np.isnan(ph) & ~np.isnan(step_s)
    denom = _where(step_s, known).sum()
    share = float(_where(ph, known).sum() / denom) if known.any() and denom > 0 else None
    return share, _nanmean(ph)


def _running_sum(ser: Series, keep: np.ndarray | None = None) -> float | None:
    """The known values (of the records ``keep`` marks, if given) added one after another in
    record order.

    Not numpy's pairwise sum, which rounds differently: a user phase's total stays the figure
    a running total gives.
    """
    known = ser.known()
    vals = ser.values[known if keep is None else known & keep]
    if not vals.size:
        return None
    with np.errstate(invalid="ignore"):  # inf + -inf is NaN, without a warning, as in Python
        return float(np.add.accumulate(np.concatenate(([0.0], vals)))[-1])


def _grad_norm(s: Stats, g: Series) -> None:
    """Last known norm, the largest finite one, and how many were NaN or infinite."""
    known = g.known()
    last = _last(known)
    if last is None:
        return
    s.grad_norm_last = float(g.values[last])
    finite = np.isfinite(g.values)  # unknown is NaN: not finite
    if finite.any():
        top = np.max(g.values, where=finite, initial=-np.inf)
        # The first record holding the maximum, as written: an integer stays one, and of 0.0
        # and -0.0 the first is shown.
        s.grad_norm_max = g.item(int(np.argmax(finite & (g.values == top))))
    s.grad_norm_nonfinite = int(known.sum() - finite.sum())


def _overall(per_rank: dict[int, Stats], pooled: Columns) -> Stats:
    """All ranks pooled for the distributions; throughput is the job's, not a sum of steps.

    Every rank runs every step of a data-parallel job, so the job advances at the pace of its
    slowest rank (the lowest steps/s), while tokens are each rank's own batch and add up.
    """
    o = stats_for(pooled, None)
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


def _about(f: Any) -> list[Any]:
    """The ranks a finding is about: those it names (``data.ranks``: a straggler rank 0 found on
    rank 1), else the rank that wrote it."""
    named = f.data.get("ranks") if isinstance(getattr(f, "data", None), dict) else None
    if isinstance(named, list) and named and all(type(r) is int for r in named):
        return named
    return [f.rank]


def _occurrences(f: Finding) -> int:
    """How many findings a line of the findings file stands for. The rate limit
    (analysis/ratelimit.py) writes one line per episode and repeat: a line carries the findings
    held back since the last line (``data.episode.held_back``); a closing line is itself the last
    of those held back."""
    ep = f.data.get("episode") if isinstance(f.data, dict) else None
    if not isinstance(ep, dict):
        return 1
    held = ep.get("held_back")
    if type(held) is not int or held < 0:
        return 1
    return held if ep.get("final") is True and held else held + 1


def group_findings(run: Run) -> list[FindingGroup]:
    groups: dict[str, FindingGroup] = {}
    for f in run.findings:  # ordered by time: the last one seen is the latest
        g = groups.get(f.kind)
        if g is None:
            groups[f.kind] = FindingGroup(
                f.kind, f.severity, _occurrences(f), list(dict.fromkeys(_about(f))), f.step, f.step, f.summary,
                f.diagnosis, f.action
            )
            continue
        g.count += _occurrences(f)
        g.severity = _worst(f.severity, g.severity)
        for r in _about(f):
            if r not in g.ranks:
                g.ranks.append(r)
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


def _work_p50(step_s: np.ndarray, data_wait: np.ndarray, exposed: np.ndarray, skipped: np.ndarray) -> float | None:
    """The median over steps of step time less data wait less the communication the rank sat
    waiting in: its own work, wherever it is (the phases, or Python between them: ``other_s``).

    Only steps with the exposed-communication figure count, and none without it is this rank's
    work, not the plain step: in DDP the AllReduce wait lands in backward, so the fast rank,
    which waits for the slow one, would show the most."""
    ok = ~skipped & ~np.isnan(step_s) & (step_s > 0) & ~np.isnan(exposed)
    if not ok.any():
        return None
    work = step_s[ok] - np.nan_to_num(data_wait[ok]) - exposed[ok]
    return float(np.median(np.maximum(work, 0.0)))


def summarize(run: Run) -> Summary:
    per_rank = {r: stats_for(c, r) for r, c in sorted(run.columns.items())}
    return Summary(
        run=run,
        # Ranks in the order they were read, as records of equal time were always pooled.
        overall=_overall(per_rank, pool(list(run.columns.values()))),
        per_rank=per_rank,
        findings=group_findings(run),
        slowest_rank=_argmax(per_rank, lambda s: s.steady_step_mean),
        slowest_compute_rank=_argmax(per_rank, lambda s: s.work_p50),
        most_data_wait_rank=_argmax(per_rank, lambda s: s.steady_data_wait_mean),
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
