"""The server's process tree, read from /proc (Linux).

vLLM 0.32 runs the API server (python), which spawns ``VLLM::EngineCore``, which spawns
``VLLM::Worker...`` processes (on CPU, and with TP/PP > 1); the names are set with
``setproctitle`` and show in /proc/<pid>/cmdline (and, cut to 15 bytes, in ``comm``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# proc(5), /proc/[pid]/stat field 3 "state".
STATES = {
    "R": "running",
    "S": "sleeping (interruptible)",
    "D": "uninterruptible sleep (waiting in the kernel: I/O, a driver, a device)",
    "Z": "zombie",
    "T": "stopped (by a signal: SIGSTOP/SIGTSTP)",
    "t": "stopped by a debugger (tracing stop)",
    "X": "dead",
    "I": "idle kernel thread",
    "P": "parked",
}
# States that mean "this process cannot make progress": the first suspects of a stall.
STUCK_STATES = ("T", "t", "D")
# Stopped: it acts on no signal but SIGKILL (and SIGCONT) until continued.
STOPPED_STATES = ("T", "t")


@dataclass(frozen=True, slots=True)
class ProcStat:
    pid: int
    comm: str
    state: str
    ppid: int
    pgrp: int
    starttime: int  # clock ticks after boot: with the pid, names a process across pid reuse


def read_stat(pid: int, proc: str = "/proc") -> ProcStat | None:
    """None when the process is gone (or /proc is not there)."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    # comm may contain spaces and ')': it is everything between the first '(' and the last ')'.
    lp, rp = raw.find("("), raw.rfind(")")
    if lp < 0 or rp < 0:
        return None
    rest = raw[rp + 2 :].split()
    try:
        return ProcStat(pid, raw[lp + 1 : rp], rest[0], int(rest[1]), int(rest[2]), int(rest[19]))
    except (IndexError, ValueError):
        return None


def cmdline(pid: int, proc: str = "/proc") -> str:
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def all_stats(proc: str = "/proc") -> dict[int, ProcStat]:
    out: dict[int, ProcStat] = {}
    try:
        entries = os.listdir(proc)
    except OSError:
        return out
    for e in entries:
        if e.isdigit():
            st = read_stat(int(e), proc)
            if st is not None:
                out[st.pid] = st
    return out


def tree(root: int, proc: str = "/proc") -> list[ProcStat]:
    """``root`` and all its descendants, parents before children. Empty when root is gone."""
    stats = all_stats(proc)
    if root not in stats:
        return []
    children: dict[int, list[int]] = {}
    for st in stats.values():
        children.setdefault(st.ppid, []).append(st.pid)
    out: list[ProcStat] = []
    todo = [root]
    seen: set[int] = set()
    while todo:
        pid = todo.pop(0)
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        out.append(stats[pid])
        todo.extend(sorted(children.get(pid, ())))
    return out


def depth(pid: int, root: int, stats: dict[int, ProcStat]) -> int:
    d = 0
    while pid != root and pid in stats and d < 64:
        pid = stats[pid].ppid
        d += 1
    return d


def alive(pid: int, starttime: int | None = None, proc: str = "/proc") -> bool:
    """Is this process (and not a later one that re-used its pid) still there, not a zombie?"""
    st = read_stat(pid, proc)
    if st is None or st.state in ("Z", "X"):
        return False
    return starttime is None or st.starttime == starttime


def set_child_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (prctl PR_SET_CHILD_SUBREAPER,
    linux/prctl.h = 36), so a vLLM engine whose API server died stays findable as our
    descendant instead of moving under init. Only for a process that owns its children
    (the CLI wrapper): it must then reap them."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_zombies() -> None:
    """Collect exit statuses of adopted orphans (see :func:`set_child_subreaper`)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
