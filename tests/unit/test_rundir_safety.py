"""Run-directory safety: nothing is written through a link planted in the run directory, and a
run directory that others own or may write to is not used as is (stepwatch/_files.py)."""

import json
import logging
import os
import stat
import threading

import pytest
import torch
import torch.nn as nn

from stepwatch import _files

VICTIM_TEXT = "outside the run dir: must stay as it is\n"


def _train(steps):
    torch.manual_seed(0)
    m = nn.Linear(8, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(steps):
        m(torch.randn(4, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture
def victim(tmp_path):
    v = tmp_path / "outside" / "victim.txt"
    v.parent.mkdir()
    v.write_text(VICTIM_TEXT)
    v.chmod(0o644)
    return v


def _unchanged(v):
    assert v.read_text() == VICTIM_TEXT
    assert stat.S_IMODE(os.stat(v).st_mode) == 0o644


def test_session_writes_nothing_through_links_planted_in_the_run_dir(sw, tmp_path, victim):
    """Links at every name a rank writes by a predictable name: the manifests' temporary files,
    the SIGUSR1 stack file (appended to), the records, the capture folder."""
    stepwatch, mem, start = sw
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    pid = os.getpid()
    planted = ["rank0.json.tmp%d" % pid, "run.json.tmp%d" % pid, "sigusr1.rank0.txt",
               "findings.watchdog.rank0.jsonl", "steps.rank0.jsonl"]
    for name in planted:
        os.symlink(victim, run / name)
    os.symlink(victim.parent, run / "captures")
    start(dir=str(run), watchdog="on", capture="off")
    _train(3)
    stepwatch.shutdown()
    _unchanged(victim)
    assert os.listdir(victim.parent) == ["victim.txt"]
    for name in planted:
        assert os.path.islink(run / name) or not os.path.lexists(run / name), name
    # the job's records still went somewhere of ours
    mine = [n for n in os.listdir(run) if n.startswith("steps.rank0") and not os.path.islink(run / n)]
    assert len(mine) == 1
    assert [json.loads(x)["step"] for x in (run / mine[0]).read_text().splitlines()] == [0, 1, 2]
    assert json.loads((run / "run.json").read_text())["steps"] == 3


def test_append_refuses_a_link_and_a_fifo(tmp_path, victim):
    link = tmp_path / "sigusr1.rank0.txt"
    os.symlink(victim, link)
    with pytest.raises(PermissionError, match="link"):
        _files.open_private(str(link), exclusive=False)
    fifo = tmp_path / "findings.watchdog.rank0.jsonl"
    os.mkfifo(fifo)
    done = []
    # a FIFO with no reader would block a plain open(O_WRONLY) for ever
    th = threading.Thread(target=lambda: done.append(pytest.raises(OSError, _files.open_private, str(fifo), exclusive=False)))
    th.start()
    th.join(10)
    assert done, "open_private blocked on a FIFO"
    _unchanged(victim)


def test_atomic_write_replaces_a_link_instead_of_writing_through_it(tmp_path, victim):
    target = tmp_path / "rank0.json"
    os.symlink(victim, target)
    # the predictable temporary names of before, planted too
    os.symlink(victim, tmp_path / f"rank0.json.tmp{os.getpid()}")
    _files.write_json_private(str(target), {"rank": 0})
    _unchanged(victim)
    assert not os.path.islink(target)
    assert json.loads(target.read_text()) == {"rank": 0}
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600


def test_subdir_refuses_a_link(tmp_path, victim):
    os.symlink(victim.parent, tmp_path / "hang-1")
    with pytest.raises(PermissionError):
        _files.private_subdir(str(tmp_path / "hang-1"))
    assert stat.S_IMODE(os.stat(_files.private_subdir(str(tmp_path / "hang-2"))).st_mode) == 0o700


def _run_into(run_dir, steps, sw, caplog):
    """A session with ``dir=run_dir`` trains ``steps`` steps and shuts down; stepwatch's log lines
    go to ``caplog`` meanwhile."""
    stepwatch, _, start = sw
    logging.getLogger("stepwatch").addHandler(caplog.handler)
    try:
        start(dir=str(run_dir))
        _train(steps)
        stepwatch.shutdown()
    finally:
        logging.getLogger("stepwatch").removeHandler(caplog.handler)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "private subfolder" in r.getMessage()]


@pytest.mark.parametrize("kind", ["group-writable", "world-writable", "other-owner"])
def test_a_shared_or_foreign_run_dir_gets_one_warning_and_a_private_subfolder(sw, tmp_path, caplog, kind):
    run = tmp_path / "shared"
    run.mkdir()
    if kind == "other-owner":
        if os.getuid() != 0:
            pytest.skip("needs root to give the directory to another user")
        run.chmod(0o755)
        os.chown(run, 65534, 65534)
    else:
        run.chmod(0o770 if kind == "group-writable" else 0o777)
    _run_into(run, 2, sw, caplog)
    sub = run / f"private-{os.getuid()}"
    assert len(_warnings(caplog)) == 1, _warnings(caplog)
    assert os.listdir(run) == [sub.name]
    st = os.lstat(sub)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    assert len((sub / "steps.rank0.jsonl").read_text().splitlines()) == 2
    from stepwatch.report import load_run

    assert load_run(str(run)).path == str(sub)  # `stepwatch report <the dir given>` finds it


def test_a_planted_private_subfolder_is_refused_and_the_job_goes_on(sw, tmp_path, victim, caplog):
    mem = sw[1]
    run = tmp_path / "shared"
    run.mkdir()
    run.chmod(0o777)
    os.symlink(victim.parent, run / f"private-{os.getuid()}")
    _run_into(run, 2, sw, caplog)
    assert len(mem.records) == 2
    assert os.listdir(victim.parent) == ["victim.txt"]
    _unchanged(victim)
    assert any("going on without files" in r.getMessage() for r in caplog.records)



def test_report_html_is_not_written_through_a_planted_link(tmp_path, victim):
    """`stepwatch report` writes report.html into the run dir: a link at its temporary name of
    before (``report.html.tmp<pid>``) or at its name must not carry the page elsewhere."""
    from test_report import cli, make_run

    run = tmp_path / "run"
    make_run(run, ranks=1, n=20)
    os.symlink(victim, run / f"report.html.tmp{os.getpid()}")
    os.symlink(victim, run / "report.html")
    assert cli(["report", str(run)]) == 0
    _unchanged(victim)
    assert not os.path.islink(run / "report.html")
    assert "<html" in (run / "report.html").read_text().lower()


def test_reads_refuse_a_link_and_a_fifo_and_are_bounded(tmp_path, victim):
    """What the job reads back from its run directory: never through a link, never from a FIFO
    (a plain open(O_RDONLY) of a FIFO blocks until someone writes), at most max_bytes."""
    link = tmp_path / "rank1.json"
    os.symlink(victim, link)
    with pytest.raises(PermissionError, match="link"):
        _files.read_private(str(link))
    fifo = tmp_path / "watchdog.rank1.json"
    os.mkfifo(fifo)
    done = []
    th = threading.Thread(target=lambda: done.append(pytest.raises(OSError, _files.read_json_private, str(fifo))),
                          daemon=True)
    th.start()
    th.join(10)
    assert done, "read_private blocked on a FIFO"
    big = tmp_path / "progress.rank0.json"
    big.write_text("x" * 5000)
    assert _files.read_private(str(big), max_bytes=100) == "x" * 100
    assert _files.read_private(str(big), offset=4990) == "x" * 10


def test_a_fifo_planted_where_the_job_reads_other_ranks_files_does_not_hang_shutdown(tmp_path):
    """A FIFO at every name the job reads back at shutdown (other ranks' manifests and watchdog
    notes, comm timelines): the job ends within its shutdown budget and writes run.json."""
    import subprocess
    import sys

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    for name in ("rank1.json", "watchdog.rank1.json", "comm_timeline.rank1.json", "checkpointing.rank1.json"):
        os.mkfifo(run / name)
    code = (
        "import torch, torch.nn as nn, stepwatch\n"
        f"stepwatch.init(dir={str(run)!r}, watchdog='on', capture='off')\n"
        "m = nn.Linear(4, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "stepwatch.shutdown()\n"
    )
    p = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads((run / "run.json").read_text())["steps"] == 3


@pytest.mark.parametrize("mode", [0o644, 0o600])
def test_a_run_dir_that_is_a_file_gets_one_warning_that_says_so(sw, tmp_path, caplog, mode):
    """``STEPWATCH_DIR`` naming a file: the first warning said the directory "is writable by other
    users" (for a 0644 file), then the records file and the manifest (twice) each warned again:
    four or five lines. One now, naming the setting and what is wrong; the file is untouched and
    the exporters still get every record."""
    mem = sw[1]
    f = tmp_path / "afile"
    f.write_text("mine\n")
    f.chmod(mode)
    _run_into(f, 3, sw, caplog)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and str(f) in r.getMessage()]
    assert len(warned) == 1, warned
    assert "not a directory" in warned[0] and "STEPWATCH_DIR" in warned[0] and "writable" not in warned[0]
    assert f.read_text() == "mine\n" and len(mem.records) == 3
