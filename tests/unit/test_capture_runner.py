"""`stepwatch run`: the argument list and environment it builds, and its errors
(tests/integration/test_dump.py runs it for real)."""

import os
import sys

import pytest

from stepwatch.cli import main
from stepwatch.runner import cli as runner

ENV = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": "/elsewhere"}


def test_torchrun_commands_enable_only_the_ranks():
    argv, env = runner.build(["--", "torchrun", "--nproc-per-node", "2", "train.py"], nsys=False, nsys_ranges=5,
                             run_dir=None, environ=ENV)
    assert argv == ["torchrun", "--nproc-per-node", "2", "train.py"]
    assert env["STEPWATCH_RUN_MODE"] == "ranks"
    parts = env["PYTHONPATH"].split(os.pathsep)
    assert parts[0] == runner.SHIM and parts[-1] == "/elsewhere"
    _, env = runner.build([sys.executable, "-m", "torch.distributed.run", "x.py"], nsys=False, nsys_ranges=5,
                          run_dir="r", environ=ENV)
    assert env["STEPWATCH_RUN_MODE"] == "ranks" and env["STEPWATCH_DIR"] == os.path.abspath("r")
    _, env = runner.build(["python", "train.py"], nsys=False, nsys_ranges=5, run_dir=None, environ=ENV)
    assert env["STEPWATCH_RUN_MODE"] == "top"


def test_nsys_wraps_the_command_or_says_it_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="nsys.*not on PATH.*without --nsys"):
        runner.build(["python", "t.py"], nsys=True, nsys_ranges=5, run_dir=None, environ={"PATH": str(tmp_path)})
    fake = tmp_path / "nsys"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    argv, env = runner.build(["torchrun", "t.py"], nsys=True, nsys_ranges=3, run_dir=str(tmp_path / "r"),
                             environ={"PATH": str(tmp_path)})
    assert argv[:2] == [str(fake), "profile"] and "--capture-range=cudaProfilerApi" in argv
    assert "--capture-range-end=repeat:3" in argv and argv[-2:] == ["torchrun", "t.py"]
    assert env["STEPWATCH_NSYS"] == "1"
    # one report per node and nsys process, in a private folder of the run dir
    import socket
    import stat

    out = argv[argv.index("-o") + 1]
    assert os.path.dirname(out) == str(tmp_path / "r" / "nsys")
    assert os.path.basename(out).startswith("report-") and out.endswith("-%p")
    assert socket.gethostname().split(".")[0] in out
    assert stat.S_IMODE(os.stat(tmp_path / "r" / "nsys").st_mode) == 0o700


@pytest.mark.skipif(not os.path.isfile("/usr/bin/python3"), reason="needs a second Python (the distribution's)")
def test_another_pythons_job_imports_its_own_packages_first(tmp_path):
    """``stepwatch run`` put its own package's folder on PYTHONPATH: for an installed stepwatch,
    its venv's whole site-packages, ahead of the standard library and the job's own packages, so
    a job run with another Python (another venv's) imported that venv's packages (torch
    included). Now that folder goes last on ``sys.path``, and only where the job's Python cannot
    import stepwatch itself. The distribution's Python here has neither stepwatch nor torch."""
    import json
    import subprocess

    code = "import json, sys; print(json.dumps(sys.path))"
    out = subprocess.run([sys.executable, "-m", "stepwatch", "run", "--dir", str(tmp_path / "run"), "--",
                          "/usr/bin/python3", "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr
    path = json.loads(out.stdout.strip().splitlines()[-1])
    assert runner.PKG_PARENT in path, (runner.PKG_PARENT, path)
    import re

    stdlib = next(i for i, p in enumerate(path) if re.search(r"/lib/python3\.\d+$", p))
    assert path.index(runner.PKG_PARENT) == len(path) - 1 > stdlib, path
    # it found stepwatch there (and then no torch in that Python: said, and the job ran on)
    assert "No module named 'torch'" in out.stderr, out.stderr


def test_nsys_ranges_without_nsys_is_a_clear_error(capsys):
    """``--nsys-ranges 3`` without ``--nsys`` ran the job as if it had not been given."""
    assert main(["run", "--nsys-ranges", "3", "--", sys.executable, "-c", "raise SystemExit(7)"]) == 2
    err = capsys.readouterr().err
    assert "--nsys-ranges 3 applies with --nsys only" in err, err


def test_run_without_a_command_is_a_clear_error(capsys):
    assert main(["run"]) == 2
    assert "no command given" in capsys.readouterr().err


def test_dump_of_a_missing_target_is_a_clear_error(capsys, tmp_path):
    assert main(["dump", str(tmp_path / "nope")]) == 2
    assert "neither a directory nor a pid" in capsys.readouterr().err


def test_dump_of_pid_0_or_a_process_py_spy_cannot_read_is_one_clear_line(capsys):
    """``stepwatch dump 0`` asked the process group (kill(0, 0) succeeds) and printed py-spy's
    error on pid 0; a failed dump's line ended in a Rust backtrace's last frames ("9:
    std::rt::lang_start_internal 10: main")."""
    assert main(["dump", "0"]) == 2
    assert "PID must be a process id above 0, got 0" in capsys.readouterr().err
    from stepwatch._os.pyspy import _why

    err = ("Error: Failed to get process executable name. Check that the process is running.\n\nCaused by:\n"
           "    0: Permission denied (os error 13)\n    1: Permission denied (os error 13)\n\nStack backtrace:\n"
           "   0: <E as anyhow::context::ext::StdError>::ext_context\n   9: std::rt::lang_start_internal\n  10: main\n")
    assert _why(err) == ("Error: Failed to get process executable name. Check that the process is running. "
                         "Caused by: Permission denied (os error 13)")


def _state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_failed_py_spy_leaves_no_process_stopped(tmp_path):
    """py-spy stops threads while it reads them; when it fails or is killed midway the target
    can be left stopped (py-spy #390, #416). dump() resumes it. Here the "py-spy" is a program
    that stops its target and fails."""
    import signal
    import subprocess
    import sys
    import time

    from stepwatch._os.pyspy import dump

    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\nkill -STOP \"$4\"\nexit 1\n")  # py-spy dump --pid PID
    fake.chmod(0o755)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.1)
        ok, _ = dump(str(fake), child.pid)
        assert not ok
        time.sleep(0.1)
        assert _state(child.pid) in ("S", "R")
    finally:
        child.kill()
        child.wait()


def test_a_process_stopped_by_someone_else_is_read_without_pausing_it_and_left_stopped(tmp_path):
    """A rank paused on purpose (``kill -STOP``, a debugger): a blocking py-spy fails on it at once,
    and the SIGCONT meant for a py-spy killed midway restarted it (it went on training, and the
    hang report's second sample described the resumed process). It is read with --nonblocking,
    left stopped, and the dump says so."""
    import signal
    import subprocess
    import sys
    import time

    from stepwatch._os.pyspy import STOPPED_NOTE, dump

    args = tmp_path / "args"
    fake = tmp_path / "py-spy"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {args}\necho 'Thread 0x1 (idle): \"MainThread\"'\n")
    fake.chmod(0o755)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while _state(child.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.02)
        ok, text = dump(str(fake), child.pid)
        assert ok and STOPPED_NOTE in text and "--nonblocking" in args.read_text()
        fake.write_text("#!/bin/sh\nexit 1\n")  # and when the dump fails
        ok, text = dump(str(fake), child.pid)
        assert not ok and STOPPED_NOTE in text
        time.sleep(0.1)
        assert _state(child.pid) == "T"
    finally:
        child.kill()
        child.wait()


def test_run_delivers_group_signals_once_and_passes_sigterm_on(tmp_path):
    """A signal sent to the whole process group (Ctrl-C, SLURM's --signal=USR1) reaches the
    command once, not again through the runner; SIGTERM sent to the runner alone (a container's
    PID 1) reaches the command."""
    import signal
    import subprocess
    import time

    child = tmp_path / "child.py"
    child.write_text(
        "import os, signal, sys, time\n"
        "n = []\n"
        "signal.signal(signal.SIGUSR1, lambda *a: n.append(1))\n"
        f"open({str(tmp_path / 'ready')!r}, 'w').write(str(os.getpid()))\n"
        "end = time.time() + 3\n"
        "while time.time() < end:\n"
        "    time.sleep(0.05)\n"
        f"open({str(tmp_path / 'count')!r}, 'w').write(str(len(n)))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "src"), STEPWATCH_ENABLED="0")

    def start():
        (tmp_path / "ready").unlink(missing_ok=True)
        p = subprocess.Popen([sys.executable, "-m", "stepwatch", "run", "--", sys.executable, str(child)],
                             env=env, start_new_session=True)
        for _ in range(200):
            if (tmp_path / "ready").exists():
                return p
            time.sleep(0.05)
        p.kill()
        raise AssertionError("the command did not start")

    p = start()
    os.killpg(p.pid, signal.SIGUSR1)  # the whole group, as SLURM does
    assert p.wait(timeout=30) == 0
    assert (tmp_path / "count").read_text() == "1"

    p = start()
    os.kill(p.pid, signal.SIGTERM)  # the runner alone
    assert p.wait(timeout=30) == 128 + signal.SIGTERM


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "abc", "1e9"])
def test_a_dump_timeout_that_is_no_time_is_refused_naming_the_option(capsys, value):
    """``--timeout inf`` was a Python traceback (``subprocess.run(timeout=inf)``); ``nan`` a line that
    named no option; ``0`` and ``-1`` were taken (a dump that failed at once, or a silent fallback
    to SIGUSR1); ``1e9`` a traceback from the wait under it (``poll``: timeout is too large)."""
    with pytest.raises(SystemExit) as e:
        main(["dump", "--timeout", value, str(os.getpid())])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--timeout" in err and "Traceback" not in err, err


_AS_NOBODY = r'''
import contextlib, io, os, sys
from stepwatch.cli import main
# Everything the command imports, imported as root first: nobody may not read the sources (a
# fresh clone in a 0700 temporary folder), and stepwatch imports its commands' modules lazily.
with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
    try:
        main([sys.argv[1], "/nonexistent-run-dir", *sys.argv[3:]])
    except SystemExit:
        pass
err = io.StringIO()
os.setgroups([]); os.setegid(65534); os.seteuid(65534)
with contextlib.redirect_stderr(err):
    try:
        rc = main(sys.argv[1:])
    except SystemExit as e:
        rc = e.code
os.seteuid(0)
sys.stdout.write(f"{rc}\n{err.getvalue()}")
'''


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="switches to another user (needs root)")
@pytest.mark.parametrize("command", ["dump", "capture"])
@pytest.mark.parametrize("mode", [0o700, 0o755])
def test_dump_and_capture_of_another_users_run_dir_are_one_clear_line(command, mode):
    """A colleague on call runs ``stepwatch dump``/``capture`` on someone else's live job. Its run
    dir 0700: ``dump`` was a PermissionError traceback, ``capture`` said "not a stepwatch run
    directory (no run.json)". Readable, not writable: both were tracebacks (the dump's folder, the
    capture's request). Now one line that says the run dir cannot be read or written, and to run
    as the job's user; exit 2. The job's user here is root, the caller ``nobody``."""
    import json
    import pathlib
    import shutil
    import socket
    import subprocess
    import tempfile

    # Under /tmp itself: pytest's own base folder is 0700, which nobody could not even pass through.
    top = pathlib.Path(tempfile.mkdtemp(prefix="sw-foreign-", dir="/tmp"))
    try:
        _foreign_dir_commands(top, command, mode)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _foreign_dir_commands(top, command, mode):
    import json
    import socket
    import subprocess

    run = top / "run"
    run.mkdir()
    for name, info in (("run.json", {"run_id": "r", "world_size": 1}),
                       ("rank0.json", {"rank": 0, "pid": os.getpid(), "host": socket.gethostname()})):
        (run / name).write_text(json.dumps(info))
        (run / name).chmod(0o644)
    run.chmod(mode)
    top.chmod(0o755)
    argv = ["dump", str(run)] if command == "dump" else ["capture", str(run), "--timeout", "2"]
    out = subprocess.run([sys.executable, "-c", _AS_NOBODY, *argv], capture_output=True, text=True, timeout=120,
                         cwd="/")
    rc, _, err = out.stdout.partition("\n")
    assert rc == "2" and "Traceback" not in err + out.stderr, (out.stdout, out.stderr)
    assert str(run) in err and "as the user that runs" in err, err
    assert ("cannot be read" if mode == 0o700 else "cannot write") in err, err


_OWN_INIT = r'''
import json, os, sys, torch
import stepwatch
if sys.argv[1] != "late":
    stepwatch.init(**json.loads(sys.argv[1]))  # the script's own line, as its README taught it
s = stepwatch.get_session()
m = torch.nn.Linear(4, 2)
o = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(3):
    m(torch.randn(2, 4)).sum().backward(); o.step(); o.zero_grad()
if sys.argv[1] == "late":
    stepwatch.init(console="off", flush_interval_s=0.5)  # once it trains: the run's kept, said once
print("trained", json.dumps({"dir": s.config.dir, "console": s.config.console}))
'''


@pytest.mark.parametrize("how", ["same_dir_spelled_otherwise", "other_settings", "other_settings_after_training"])
def test_a_scripts_own_init_under_stepwatch_run_never_ends_the_job(tmp_path, how):
    """``stepwatch run`` starts stepwatch before the script runs; a script that already calls
    ``stepwatch.init(...)`` (the README's line) then called it a second time with other settings
    and died of ConfigError before its first step: ``init(console="off")``, or even
    ``init(dir="runs/x")`` under ``stepwatch run --dir runs/x`` (the CLI passes the absolute path).
    A directory is now one however it is spelled, and the script's own settings replace the
    session the run started while nothing was measured; once it trains, the run's session stays
    and one line says the settings were not applied. The job trains either way."""
    import json
    import subprocess

    script = tmp_path / "train.py"
    script.write_text(_OWN_INIT)
    kwargs = {"dir": "runs/x"} if how == "same_dir_spelled_otherwise" else {"dir": "runs/mine", "console": "off"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src"),
                "STEPWATCH_CAPTURE": "off", "STEPWATCH_WATCHDOG": "off"})
    args = ["late"] if how == "other_settings_after_training" else [json.dumps(kwargs)]
    r = subprocess.run([sys.executable, "-m", "stepwatch", "run", "--dir", "runs/x", "--", sys.executable, str(script),
                        *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.split("trained ", 1)[1])
    want_dir = tmp_path / ("runs/mine" if how == "other_settings" else "runs/x")
    assert got["dir"] == str(want_dir), got
    with open(want_dir / "steps.rank0.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1, 2]
    if how == "other_settings":
        assert not (tmp_path / "runs" / "x").exists()  # the run's session gave way and left nothing
    said = [line for line in r.stderr.splitlines() if "not applied" in line]
    assert len(said) == (1 if how == "other_settings_after_training" else 0), r.stderr[-2000:]
