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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        for i in range(first, min(first + parallel, n)):  # jobs of their own, side by side
            port = _free_port()
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
        for i, pids in runs:
            got = [_status(os.waitpid(pid, 0)[1]) for pid in pids]
            bad += any(s != "ok" for s in got)
            print(f"run {i}: rank0 {got[0]} rank1 {got[1]}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
