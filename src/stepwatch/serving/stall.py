"""A stall: requests in flight and no token progress for S seconds; then, stacks of the whole tree.

vLLM's ``/health`` stays 200 while the engine is frozen (it reports only a dead engine), and every
``vllm:*`` metric freezes with it (``num_requests_running`` can read 0 with requests in flight;
shared/vllm/README.md). So the in-flight count is the larger of the API server's ``/load`` (vLLM
counts requests there only with ``--enable-server-load-tracking``) and the engine's running +
waiting, and progress comes from the counters that
move whenever the engine steps: ``generation_tokens_total``, ``prompt_tokens_total`` and the
``iteration_tokens`` histogram's count.

On a stall every process of the server's tree is dumped with py-spy, all at once, twice (1 s
apart), into ``D/stall-<n>/stacks.<pid>.txt``; ``report.json`` names the stuck process by its
state (stopped, uninterruptible sleep) and by which stacks did not move, and where it is.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from .._files import make_private_dir, write_json_private, write_private
from .._os.pyspy import dump as pyspy_dump
from .._os.pyspy import parse_threads
from .._os import procs

# -- the detector ------------------------------------------------------------------------------


@dataclass
class StallState:
    """What the detector knows now (exported as samples, kept in the report)."""

    in_flight: float | None = None
    progress: tuple[float, ...] | None = None
    last_progress_mono: float | None = None
    busy_since_mono: float | None = None
    fired: bool = False  # this episode already dumped; re-armed when progress resumes


class StallDetector:
    """Feed it once per scrape; it says when a stall starts (once per episode)."""

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"stall timeout must be > 0 seconds, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.state = StallState()

    def seconds_since_progress(self, now: float) -> float | None:
        last = self.state.last_progress_mono
        return None if last is None else max(0.0, now - last)

    def update(self, now: float, *, in_flight: float | None, progress: tuple[float, ...] | None,
               unreachable: bool = False) -> bool:
        """``in_flight``: requests in flight (None = unknown: the server did not answer);
        ``progress``: the progress counters (None = not read this time); ``unreachable``: the
        server refused the connection (nothing listens: it is gone or restarting, not stuck).
        True = a stall began."""
        st = self.state
        st.in_flight = in_flight
        if in_flight is None and unreachable:
            # Not busy, and not idle either: no stall clock runs until it answers again.
            st.busy_since_mono = None
            return False
        if progress is not None and progress != st.progress:
            moved = st.progress is not None
            st.progress = progress
            st.last_progress_mono = now
            if moved:
                st.fired = False
        if st.last_progress_mono is None:
            return False  # never seen the server answer: still starting
        # Unknown in-flight counts as busy: a server that stops answering at all is stuck too.
        busy = in_flight is None or in_flight > 0
        if not busy:
            st.busy_since_mono = None
            st.last_progress_mono = now  # an idle server makes no tokens, and is not stalled
            st.fired = False
            return False
        if st.busy_since_mono is None:
            st.busy_since_mono = now
        # Measured from the later of "last progress" and "became busy": an idle server that just
        # received a request has not been stalled for its whole idle time.
        since = max(st.last_progress_mono, st.busy_since_mono)
        if not st.fired and now - since >= self.timeout_s:
            st.fired = True
            return True
        return False


# -- py-spy dumps ------------------------------------------------------------------------------

def parse_pyspy(text: str) -> dict[str, dict[str, Any]]:
    """py-spy 0.4 ``dump`` text -> {thread id: {"status", "name", "frames": [...] innermost first}}."""
    return {t["id"]: {"status": t["state"], "name": t["name"], "frames": t["frames"]} for t in parse_threads(text)}


@dataclass
class Dump:
    pid: int
    state: str
    ok: bool
    text: str
    seconds: float
    nonblocking: bool


def dump_one(pyspy: str | None, pid: int, timeout_s: float = 15.0) -> Dump:
    """Stacks of one process. A stopped or D-state process is read without pausing it
    (``--nonblocking``: py-spy would wait to stop a process that cannot answer); a normal one
    is paused for a consistent stack, and read without pausing if that fails."""
    t0 = time.monotonic()
    st = procs.read_stat(pid)
    state = st.state if st else "?"
    if pyspy is None:
        return Dump(pid, state, False, "py-spy not found (pip install py-spy)", 0.0, False)
    nonblocking = state in procs.STUCK_STATES
    ok, text = pyspy_dump(pyspy, pid, nonblocking=nonblocking, timeout_s=timeout_s)
    if not ok and not nonblocking:
        nonblocking = True
        ok2, text2 = pyspy_dump(pyspy, pid, nonblocking=True, timeout_s=timeout_s)
        ok, text = (ok2, text2) if ok2 else (False, f"{text}\n(--nonblocking: {text2})")
    return Dump(pid, state, ok, text, time.monotonic() - t0, nonblocking)


def dump_all(pyspy: str | None, pids: list[int], timeout_s: float = 15.0) -> dict[int, Dump]:
    """One py-spy per process, all at the same time (a tree of 3-10 processes: one thread each)."""
    out: dict[int, Dump] = {}
    lock = threading.Lock()

    def work(pid: int) -> None:
        d = dump_one(pyspy, pid, timeout_s)
        with lock:
            out[pid] = d

    threads = [threading.Thread(target=work, args=(p,), name=f"stepwatch-pyspy-{p}", daemon=True) for p in pids]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 2 * timeout_s + 5
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    with lock:
        return dict(out)


# -- the verdict -------------------------------------------------------------------------------


def _key_thread(threads: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """The thread that shows where a process is: an active one, else MainThread, else the first."""
    for tid, t in threads.items():
        if "active" in t["status"] and t["frames"]:
            return tid, t
    for tid, t in threads.items():
        if t["name"] == "MainThread":
            return tid, t
    return next(iter(threads.items()), None)


def verdict(root: int, stats: dict[int, procs.ProcStat], first: dict[int, Dump], second: dict[int, Dump]) -> dict[str, Any]:
    """Which process is stuck, why we think so, and where.

    1. A process that is stopped (T/t) or in uninterruptible sleep (D) cannot make progress.
    2. Else a process whose stacks did not move between the two samples; among several, an
       active (on-CPU per py-spy) one, then the deepest in the tree: the API server waits on the
       engine core, the engine core on its workers, so the deepest unmoving one is the cause.
    """
    rows: list[dict[str, Any]] = []
    for pid in sorted(set(first) | set(second), key=lambda p: (procs.depth(p, root, stats), p)):
        a, b = first.get(pid), second.get(pid)
        st = stats.get(pid)
        ta = parse_pyspy(a.text) if a and a.ok else {}
        tb = parse_pyspy(b.text) if b and b.ok else {}
        both = set(ta) & set(tb)
        moved = sorted(t for t in both if ta[t]["frames"] != tb[t]["frames"])
        state = (b.state if b else None) or (a.state if a else "?")
        key = _key_thread(tb or ta)
        rows.append({
            "pid": pid,
            "name": procs.cmdline(pid)[:200] or (st.comm if st else ""),
            "ppid": st.ppid if st else None,
            "depth": procs.depth(pid, root, stats),
            "state": state,
            "state_meaning": procs.STATES.get(state, "unknown"),
            "dumped": bool((a and a.ok) or (b and b.ok)),
            "error": None if (a and a.ok) else (a.text[:500] if a else "not dumped"),
            "nonblocking": bool(a and a.nonblocking),
            "threads": len(tb or ta),
            "threads_moved": moved,
            "stacks_moved": bool(moved) if both else None,
            "active_threads": sorted(t for t, v in (tb or ta).items() if "active" in v["status"]),
            "where": (
                {"thread": key[0], "thread_name": key[1]["name"], "frames": key[1]["frames"][:8]}
                if key else None
            ),
        })
    stuck = None
    why: list[str] = []
    by_state = [r for r in rows if r["state"] in procs.STUCK_STATES]
    if by_state:
        stuck = max(by_state, key=lambda r: (r["state"] in procs.STOPPED_STATES, r["depth"]))
        why.append(f"process state {stuck['state']}: {stuck['state_meaning']}")
        if stuck["stacks_moved"] is False:
            why.append("its stacks did not move between the two samples")
    else:
        still = [r for r in rows if r["stacks_moved"] is False]
        if still:
            stuck = max(still, key=lambda r: (bool(r["active_threads"]), r["depth"]))
            why.append("its stacks did not move between the two samples" + (" while on CPU" if stuck["active_threads"] else ""))
    return {
        "stuck": (
            {"pid": stuck["pid"], "name": stuck["name"], "state": stuck["state"], "why": why, "where": stuck["where"]}
            if stuck else None
        ),
        "processes": rows,
    }


def _title(r: dict[str, Any]) -> str:
    return r["name"].split(" ", 1)[0] if r["name"] else str(r["pid"])


def capture_stall(
    root: int,
    out_dir: str,
    *,
    pyspy: str | None,
    info: dict[str, Any],
    timeout_s: float = 15.0,
    gap_s: float = 1.0,
) -> dict[str, Any]:
    """Dump every process under ``root`` twice into ``out_dir``; write and return the report."""
    make_private_dir(out_dir)
    t0 = time.time()
    members = procs.tree(root)
    stats = {p.pid: p for p in members}
    pids = [p.pid for p in members]
    first = dump_all(pyspy, pids, timeout_s)
    time.sleep(gap_s)
    second = dump_all(pyspy, [p for p in pids if procs.alive(p)], timeout_s)
    v = verdict(root, stats, first, second)
    for pid in pids:
        a, b = first.get(pid), second.get(pid)
        parts = [f"# pid {pid}: {procs.cmdline(pid) or stats[pid].comm}\n"]
        for n, d in ((1, a), (2, b)):
            if d is None:
                parts.append(f"\n## sample {n}: not taken (process gone)\n")
                continue
            mode = "--nonblocking" if d.nonblocking else "paused"
            parts.append(f"\n## sample {n}: state {d.state} ({procs.STATES.get(d.state, '?')}), py-spy {mode}, {d.seconds:.2f} s\n")
            parts.append(d.text if d.ok else f"(no stacks: {d.text})\n")
        write_private(os.path.join(out_dir, f"stacks.{pid}.txt"), "".join(parts))
    report = {
        **info,
        "time": t0,
        "root_pid": root,
        "dump_seconds": round(time.time() - t0, 3),
        "pyspy": pyspy,
        "dumped": sum(1 for r in v["processes"] if r["dumped"]),
        **v,
    }
    write_json_private(os.path.join(out_dir, "report.json"), report)
    return report


def summary(report: dict[str, Any]) -> str:
    s = report.get("stuck")
    n = report.get("in_flight")
    busy = (f"{n:g} request(s) in flight" if isinstance(n, (int, float)) else
            "the server does not answer (requests in flight unknown)")
    base = f"engine stalled: {busy}, no token progress for {report.get('seconds_without_progress') or 0:.0f} s"
    if not s:
        return base + f"; dumped {report.get('dumped', 0)} process(es), no single stuck process found"
    where = (s.get("where") or {}).get("frames") or ["?"]
    name = s["name"].split(" ")[0] if s.get("name") else str(s["pid"])
    return f"{base}; stuck: pid {s['pid']} {name} ({'; '.join(s['why'])}) at {where[0]}"
