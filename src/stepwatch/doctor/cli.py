"""``stepwatch doctor``: check a node before or during a job, and say what to do.

Exit status: 0 unless a check failed (a GPU with uncorrectable errors, a driver that is installed
but does not answer); a machine without a GPU is not a failure.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from typing import Any

from .checks import Check


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
    p.add_argument("--storage-size-mb", type=int, default=1024, metavar="MB",
                   help="bytes written per job, in MiB (default 1024; bounded by free space)")
    p.add_argument("--storage-seconds", type=float, default=10.0, metavar="S",
                   help="time limit per phase (write, read), seconds (default 10)")
    p.add_argument("--storage-jobs", type=int, default=1, metavar="N",
                   help="parallel streams, one file each (default 1, not graded; the reference grades 16, as its fio)")
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
    from .storage import DEGRADED_GBPS, GRADED_JOBS, HEALTHY_GBPS, measure

    size = args.storage_size_mb * 1024 * 1024
    block = min(4 * 1024 * 1024, size)
    try:
        r = measure(args.storage, size_bytes=size, block_bytes=block, max_seconds=args.storage_seconds,
                    jobs=args.storage_jobs)
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
    """Bad arguments fail before any check runs, naming the argument."""
    if args.storage is not None:
        import os

        if not os.path.isdir(args.storage):
            raise ValueError(f"--storage {args.storage!r}: not an existing directory")
        if args.storage_size_mb < 1:
            raise ValueError(f"--storage-size-mb must be >= 1, got {args.storage_size_mb}")
        if args.storage_jobs < 1:
            raise ValueError(f"--storage-jobs must be >= 1, got {args.storage_jobs}")
        if not args.storage_seconds > 0:
            raise ValueError(f"--storage-seconds must be > 0, got {args.storage_seconds}")


def run(args: argparse.Namespace) -> int:
    try:
        _validate(args)
        checks = collect(args)
    except ValueError as e:  # bad arguments: say which
        print(f"stepwatch doctor: {e}", file=sys.stderr)
        return 2
    code = 1 if any(c.status == "fail" for c in checks) else 0
    if args.json:
        print(json.dumps({"host": socket.gethostname(), "time": time.time(), "exit_code": code,
                          "checks": [c.to_dict() for c in checks]}, indent=2, default=str))
    else:
        print(render(checks))
    return code
