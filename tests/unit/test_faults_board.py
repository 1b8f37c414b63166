"""Fault bounds of the hang watchdog's plumbing (README "Never breaks the job"):

* a full /dev/shm (or disk) under the progress board: the job goes on without the watchdog, with
  one warning, instead of dying of SIGBUS when the first write reaches a page tmpfs cannot back;
* a stopped (SIGSTOP) sidecar: shutdown still ends within its bound, and a SIGTERM still leaves
  the final manifest.

Each runs a real trainer process (and a real sidecar), as the faults kill or delay processes.
"""

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from stepwatch._pipeline import SHUTDOWN_TIMEOUT_S
from stepwatch.hooks import progress

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")

_TRAIN = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch, torch.nn as nn
    import stepwatch
    d, mode = sys.argv[1], sys.argv[2]
    stepwatch.init(dir=d, console="off", watchdog="on")
    m = nn.Linear(8, 1); opt = torch.optim.SGD(m.parameters(), lr=0.01); x = torch.randn(4, 8)
    def sidecar():  # this process's watchdog sidecar (its child)
        for p in os.listdir("/proc"):
            try:
                if (p.isdigit() and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == str(os.getpid())
                        and b"stepwatch.watchdog.sidecar" in open(f"/proc/{p}/cmdline", "rb").read()):
                    return int(p)
            except OSError:
                continue
    for i in range(60):
        opt.zero_grad(); m(x).sum().backward(); opt.step(); time.sleep(0.003)
        if i == 30 and mode in ("stop", "stopterm"):
            for _ in range(100):  # the sidecar may still be starting
                pid = sidecar()
                if pid: break
                time.sleep(0.05)
            os.kill(pid, signal.SIGSTOP)
            print("SIDECAR", pid, flush=True)
    if mode == "stopterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10); print("NOT ENDED", flush=True)
    t = time.monotonic(); stepwatch.shutdown(); print("SHUTDOWN_S %.3f" % (time.monotonic() - t), flush=True)
    print("END", flush=True)
""")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH", "")) if p)
    env.pop("STEPWATCH_ENABLED", None)
    return env


# -- a full /dev/shm ------------------------------------------------------------------------------


def test_a_board_that_cannot_be_backed_raises_and_leaves_no_file(tmp_path, monkeypatch):
    """posix_fallocate's ENOSPC is an OSError at creation, not a SIGBUS at the first write."""
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    path = str(tmp_path / "b")
    with pytest.raises(OSError) as e:
        progress.Board(path, rank=0)
    assert e.value.errno == errno.ENOSPC
    assert not os.path.exists(path)


def test_a_file_system_without_fallocate_gets_the_board_written(tmp_path, monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    path = str(tmp_path / "b")
    b = progress.Board(path, rank=2)
    b.set_step(5)
    assert os.path.getsize(path) == progress.SIZE
    assert os.stat(path).st_blocks > 0  # not sparse
    assert progress.Reader(path).read()["step"] == 5
    b.close()


def _can_mount_tmpfs():
    if os.geteuid() != 0 or shutil.which("unshare") is None or not os.path.isdir("/dev/shm"):
        return False
    r = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /dev/shm"],
                       capture_output=True, timeout=30)
    return r.returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs root and unshare -m to mount a tiny tmpfs on /dev/shm")
def test_a_full_dev_shm_leaves_the_job_running_without_the_watchdog(tmp_path):
    """A tiny tmpfs over /dev/shm in a private mount namespace (the machine's is not touched),
    filled up: before the fix the trainer died of SIGBUS (exit 135) inside init."""
    d = str(tmp_path / "rd")
    script = tmp_path / "job.py"
    script.write_text(_TRAIN)
    shell = (
        "mount -t tmpfs -o size=64k tmpfs /dev/shm && "
        "(dd if=/dev/zero of=/dev/shm/filler bs=4k count=1000 2>/dev/null; true) && "
        f'exec "{sys.executable}" "{script}" "{d}" plain'
    )
    p = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr[-3000:])
    assert "END" in p.stdout
    warnings = [ln for ln in p.stderr.splitlines() if "hang watchdog off" in ln]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], p.stderr[-3000:]
    wd = json.load(open(os.path.join(d, "run.json")))["features"]["capture"]["hang_watchdog"]
    assert wd["enabled"] is False and "progress board" in wd["off"]


# -- a stopped sidecar ----------------------------------------------------------------------------


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _run_stopped(tmp_path, mode):
    d = str(tmp_path / "rd")
    script = tmp_path / "job.py"
    script.write_text(_TRAIN)
    p = subprocess.run([sys.executable, str(script), d, mode], capture_output=True, text=True, timeout=120,
                       env=_env())
    pids = [int(ln.split()[1]) for ln in p.stdout.splitlines() if ln.startswith("SIDECAR")]
    return p, d, pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and SIGSTOP")
def test_a_stopped_sidecar_does_not_hold_up_shutdown(tmp_path):
    """Before the fix: ~4 s (wait 2 s, SIGTERM a stopped process ignores, wait 2 s, SIGKILL)."""
    p, d, pids = _run_stopped(tmp_path, "stop")
    assert p.returncode == 0, (p.stdout, p.stderr[-3000:])
    assert len(pids) == 1
    took = float(p.stdout.split("SHUTDOWN_S")[1].split()[0])
    assert took <= SHUTDOWN_TIMEOUT_S, took
    # Not left behind, stopped, after the trainer.
    end = time.monotonic() + 5
    while _alive(pids[0]) and time.monotonic() < end:
        time.sleep(0.05)
    assert not _alive(pids[0])
    assert json.load(open(os.path.join(d, "run.json")))["end_time"] is not None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and SIGSTOP")
def test_sigterm_with_a_stopped_sidecar_still_writes_the_final_manifest(tmp_path):
    p, d, pids = _run_stopped(tmp_path, "stopterm")
    assert "NOT ENDED" not in p.stdout
    r = json.load(open(os.path.join(d, "run.json")))
    assert r["ended_by"] == "SIGTERM" and r["end_time"] is not None, (r["ended_by"], r["end_time"], p.stderr[-3000:])
    end = time.monotonic() + 5
    while pids and _alive(pids[0]) and time.monotonic() < end:
        time.sleep(0.05)
    assert not pids or not _alive(pids[0])


_BUSY = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    import torch, torch.nn as nn
    import stepwatch
    d = sys.argv[1]
    s = stepwatch.init(dir=d, console="off", watchdog="on")
    feat = next(f for f in s.features_started if hasattr(f, "sidecar"))
    sig = int(feat.dump_signal.signum) if feat.dump_signal is not None else int(signal.SIGUSR1)
    m = nn.Linear(8, 1); opt = torch.optim.SGD(m.parameters(), lr=0.01); x = torch.randn(4, 8)
    for i in range(5):
        opt.zero_grad(); m(x).sum().backward(); opt.step()
    # The sidecar in the middle of a hang dump, as shutdown finds it: it ignores SIGTERM, and asks
    # the trainer for its stacks (its way without py-spy) once the trainer has shut down.
    busy = subprocess.Popen([sys.executable, "-c",
        "import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('R', flush=True); "
        "time.sleep(2.5); os.kill(int(sys.argv[1]), int(sys.argv[2]))", str(os.getpid()), str(sig)],
        stdout=subprocess.PIPE)
    assert busy.stdout.readline().strip() == b"R"
    real, feat.sidecar = feat.sidecar, busy
    real.terminate(); real.wait()
    stepwatch.shutdown()  # within 1.5 s: the signal comes after it
    print("SHUT", flush=True)
    busy.wait(10)  # the job's own work after shutdown (an evaluation, an upload)
    print("END", flush=True)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and real-time signals")
def test_a_sidecar_left_finishing_a_dump_cannot_end_the_trainer_with_its_signal(tmp_path):
    """Shutdown leaves a sidecar that is inside a hang dump to finish it, after the trainer. Without
    py-spy that dump asks the trainer for its stacks with the dump signal (SIGRTMIN+6), and
    shutdown had put that signal's default action back: it ended the trainer (a suite run: rc -40
    after a 12-step job's clean shutdown). The registrations stay while such a sidecar runs."""
    script = tmp_path / "job.py"
    script.write_text(_BUSY)
    d = str(tmp_path / "run")
    p = subprocess.run([sys.executable, str(script), d], capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode == 0 and "END" in p.stdout, (p.returncode, p.stdout, p.stderr[-3000:])
    assert "finishing a stack dump" in p.stderr
