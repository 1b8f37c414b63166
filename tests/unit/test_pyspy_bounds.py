"""py-spy that never returns (stuck on a target in D state, or blocked on ptrace): the dump must be
bounded and must not outlive whoever ran it. The stuck py-spy is a stand-in script (``exec sleep``):
the real one cannot be made to hang on demand."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from stepwatch._os import pyspy


def _stuck_pyspy(tmp_path):
    exe = tmp_path / "py-spy"
    marker = tmp_path / "pids"
    exe.write_text(f"#!/bin/sh\necho $$ >> {marker}\nexec sleep 1000\n")
    exe.chmod(0o755)
    return str(exe), marker


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for this purpose
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_stuck_pyspy_is_tried_once_per_hang_not_three_times(tmp_path):
    """The first dump timing out meant the native and the plain retry each waited their whole
    budget too: 10 + 2 + 8 + 10 s before the faulthandler fallback, longer than many hangs last
    (the job ended first, with no stacks and no finding)."""
    exe, marker = _stuck_pyspy(tmp_path)
    t0 = time.monotonic()
    res = pyspy.two_samples(exe, os.getpid(), gap_s=0.1, native_budget_s=1.0, timeout_s=1.0)
    took = time.monotonic() - t0
    assert not res["ok"] and "did not finish" in res["error"]
    assert took < 2.0, took  # one timeout, not three
    assert len(marker.read_text().split()) == 1


def test_a_stuck_pyspy_dies_with_the_process_that_ran_it(tmp_path):
    """The watchdog sidecar is killed (SIGKILL after its grace) while it waits on py-spy: the
    py-spy it started was left running, orphaned, after the job ended."""
    exe, marker = _stuck_pyspy(tmp_path)
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {os.path.join(os.path.dirname(__file__), '..', '..', 'src')!r})
        from stepwatch._os import pyspy
        pyspy.dump({exe!r}, os.getpid(), timeout_s=60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while not (marker.exists() and marker.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(marker.read_text().split()[0])
        assert _alive(child)
    finally:
        p.kill()
        p.wait()
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "py-spy outlived the process that ran it"
