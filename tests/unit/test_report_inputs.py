"""`stepwatch report` on what a run directory may hold besides well-formed records: records the
writer lost (run.json's ``exporter_drops``), files that are no regular file (a FIFO, a link to a
device), manifest numbers out of any range.

Run directories are real files in ``tmp_path``; the report runs as a user runs it (the CLI, a
subprocess where a bug would block or eat the memory).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_report import SRC, cli, make_run, write_manifest

ENV = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           OMP_NUM_THREADS="1")


def report(*argv: str, timeout: float = 60, mem_bytes: int = 2 << 30, cwd: str | None = None,
           ) -> subprocess.CompletedProcess:
    """``python -m stepwatch report ...`` in a subprocess with a time and an address-space limit:
    a report that blocks or reads without end fails the test instead of hanging it or taking the
    machine's memory."""
    def limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))

    return subprocess.run([sys.executable, "-m", "stepwatch", "report", *argv], capture_output=True,
                          text=True, env=ENV, timeout=timeout, preexec_fn=limit, cwd=cwd)


def flat(text: str) -> str:
    """The terminal output with its table padding and line wraps folded to single spaces."""
    return " ".join(text.split())


# --- records the writer lost: run.json's exporter_drops ----------------------------------------

# A job whose records file hits a full disk while one of its own exporters is too slow: the file
# size limit (RLIMIT_FSIZE, what a full disk is to one file) stops the steps file at 40 KB, while
# run.json (3 KB, written through a temporary file) still fits.
_FULL_DISK_JOB = textwrap.dedent("""
    import resource, signal, sys, time
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))
    import stepwatch
    from stepwatch.exporters.base import Exporter

    class Slow(Exporter):
        name = "slow"

        def export(self, batch):
            time.sleep(0.2)

    stepwatch.init(dir=sys.argv[1], run_id="full", exporters=[Slow()], queue_size=64, flush_interval_s=0.01,
                   console="off")
    for i in range(1500):
        stepwatch.step()
        time.sleep(0.001)
    stepwatch.shutdown()
""")


@pytest.mark.skipif(sys.platform != "linux", reason="a full disk made with RLIMIT_FSIZE and SIGXFSZ")
def test_records_a_full_disk_and_a_slow_exporter_lost_are_named_in_the_run_table(tmp_path):
    """The tester's full tmpfs: run.json said 1500 steps and 1355 records lost by the records
    exporter, and the report said "steps 145" with no word of the others."""
    run = tmp_path / "run"
    job = tmp_path / "job.py"
    job.write_text(_FULL_DISK_JOB)
    p = subprocess.run([sys.executable, str(job), str(run)], capture_output=True, text=True, env=ENV, timeout=120)
    assert p.returncode == 0, p.stderr
    m = json.loads((run / "run.json").read_text())
    lost, slow = m["exporter_drops"]["records"]["records"], m["exporter_drops"]["slow"]["records"]
    in_file = len((run / "steps.rank0.jsonl").read_text().splitlines())
    assert m["steps"] == 1500 and lost > 0 and slow > 0, m
    # what the writer counted is what is missing (with what the queue of 64 dropped on a loaded machine)
    assert in_file == 1500 - lost - m["dropped_records"]

    r = report(str(run))
    assert r.returncode == 0, r.stderr
    out = flat(r.stdout)
    assert f"rank 0: {lost} of its 1500 step records are not in its steps file" in out, out
    assert "run.json exporter_drops" in out and "the figures below leave those steps out" in out, out
    # (and the findings it lost, when a pass's findings came while its queue was full: under load)
    assert re.search(rf"Other exporters lost on rank 0: slow {slow} records(, \d+ findings)? \(.*\)\. Missing from those "
                     r"exporters' destinations only: this report reads the records file", out), out
    page = flat((run / "report.html").read_text())
    assert f"rank 0: {lost} of its 1500 step records are not in its steps file" in page
    assert f"slow {slow} records" in page


def test_only_another_exporter_lost_records_the_report_says_its_figures_stand(tmp_path, capsys):
    make_run(tmp_path, ranks=1, n=20)
    m = json.loads((tmp_path / "run.json").read_text())
    m |= {"steps": 20, "exporter_drops": {"bad": {"records": 200, "findings": 3}, "otlp": {"points": 7}}}
    (tmp_path / "run.json").write_text(json.dumps(m))
    assert cli(["report", str(tmp_path), "--no-html"]) == 0
    out = flat(capsys.readouterr().out)
    assert "Other exporters lost on rank 0: bad 200 records, 3 findings; otlp 7 points" in out, out
    assert "not in its steps file" not in out


def test_the_records_file_losing_findings_alone_is_said(tmp_path, capsys):
    make_run(tmp_path, ranks=2, n=20)
    m = json.loads((tmp_path / "run.json").read_text())
    m |= {"exporter_drops": {"records": {"findings": 4}}}
    (tmp_path / "run.json").write_text(json.dumps(m))
    assert cli(["report", str(tmp_path), "--no-html"]) == 0
    out = flat(capsys.readouterr().out)
    assert "rank 0: 4 findings are not in its findings file" in out, out
    assert "the other ranks' losses are not in run.json" in out, out


@pytest.mark.parametrize("drops", [
    5, "many", [1], {"records": 7}, {"records": {"records": "x"}}, {"records": {"records": -3}},
    {"records": {"records": True}}, {"x": {"records": 10**400}}, {"x" * 500: {"records": 1}}, {"records": {}},
])
def test_exporter_drops_of_any_shape_never_breaks_the_report(tmp_path, capsys, drops):
    """A hand-edited or corrupt exporter_drops: a wrong type is a note; within it, an entry that
    is no count is left out, and the others are still said."""
    make_run(tmp_path, ranks=1, n=20)
    m = json.loads((tmp_path / "run.json").read_text())
    if isinstance(drops, dict):
        drops = drops | {"good": {"records": 5}}
    (tmp_path / "run.json").write_text(json.dumps(m | {"exporter_drops": drops}))
    assert cli(["report", str(tmp_path)]) == 0
    out = flat(capsys.readouterr().out)
    if isinstance(drops, dict):
        assert "Other exporters lost on rank 0:" in out and "good 5 records" in out, out
        assert "not in its steps file" not in out, out
    else:
        assert "run.json: 'exporter_drops' is" in out and "ignored" in out, out
    assert "x" * 100 not in out  # a long name is cut
    assert "0" * 50 not in out  # a count no job reaches is not printed


# --- files that are no regular file -----------------------------------------------------------


def test_a_fifo_named_like_a_steps_file_is_skipped_with_a_note(tmp_path):
    """A FIFO named steps.rank0.jsonl: the report blocked forever opening it."""
    make_run(tmp_path, ranks=2, n=20)
    (tmp_path / "steps.rank0.jsonl").unlink()
    os.mkfifo(tmp_path / "steps.rank0.jsonl")
    r = report(str(tmp_path), "--no-html", timeout=30)
    assert r.returncode == 0, r.stderr
    out = flat(r.stdout)
    assert "steps.rank0.jsonl: not a regular file (a FIFO): skipped" in out, out
    assert re.search(r"ranks with records 1\b", out), out


def test_every_file_the_report_reads_refuses_a_fifo(tmp_path):
    """run.json, rank<R>.json, the findings and the watchdog's findings as FIFOs: each blocked."""
    make_run(tmp_path, ranks=1, n=20)
    for name in ("run.json", "rank0.json", "findings.rank0.jsonl", "findings.watchdog.rank0.jsonl"):
        (tmp_path / name).unlink(missing_ok=True)
        os.mkfifo(tmp_path / name)
    r = report(str(tmp_path), "--no-html", timeout=30)
    assert r.returncode == 0, r.stderr
    out = flat(r.stdout)
    for name in ("run.json", "rank0.json", "findings.rank0.jsonl", "findings.watchdog.rank0.jsonl"):
        assert f"{name}: not a regular file (a FIFO): skipped" in out, (name, out)
    assert "Summary (all ranks)" in out and "Traceback" not in r.stderr


def test_a_fifo_among_the_captures_analyses_does_not_block_the_report(tmp_path):
    """captures/capture-1-steps0-5.rank0.analysis.json as a FIFO blocked the report forever (read
    with a plain open by the captures' reader, traces/rundir.py): it is skipped like a file that is
    not JSON."""
    make_run(tmp_path, ranks=1, n=20)
    (tmp_path / "captures").mkdir()
    os.mkfifo(tmp_path / "captures" / "capture-1-steps0-5.rank0.analysis.json")
    r = report(str(tmp_path), "--no-html", timeout=30)
    assert r.returncode == 0, r.stderr
    assert "Summary (all ranks)" in flat(r.stdout) and "Traceback" not in r.stderr


def test_a_link_to_a_device_is_refused_a_link_to_a_file_is_read(tmp_path):
    """steps.rank0.jsonl -> /dev/zero was read without end (MemoryError). A link to a regular file
    is read: a run directory gathered from the nodes' disks with links is the user's own choice;
    one to nothing (that node's disk not mounted) is a note, not the end of the report."""
    make_run(tmp_path / "elsewhere", ranks=2, n=20)
    run = tmp_path / "run"
    run.mkdir()
    write_manifest(run, 2)
    (run / "steps.rank0.jsonl").symlink_to("/dev/zero")
    (run / "steps.rank1.jsonl").symlink_to(tmp_path / "elsewhere" / "steps.rank1.jsonl")
    (run / "findings.rank2.jsonl").symlink_to(tmp_path / "unmounted" / "findings.rank2.jsonl")
    r = report(str(run), "--no-html", timeout=60, mem_bytes=2 << 30)
    assert r.returncode == 0, r.stderr
    out = flat(r.stdout)
    assert "steps.rank0.jsonl: not a regular file (a character device, through a link): skipped" in out, out
    assert "findings.rank2.jsonl: a link to " in out and "unmounted" in out and "which does not exist" in out, out
    assert re.search(r"ranks with records 1\b", out) and re.search(r"\bsteps 20\b", out), out


def test_a_run_dir_of_fifos_only_is_an_error_naming_them(tmp_path):
    os.mkfifo(tmp_path / "steps.rank0.jsonl")
    r = report(str(tmp_path), "--no-html", timeout=30)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert str(tmp_path) in r.stderr and "steps.rank0.jsonl: not a regular file (a FIFO)" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_run_dir_given_through_a_link_and_a_directory_named_like_a_file(tmp_path, capsys):
    make_run(tmp_path / "real", ranks=2, n=20)
    (tmp_path / "real" / "findings.rank1.jsonl").unlink()
    (tmp_path / "real" / "findings.rank1.jsonl").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert cli(["report", str(tmp_path / "link"), "--no-html"]) == 0
    out = flat(capsys.readouterr().out)
    assert "findings.rank1.jsonl: not a regular file (a directory): skipped" in out, out
    assert re.search(r"ranks with records 0, 1\b", out), out


def test_an_endless_line_is_skipped_without_holding_it(tmp_path):
    """A torn file whose tail is one 'line' of zeros (a crash on a file system that leaves the
    unwritten blocks as NULs): the line is skipped and counted, read in bounded pieces."""
    make_run(tmp_path, ranks=1, n=20)
    with open(tmp_path / "steps.rank0.jsonl", "ab") as f:
        f.truncate(f.tell() + (384 << 20))  # a sparse tail: reads as NULs, takes no disk
    # 384 MB in one line: read whole (twice that while the pieces are joined) it does not fit in
    # the limit beside the report's own ~300 MB
    r = report(str(tmp_path), "--no-html", timeout=120, mem_bytes=768 << 20)
    assert r.returncode == 0, r.stderr[-2000:]
    out = flat(r.stdout)
    assert "1 unreadable line(s) skipped" in out and re.search(r"\bsteps 20\b", out), out


# --- manifest numbers out of any range ---------------------------------------------------------


@pytest.mark.parametrize("key, value", [
    ("start_time", 1e20), ("start_time", 10**30), ("start_time", -5.0), ("start_time", 0),
    ("start_time", float("inf")), ("start_time", float("nan")), ("end_time", 1e300), ("end_time", float("-inf")),
    ("world_size", -3), ("world_size", 0), ("world_size", 10**30), ("steps", -1), ("steps", 10**30),
    ("dropped_records", -2), ("dropped_records", 10**30), ("attempt", -1), ("schema_version", 10**30),
])
def test_a_manifest_number_out_of_range_is_ignored_with_a_note_exit_0(tmp_path, capsys, key, value):
    """``"start_time": 1e20`` was a traceback (OverflowError from time.gmtime), exit 1."""
    make_run(tmp_path, ranks=1, n=20)
    m = json.loads((tmp_path / "run.json").read_text())
    m |= {"start_time": 1.7e9, "end_time": 1.7e9 + 60, key: value}
    (tmp_path / "run.json").write_text(json.dumps(m))  # NaN and Infinity as Python's json writes them
    assert cli(["report", str(tmp_path)]) == 0
    out = flat(capsys.readouterr().out)
    assert f"run.json: {key!r} is" in out and "ignored" in out, out
    assert "9" * 20 not in out and "0" * 20 not in out


def test_out_of_range_numbers_in_the_other_manifests_are_not_fatal(tmp_path, capsys):
    """The first launch's run.json and a rank's file are read too; a huge step offset and internal
    error count as well."""
    make_run(tmp_path, ranks=1, n=20)
    m = json.loads((tmp_path / "run.json").read_text())
    (tmp_path / "run.json").write_text(json.dumps(m | {"start_time": -1e300, "config": {"step_offset": 10**30}}))
    (tmp_path / "run.1.json").write_text(json.dumps(m | {"start_time": 1.7e9, "internal_errors": {"x": 10**40}}))
    (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0, "host": "h", "attempt": 10**40, "end_time": None}))
    (tmp_path / "rank0.1.json").write_text(json.dumps({"rank": 0, "host": "h", "attempt": 1, "end_time": 1e300,
                                                      "ended_by": "SIGTERM"}))
    assert cli(["report", str(tmp_path)]) == 0
    out = flat(capsys.readouterr().out)
    assert "0" * 20 not in out, out


# --- --compare's default page name ---------------------------------------------------------------


def test_compare_with_dot_names_the_page_after_the_directory(tmp_path, monkeypatch, capsys):
    """``stepwatch report ../base --compare .`` wrote ``compare-..html``."""
    make_run(tmp_path / "base", ranks=1, n=10)
    make_run(tmp_path / "tuned", ranks=1, n=10, seed=1)
    monkeypatch.chdir(tmp_path / "tuned")
    assert cli(["report", "../base", "--compare", "."]) == 0
    assert (tmp_path / "base" / "compare-tuned.html").is_file()
    assert not (tmp_path / "base" / "compare-..html").exists()
    monkeypatch.chdir(tmp_path / "base")
    assert cli(["report", ".", "--compare", "../tuned/."]) == 0
    assert (tmp_path / "base" / "compare-tuned.html").is_file()


_REPORT_AS_NOBODY = r'''
import contextlib, io, os, sys
from stepwatch.cli import main
# The report's modules imported as root first: nobody may not read the sources (a fresh clone
# in a 0700 temporary folder), and stepwatch imports its commands' modules lazily.
with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
    main(["report", "/nonexistent-run-dir", "--no-html"])
err = io.StringIO()
os.setgroups([]); os.setgid(65534); os.setuid(65534)  # real ids too: the report asks os.getuid()
with contextlib.redirect_stderr(err):
    rc = main(["report", sys.argv[1], "--no-html"])
sys.stdout.write(f"{rc}\n{err.getvalue()}")
'''


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="switches to another user (needs root)")
def test_a_shared_run_dir_another_user_wrote_into_says_whose_it_is():
    """A shared run dir (1777) that another user's job wrote into its private-<uid>/ (0700):
    ``stepwatch report`` said it had no record files, and no more. It names the folder and says
    to run the report as that user. The job's user here is root, the reader ``nobody``."""
    import shutil
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="sw-shared-", dir="/tmp"))
    try:
        top.chmod(0o1777)
        mine = top / "private-0"
        make_run(mine, ranks=1, n=5)
        mine.chmod(0o700)
        out = subprocess.run([sys.executable, "-c", _REPORT_AS_NOBODY, str(top)], capture_output=True, text=True,
                             timeout=120, cwd="/", env=ENV)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    rc, _, err = out.stdout.partition("\n")
    assert rc == "2" and "Traceback" not in err + out.stderr, (out.stdout, out.stderr)
    assert "has no steps.rank<R>.jsonl" in err and "private-0/ holds another user's run" in err, err
    assert "run the report as that user" in err, err
