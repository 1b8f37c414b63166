"""``stepwatch run [--nsys] -- CMD ...`` and ``stepwatch dump RUN_DIR|PID``.

``run`` starts the command with stepwatch enabled in every rank and no code change: the shim
directory (``runner/shim``, holding a ``sitecustomize.py``) goes first on ``PYTHONPATH``, and
Python imports it in every process it starts. Commands are argument lists, never shell strings.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from typing import Any

from .. import _env
from .._argtypes import positive
from .._files import make_private_dir, private_run_dir

SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# nsys profile options (Nsight Systems user guide, "CLI profile command switch options"):
# record only between cudaProfilerStart/Stop, once per capture range, up to N ranges.
NSYS_ARGS = ("profile", "--capture-range=cudaProfilerApi", "--trace=cuda,nvtx,osrt")
NSYS_RANGES = 5  # --nsys-ranges' default
# Exit status of a wrapper whose command could not be started (missing, not executable), as a
# shell's "command not found".
CANNOT_START = 127
# `stepwatch dump --timeout`: a day is more than any dump takes (the wait under it overflowed
# past ~25 days: a traceback from poll).
DUMP_TIMEOUT_MAX_S = 86400.0


def cannot_start(prog: str, argv0: str, e: OSError) -> int:
    """The one line a wrapper command prints when ``Popen`` could not start ``argv0``; returns
    :data:`CANNOT_START`. Shared by ``stepwatch run`` and ``stepwatch serve-vllm``."""
    print(f"stepwatch {prog}: cannot start {argv0!r}: {e.strerror or e}", file=sys.stderr)
    return CANNOT_START


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help="run a training command (e.g. torchrun ...) with stepwatch in every rank, no code change",
        description="Run CMD with stepwatch enabled in every rank (a sitecustomize shim on PYTHONPATH). "
        "Example: stepwatch run -- torchrun --nproc-per-node 8 train.py",
    )
    p.add_argument("--nsys", action="store_true", help="run under nsys profile; captures open nsys capture ranges")
    p.add_argument("--nsys-ranges", type=int, default=None, metavar="N",
                   help=f"with --nsys: most capture ranges nsys records (--capture-range-end=repeat:N; default {NSYS_RANGES})")
    p.add_argument("--dir", default=None, help="run directory (STEPWATCH_DIR)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    p.set_defaults(func=run_main)

    d = subparsers.add_parser(
        "dump",
        help="dump the stacks of a running job's ranks (a run dir) or of one process (a pid)",
        description="Stacks of every rank of a running job, without stopping it: py-spy when it can "
        "attach, else SIGUSR1 (faulthandler, Python frames). RUN_DIR: every rank on this host, "
        "written to RUN_DIR/dump-<n>/stacks.rank<R>.txt. PID: printed.",
    )
    d.add_argument("target", metavar="RUN_DIR|PID")
    d.add_argument("--native", action="store_true", help="include native frames (slower)")
    d.add_argument("--timeout", type=positive(most=DUMP_TIMEOUT_MAX_S), default=10.0,
                   help=f"seconds per py-spy dump (default 10, at most {DUMP_TIMEOUT_MAX_S:g})")
    d.set_defaults(func=dump_main)


def _is_torchrun(cmd: list[str]) -> bool:
    base = os.path.basename(cmd[0])
    if base in ("torchrun", "torchx"):
        return True
    return "torch.distributed.run" in cmd[:4] or "torch.distributed.launch" in cmd[:4]


def build(cmd: list[str], *, nsys: bool, nsys_ranges: int, run_dir: str | None, environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The argument list and environment ``run`` starts (no shell)."""
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ValueError("no command given; usage: stepwatch run [--nsys] -- CMD ...")
    env = dict(environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SHIM, env.get("PYTHONPATH", "")) if p)
    env[_env.PKG_PATH] = PKG_PARENT
    env[_env.RUN] = "1"
    env[_env.RUN_MODE] = "ranks" if _is_torchrun(cmd) else "top"
    env.pop(_env.RUN_ACTIVE, None)
    if run_dir:
        env["STEPWATCH_DIR"] = os.path.abspath(run_dir)
    argv = list(cmd)
    if nsys:
        exe = shutil.which("nsys", path=env.get("PATH"))
        if exe is None:
            raise FileNotFoundError(
                "--nsys: the nsys command (NVIDIA Nsight Systems) is not on PATH; install Nsight Systems "
                "(https://developer.nvidia.com/nsight-systems) or run without --nsys"
            )
        if nsys_ranges < 1:
            raise ValueError(f"--nsys-ranges must be >= 1, got {nsys_ranges}")
        base = env.get("STEPWATCH_DIR")
        # beside the ranks' files: the same private subfolder when the run dir is not ours alone
        out_dir = os.path.join(private_run_dir(base) if base else os.getcwd(), "nsys")
        make_private_dir(out_dir)
        # One nsys per node: its pid alone repeats across nodes in containers (and across
        # relaunches), so the node's name goes in too (only [A-Za-z0-9._-]: nsys expands %).
        host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"
        out = os.path.join(out_dir, f"report-{host}-%p")
        env[_env.NSYS] = "1"
        argv = [exe, *NSYS_ARGS, f"--capture-range-end=repeat:{nsys_ranges}", "-o", out, *cmd]
    return argv, env


def run_main(args: argparse.Namespace) -> int:
    if args.nsys_ranges is not None and not args.nsys:  # it was ignored without a word
        print(f"stepwatch run: --nsys-ranges {args.nsys_ranges} applies with --nsys only (nsys capture ranges); "
              "add --nsys, or leave it out", file=sys.stderr)
        return 2
    ranges = NSYS_RANGES if args.nsys_ranges is None else args.nsys_ranges
    try:
        argv, env = build(args.cmd, nsys=args.nsys, nsys_ranges=ranges, run_dir=args.dir, environ=dict(os.environ))
    except (ValueError, FileNotFoundError) as e:
        print(f"stepwatch run: {e}", file=sys.stderr)
        return 2
    try:
        proc = subprocess.Popen(argv, env=env)
    except OSError as e:
        return cannot_start("run", argv[0], e)

    def forward(signum: int, _frame: Any) -> None:
        try:
            proc.send_signal(signum)
        except OSError:
            pass

    # SIGTERM is often sent to this process alone (a container's PID 1, `kill <pid>`): passed on.
    # So is SIGHUP (`kill -HUP <pid>`), as a shell resends it to its jobs: its default action ended
    # the runner alone, and the command trained on, orphaned. The exit status is the command's.
    # SIGINT and SIGQUIT (the terminal's Ctrl-C, Ctrl-\) and SIGUSR1 (SLURM's --signal, `scancel
    # -s`) reach the whole process group or job step, the command included: passing them on would
    # deliver them twice (a second SIGINT interrupts torchrun's shutdown; a second SIGUSR1 runs a
    # requeue handler again). The runner only outlives them, waiting for the command (SIGQUIT's
    # default action ended the runner alone, as SIGHUP's did).
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, forward)
    for s in (signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1):
        signal.signal(s, lambda *_: None)
    while True:
        try:
            rc = proc.wait()
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries, kept for clarity
            continue
    return rc if rc >= 0 else 128 - rc


def dump_main(args: argparse.Namespace) -> int:
    from .dump import dump_pid, dump_run_dir

    t = args.target
    try:
        if t.isdigit() and not os.path.isdir(t):  # a run dir may be named by digits (a date): it wins
            return dump_pid(int(t), native=args.native, timeout_s=args.timeout)
        return dump_run_dir(t, native=args.native, timeout_s=args.timeout)
    except (ValueError, FileNotFoundError) as e:
        print(f"stepwatch dump: {e}", file=sys.stderr)
        return 2
