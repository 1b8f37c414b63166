"""``stepwatch run``'s signals and ``stepwatch dump``'s target: real runner processes, real
commands, real signals."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from stepwatch.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _runner(tmp_path, child_code):
    """``stepwatch run -- python child.py`` in a session of its own (the signals below go to the
    runner alone), once the command runs."""
    ready = tmp_path / "ready"
    child = tmp_path / "child.py"
    child.write_text("import os, signal, sys, time\n" + child_code +
                     f"open({str(ready)!r}, 'w').write(str(os.getpid()))\n"
                     "for _ in range(300):\n    time.sleep(0.1)\n")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), STEPWATCH_ENABLED="0")
    # no core file where the runner, or the command, dies of SIGQUIT
    p = subprocess.Popen([sys.executable, "-m", "stepwatch", "run", "--", sys.executable, str(child)],
                         env=env, start_new_session=True, cwd=tmp_path,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
    for _ in range(200):
        if ready.exists() and ready.read_text():
            return p, int(ready.read_text())
        time.sleep(0.05)
    p.kill()
    raise AssertionError("the command did not start")


@contextlib.contextmanager
def _running(tmp_path, child_code):
    """``_runner``, both processes killed at the end whatever the test did."""
    p, child = _runner(tmp_path, child_code)
    try:
        yield p, child
    finally:
        for pid in (child, p.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait(timeout=10)


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_sighup_to_the_runner_reaches_the_command(tmp_path):
    """``kill -HUP <stepwatch run pid>`` killed the runner (status 129) and left the command
    training on, orphaned. Forwarded now, as SIGTERM (and as a shell resends it to its jobs): the
    command's handler runs, and the runner's status is the command's."""
    sig = signal.SIGHUP
    with _running(tmp_path, f"signal.signal({int(sig)}, lambda n, f: os._exit(40 + n))\n") as (p, child):
        os.kill(p.pid, sig)  # the runner alone, as `kill -HUP <pid>`
        assert p.wait(timeout=30) == 40 + sig
        assert _gone(child)


def test_sigquit_to_the_runner_leaves_no_orphan(tmp_path):
    """``kill -QUIT <stepwatch run pid>`` killed the runner (status 131) and left the command
    orphaned. SIGQUIT is the terminal's Ctrl-\\, which reaches the command too: the runner outlives
    it, as SIGINT, and goes on waiting for the command, whose status it returns."""
    with _running(tmp_path, "") as (p, child):
        os.kill(p.pid, signal.SIGQUIT)  # the runner alone
        time.sleep(1.0)
        assert p.poll() is None and not _gone(child)  # neither ended: the runner still waits
        os.kill(child, signal.SIGTERM)
        assert p.wait(timeout=30) == 128 + signal.SIGTERM
        assert _gone(child)


def test_a_command_killed_by_a_forwarded_sighup_is_said_as_the_shell_would(tmp_path):
    """The command dies of SIGHUP's default action: the runner exits 128 + 1, as a shell reports it."""
    with _running(tmp_path, "") as (p, child):
        os.kill(p.pid, signal.SIGHUP)
        assert p.wait(timeout=30) == 128 + signal.SIGHUP
        assert _gone(child)


def test_dump_of_an_all_digit_run_directory_is_that_run_directory(tmp_path, monkeypatch, capsys):
    """``STEPWATCH_DIR=runs/20261207`` then ``cd runs; stepwatch dump 20261207``: taken for a pid
    ("no process with pid 20261207"), although the directory exists. A directory of that name is
    the run directory; a number that names none is still a pid."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "20261207").mkdir()
    assert main(["dump", "20261207"]) == 2
    assert capsys.readouterr().err == "stepwatch dump: no running rank of 20261207 on this host (read from its rank<R>.json files)\n"
    assert main(["dump", "99999999"]) == 2  # above any pid_max: no such directory, no such process
    assert capsys.readouterr().err == "stepwatch dump: no process with pid 99999999\n"
