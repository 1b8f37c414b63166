"""``stepwatch dump``: stacks of a running job without stopping it.

A pid: ``py-spy dump`` printed. A run dir: every rank of this host (from ``rank<R>.json``: pid,
host), dumped in parallel into ``RUN_DIR/dump-<n>/stacks.rank<R>.txt``. When py-spy cannot
attach (no ptrace rights), SIGUSR1 makes the rank's faulthandler write its Python stacks to
``RUN_DIR/sigusr1.rank<R>.txt`` -- only for processes that run stepwatch's SIGUSR1 handler
(the default action of SIGUSR1 is to terminate a process).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

from .._files import job_dir, private_subdir
from .._os import pyspy
from ..capture import signals


def _ranks(run_dir: str) -> dict[int, int]:
    """rank -> pid for the ranks of this host, from the newest attempt's rank files."""
    host = socket.gethostname()
    out: dict[int, tuple[float, int]] = {}
    try:
        names = os.listdir(run_dir)
    except OSError as e:  # another user's job: its run dir is 0700
        raise ValueError(f"RUN_DIR {run_dir!r} cannot be read ({e.strerror or e}): dump a job's ranks as the "
                         "user that runs it (or root)") from None
    for n in names:
        if not (n.startswith("rank") and n.endswith(".json")):
            continue
        try:
            with open(os.path.join(run_dir, n), encoding="utf-8") as f:
                info = json.load(f)
            r, pid, h = int(info["rank"]), int(info["pid"]), info.get("host")
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if h != host:
            continue
        t = float(info.get("start_time") or 0)
        if r not in out or t > out[r][0]:
            out[r] = (t, pid)
    return {r: pid for r, (_, pid) in out.items()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _next_dir(run_dir: str) -> str:
    k = 1
    while os.path.exists(os.path.join(run_dir, f"dump-{k}")):
        k += 1
    return private_subdir(os.path.join(run_dir, f"dump-{k}"))


def _signal_dump(run_dir: str, rank: int, pid: int, out_dir: str | None) -> bool:
    path = os.path.join(run_dir, f"sigusr1.rank{rank}.txt")
    if not os.path.exists(path):
        return False  # no stepwatch SIGUSR1 handler there: the signal would kill it
    start = os.path.getsize(path)
    # The trainer's private dump signal when it announced one: SIGUSR1 may also run the job's
    # own handler (SLURM/Lightning requeue on SIGUSR1).
    sig, announced = signals.signal_for(path, pid)
    if sig is None and announced:
        return False  # that trainer is gone and its pid taken by another process: signal nothing
    os.kill(pid, sig or signal.SIGUSR1)
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and os.path.getsize(path) == start:
        time.sleep(0.05)
    time.sleep(0.2)  # let the handler finish writing every thread
    with open(path, encoding="utf-8", errors="replace") as f:
        f.seek(start)
        text = f.read()
    if out_dir:
        pyspy.write_private(os.path.join(out_dir, f"stacks.rank{rank}.txt"), "== faulthandler (SIGUSR1) ==\n" + text)
    return bool(text)


def dump_pid(pid: int, *, native: bool, timeout_s: float) -> int:
    if pid <= 0:  # kill(0, 0) asks the process group: "alive", then py-spy's error on pid 0
        raise ValueError(f"PID must be a process id above 0, got {pid}")
    if not _alive(pid):
        raise ValueError(f"no process with pid {pid}")
    exe = pyspy.find_pyspy()
    if exe is None:
        raise FileNotFoundError("py-spy is not installed (pip install py-spy); for a stepwatch rank, "
                                "`stepwatch dump RUN_DIR` falls back to SIGUSR1")
    ok, text = pyspy.dump(exe, pid, native=native, timeout_s=timeout_s)
    if not ok:
        print(f"stepwatch dump: py-spy could not dump pid {pid}: {text}", file=sys.stderr)
        return 1
    sys.stdout.write(text)
    return 0


def dump_run_dir(run_dir: str, *, native: bool, timeout_s: float) -> int:
    if not os.path.isdir(run_dir):
        raise ValueError(f"RUN_DIR|PID: {run_dir!r} is neither a directory nor a pid")
    run_dir = job_dir(run_dir)  # a shared or foreign run dir: the job wrote into its private subfolder
    ranks = {r: p for r, p in _ranks(run_dir).items() if _alive(p)}
    if not ranks:
        raise ValueError(f"no running rank of {run_dir} on this host (read from its rank<R>.json files)")
    try:
        out = _next_dir(run_dir)
    except OSError as e:  # another user's run dir, readable to others: its stacks are not ours to write
        raise ValueError(f"cannot write the stacks into {run_dir!r} ({e.strerror or e}): dump a job's ranks as "
                         "the user that runs it (or root)") from None
    exe = pyspy.find_pyspy()
    status = pyspy.parallel(exe, ranks, out, native=native, timeout_s=timeout_s) if exe else {r: "py-spy not installed" for r in ranks}
    failed = 0
    for r in sorted(ranks):
        how = "py-spy"
        if status.get(r) != "ok":
            how = "SIGUSR1" if _signal_dump(run_dir, r, ranks[r], out) else None
        if how is None:
            failed += 1
            print(f"rank {r} (pid {ranks[r]}): no stacks ({status.get(r)})", file=sys.stderr)
        else:
            print(f"rank {r} (pid {ranks[r]}): {os.path.join(out, f'stacks.rank{r}.txt')} ({how})")
    return 1 if failed == len(ranks) else 0
