"""`stepwatch ... | head`: a reader that stops early ends a command quietly, as it ends `git log`.

Each command runs as a user runs it (``python -m stepwatch``, its output into a pipe), and the
reader closes the pipe after a few lines (or before the first, for the commands whose output is
short or written at once). The pipe is made as small as Linux allows (one page), and each
command's whole output is checked to be larger than the pipe and the lines read, so the command
is still writing when the reader goes: what happens then is what this tests.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_report import make_run

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "tests" / "unit" / "data" / "gloo_ddp_cpu_capture.rank1.trace.json.gz"
READER_GONE = 128 + signal.SIGPIPE  # 141, as a shell reports `git log | head`'s git
fcntl = pytest.importorskip("fcntl")
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux; the constant is in fcntl from 3.10


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update(PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    return env


def _stepwatch(argv):
    return [sys.executable, "-m", "stepwatch", *map(str, argv)]


def _into_pipe_closed_after(argv, lines, before=lambda: None):
    """``stepwatch ARGV | head -LINES`` (``before()`` called first): (exit status, the lines read,
    stderr). With ``lines`` 0 the reader is gone before the command starts."""
    whole = subprocess.run(_stepwatch(argv), capture_output=True, env=_env(), timeout=300)
    assert whole.returncode == 0, whole.stderr.decode()[-2000:]
    r, w = os.pipe()
    try:
        size = fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    except OSError:
        pytest.skip("cannot make a pipe of one page here (Linux's F_SETPIPE_SZ)")
    before()
    p = subprocess.Popen(_stepwatch(argv), stdout=w, stderr=subprocess.PIPE, env=_env())
    os.close(w)
    got = b""
    while got.count(b"\n") < lines:  # one byte at a time: nothing past the lines is taken out
        b = os.read(r, 1)
        if not b:
            break
        got += b
    os.close(r)
    _, err = p.communicate(timeout=300)
    assert whole.stdout.startswith(got)
    # More than the pipe holds was left to write when the reader went: the command met it gone.
    assert len(whole.stdout) > (size + len(got) if lines else 0), "this would test nothing"
    return p.returncode, got.decode(), err.decode()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    make_run(d, ranks=16, n=200)
    return d


@pytest.mark.parametrize("argv, lines", [
    (["report", "{run}", "--no-html"], 3),
    (["report", "{run}", "--compare", "{run}", "--no-html"], 3),
    (["trace", TRACE], 3),
    (["trace", "--json", TRACE], 3),
    # One write each: a reader that goes in the middle of it takes a part and Python drops the rest
    # without a word (a partial write), so the reader is gone before the command starts.
    (["rules"], 0),
    (["dashboard"], 0),
    # Less than a page of output: the same.
    (["doctor", "--no-attach"], 0),
    (["doctor", "--json", "--no-attach"], 0),
], ids=lambda v: " ".join(map(str, v)) if isinstance(v, list) else None)
def test_a_reader_that_stops_early_ends_the_command_quietly(run_dir, argv, lines):
    argv = [str(a).format(run=run_dir) for a in argv]
    rc, got, err = _into_pipe_closed_after(argv, lines)
    assert err == ""  # no traceback, no "Exception ignored", no error message
    assert rc == READER_GONE
    assert got.count("\n") == lines


def test_report_into_head_still_writes_its_html_report(tmp_path):
    """`stepwatch report RUN | head -3`: the summary is cut, but RUN/report.html, which the
    command writes unasked, is there and whole -- not missing, not a stale one of before."""
    make_run(tmp_path, ranks=16, n=200)
    page = tmp_path / "report.html"
    rc, got, err = _into_pipe_closed_after(["report", tmp_path], 3,
                                           before=lambda: page.write_text("a stale report of before"))
    assert (rc, err) == (READER_GONE, "")
    assert got.startswith("Run")
    text = page.read_text()
    assert text.rstrip().endswith("</html>") and "Per rank" in text
    assert json.loads((tmp_path / "run.json").read_text())["run_id"] in text


def test_an_ascii_only_stdout_gets_the_report_with_its_characters_replaced(run_dir):
    """A minimal container's C locale (``LC_ALL=C``, no UTF-8 mode): stdout's encoding is ASCII,
    and the report's dashes and ellipses ended the command with a UnicodeEncodeError traceback."""
    env = {**_env(), "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": "ascii"}
    p = subprocess.run(_stepwatch(["report", run_dir, "--no-html"]), capture_output=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    assert p.stderr == b""
    out = p.stdout.decode("ascii")  # what reached the terminal is ASCII
    assert out.startswith("Run") and "Per rank" in out


def test_a_full_or_closed_stdout_gets_one_line_not_a_traceback(run_dir):
    """``stepwatch report RUN > /dev/full`` (a full disk) said so in a traceback; with stdout
    closed (``>&-``) the command died of ``None.flush()``."""
    argv = _stepwatch(["report", run_dir, "--no-html"])
    with open("/dev/full", "w") as full:
        p = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, env=_env(), timeout=300)
    err = p.stderr.decode()
    assert p.returncode == 1
    assert err.strip() == "stepwatch: cannot write to standard output: [Errno 28] No space left on device", err
    p = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env(), timeout=300,
                       preexec_fn=lambda: os.close(1))
    err = p.stderr.decode()
    assert p.returncode == 1
    assert err.strip() == "stepwatch: cannot write to standard output: it is closed", err
