"""The report's tables as plain data, so the terminal and the HTML page show the same numbers."""

from __future__ import annotations

import time
from typing import Any

from .._table import Table
from ..record import STEP_FIELDS
from . import fmt
from .load import is_count, is_time
from .summary import (
    COMPARE_NOISE_PP, COMPARE_NOISE_REL, PHASE_LABELS, PHASES, STANDOUT_SPREAD, CompareRow, Summary,
)


# The Summary's "last <scalar>" rows: how many, and a name's characters at most.
SUMMARY_SCALARS = 8
SCALAR_LABEL_CHARS = 40


def run_info(s: Summary) -> Table:
    run, m = s.run, s.run.manifest or {}
    rows = [["path", run.path]]
    if m:
        rows.append(["run id", str(m.get("run_id", fmt.UNKNOWN))])
        v = m.get("versions") if isinstance(m.get("versions"), dict) else {}
        if v:
            rows.append(["versions", ", ".join(f"{k} {val}" for k, val in v.items())])
        rows.append(["world size", str(m.get("world_size", fmt.UNKNOWN))])
        hosts = m.get("hosts")
        if isinstance(hosts, list) and hosts:
            more = " ..." if len(hosts) > 8 else ""
            rows.append(["hosts", ", ".join(map(str, hosts[:8])) + more])
        argv = m.get("argv")
        if isinstance(argv, list) and argv:
            rows.append(["command", " ".join(map(str, argv))])
        feats = m.get("features")
        if isinstance(feats, dict) and feats:
            on, off = _features(feats)
            rows.append(["features on", ", ".join(on) or "none"])
            if off:
                rows.append(["features off", "; ".join(off)])
            if isinstance(feats.get("timing_clock"), str):
                rows.append(["phase clock", feats["timing_clock"]])
        start, end = m.get("start_time"), m.get("end_time")
        if is_time(start):
            first = run.first_start
            if first is not None and first < start:  # a relaunch: the figures cover every launch
                rows.append(["started", f"{_utc(first)} (the first of {run.launches} launches; the last started "
                                        f"{_utc(start)})"])
            else:
                rows.append(["started", _utc(start)])
        if is_time(end):
            how = m.get("ended_by")
            stopped = isinstance(how, str) and how and how != "shutdown"
            rows.append(["ended", _utc(end) + (f" ({how}: stopped, not finished)" if stopped else "")])
        elif "end_time" in m:
            rows.append(["ended", "no end time: still running, or it crashed"])
    rows.append(["ranks with records", ", ".join(map(str, run.ranks)) or "none"])
    world = m.get("world_size")
    missing = [r for r in range(world) if r not in run.columns] if type(world) is int and 0 < world <= 1 << 16 else []
    if missing and run.columns:
        shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
        rows.append(["ranks without records", f"{shown} (of world size {world})"])
    restarts = sorted({a for att in run.attempts.values() for a in att})
    if len(restarts) > 1:
        what = "two jobs at the same time: see below" if run.concurrent else "elastic restarts or relaunches"
        rows.append(["attempts", ", ".join(map(str, restarts)) + f" ({what})"])
    if run.rank_ends:
        last = max(a for a, _, _ in run.rank_ends)
        several = len({a for a, _, _ in run.rank_ends}) > 1 or len(restarts) > 1
        said = []
        for a, r, how in run.rank_ends:
            what = how or ("no end written: killed (SIGKILL, the OOM killer), or still running"
                           if a == last else "no end written: killed (SIGKILL, the OOM killer)")
            said.append((f"attempt {a} " if several else "") + f"rank {r}: {what}")
        rows.append(["ranks that stopped", "; ".join(said)])
    t = Table("Run", ["", ""], rows)
    if missing and run.columns:
        t.notes.append(f"{len(missing)} of {world} ranks have no step records here (their steps files are missing "
                       "or empty): the job's figures (tokens/s, the slowest rank's steps/s) count only the ranks "
                       "with records.")
    if not m:
        t.notes.append(run.manifest_error or "run.json missing: versions and command unknown.")
    if isinstance(m.get("dropped_records"), int) and m["dropped_records"] > 0:
        t.notes.append(f"{m['dropped_records']} record(s) dropped on rank 0 while the job ran "
                       "(the queue to the background thread was full).")
    t.notes.extend(_exporter_drops(m, several_ranks=len(run.ranks) > 1 or is_count(world, 2)))
    errs = m.get("internal_errors")
    if isinstance(errs, dict) and errs:
        t.notes.append("stepwatch parts that failed and disabled themselves: "
                       + ", ".join(f"{_cut(k)} ({v if is_count(v) else fmt.UNKNOWN})"
                                   for k, v in sorted(errs.items())))
    t.notes.extend(run.notes)
    if run.bad_lines:
        files = ", ".join(f"{n} ({c})" for n, c in sorted(run.bad_lines_by_file.items()))
        t.notes.append(f"{run.bad_lines} unreadable line(s) skipped (a crash mid-write?): {files}")
    return t


def _exporter_drops(m: dict[str, Any], *, several_ranks: bool) -> list[str]:
    """run.json's ``exporter_drops`` (rank 0's: only rank 0 writes run.json) as notes. What the
    records exporter lost is missing from everything below, so it comes first and says so: a disk
    that filled up left "steps 145" of a 1500-step run, and not a word of the rest. What other
    exporters lost is missing from their destinations only."""
    drops = m.get("exporter_drops")
    if not isinstance(drops, dict):
        return []
    lost = {name: {kind: n for kind, n in d.items() if is_count(n, 1)} for name, d in drops.items()
            if isinstance(d, dict)}
    own = lost.pop("records", {})
    notes, said, so = [], [], []
    if n := own.get("records"):
        steps = m.get("steps")
        of = f" of its {steps}" if is_count(steps, n) else ""
        said.append(f"{n}{of} step record{'s are' if n > 1 else ' is'} not in its steps file")
        so.append("the figures below leave those steps out")
    if n := own.get("findings"):
        said.append(f"{n} finding{'s are' if n > 1 else ' is'} not in its findings file")
        so.append("the Findings table leaves those out")
    if said:
        others = " (only rank 0's are counted: the other ranks' losses are not in run.json)" if several_ranks else ""
        notes.append(f"rank 0: {' and '.join(said)}: the records file could not write them (the disk was full or "
                     "over quota, a line was longer than a segment of the rank's share of "
                     "STEPWATCH_DISK_BUDGET_MB, or the file was deleted while the job ran; run.json "
                     f"exporter_drops), so {' and '.join(so)}{others}.")
    theirs = "; ".join(f"{_cut(name)} " + ", ".join(f"{n} {_cut(kind)}" for kind, n in d.items())
                       for name, d in sorted(lost.items()) if d)
    if theirs:
        notes.append(f"Other exporters lost on rank 0: {theirs} (their queue was full, they could not start, or "
                     "shutdown's time ran out; run.json exporter_drops). Missing from those exporters' "
                     "destinations only: this report reads the records file.")
    return notes


def _cut(name: str, most: int = SCALAR_LABEL_CHARS) -> str:
    """A name from run.json as a note shows it: at most ``most`` characters."""
    return name if len(name) <= most else name[: most - 1] + "…"


def _utc(t: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))
    except (OverflowError, OSError, ValueError):  # load.py drops such times; a last guard all the same
        return fmt.UNKNOWN


def _mfu_basis(s: Summary) -> str:
    """MFU's denominator: device (from run.json), dtype and peak, as far as they are known."""
    o = s.overall
    feats = (s.run.manifest or {}).get("features")
    tm = feats.get("training_metrics") if isinstance(feats, dict) else None
    tm = tm if isinstance(tm, dict) else {}
    parts = [str(tm["device"])] if tm.get("device") else []
    parts += list(o.mfu_dtypes)
    if o.peak_tflops:
        parts.append(f"peak {o.peak_tflops:,.4g} TFLOP/s")
    return f" ({', '.join(parts)})" if parts and o.mfu_mean is not None else ""


def overview(s: Summary) -> Table:
    o = s.overall
    rows = [
        ["steps", f"{o.steps}" + (f" ({o.skipped} skipped)" if o.skipped else "")],
        ["step range", fmt.steps_range(o.first_step, o.last_step)],
        ["step time p50 / p90 / p99", " / ".join(fmt.dur(o.step_p.get(p)) for p in (50, 90, 99))],
        ["step time mean / max", f"{fmt.dur(o.step_mean)} / {fmt.dur(o.step_max)}"],
        ["throughput", f"{fmt.rate(o.steps_per_s)} steps/s, {fmt.rate(o.tokens_per_s)} tokens/s"],
        ["MFU mean / HFU mean", f"{fmt.pct(o.mfu_mean)} / {fmt.pct(o.hfu_mean)}" + _mfu_basis(s)],
        ["grad norm last / max", f"{fmt.num(o.grad_norm_last)} / {fmt.num(o.grad_norm_max)}"
         + (f" ({o.grad_norm_nonfinite} non-finite)" if o.grad_norm_nonfinite else "")],
        ["comm mean / exposed mean", f"{fmt.dur(o.comm_mean)} / {fmt.dur(o.comm_exposed_mean)}"],
        ["overlap mean / allreduce mean",
         f"{fmt.pct(o.overlap_mean)} / {fmt.dur(o.allreduce_mean)}"],
        ["peak memory", fmt.nbytes(o.mem_peak_max)],
        ["eval total / checkpoint total",
         f"{fmt.dur(o.eval_total)} / {fmt.dur(o.checkpoint_total)}"],
        ["wall time (first to last step)", fmt.dur(o.wall_s)],
    ]
    # The losses first, then the other names; a long name is cut (a 300-character one left the
    # value column no room: the numbers above came out cut, or empty).
    names = sorted(o.scalars_last, key=lambda k: ("loss" not in k.lower(), k))
    for k in names[:SUMMARY_SCALARS]:
        label = k if len(k) <= SCALAR_LABEL_CHARS else k[: SCALAR_LABEL_CHARS - 1] + "…"
        # A logged name that is also a record's own (stepwatch.log(step=...)): "last step 109"
        # read as the run's last step beside its step range 0-9.
        rows.append([f"last {label}" + (" (logged)" if k in STEP_FIELDS else ""), fmt.num(o.scalars_last[k])])
    t = Table("Summary (all ranks)", ["", ""], rows)
    t.notes.append(
        "Percentiles and mean leave out skipped steps; steps/s is the slowest rank's; "
        "tokens/s adds up the ranks; eval and checkpoint time are outside step time."
    )
    if len(names) > SUMMARY_SCALARS:
        t.notes.append(f"{len(names) - SUMMARY_SCALARS} more scalars logged: every value is in steps.rank<R>.jsonl.")
    return t


def phases(s: Summary) -> Table:
    o = s.overall
    rows, tags = [], []
    for k in PHASES:
        rows.append([PHASE_LABELS[k], fmt.pct(o.phase_share.get(k)), fmt.dur(o.phase_mean.get(k))])
        tags.append("")
    for k, v in o.user_phase_mean.items():
        rows.append([f"phase '{k}' (yours)", fmt.pct(o.user_phase_share.get(k)), fmt.dur(v)])
        tags.append("info")
    t = Table("Phases (share of step time)", ["phase", "share", "mean per step"], rows, tags)
    t.notes.append(f"eval total {fmt.dur(o.eval_total)}, checkpoint total "
                   f"{fmt.dur(o.checkpoint_total)} (not part of step time).")
    return t


def _waited_for_others(s: Summary, rank: int) -> bool:
    """The slowest rank's mean step time exceeds the quickest other rank's mostly by exposed
    communication (at least half of the difference): time it stood in collectives -- a barrier
    after rank 0's save, a rank-0-only evaluation, a slower peer -- which is the others' to fix."""
    me = s.per_rank[rank]
    others = [st for r, st in s.per_rank.items() if r != rank and st.steady_step_mean is not None]
    if me.steady_step_mean is None or me.comm_exposed_mean is None or not others:
        return False
    low = min(others, key=lambda st: st.steady_step_mean)
    if low.comm_exposed_mean is None:
        return False
    excess = me.steady_step_mean - low.steady_step_mean
    return excess > 0 and me.comm_exposed_mean - low.comm_exposed_mean >= 0.5 * excess


def per_rank(s: Summary) -> Table:
    headers = ["rank", "steps", "skipped", "p50", "p99", "mean", "data wait", "forward",
               "backward", "optimizer", "other", "comm exposed", "peak mem"]
    info = s.run.rank_info
    with_host = any(isinstance(i.get("host"), str) for i in info.values())
    if with_host:
        headers.insert(1, "host")
    rows, tags, notes = [], [], []
    for r, st in s.per_rank.items():
        marks = []
        waited = False
        if r == s.slowest_rank:
            waited = _waited_for_others(s, r)
            marks.append("slowest step time, most of it exposed communication: it waited in collectives for the "
                         "other ranks (their checkpoint_s, eval_s or slower steps), not its own work"
                         if waited else "slowest step time")
        if r == s.slowest_compute_rank:
            marks.append("most work (step time less data wait and exposed comm, per step)")
        if r == s.most_data_wait_rank:
            marks.append("most data wait")
        if marks:
            notes.append(f"* rank {r}: {', '.join(marks)}.")
        rows.append([
            f"{r} *" if marks else str(r), str(st.steps), str(st.skipped),
            fmt.dur(st.step_p.get(50)), fmt.dur(st.step_p.get(99)), fmt.dur(st.step_mean),
            *(fmt.dur(st.phase_mean.get(k)) for k in PHASES),
            fmt.dur(st.comm_exposed_mean), fmt.nbytes(st.mem_peak_max),
        ])
        if with_host:
            rows[-1].insert(1, str(info.get(r, {}).get("host", fmt.UNKNOWN)))
        tags.append(("info" if waited and len(marks) == 1 else "warn") if marks else "")
    t = Table("Per rank (means per step)", headers, rows, tags, notes)
    if len(s.per_rank) > 1 and any(x.comm_exposed_mean is None for x in s.per_rank.values()):
        t.notes.append(
            "Communication time unknown: backward includes waiting in AllReduce for slower ranks, "
            "so the rank with the longest backward is often the one that waits, not the slow one."
        )
    if len(s.per_rank) > 1:
        t.notes.append(
            f"A rank is marked * where its mean step time or data wait (its first step, start-up, "
            f"left out) or its work exceeds the lowest rank's by more than {STANDOUT_SPREAD:.0%} "
            "of a step."
        )
    return t


def findings(s: Summary) -> Table:
    rows, tags = [], []
    for g in s.findings:
        ranks = ", ".join(map(str, g.ranks[:8])) + (" ..." if len(g.ranks) > 8 else "")
        rows.append([g.kind, g.severity, str(g.count), ranks,
                     fmt.steps_range(g.first_step, g.last_step), g.summary, g.diagnosis, g.action])
        tags.append(g.severity if g.severity in ("warning", "critical") else "info")
    t = Table("Findings", ["kind", "severity", "count", "ranks", "steps", "latest", "diagnosis",
                           "action"], rows, tags, fold_last=2)
    if not rows:
        t.notes.append("No findings.")
    return t


def comparison(rows: list[CompareRow], name_a: str, name_b: str) -> Table:
    out, tags = [], []
    for c in rows:
        out.append([c.label, fmt.by_unit(c.a, c.unit), fmt.by_unit(c.b, c.unit),
                    fmt.delta(c.delta, c.rel, c.unit)])
        tags.append("" if c.better is None else ("good" if c.better else "bad"))
    t = Table(f"Compare: A = {name_a}, B = {name_b}", ["", "A", "B", "B − A"], out, tags)
    t.notes.append(
        "Green: B is better on that row; red: B is worse; plain: neither, or a change within "
        f"{COMPARE_NOISE_REL:.0%} ({COMPARE_NOISE_PP * 100:.0f} pp for shares)."
    )
    return t


def all_tables(s: Summary) -> list[Table]:
    return [run_info(s), overview(s), phases(s), per_rank(s), findings(s)]


def _features(feats: dict[str, Any]) -> tuple[list[str], list[str]]:
    """run.json's ``features``: the names that ran, and those that were asked for but did not
    (with the reason they gave). ``true`` is on; a feature's status (a dict) is on unless it says
    otherwise (``enabled``/``running`` false, ``off`` true), and its ``error`` is the reason.
    Facts that are no feature (the clock, the roots, the boundary, ``console``'s mode) are left
    out."""
    on, off = [], []
    for name, v in feats.items():
        if v is True:
            on.append(name)
        elif isinstance(v, dict):
            if v.get("run_seen") is False:
                continue  # a sink that waits for the job's own run (MLflow) and saw none: it did nothing
            if v.get("enabled") is False or v.get("running") is False or v.get("off") is True:
                why = v.get("error")
                off.append(f"{name} ({why})" if isinstance(why, str) and why else name)
            else:
                on.append(name)
    return on, off
