"""``stepwatch doctor``: check a node before or during a job, and say what to do.

Exit status: 0 unless a check failed (a GPU with uncorrectable errors, a driver that is installed
but does not answer); a machine without a GPU is not a failure; 2 for bad arguments. Ctrl-C or
SIGTERM stop it, the storage test files removed first: one line, then exit 130 (Ctrl-C) or death
by SIGTERM (143 in a shell).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from typing import Any

from .checks import Check
from .storage import MAX_JOBS

# The storage test's defaults: the options default to None so that one given without --storage
# can be told from one left out.
STORAGE_SIZE_MB = 1024
STORAGE_SECONDS = 10.0
STORAGE_JOBS = 1


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check this node: GPUs and their health, GPM, timing backend, py-spy, nsys, NCCL/torchrun env",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--storage", metavar="PATH", help="also measure sequential write/read throughput of this "
                   "directory (e.g. the checkpoint directory; reference B.9)")
    p.add_argument("--storage-size-mb", type=int, default=None, metavar="MB",
                   help=f"with --storage: bytes written per job, in MiB (default {STORAGE_SIZE_MB}; bounded by free space)")
    p.add_argument("--storage-seconds", type=float, default=None, metavar="S",
                   help=f"with --storage: time limit per phase (write, read), seconds (default {STORAGE_SECONDS:g})")
    p.add_argument("--storage-jobs", type=int, default=None, metavar="N",
                   help=f"with --storage: parallel streams, one file and one thread each, 1-{MAX_JOBS} (default "
                        f"{STORAGE_JOBS}, not graded; the reference grades 16, as its fio)")
    p.add_argument("--no-attach", action="store_true", help="do not try a real py-spy attach")
    p.set_defaults(func=run)


def collect(args: argparse.Namespace) -> list[Check]:
    from . import checks

    out: list[Check] = [checks.python_info()]
    out.extend(checks.check_nvidia())
    out.extend(checks.check_amd())
    out.append(checks.check_timing())
    out.append(checks.check_speedups())
    out.append(checks.check_pyspy(attach=not args.no_attach))
    out.append(checks.check_nsys())
    out.extend(checks.check_nccl_env())
    out.extend(checks.check_torchrun_env())
    if args.storage:
        out.append(storage_check(args))
    return out


def storage_check(args: argparse.Namespace) -> Check:
    from .storage import DEGRADED_GBPS, GRADED_JOBS, HEALTHY_GBPS, NotEnoughSpace, measure

    size = args.storage_size_mb * 1024 * 1024
    block = min(4 * 1024 * 1024, size)
    try:
        r = measure(args.storage, size_bytes=size, block_bytes=block, max_seconds=args.storage_seconds,
                    jobs=args.storage_jobs)
    except NotEnoughSpace as e:
        return Check("storage", "warn", str(e),
                     "Free space on this filesystem (a checkpoint will not fit either), or measure another "
                     "directory with --storage.")
    except OSError as e:
        return Check("storage", "fail", f"{args.storage}: I/O error during the benchmark: {e}",
                     "Check the mount and permissions.")
    d = r.to_dict()
    w, rd = r.write_gbps, r.read_gbps
    fmt = lambda v: "?" if v is None else f"{v:.2f} GB/s"  # noqa: E731
    summary = (f"{r.path}: write {fmt(w)}, read {fmt(rd)} ({r.write_bytes / 2**20:.0f} MiB, {r.jobs} stream(s), "
               f"{'direct I/O' if r.direct else 'buffered I/O'}) -> {d['verdict']} "
               f"(> {HEALTHY_GBPS:g} GB/s healthy, < {DEGRADED_GBPS:g} GB/s degraded)")
    if r.notes:
        summary += "; " + "; ".join(r.notes)
    status = {"healthy": "ok", "between": "info", "degraded": "warn", "unknown": "info", "ungraded": "info"}[d["verdict"]]
    action = None
    if d["verdict"] == "degraded":
        action = ("Storage is degraded for checkpoints: check the filesystem (lfs df / lfs check servers on "
                  "Lustre, nfsstat on NFS), use a faster tier, or save asynchronously.")
    elif d["verdict"] == "ungraded":
        action = (f"The reference's thresholds are for {GRADED_JOBS} parallel streams (fio --numjobs={GRADED_JOBS}): "
                  f"run with --storage-jobs {GRADED_JOBS} to grade; one stream understates a parallel filesystem.")
    return Check("storage", status, summary, action, d)


def render(checks: list[Check]) -> str:
    width = max((len(c.name) for c in checks), default=10)
    lines = [f"stepwatch doctor on {socket.gethostname()} ({time.strftime('%Y-%m-%d %H:%M:%S')})"]
    for c in checks:
        lines.append(f"  [{c.status:<4}] {c.name:<{width}}  {c.summary}")
        if c.action:
            lines.append(f"  {'':6} {'':<{width}}  -> {c.action}")
    fails = sum(c.status == "fail" for c in checks)
    warns = sum(c.status == "warn" for c in checks)
    lines.append(f"{fails} failed, {warns} warning(s), {len(checks)} checks")
    return "\n".join(lines)


def _validate(args: argparse.Namespace) -> None:
    """Bad arguments fail before any check runs, naming the argument (the storage test's numbers
    with or without ``--storage``: a bad one is a mistake either way; a good one without
    ``--storage`` is one too). Fills in the storage test's defaults."""
    if args.storage is not None and not os.path.isdir(args.storage):
        raise ValueError(f"--storage {args.storage!r}: not an existing directory")
    if args.storage_size_mb is not None and args.storage_size_mb < 1:
        raise ValueError(f"--storage-size-mb must be >= 1, got {args.storage_size_mb}")
    if args.storage_jobs is not None and not 1 <= args.storage_jobs <= MAX_JOBS:
        raise ValueError(f"--storage-jobs must be between 1 and {MAX_JOBS}, got {args.storage_jobs}")
    if args.storage_seconds is not None and not args.storage_seconds > 0:
        raise ValueError(f"--storage-seconds must be > 0, got {args.storage_seconds}")
    given = [(o, v) for o, v in (("--storage-size-mb", args.storage_size_mb), ("--storage-seconds", args.storage_seconds),
                                 ("--storage-jobs", args.storage_jobs)) if v is not None]
    if given and args.storage is None:  # no storage test runs: they were ignored without a word
        o, v = given[0]
        raise ValueError(f"{o} {v:g} applies with --storage PATH only (the storage test); add --storage PATH, "
                         "or leave it out")
    if args.storage_size_mb is None:
        args.storage_size_mb = STORAGE_SIZE_MB
    if args.storage_seconds is None:
        args.storage_seconds = STORAGE_SECONDS
    if args.storage_jobs is None:
        args.storage_jobs = STORAGE_JOBS


class _Terminated(BaseException):
    """SIGTERM, raised on the main thread so that what a check started is undone on the way out."""


def _on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the clean-up is not interrupted again
    raise _Terminated()


def _stopped(args: argparse.Namespace, why: str) -> None:
    left = f"; no storage test files left in {args.storage}" if args.storage else ""
    print(f"stepwatch doctor: stopped by {why} before the checks finished{left}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        _validate(args)
    except ValueError as e:  # bad arguments: say which
        print(f"stepwatch doctor: {e}", file=sys.stderr)
        return 2
    # SIGTERM's default action would end the process in the middle of the storage test and leave
    # its files (up to --storage-size-mb each) behind: turned into an exception like Ctrl-C's.
    caught = False
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # not when ignored, or someone else's
            signal.signal(signal.SIGTERM, _on_sigterm)
            caught = True
    except ValueError:  # not the main thread (called from Python): left as it is
        pass
    try:
        checks = collect(args)
    except ValueError as e:  # bad arguments: say which
        print(f"stepwatch doctor: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _stopped(args, "Ctrl-C (SIGINT)")
        return 130  # 128 + SIGINT, as a shell reports it
    except _Terminated:
        _stopped(args, "SIGTERM")
        sys.stdout.flush()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # die of it, as the default action would have
        return 128 + signal.SIGTERM  # not reached
    finally:
        if caught:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    code = 1 if any(c.status == "fail" for c in checks) else 0
    if args.json:
        print(json.dumps({"host": socket.gethostname(), "time": time.time(), "exit_code": code,
                          "checks": [c.to_dict() for c in checks]}, indent=2, default=str))
    else:
        print(render(checks))
    return code
