"""`stepwatch report`: reading run directories back, the numbers, the terminal summary, the HTML.

Run directories are written here the way the records exporter writes them: one JSON line per
``StepRecord.to_dict()`` / ``Finding.to_dict()``. Nothing is mocked.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stepwatch.record import Finding, StepRecord
from stepwatch.report import ReportError, load_run, summarize
from stepwatch.report.summary import PHASES, compare
from stepwatch.report.svg import minmax_downsample

SRC = Path(__file__).resolve().parents[2] / "src"
HAVE_PACKAGE_INIT = (SRC / "stepwatch" / "__init__.py").exists()
needs_init = pytest.mark.skipif(
    not HAVE_PACKAGE_INIT, reason="stepwatch/__init__.py (the public API) is not in the tree yet"
)


def make_records(rank: int, n: int, rng: np.random.Generator, *, t0: float = 1.7e9,
                 skip_every: int = 0, first_step: int = 0, **fixed) -> list[StepRecord]:
    recs, t = [], t0
    for i in range(n):
        dw, fw, bw, op, ot = rng.uniform(0.001, 0.02, size=5)
        s = float(dw + fw + bw + op + ot)
        t += s
        kw = dict(step=first_step + i, rank=rank, time=t, step_s=s, data_wait_s=float(dw),
                  forward_s=float(fw), backward_s=float(bw), optimizer_s=float(op),
                  other_s=float(ot), skipped=bool(skip_every and i % skip_every == 3))
        kw.update(fixed)
        recs.append(StepRecord(**kw))
    return recs


def write_jsonl(path: Path, items, tail: str = "") -> None:
    with open(path, "w", encoding="utf-8") as f:
        for it in items:
            f.write(json.dumps(it.to_dict() if hasattr(it, "to_dict") else it) + "\n")
        f.write(tail)


def write_manifest(d: Path, world_size: int, run_id: str | None = None) -> None:
    (d / "run.json").write_text(json.dumps({
        "schema_version": 1, "run_id": run_id or d.name, "argv": ["train.py", "--lr", "3e-4"],
        "versions": {"stepwatch": "0.1.0", "torch": "2.13.0", "python": "3.11.9"},
        "world_size": world_size, "hosts": ["node-a"], "config": {}, "features": {"records": True},
    }))


def make_run(d: Path, *, ranks: int = 2, n: int = 200, seed: int = 0, findings=(),
             **kw) -> dict[int, list[StepRecord]]:
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    out = {}
    for r in range(ranks):
        out[r] = make_records(r, n, rng, **kw)
        write_jsonl(d / f"steps.rank{r}.jsonl", out[r])
        write_jsonl(d / f"findings.rank{r}.jsonl", [f for f in findings if f.rank == r])
    write_manifest(d, ranks)
    return out


def finding(rank: int, step: int, kind: str = "data_loading", severity: str = "warning",
            summary: str = "mean wait 21 ms") -> Finding:
    return Finding(time=1.7e9 + step, step=step, rank=rank, kind=kind, severity=severity,
                   summary=summary, diagnosis="Data loading is a bottleneck.",
                   action="Increase num_workers.")


def cli(argv: list[str]) -> int:
    from stepwatch.cli import main

    return main(argv)


# --- the numbers -------------------------------------------------------------------------------


def test_percentiles_and_means_match_numpy_skipped_steps_counted_not_timed(tmp_path):
    recs = make_run(tmp_path, ranks=3, n=500, skip_every=50)
    s = summarize(load_run(str(tmp_path)))
    pooled = []
    for r, rr in recs.items():
        timed = np.array([x.step_s for x in rr if not x.skipped])
        pooled.append(timed)
        st = s.per_rank[r]
        assert st.steps == 500 and st.skipped == 10
        for p in (50, 90, 99):
            assert st.step_p[p] == pytest.approx(np.percentile(timed, p), rel=1e-12)
        assert st.step_mean == pytest.approx(timed.mean(), rel=1e-12)
        # Phase shares: each phase's time over step time, skipped steps included (they ran).
        total = sum(x.step_s for x in rr)
        for k in PHASES:
            assert st.phase_share[k] == pytest.approx(sum(getattr(x, k) for x in rr) / total)
        assert st.steps_per_s == pytest.approx(500 / total)
    allt = np.concatenate(pooled)
    for p in (50, 90, 99):
        assert s.overall.step_p[p] == pytest.approx(np.percentile(allt, p), rel=1e-12)
    assert s.overall.steps == 500  # the job's steps, not records summed over ranks
    assert s.overall.steps_per_s == pytest.approx(min(x.steps_per_s for x in s.per_rank.values()))


def test_tokens_mfu_gradnorm_eval_checkpoint_and_unknown_stays_unknown(tmp_path):
    rng = np.random.default_rng(1)
    recs = make_records(0, 50, rng, tokens=2048, eval_s=0.5, checkpoint_s=0.0)
    for i, r in enumerate(recs):
        r.grad_norm = float(10 - i * 0.1)
        r.mfu = 0.4 if i >= 10 else None  # MFU unknown for the first steps
    write_jsonl(tmp_path / "steps.rank0.jsonl", recs)
    st = summarize(load_run(str(tmp_path))).per_rank[0]
    total = sum(r.step_s for r in recs)
    assert st.tokens_per_s == pytest.approx(50 * 2048 / total)
    assert st.mfu_mean == pytest.approx(0.4)
    assert st.grad_norm_last == pytest.approx(recs[-1].grad_norm)
    assert st.grad_norm_max == pytest.approx(10.0)
    assert st.eval_total == pytest.approx(25.0) and st.checkpoint_total == 0.0
    # Never measured: unknown, not zero.
    assert st.comm_mean is None and st.overlap_mean is None and st.hfu_mean is None
    assert st.mem_peak_max is None


def test_null_fields_read_as_unknown_in_terminal_not_zero(tmp_path, capsys):
    rows = []
    for i in range(20):
        d = StepRecord(step=i, rank=0, time=1.7e9 + i, step_s=0.05).to_dict()
        d["data_wait_s"] = None  # no data-loader hook: unknown
        del d["forward_s"]  # an older writer that did not have the field
        d["mfu"] = float("nan")  # json.dumps writes NaN; not a number to average
        d["tokens"] = "many"
        rows.append(d)
    write_jsonl(tmp_path / "steps.rank0.jsonl", rows)
    s = summarize(load_run(str(tmp_path)))
    assert s.overall.phase_share["data_wait_s"] is None
    assert s.overall.phase_share["forward_s"] is None
    assert s.overall.phase_share["backward_s"] == 0.0  # written as 0.0: a measured zero
    assert s.overall.mfu_mean is None and s.overall.tokens_per_s is None
    assert cli(["report", str(tmp_path), "--no-html"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("data wait"))
    assert "–" in line and "0.0%" not in line


def test_rotated_segments_and_restart_attempts_are_merged_in_time_order(tmp_path):
    rng = np.random.default_rng(2)
    first = make_records(0, 30, rng, t0=1000.0)
    second = make_records(0, 30, rng, t0=first[-1].time, first_step=30)
    # The elastic restart resumed from a checkpoint at step 50: steps 50.. run again.
    restart = make_records(0, 20, rng, t0=second[-1].time + 100, first_step=50)
    write_jsonl(tmp_path / "steps.rank0.jsonl.1", first)  # rotated, older
    write_jsonl(tmp_path / "steps.rank0.jsonl", second)
    write_jsonl(tmp_path / "steps.rank0.1.jsonl", restart)  # attempt 1
    write_jsonl(tmp_path / "findings.rank0.1.jsonl.2", [finding(0, 60)])
    run = load_run(str(tmp_path))
    got = run.columns[0]
    assert len(got) == 80
    assert got.time.tolist() == sorted(r.time for r in first + second + restart)
    assert got.step.tolist() == list(range(60)) + list(range(50, 70))
    assert run.attempts == {0: [0, 1]}
    assert [f.step for f in run.findings] == [60]


def test_truncated_last_line_and_garbage_are_skipped_and_counted(tmp_path, capsys):
    make_run(tmp_path, ranks=1, n=40)
    with open(tmp_path / "steps.rank0.jsonl", "a") as f:
        f.write('"just a string"\n{"step": 3}\n{"step": 41, "rank": 0, "time": 1.7e9, "st')
    with open(tmp_path / "findings.rank0.jsonl", "a") as f:
        f.write('{"kind": "data_lo')
    run = load_run(str(tmp_path))
    assert len(run.columns[0]) == 40
    assert run.bad_lines == 4
    assert run.bad_lines_by_file == {"steps.rank0.jsonl": 3, "findings.rank0.jsonl": 1}
    assert cli(["report", str(tmp_path), "--no-html"]) == 0
    assert "4 unreadable line(s) skipped" in capsys.readouterr().out


def test_findings_grouped_by_kind_with_worst_severity(tmp_path):
    fs = [finding(1, 100), finding(1, 300, severity="critical", summary="latest one"),
          finding(0, 200), finding(0, 50, kind="internal_error", severity="info")]
    make_run(tmp_path, ranks=2, n=10, findings=fs)
    groups = summarize(load_run(str(tmp_path))).findings
    assert [g.kind for g in groups] == ["data_loading", "internal_error"]
    g = groups[0]
    got = (g.severity, g.count, g.ranks, g.first_step, g.last_step)
    assert got == ("critical", 3, [0, 1], 100, 300)
    assert g.summary == "latest one"  # ordered by time: step 300 is the latest


def test_findings_the_rate_limit_held_back_are_counted_in_the_report(tmp_path):
    """A spike on rank 0 every 50 steps (a checkpoint) and the rank waiting for it: 7 findings,
    written as 4 lines by the rate limit (an opening, then "[episode over: 3 in all]"). The
    report's count was the lines: 5 of 7, or 2 of 3 for one rank alone."""
    from stepwatch.analysis.ratelimit import FindingLimiter

    lim = FindingLimiter(window=60)
    raw = [finding(r, s, kind="step_time_spike") for s in (50, 100, 150) for r in (0, 1)]
    raw.append(finding(1, 400, kind="step_time_spike"))  # a later episode: one line, one finding
    lines = [f for one in raw for f in lim.filter([one])] + lim.flush()
    assert len(lines) == 5
    make_run(tmp_path, ranks=2, n=10, findings=lines)
    (g,) = summarize(load_run(str(tmp_path))).findings
    assert (g.kind, g.count, g.ranks, g.first_step, g.last_step) == ("step_time_spike", 7, [0, 1], 50, 400)


def test_a_hang_the_job_was_ended_for_is_read_from_the_watchdogs_own_file(tmp_path):
    """The sidecar writes its ``hang`` finding to ``findings.watchdog.rank<R>.jsonl`` and the
    trainer copies it into ``findings.rank<R>.jsonl`` within a second: a trainer ended right
    after the dump (STEPWATCH_HANG_ACTION=exit, a scheduler's SIGTERM) never copied it, and the
    report said "No findings". A copy that did land is not counted twice."""
    hang = finding(0, 20, kind="hang", severity="critical", summary="Laggard: rank 1")
    make_run(tmp_path / "ended", ranks=2, n=30)
    write_jsonl(tmp_path / "ended" / "findings.watchdog.rank0.jsonl", [hang])
    got = load_run(str(tmp_path / "ended"))
    assert [(f.kind, f.rank, f.step) for f in got.findings] == [("hang", 0, 20)]
    assert "findings.watchdog.rank0.jsonl" in got.files
    make_run(tmp_path / "copied", ranks=2, n=30, findings=[hang, finding(1, 5)])
    write_jsonl(tmp_path / "copied" / "findings.watchdog.rank0.jsonl", [hang])
    assert sorted(f.kind for f in load_run(str(tmp_path / "copied")).findings) == ["data_loading", "hang"]
    assert [g.kind for g in summarize(load_run(str(tmp_path / "ended"))).findings] == ["hang"]


def test_the_ranks_that_crashed_or_were_killed_are_named_for_every_attempt(tmp_path, capsys):
    """A rank's exception was recorded nowhere (run.json is rank 0's: its ``ended_by`` was the
    peer's "Connection closed" error), and after a torchrun restart the report read only the last
    attempt: a clean end, nothing of the crash. Each rank's own file now says how it ended."""
    make_run(tmp_path, ranks=2, n=20)
    t0 = 1.7e9

    def rank_file(name, rank, attempt, ended_by, end=True, legacy=False):
        d = {"rank": rank, "host": "h", "pid": 100 + rank, "attempt": attempt, "start_time": t0}
        if not legacy:
            d.update(end_time=t0 + 60 if end else None, ended_by=ended_by if end else None)
        (tmp_path / name).write_text(json.dumps(d))

    rank_file("rank0.json", 0, 0, "uncaught RuntimeError: Connection closed by peer")
    rank_file("rank1.json", 1, 0, "uncaught RuntimeError: injected failure rank 1 step 30")
    rank_file("rank0.1.json", 0, 1, "shutdown")
    rank_file("rank1.1.json", 1, 1, None, end=False)  # killed: no end written
    rank_file("rank2.json", 2, 0, None, legacy=True)  # a file from before: no end fields at all
    run = load_run(str(tmp_path))
    assert run.rank_ends == [(0, 0, "uncaught RuntimeError: Connection closed by peer"),
                             (0, 1, "uncaught RuntimeError: injected failure rank 1 step 30"), (1, 1, None)]
    assert run.rank_info[1]["attempt"] == 1  # the latest launch's file, as before
    assert cli(["report", str(tmp_path), "--no-html"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "ranks that stopped attempt 0 rank 0: uncaught RuntimeError: Connection closed by peer;" in out
    assert "attempt 0 rank 1: uncaught RuntimeError: injected failure rank 1 step 30;" in out
    assert "attempt 1 rank 1: no end written: killed (SIGKILL, the OOM killer), or still running" in out
    # A second launch into the directory (torchrun counts its attempts from 0 again): its ends
    # read "attempt 2" as its files do, not a second "attempt 0".
    rank_file("rank0.2.json", 0, 0, "uncaught RuntimeError: boom at step 45")
    assert load_run(str(tmp_path)).rank_ends[-1] == (2, 0, "uncaught RuntimeError: boom at step 45")
    assert cli(["report", str(tmp_path), "--no-html"]) == 0
    assert "attempt 2 rank 0: uncaught RuntimeError: boom at step 45" in " ".join(capsys.readouterr().out.split())


def test_slow_rank_is_marked_only_when_it_stands_out(tmp_path):
    make_run(tmp_path / "even", ranks=2, n=300)
    s = summarize(load_run(str(tmp_path / "even")))
    assert s.slowest_rank is None and s.most_data_wait_rank is None
    d = tmp_path / "slow"
    d.mkdir()
    rng = np.random.default_rng(3)
    write_jsonl(d / "steps.rank0.jsonl", make_records(0, 100, rng))
    slow = make_records(1, 100, rng)
    for r in slow:
        r.data_wait_s += 0.05
        r.step_s += 0.05
    write_jsonl(d / "steps.rank1.jsonl", slow)
    s = summarize(load_run(str(d)))
    assert s.slowest_rank == 1 and s.most_data_wait_rank == 1 and s.slowest_compute_rank is None
    # DDP: rank 0 computes 30 ms more per step; rank 1 sits those 30 ms in backward's AllReduce.
    d, unknown = tmp_path / "ddp", tmp_path / "ddp-no-comm"
    d.mkdir()
    unknown.mkdir()
    for r in range(2):
        recs = make_records(r, 100, rng, backward_s=0.04)
        for x in recs:
            x.forward_s += 0.03 if r == 0 else 0.0
            x.comm_exposed_s = 0.0 if r == 0 else 0.03
        write_jsonl(d / f"steps.rank{r}.jsonl", recs)
        for x in recs:
            x.comm_exposed_s = None  # unknown: the longer backward proves nothing
        write_jsonl(unknown / f"steps.rank{r}.jsonl", recs)
    assert summarize(load_run(str(d))).slowest_compute_rank == 0
    assert summarize(load_run(str(unknown))).slowest_compute_rank is None


def test_compare_rows_direction(tmp_path):
    make_run(tmp_path / "a", n=100, seed=1)
    make_run(tmp_path / "b", n=100, seed=1, tokens=100)
    rng = np.random.default_rng(1)
    # B: the same steps, each 10 ms slower.
    for r in range(2):
        recs = make_records(r, 100, rng)
        for x in recs:
            x.step_s += 0.01
            x.other_s += 0.01
        write_jsonl(tmp_path / "b" / f"steps.rank{r}.jsonl", recs)
    a = summarize(load_run(str(tmp_path / "a")))
    b = summarize(load_run(str(tmp_path / "b")))
    rows = {c.label: c for c in compare(a, b)}
    assert rows["step mean"].delta == pytest.approx(b.overall.step_mean - a.overall.step_mean)
    assert rows["step mean"].better is False and rows["steps/s"].better is False
    assert rows["tokens/s"].a is None and rows["tokens/s"].delta is None


# --- errors ------------------------------------------------------------------------------------


def test_missing_and_empty_run_dir_exit_2_naming_the_path(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert cli(["report", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli(["report", str(empty)]) == 2
    err = capsys.readouterr().err
    assert str(empty) in err and "steps.rank<R>.jsonl" in err
    with pytest.raises(ReportError, match="does not exist"):
        load_run(str(missing))
    # The runs root instead of one run: say which run directories are in it.
    make_run(tmp_path / "runs" / "job-1", ranks=1, n=5)
    assert cli(["report", str(tmp_path / "runs")]) == 2
    assert "job-1" in capsys.readouterr().err
    # --compare with a bad second directory names that one.
    assert cli(["report", str(tmp_path / "runs" / "job-1"), "--compare", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err


def test_unwritable_html_path_is_an_error_naming_it(tmp_path, capsys):
    make_run(tmp_path / "r", ranks=1, n=5)
    bad = tmp_path / "no" / "such" / "dir" / "r.html"
    assert cli(["report", str(tmp_path / "r"), "--html", str(bad)]) == 1
    assert str(bad) in capsys.readouterr().err


# --- output ------------------------------------------------------------------------------------

_EXTERNAL = re.compile(r"""(?:src|href|xlink:href)\s*=\s*["']?\s*(?:https?:)?//""", re.I)


def assert_self_contained(page: str) -> None:
    assert not _EXTERNAL.search(page), _EXTERNAL.search(page).group(0)
    assert "http://" not in page and "https://" not in page
    assert "<script" not in page.lower() and "<link" not in page.lower()
    assert "@import" not in page and "url(" not in page


def charts(page: str) -> list[str]:
    return re.findall(r'<svg class="chart" data-chart="([a-z_]+)"', page)


def test_html_report_is_self_contained_with_one_svg_per_chart(tmp_path, capsys):
    fs = [finding(1, 10, summary="<script>alert(1)</script> [bold]x[/bold]")]
    make_run(tmp_path, ranks=3, n=300, findings=fs, scalars={"loss": 2.5})
    assert cli(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[bold]x[/bold]" in out  # record text is not read as rich markup
    page = (tmp_path / "report.html").read_text()
    assert_self_contained(page)
    # One step-time chart, one stacked-phase chart per rank, one chart per logged scalar.
    assert charts(page) == ["step_time", "phases", "phases", "phases", "scalar"]
    assert page.count("<svg") == len(charts(page))
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "Increase num_workers." in page
    for label in ("data wait", "forward", "backward", "optimizer", "other"):
        assert label in page


def test_html_options_path_and_no_html(tmp_path):
    make_run(tmp_path / "r", ranks=1, n=5)
    assert cli(["report", str(tmp_path / "r"), "--no-html"]) == 0
    assert not (tmp_path / "r" / "report.html").exists()
    target = tmp_path / "elsewhere.html"
    assert cli(["report", str(tmp_path / "r"), "--html", str(target)]) == 0
    assert target.exists() and not (tmp_path / "r" / "report.html").exists()
    assert cli(["report", str(tmp_path / "r")]) == 0
    # Inside the run directory the report is as private as the records the writer made 0600.
    assert (tmp_path / "r" / "report.html").stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []


def test_compare_terminal_columns_and_html_with_both_runs(tmp_path, capsys):
    make_run(tmp_path / "base", n=100, seed=1)
    make_run(tmp_path / "tuned", ranks=4, n=80, seed=2, findings=[finding(2, 5)])
    assert cli(["report", str(tmp_path / "base"), "--compare", str(tmp_path / "tuned")]) == 0
    out = capsys.readouterr().out
    assert "A = base, B = tuned" in out and "B − A" in out
    steps_line = next(x for x in out.splitlines() if x.strip().startswith("steps "))
    assert steps_line.split()[1:4] == ["100", "80", "-20"]
    assert "findings: data_loading" in out
    page = (tmp_path / "base" / "compare-tuned.html").read_text()
    assert not (tmp_path / "base" / "report.html").exists()  # the run's own report is kept
    assert_self_contained(page)
    a_charts, b_charts = ["step_time"] + ["phases"] * 2, ["step_time"] + ["phases"] * 4
    assert charts(page) == ["compare"] + a_charts + b_charts
    assert "A: base" in page and "B: tuned" in page


def test_minmax_downsample_keeps_extremes_and_bounds_points():
    rng = np.random.default_rng(4)
    y = rng.normal(1.0, 0.01, 200_000)
    y[123_457] = 9.0  # one stall
    y[7] = -3.0
    x = np.arange(y.size, dtype=float)
    xs, ys = minmax_downsample(x, y, 2000)
    assert len(xs) <= 2000
    assert ys.max() == 9.0 and ys.min() == -3.0
    assert np.all(np.diff(xs) > 0)
    assert xs[np.argmax(ys)] == 123_457


def test_long_run_html_stays_small_and_keeps_the_stall(tmp_path):
    n = 30_000
    rng = np.random.default_rng(5)
    recs = make_records(0, n, rng)
    recs[20_000].step_s = 5.0  # one stall among ~50 ms steps
    write_jsonl(tmp_path / "steps.rank0.jsonl", recs)
    out = tmp_path / "r.html"
    assert cli(["report", str(tmp_path), "--html", str(out)]) == 0
    page = out.read_text()
    assert len(page) < 400_000
    step_chart = page[page.index('data-chart="step_time"'):]
    step_chart = step_chart[:step_chart.index("</svg>")]
    lines = re.findall(r'<polyline [^>]*points="([^"]*)"', step_chart)
    assert lines and all(len(pts.split()) <= 2000 for pts in lines)
    # The stall survived thinning: it, not the ~50 ms steps, sets the y axis (0 to 5.25 s).
    ticks = re.findall(r'text-anchor="end">([^<]*)<', step_chart)
    assert ticks[-1].endswith(" s") and float(ticks[-1].split()[0]) >= 4.0, ticks


@needs_init
def test_python_dash_m_stepwatch_report_subprocess(tmp_path):
    make_run(tmp_path, ranks=2, n=50)
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "stepwatch", "report", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "Per rank" in p.stdout and "\x1b[" not in p.stdout  # plain when not a terminal
    assert (tmp_path / "report.html").exists()
    p = subprocess.run([sys.executable, "-m", "stepwatch", "report", str(tmp_path / "x")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and str(tmp_path / "x") in p.stderr


def test_restart_with_repeated_steps_and_many_ranks_render(tmp_path, capsys):
    rng = np.random.default_rng(6)
    for r in range(10):
        recs = make_records(r, 40, rng, t0=1000.0)
        again = make_records(r, 20, rng, t0=recs[-1].time + 60, first_step=30)
        if r == 7:
            for x in recs + again:
                x.step_s += 0.2
                x.other_s += 0.2
        write_jsonl(tmp_path / f"steps.rank{r}.jsonl", recs)
        write_jsonl(tmp_path / f"steps.rank{r}.1.jsonl", again)
    assert cli(["report", str(tmp_path), "--no-html"]) == 0
    assert "attempts" in capsys.readouterr().out
    from stepwatch.report.page import MAX_STACKED_RANKS, render_html

    s = summarize(load_run(str(tmp_path)))
    assert s.slowest_rank == 7
    page = render_html(s)
    assert_self_contained(page)
    assert charts(page).count("phases") == MAX_STACKED_RANKS
    assert "phases per step, rank 7" in page  # the straggler is always drawn
    assert "left out" in page
    assert "record # (steps repeat after a restart)" in page
    # Small multiples share one y axis: rank 7's 200 ms extra sets the scale of every chart.
    svgs = re.findall(r'<svg class="chart" data-chart="phases".*?</svg>', page)
    ticks = [re.findall(r'text-anchor="end">([^<]*)<', x) for x in svgs]
    assert len(ticks) == MAX_STACKED_RANKS and all(t == ticks[0] for t in ticks)
    assert "200 ms" in ticks[0]


def test_findings_only_run_reports_without_charts(tmp_path, capsys):
    write_jsonl(tmp_path / "findings.rank0.jsonl", [finding(0, 5, kind="internal_error")])
    assert cli(["report", str(tmp_path), "--html", str(tmp_path / "r.html")]) == 0
    out = capsys.readouterr().out
    assert "internal_error" in out and "run.json missing" in out
    page = (tmp_path / "r.html").read_text()
    assert charts(page) == [] and "No step records" in page


def test_writer_conventions_nonfinite_relaunch_manifest_rank_hosts(tmp_path, capsys):
    """As the records writer does: NaN spelled "nan", run.1.json after a relaunch, rank<R>.json."""
    rows = [StepRecord(step=i, rank=0, time=100.0 + i, step_s=0.1, grad_norm=float(i),
                       scalars={"loss": 1.0}).to_dict() for i in range(5)]
    rows[3]["grad_norm"] = "inf"  # overflow: the news, not an unknown
    rows[4]["scalars"] = {"loss": "nan"}
    rows[4]["mfu"] = "nan"
    write_jsonl(tmp_path / "steps.rank0.jsonl", rows)
    write_manifest(tmp_path, 1, run_id="first-launch")
    (tmp_path / "run.1.json").write_text(json.dumps({"run_id": "second-launch", "end_time": None,
                                                      "dropped_records": 7}))
    (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0, "host": "gpu-node-17"}))
    run = load_run(str(tmp_path))
    assert run.manifest["run_id"] == "second-launch" and run.manifest_name == "run.1.json"
    st = summarize(run).per_rank[0]
    assert st.grad_norm_max == 4.0 and st.grad_norm_nonfinite == 1
    assert np.isnan(st.scalars_last["loss"]) and st.mfu_mean is None
    assert cli(["report", str(tmp_path), "--no-html"]) == 0
    out = capsys.readouterr().out
    assert "gpu-node-17" in out and "(1 non-finite)" in out and "last loss" in out
    assert "still running, or it crashed" in out and "7 record(s) dropped" in out


def test_terminal_splits_wide_tables_instead_of_cutting_numbers(tmp_path):
    import io

    from stepwatch import _terminal as terminal
    from stepwatch.report import tables

    make_run(tmp_path, ranks=3, n=30, mem_peak_bytes=123 * 2**20)
    s = summarize(load_run(str(tmp_path)))
    buf = io.StringIO()
    terminal.render([tables.per_rank(s)], file=buf, width=80)
    text = buf.getvalue()
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    assert "Per rank (means per step) (continued)" in text
    for h in ("rank", "p50", "data wait", "optimizer", "comm exposed", "peak mem"):
        assert h in text
    assert text.count("123 MiB") == 3  # every rank's number whole, none cut
    for r, st in s.per_rank.items():
        assert f"{st.step_mean * 1e3:.3g} ms" in text


def test_any_mix_of_unknown_fields_reports_without_crashing(tmp_path, capsys):
    """Every optional field null at random, all-skipped ranks, a rank of one step, junk lines."""
    rng = np.random.default_rng(7)
    fields = ["step_s", "data_wait_s", "forward_s", "backward_s", "optimizer_s", "other_s",
              "eval_s", "checkpoint_s", "mem_peak_bytes", "flops", "mfu", "hfu", "tokens",
              "grad_norm", "comm_s", "comm_exposed_s", "overlap", "allreduce_s"]
    for r, n in ((0, 120), (1, 1), (2, 30)):
        rows = []
        for x in make_records(r, n, rng, tokens=64, mfu=0.2, grad_norm=1.0, comm_s=0.01,
                              comm_exposed_s=0.002, overlap=0.8, allreduce_s=0.01,
                              mem_peak_bytes=2**30, skipped=(r == 2)):
            d = x.to_dict()
            for k in fields:
                if rng.random() < 0.3:
                    d[k] = None
            rows.append(d)
        write_jsonl(tmp_path / f"steps.rank{r}.jsonl", rows, tail="[1, 2]\n{}\nnull\n")
    assert cli(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "9 unreadable line(s)" in out
    s = summarize(load_run(str(tmp_path)))
    assert s.per_rank[2].skipped == 30 and s.per_rank[2].step_p[50] is None
    assert s.per_rank[1].steps == 1 and s.per_rank[1].wall_s is None
    page = (tmp_path / "report.html").read_text()
    assert_self_contained(page)
    for chart in re.findall(r"<svg.*?</svg>", page):
        assert "nan" not in chart.lower() and "inf" not in chart.lower()  # no broken coordinates
    assert charts(page).count("phases") == 3


# --- columns: how records are held --------------------------------------------------------------


def test_sparse_phases_and_scalars_become_columns_with_unknown_apart_from_recorded_nan(tmp_path):
    rows = []
    for i in range(30):
        phases = {"fetch": 0.002} if i % 3 == 0 else {}
        if i == 4:
            phases["zeta"] = "nan"  # the writer's NaN: known, and it makes the total NaN
        scalars = {"loss": 3.0 - i / 10}
        if i % 10 == 0:
            scalars["lr"] = 1e-3
        if i >= 25:
            scalars["tokens_seen"] = 1_000_000 + i  # an integer stays one on the page
        if i == 29:
            scalars["loss"] = "nan"
        rows.append(StepRecord(step=i, rank=0, time=100.0 + i, step_s=0.1, phases=phases,
                               scalars=scalars).to_dict())
    write_jsonl(tmp_path / "steps.rank0.jsonl", rows)
    c = load_run(str(tmp_path)).columns[0]
    fetch = c.phase("fetch")
    assert np.isnan(fetch.values).tolist() == [i % 3 != 0 for i in range(30)]
    assert fetch.known().sum() == 10
    zeta = c.phase("zeta")
    assert zeta.known().tolist() == [i == 4 for i in range(30)] and np.isnan(zeta.values).all()
    assert c.scalar_names == ["loss", "lr", "tokens_seen"]  # order of first appearance
    assert c.scalar("lr").known().sum() == 3
    st = summarize(load_run(str(tmp_path))).per_rank[0]
    assert st.user_phase_mean["fetch"] == pytest.approx(10 * 0.002 / 30)
    assert np.isnan(st.user_phase_mean["zeta"])
    assert st.scalars_last["tokens_seen"] == 1_000_029
    assert type(st.scalars_last["tokens_seen"]) is int
    assert np.isnan(st.scalars_last["loss"]) and st.scalars_last["lr"] == 1e-3


def test_half_line_rotated_segment_and_a_line_of_another_rank(tmp_path):
    rng = np.random.default_rng(8)
    old = make_records(0, 10, rng, t0=1000.0)
    new = make_records(0, 10, rng, t0=old[-1].time, first_step=10)
    moved = StepRecord(step=3, rank=1, time=1000.5, step_s=0.01)  # rank 1's, in rank 0's file
    half = '{"step": 20, "time": 1.7e9, "st'  # the crash came mid-write
    write_jsonl(tmp_path / "steps.rank0.jsonl", new + [moved], tail=half)
    write_jsonl(tmp_path / "steps.rank0.jsonl.1", old)
    run = load_run(str(tmp_path))
    assert run.bad_lines_by_file == {"steps.rank0.jsonl": 1}
    assert run.ranks == [0, 1]
    assert run.columns[0].step.tolist() == list(range(20))  # the older segment first
    assert run.columns[0].num("step_s").tolist() == [r.step_s for r in old + new]
    assert run.columns[1].step.tolist() == [3]


def test_unchanging_and_never_recorded_fields_cost_no_memory_per_record(tmp_path):
    rng = np.random.default_rng(9)
    recs = make_records(0, 5000, rng, tokens=512)  # more than one chunk of lines
    for i, r in enumerate(recs):
        r.grad_norm = None if i < 4500 else float(i)  # first known past the first chunk
        r.mem_peak_bytes = 2**30 if i < 4200 else 2**31  # changes in the second chunk
    write_jsonl(tmp_path / "steps.rank0.jsonl", recs)
    c = load_run(str(tmp_path)).columns[0]
    assert np.isnan(c.num("mfu")).all() and (c.num("tokens") == 512).all()
    assert c.num("mem_peak_bytes").tolist() == [float(r.mem_peak_bytes) for r in recs]
    g = c.grad_norm
    assert g.known().tolist() == [i >= 4500 for i in range(5000)]
    assert g.values[4500:].tolist() == [float(i) for i in range(4500, 5000)]
    # What varies: time, step, step_s, five phases, memory, grad norm (8 bytes each), skipped (1).
    assert c.nbytes() <= 5000 * (10 * 8 + 1) + 1000


def test_grad_norm_nulls_beside_nans_integers_and_infinities(tmp_path):
    norms = [None, float("nan"), "nan", 3, 2.5, float("inf"), None, 3.0, "many", True]
    lines = [json.dumps({"step": i, "rank": 0, "time": 10.0 + i, "step_s": 0.1, "grad_norm": g})
             for i, g in enumerate(norms)]  # json.dumps writes NaN and Infinity literals
    (tmp_path / "steps.rank0.jsonl").write_text("\n".join(lines) + "\n")
    # Only floats and nulls: a NaN beside a null is still known.
    lines = [json.dumps({"step": i, "time": 10.0 + i, "step_s": 0.1, "grad_norm": g})
             for i, g in enumerate([None, float("nan"), 1.5, None])]
    (tmp_path / "steps.rank1.jsonl").write_text("\n".join(lines) + "\n")
    s = summarize(load_run(str(tmp_path)))
    st = s.per_rank[0]
    assert st.grad_norm_nonfinite == 3  # NaN, "nan", inf; null, "many" and true are unknown
    assert st.grad_norm_max == 3 and type(st.grad_norm_max) is int  # the first maximum, as written
    assert st.grad_norm_last == 3.0
    assert (s.per_rank[1].grad_norm_nonfinite, s.per_rank[1].grad_norm_last) == (1, 1.5)


def test_pooled_ranks_in_time_order_ties_by_rank_then_record_order(tmp_path):
    times = {0: [50.0, 51.0, 52.0, 53.0], 1: [49.0, 50.0, 51.0, 53.0]}
    first = {0: ["b"], 1: ["c", "a"]}  # scalars logged once, before the loss
    for r in range(2):
        rows = []
        for i, t in enumerate(times[r]):
            names = first[r][i:i + 1] if i < len(first[r]) else ["loss"]
            rows.append(StepRecord(step=i, rank=r, time=t, step_s=0.1 + r,
                                   scalars={k: 10.0 * r + i for k in names}).to_dict())
        write_jsonl(tmp_path / f"steps.rank{r}.jsonl", rows)
    s = summarize(load_run(str(tmp_path)))
    # Pooled: 49 r1 (c), 50 r0 (b), 50 r1 (a), 51 r0, 51 r1, 52 r0, 53 r0 (3.0), 53 r1 (13.0).
    assert list(s.overall.scalars_last) == ["c", "b", "a", "loss"]
    assert s.overall.scalars_last["loss"] == 13.0
    assert s.per_rank[0].scalars_last == {"b": 0.0, "loss": 3.0}
    assert s.overall.step_mean == pytest.approx(0.6)


# --- robustness: what a broken, shared or rotated run directory holds (issue 14) -------------------


def test_a_deeply_nested_line_is_skipped_with_a_note_exit_0(tmp_path, capsys):
    make_run(tmp_path, ranks=1, n=20)
    with open(tmp_path / "steps.rank0.jsonl", "a") as f:
        f.write("[" * 100_000 + "]" * 100_000 + "\n")  # json.loads: RecursionError
    (tmp_path / "rank0.json").write_text("{" * 100_000)
    assert cli(["report", str(tmp_path), "--no-html"]) == 0
    assert "1 unreadable line(s) skipped" in capsys.readouterr().out
    (tmp_path / "run.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    assert cli(["report", str(tmp_path), "--no-html"]) == 0
    assert "run.json is unreadable" in capsys.readouterr().out


@pytest.mark.parametrize("key, value", [
    ("features", "all"), ("features", {"training_metrics": "on"}), ("world_size", "two"), ("hosts", 5),
    ("argv", "train.py"), ("versions", [1]), ("config", 3), ("start_time", "noon"), ("end_time", []),
    ("steps", "many"), ("run_id", 7), ("dropped_records", "x"), ("internal_errors", 4), ("attempt", True),
])
def test_a_manifest_field_of_the_wrong_type_is_ignored_with_a_note_exit_0(tmp_path, capsys, key, value):
    make_run(tmp_path, ranks=1, n=20)
    m = json.loads((tmp_path / "run.json").read_text())
    m[key] = value
    (tmp_path / "run.json").write_text(json.dumps(m))
    assert cli(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    if isinstance(value, dict):  # a nested field of the wrong type: no note needed, no crash
        return
    assert f"run.json: {key!r} is" in out and "ignored" in out, out


def _rotating_run(tmp_path, steps):
    """The real records writer with a share small enough to rotate more than once."""
    from stepwatch.context import RunContext
    from stepwatch.exporters.base import Batch
    from stepwatch.exporters.records import RecordsExporter

    run = tmp_path / "run"
    ctx = RunContext(rank=0, local_rank=0, world_size=1, host="h", run_id="r", run_dir=str(run))
    e = RecordsExporter(ctx, budget_bytes=16 * 1024)  # the steps file rotates at 5.6 KiB
    rng = np.random.default_rng(0)
    recs = make_records(0, steps, rng)
    for i in range(0, steps, 10):
        e.export(Batch(records=recs[i:i + 10]))
    e.shutdown()
    write_manifest(run, 1)
    return run


def test_steps_rotated_out_are_named_in_the_report(tmp_path, capsys):
    run = _rotating_run(tmp_path, 400)
    first = min(json.loads(x)["step"] for x in (run / "steps.rank0.jsonl.1").read_text().splitlines())
    assert first > 0  # the writer really dropped the oldest steps
    assert cli(["report", str(run), "--no-html"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"rank 0: steps 0-{first - 1} were rotated out" in out
    assert "STEPWATCH_DISK_BUDGET_MB" in out


def test_one_rotation_that_lost_nothing_says_nothing(tmp_path, capsys):
    run = _rotating_run(tmp_path, 12)  # two segments hold 12 records, not more
    kept = [len((run / n).read_text().splitlines()) for n in ("steps.rank0.jsonl.1", "steps.rank0.jsonl")]
    assert sum(kept) == 12 and kept[1] > 0  # rotated once, every step still there
    assert cli(["report", str(run), "--no-html"]) == 0
    assert "rotated out" not in capsys.readouterr().out


def _resumed_job(sw, steps):
    """A real job resumed at step 1000 (``stepwatch.set_step``: HF Trainer's and Lightning's
    adapters call it on resume) whose steps file rotates within a 1 MB disk budget."""
    import torch

    stepwatch, _, start = sw
    s = start(disk_budget_mb=1, console="off", flush_interval_s=0.05)
    stepwatch.set_step(1000)
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for _ in range(steps):
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    return Path(s.ctx.run_dir)


def test_a_resumed_job_whose_steps_file_rotated_once_lost_nothing(sw, capsys):
    """The report said "rank 0: steps 0-999 were rotated out" of a job resumed at step 1000 whose
    file rotated once and kept every step: it took the first step from run.json's step offset,
    0 after ``set_step``. Each rank's file now says how many steps rotation dropped."""
    run = _resumed_job(sw, 500)
    assert (run / "steps.rank0.jsonl.1").exists()  # it rotated
    kept = [json.loads(x)["step"] for n in ("steps.rank0.jsonl.1", "steps.rank0.jsonl")
            for x in (run / n).read_text().splitlines()]
    assert kept == list(range(1000, 1500))
    assert json.loads((run / "rank0.json").read_text())["steps_rotated_out"] == 0
    assert cli(["report", str(run), "--no-html"]) == 0
    assert "rotated out" not in capsys.readouterr().out


def test_a_resumed_job_that_rotated_steps_out_is_told_how_many(sw, capsys):
    run = _resumed_job(sw, 1500)
    kept = [json.loads(x)["step"] for n in ("steps.rank0.jsonl.1", "steps.rank0.jsonl")
            for x in (run / n).read_text().splitlines()]
    lost = kept[0] - 1000
    assert lost > 0 and kept == list(range(kept[0], 2500))
    assert json.loads((run / "rank0.json").read_text())["steps_rotated_out"] == lost
    assert cli(["report", str(run), "--no-html"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"rank 0: {lost} steps before step {kept[0]} were rotated out" in out, out


def test_two_concurrent_jobs_are_told_apart_from_an_elastic_restart(tmp_path, capsys):
    rng = np.random.default_rng(3)
    shared, restarted = tmp_path / "shared", tmp_path / "restarted"
    a = make_records(0, 30, rng, t0=1000.0)
    b = make_records(0, 30, rng, t0=1000.2)  # a second job, started 0.2 s later in the same dir
    for d, second in ((shared, b), (restarted, make_records(0, 30, rng, t0=a[-1].time + 5, first_step=20))):
        d.mkdir()
        write_jsonl(d / "steps.rank0.jsonl", a)
        write_jsonl(d / "steps.rank0.1.jsonl", second)
        write_manifest(d, 1)
    assert cli(["report", str(shared), "--no-html"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "two jobs ran in this directory at once (not an elastic restart)" in out
    assert "steps.rank0.jsonl and steps.rank0.1.jsonl" in out
    assert cli(["report", str(restarted), "--no-html"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "two jobs" not in out and "elastic restarts" in out


def test_a_tail_record_counts_in_eval_and_checkpoint_totals_not_in_step_times(tmp_path):
    rng = np.random.default_rng(3)
    recs = make_records(0, 40, rng)
    tail = StepRecord(step=40, rank=0, time=recs[-1].time + 30, step_s=0.0, eval_s=20.0, checkpoint_s=5.0, tail=True)
    write_jsonl(tmp_path / "steps.rank0.jsonl", recs + [tail])
    st = summarize(load_run(str(tmp_path))).per_rank[0]
    timed = np.array([r.step_s for r in recs])
    assert st.step_p[50] == pytest.approx(np.percentile(timed, 50), rel=1e-12)
    assert st.eval_total == pytest.approx(sum(r.eval_s for r in recs) + 20.0)
    assert st.checkpoint_total == pytest.approx(sum(r.checkpoint_s for r in recs) + 5.0)
    # No training step: it counted as one (41 steps, range 0-40), and its zeros pulled the
    # steps/s up and the phase and user-phase means down.
    assert (st.steps, st.first_step, st.last_step) == (40, 0, 39)
    assert st.steps_per_s == pytest.approx(40 / timed.sum(), rel=1e-12)
    assert st.phase_mean["forward_s"] == pytest.approx(np.mean([r.forward_s for r in recs]), rel=1e-12)


def test_a_tail_records_user_phase_is_no_steps(tmp_path):
    """A user phase after the last step (``with stepwatch.phase("eval")`` after the loop) is in the
    tail record: not a step's phase, so neither in the per-step mean nor in the share of step time."""
    rng = np.random.default_rng(4)
    recs = make_records(0, 10, rng, phases={"fwd_user": 0.002})
    tail = StepRecord(step=10, rank=0, time=recs[-1].time + 5, step_s=0.0, eval_s=3.0, tail=True,
                      phases={"fwd_user": 3.0})
    write_jsonl(tmp_path / "steps.rank0.jsonl", recs + [tail])
    write_manifest(tmp_path, 1)
    s = summarize(load_run(str(tmp_path)))
    st = s.per_rank[0]
    assert st.steps == 10 and s.overall.steps == 10
    assert st.user_phase_mean["fwd_user"] == pytest.approx(0.002)
    assert st.user_phase_share["fwd_user"] == pytest.approx(0.02 / sum(r.step_s for r in recs))


def test_the_run_table_names_every_feature_that_ran_and_why_one_did_not(tmp_path, capsys):
    """``features on`` listed only the features whose run.json value is ``true``: a 2-rank DDP run
    with the watchdog, captures, comm, memory and training metrics on showed
    "step_tracking, records". A feature's status (a dict) says it ran unless it says it did not."""
    make_run(tmp_path, ranks=1, n=20)
    m = json.loads((tmp_path / "run.json").read_text())
    m["features"] = {
        "step_tracking": True, "nvtx": False, "records": True, "console": "off", "timing_clock": "host",
        "root_modules": ["GPT"], "step_boundary": "optimizer", "module_scan_s": 0.2,
        "gpu_telemetry": {"enabled": True, "running": False, "error": "NVIDIA driver not found"},
        "training_metrics": {"device": "cpu", "peak_tflops": None},
        "comm": {"ddp_models": 1},
        "memory": {"every": 10, "ooms": 0},
        "capture": {"hang_watchdog": {"enabled": True}, "captures": {"taken": 0}},
        "mlflow": {"run_seen": False, "off": False},  # no active MLflow run: did nothing
    }
    (tmp_path / "run.json").write_text(json.dumps(m))
    assert cli(["report", str(tmp_path), "--no-html"]) == 0
    out = capsys.readouterr().out
    on = next(line for line in out.splitlines() if "features on" in line)
    for name in ("step_tracking", "records", "training_metrics", "comm", "memory", "capture"):
        assert name in on, on
    for name in ("nvtx", "gpu_telemetry", "mlflow", "console"):
        assert name not in on, on
    assert "mlflow" not in out
    off = " ".join(line for line in out.splitlines() if "features off" in line or "NVIDIA" in line)
    assert "gpu_telemetry" in off and "NVIDIA driver not found" in off, out


def _ddp_pair(n, *, slow_other_s=0.0, step0_wait=0.0):
    """Two DDP ranks in lockstep: rank 1 does ``slow_other_s`` more work outside the phases each
    step (other_s), which rank 0 waits out in the AllReduce (exposed comm in its backward).
    ``step0_wait``: how long rank 0 waits in step 0 for rank 1's one-off work (a FLOP count,
    which rank 1 keeps out of its own step)."""
    out = {0: [], 1: []}
    t = 1.7e9
    for i in range(n):
        base = 0.004
        t += base + slow_other_s
        for r in (0, 1):
            extra = slow_other_s if r == 1 else 0.0
            wait = slow_other_s - extra + (step0_wait if i == 0 and r == 0 else 0.0)
            step = base + extra + wait
            out[r].append(StepRecord(step=i, rank=r, time=t, step_s=step, data_wait_s=0.0001, forward_s=0.001,
                                     backward_s=0.0015 + wait, optimizer_s=0.001,
                                     other_s=step - 0.0001 - 0.001 - 0.0015 - wait - 0.001,
                                     comm_s=0.001 + wait, comm_exposed_s=wait))
    return out


def test_a_straggler_whose_extra_work_is_outside_the_phases_is_marked(tmp_path, capsys):
    """A rank slow in Python between the hooked phases (its time in other_s): the report's compute
    (forward + backward + optimizer less exposed comm) left other_s out, so neither rank was
    marked while the straggler finding named rank 1. The mark now judges what the straggler
    detector does: step time less data wait and exposed comm, per step, its median."""
    recs = _ddp_pair(120, slow_other_s=0.030)
    for r, rs in recs.items():
        write_jsonl(tmp_path / f"steps.rank{r}.jsonl", rs)
    write_manifest(tmp_path, 2)
    s = summarize(load_run(str(tmp_path)))
    assert s.slowest_compute_rank == 1 and s.slowest_rank is None
    assert cli(["report", str(tmp_path), "--no-html"]) == 0
    assert "* rank 1: most work" in " ".join(capsys.readouterr().out.split())


def test_step_0_alone_marks_no_rank(tmp_path):
    """A balanced job whose rank 0 waited 55 ms in step 0 for rank 1's one-off work (kept out of
    rank 1's own step): the mean step time with step 0 in it marked rank 0 as the slowest. Step 0
    holds the ranks' start-up; the marks judge the steps after it."""
    recs = _ddp_pair(120, step0_wait=0.055)
    assert recs[0][0].step_s > 10 * recs[1][0].step_s
    for r, rs in recs.items():
        write_jsonl(tmp_path / f"steps.rank{r}.jsonl", rs)
    write_manifest(tmp_path, 2)
    s = summarize(load_run(str(tmp_path)))
    assert (s.slowest_rank, s.slowest_compute_rank, s.most_data_wait_rank) == (None, None, None)


WARMUP_JOB = '''
import stepwatch.auto  # noqa: F401
import sys, time
import torch, torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 8 * int(sys.argv[1])

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), torch.randn(1, generator=g)


def slow_start(worker_id):  # rank 1's loader worker takes long to start (an import, a file index)
    time.sleep(1.0)


model = DDP(nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = torch.utils.data.DataLoader(Data(), batch_size=8, num_workers=1,
                                     worker_init_fn=slow_start if rank == 1 else None)
for x, y in loader:
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.1)  # the rest of a step: the worker has the next batch ready long before
dist.destroy_process_group()
'''


@needs_init
def test_a_slow_first_batch_alone_marks_no_rank_for_data_wait(tmp_path):
    """A real 2-rank gloo DDP job whose rank 1 waited a second for its DataLoader worker to start, in
    step 0 only: its mean data wait, step 0 in it, stood out and the report marked rank 1 "most data
    wait" although every later batch was ready at once. Step 0 holds the start-up; the data-wait
    mark judges the steps after it, as the other marks do."""
    import socket

    steps = 40
    (tmp_path / "train.py").write_text(WARMUP_JOB)
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "STEPWATCH_CONSOLE": "off",
                "STEPWATCH_DIR": str(run), "STEPWATCH_GPU_TELEMETRY": "0"})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(port), "train.py", str(steps)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    # The job did what this test is about: rank 1's first batch came late, the others at once.
    waits = {}
    for rank in (0, 1):
        recs = [json.loads(x) for x in (run / f"steps.rank{rank}.jsonl").read_text().splitlines()]
        assert [x["step"] for x in recs] == list(range(steps))
        waits[rank] = [x["data_wait_s"] for x in recs]
    assert waits[1][0] > 0.6 and waits[1][0] > waits[0][0] + 0.5, waits
    assert np.median(waits[1][1:]) < 0.01 and np.median(waits[0][1:]) < 0.01, waits
    s = summarize(load_run(str(run)))
    dw = {r: st.phase_mean["data_wait_s"] for r, st in s.per_rank.items()}
    spread = 0.05 * float(np.median([st.step_mean for st in s.per_rank.values()]))
    assert dw[1] - dw[0] > spread  # with step 0 in the mean, rank 1 stands out
    assert s.most_data_wait_rank is None, (dw, spread)
    p = subprocess.run([sys.executable, "-m", "stepwatch", "report", str(run), "--no-html"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "Per rank" in p.stdout and "most data wait" not in p.stdout


# --- what the CLI hunt of the thirty-second session found -------------------------------------


def test_a_finding_about_other_ranks_is_listed_under_them(tmp_path):
    """The straggler finding is written by rank 0 about rank 1 (``data.ranks``): the Findings
    table's ranks column said 0, pointing on-call at the wrong rank."""
    f = finding(0, 40, kind="straggler", summary="rank 1 computes 30 ms per step vs 12 ms")
    f.data = {"ranks": [1], "subject": "ranks 1"}
    make_run(tmp_path, ranks=2, n=50, findings=[f, finding(1, 45)])
    groups = {g.kind: g for g in summarize(load_run(str(tmp_path))).findings}
    assert groups["straggler"].ranks == [1]
    assert groups["data_loading"].ranks == [1]  # a finding about its own rank: the rank that wrote it


def test_a_rank_without_records_is_named_and_job_figures_say_they_miss_it(tmp_path, capsys):
    """world_size 2 and rank 1's steps file gone (a node's disk lost, a copy that missed it): the
    report said only "ranks with records 0", and the job's tokens/s was rank 0's alone."""
    make_run(tmp_path, ranks=2, n=20, tokens=512)
    (tmp_path / "steps.rank1.jsonl").unlink()
    assert cli(["report", str(tmp_path), "--no-html"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"ranks without records\s+1 \(of world size 2\)", out), out
    assert "count only the ranks with records" in out, out


def test_a_relaunch_into_the_same_directory_starts_at_the_first_launch(tmp_path, capsys):
    """Two launches one after the other into one run dir: "started" was the second launch's start,
    while the step figures and the wall time covered both."""
    make_run(tmp_path, ranks=1, n=10)
    m = json.loads((tmp_path / "run.json").read_text())
    (tmp_path / "run.json").write_text(json.dumps(m | {"start_time": 1.7e9 - 100, "end_time": 1.7e9 + 1}))
    (tmp_path / "run.1.json").write_text(json.dumps(m | {"start_time": 1.7e9 + 50, "end_time": 1.7e9 + 60}))
    assert cli(["report", str(tmp_path), "--no-html"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"started\s+\S+ \S+ UTC \(the first of 2 launches; the last started \S+ \S+ UTC\)", out), out
    import time as _time

    first = _time.strftime("%Y-%m-%d %H:%M:%S", _time.gmtime(1.7e9 - 100))
    assert f"started  {first}" in out or re.search(rf"started\s+{re.escape(first)}", out), out


def test_a_run_dir_whose_path_is_not_utf8_gets_its_summary_and_page(tmp_path, capsys):
    """A run dir named with a byte that is not UTF-8 (a job ran into it fine): the report was a
    traceback writing report.html, with no summary printed."""
    d = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/bad\xffbyte"))
    make_run(d, ranks=1, n=10)
    assert cli(["report", str(d)]) == 0
    out = capsys.readouterr().out
    assert "step time" in out.lower(), out
    page = (d / "report.html").read_bytes()
    assert b"<html" in page.lower()


def test_a_corrupt_huge_time_prints_short():
    """``step_s`` 1e300 in a hand-corrupted record printed a 300-digit number and broke the tables."""
    from stepwatch.report import fmt

    assert fmt.dur(1e300) == "1e+300 s" and fmt.dur(1e30) == "1e+30 s"
    assert fmt.dur(3600.4) == "3600 s" and fmt.dur(12.34) == "12.3 s"


def test_summary_with_many_and_long_scalar_names_keeps_its_numbers_and_the_loss(tmp_path, capsys):
    """A run that logged 20 names, one of them 300 characters long, with ``loss`` late in the
    alphabet: the Summary's value column came out cut ("3.38 ms" for "3.38 ms / 9.1 ms", nothing
    at all past 300 characters), and "last loss" was not among the first eight names."""
    long = "x" * 300
    names = [f"a{i:02d}" for i in range(6)] + [long, "loss"] + [f"z{i:02d}" for i in range(12)]
    rows = [StepRecord(step=i, rank=0, time=100.0 + i, step_s=0.1 * (i + 1),
                       scalars={n: float(i) for n in names}).to_dict() for i in range(5)]
    write_jsonl(tmp_path / "steps.rank0.jsonl", rows)
    write_manifest(tmp_path, 1)
    assert cli(["report", str(tmp_path), "--no-html"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"step time mean / max\s+300 ms / 500 ms\s", out), out
    assert re.search(r"last loss\s+4", out), out
    assert "12 more scalars" in out, out
    assert "last " + "x" * 39 + "…" in out and "x" * 41 not in out  # a long name is cut, with an ellipsis


def test_a_logged_name_that_is_a_records_own_says_it_was_logged(tmp_path, capsys):
    """``stepwatch.log(step=100 + i)``: the Summary said "last step 109" beside "step range 0–9",
    as if the run's steps went to 109. A logged name that is a record field's says "(logged)"."""
    rows = [StepRecord(step=i, rank=0, time=100.0 + i, step_s=0.1,
                       scalars={"step": 100.0 + i, "loss": 1.0}).to_dict() for i in range(10)]
    write_jsonl(tmp_path / "steps.rank0.jsonl", rows)
    write_manifest(tmp_path, 1)
    assert cli(["report", str(tmp_path), "--no-html"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"last step \(logged\)\s+109", out) and re.search(r"last loss\s+1", out), out
    assert not re.search(r"last step\s+109", out), out
