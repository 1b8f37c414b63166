"""Run the 2-rank example's whole life, exit included, N times, cheaply: torch is imported once
here and every pair of ranks is forked from this process (torchrun's start-up, ~10-30 s a launch
on a busy machine, would make 20 launches take minutes). Each rank runs ``examples/ddp_train.py``
as torchrun would start it (RANK, WORLD_SIZE, MASTER_ADDR/PORT, gloo), then leaves through the
normal interpreter exit, where the teardown races live.

    python teardown_harness.py N PARALLEL [example args...]   # N runs, PARALLEL jobs at a time

Prints one line per run: ``run <i>: rank0 <status> rank1 <status>``, status ``ok``, ``exit <code>``
or ``signal <name>``; exits 1 when any rank did not end with 0.
"""

from __future__ import annotations

import os
import runpy
import signal
import socket
import sys

import gc

import torch  # noqa: F401  -- imported once, inherited by every forked rank

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "examples", "ddp_train.py")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: the sockets stay bound until all are chosen (a port closed at
    once can be handed out again by the next bind: two jobs on one port hung a CI run, a rank
    waiting for a store that the other job's rank 0 owned or failed to open)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _status(st: int) -> str:
    if os.WIFSIGNALED(st):
        return f"signal {signal.Signals(os.WTERMSIG(st)).name}"
    code = os.WEXITSTATUS(st)
    return "ok" if code == 0 else f"exit {code}"


def _rank(rank: int, port: int, args: list[str]) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": f"teardown-{port}"})
    sys.argv = [EXAMPLE, *args]
    runpy.run_path(EXAMPLE, run_name="__main__")


def main() -> int:
    n, parallel, args = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    # torch's import graph is frozen, shared by the forks and skipped by their collections (the
    # final one at exit took seconds a rank); the objects the job makes are collected as usual.
    gc.freeze()
    bad = 0
    for first in range(0, n, parallel):
        runs = []
        batch = range(first, min(first + parallel, n))
        for i, port in zip(batch, _free_ports(len(batch))):  # jobs of their own, side by side
            pids = []
            for rank in (0, 1):
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    _rank(rank, port, args)
                    # Out through every frame to the interpreter's own exit, as a torchrun rank ends.
                    raise SystemExit(0)
                pids.append(pid)
            runs.append((i, pids))
        # As each rank ends: a rank that failed leaves its partner waiting for it (at the
        # rendezvous, in a collective) until gloo's 30-minute timeout, so the partner is killed
        # and the run reported bad, instead of the test's own timeout saying nothing.
        status: dict[int, str] = {}
        partner = {a: b for _, (a, b) in runs} | {b: a for _, (a, b) in runs}
        while len(status) < 2 * len(runs):
            pid, st = os.wait()
            if pid not in partner:
                continue
            status.setdefault(pid, _status(st))
            other = partner[pid]
            if status[pid] != "ok" and other not in status:
                try:
                    os.kill(other, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                status[other] = "killed: its partner failed"
        for i, pids in runs:
            got = [status[pid] for pid in pids]
            bad += any(s != "ok" for s in got)
            print(f"run {i}: rank0 {got[0]} rank1 {got[1]}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
