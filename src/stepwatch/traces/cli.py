"""``stepwatch trace PATH... [--json]`` and ``stepwatch capture RUN_DIR [--steps N]``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ENDED_POLL_S = 1.0  # how often `stepwatch capture` checks whether the job has ended while it waits


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "trace",
        help="analyse Kineto/torch.profiler Chrome traces: GPU idle, overlap, kernels, gaps, findings",
        description=("Read Chrome traces (.json or .json.gz; a directory of per-rank traces, stepwatch's "
                     "captures/ included) as a stream and print, per rank, the temporal breakdown, "
                     "comm/compute overlap, idle time per stream, kernels by class, launch delay, the "
                     "largest GPU idle gaps with the CPU op spanning each, and findings with the action "
                     "to take (definitions of Holistic Trace Analysis 0.5.0; docs/traces.md)."),
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="trace file(s) or directory(ies) of traces")
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per rank (docs/traces.md)")
    p.set_defaults(func=run_trace)

    c = subparsers.add_parser(
        "capture",
        help="ask a live job to capture the same N steps on every rank (torch.profiler), analysed",
        description=("Drop a request in RUN_DIR/requests/; rank 0 of the running job picks it up within "
                     "a second, every rank profiles the same N steps, writes its trace to RUN_DIR/captures/ "
                     "and analyses it. Waits for the analyses and prints them. The job must run with "
                     "captures on (under `stepwatch run` or with several ranks, or STEPWATCH_CAPTURE=on); "
                     "a job that has ended (run.json's end_time, or no rank process left) is said at once."),
    )
    c.add_argument("run_dir", metavar="RUN_DIR", help="the live job's run directory")
    c.add_argument("--steps", type=int, default=3, help="steps to capture, 1-100 (default 3)")
    c.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to wait for the job to take the request and analyse it (default 300)")
    c.add_argument("--json", action="store_true", help="print the ranks' analyses as a JSON list")
    c.set_defaults(func=run_capture)


def _print(summaries: list[dict], as_json: bool) -> None:
    """Print the summaries; the ranks are compared only within one capture (``capture_groups``),
    and each group's ``trace_rank_idle`` goes to that group's file of the rank it names."""
    from ..record import Finding
    from .findings import across_ranks, capture_groups

    groups = capture_groups(summaries)
    joined: list[tuple[Finding, list[dict]]] = []
    for label, group in groups:
        for f in across_ranks(group, label=label if len(groups) > 1 else None, context={"group": label}):
            joined.append((f, group))
    if as_json:
        for f, group in joined:
            for s in group:
                if s.get("rank") == f.rank:
                    s["findings"].append(f.to_dict())
        for s in summaries:
            s.pop("_capture", None)
        json.dump(summaries, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    from .. import _terminal as terminal
    from .tables import all_tables

    fs = [Finding.from_dict(f) for s in summaries for f in s.get("findings", [])] + [f for f, _ in joined]
    terminal.render(all_tables(summaries, fs, files=True))


def run_trace(args: argparse.Namespace) -> int:
    from . import TraceFormatError, analyse_with_findings, trace_files

    try:
        paths = trace_files(args.paths)
    except FileNotFoundError as e:
        print(f"stepwatch trace: error: {e}", file=sys.stderr)
        return 2
    if not paths:
        print(f"stepwatch trace: error: no .json or .json.gz trace in {args.paths}", file=sys.stderr)
        return 2
    out, rc = [], 0
    for p in paths:
        try:
            out.append(analyse_with_findings(p))
        except (TraceFormatError, OSError, EOFError) as e:
            msg = str(e) if str(e).startswith(p) else f"{p}: {e}"  # TraceFormatError names the file
            print(f"stepwatch trace: error: {msg}", file=sys.stderr)
            rc = 1
        except Exception as e:  # noqa: BLE001 - a trace this analysis did not foresee: say so, go on with the others
            print(f"stepwatch trace: error: {p}: could not be analysed ({type(e).__name__}: {e})", file=sys.stderr)
            rc = 1
    if out or args.json:  # --json: a JSON list always, empty when no trace could be read
        _print(out, args.json)
    return rc


def _readable_dir(path: str) -> bool:
    """This user may list ``path`` (tried, not ``os.access``: that asks for the real uid)."""
    try:
        os.listdir(path)
    except PermissionError:
        return False
    except OSError:
        return True  # another problem: the checks after this one say it
    return True


def run_capture(args: argparse.Namespace) -> int:
    from .._files import job_dir
    from . import rundir

    # Everything of the job -- its manifest, ranks, requests/, captures/ -- is where it wrote.
    run_dir = job_dir(args.run_dir)
    err = None
    if not 1 <= args.steps <= rundir.MAX_STEPS:
        err = f"--steps must be between 1 and {rundir.MAX_STEPS}, got {args.steps}"
    elif not args.timeout > 0:
        err = f"--timeout must be > 0 seconds, got {args.timeout}"
    elif os.path.isdir(run_dir) and not _readable_dir(run_dir):
        # another user's job: its run dir is 0700 (not "no run.json": it may well have one)
        err = (f"RUN_DIR {args.run_dir!r} cannot be read (permission denied): ask for a capture as the user "
               "that runs the job (or root)")
    elif not os.path.isfile(os.path.join(run_dir, "run.json")):
        err = f"RUN_DIR {args.run_dir!r} is not a stepwatch run directory (no run.json)"
    else:
        # a finished job, or one with captures off, takes no request: say so now, not after --timeout
        err = rundir.run_ended(run_dir) or rundir.captures_off(run_dir)
    if err:
        print(f"stepwatch capture: error: {err}", file=sys.stderr)
        return 2
    try:
        with open(os.path.join(run_dir, "run.json"), encoding="utf-8") as f:
            world = int(json.load(f).get("world_size") or 1)
    except (OSError, ValueError, TypeError):
        world = 1
    try:
        rid = rundir.request_capture(run_dir, args.steps)
    except OSError as e:  # a run dir others may read, not write: the request is the job's user's to make
        print(f"stepwatch capture: error: cannot write the request into {rundir.request_dir(run_dir)!r} "
              f"({e.strerror or e}): ask for a capture as the user that runs the job (or root)", file=sys.stderr)
        return 2
    d = rundir.request_dir(run_dir)
    deadline = time.monotonic() + args.timeout
    taken = os.path.join(d, f"capture-{rid}.taken.json")
    answer = ended = None
    checked = time.monotonic()
    while time.monotonic() < deadline:
        answer = rundir._read(taken)
        if answer is not None:
            break
        if time.monotonic() - checked >= ENDED_POLL_S:
            checked = time.monotonic()
            ended = rundir.run_ended(run_dir)
            if ended:
                answer = rundir._read(taken)  # taken just before the end: go on with it
                break
        time.sleep(0.2)
    if answer is None:
        try:
            os.unlink(os.path.join(d, f"capture-{rid}.json"))
        except OSError:
            pass
        if ended:
            print(f"stepwatch capture: error: {ended}, before any rank took the request", file=sys.stderr)
        else:
            print(f"stepwatch capture: error: no rank took the request within {args.timeout:.0f} s: is the job "
                  "running, with captures on (STEPWATCH_CAPTURE=on, or `stepwatch run`)?", file=sys.stderr)
        return 1
    if "refused" in answer:
        print(f"stepwatch capture: the job refused the capture: {answer['refused']}", file=sys.stderr)
        return 1
    k = answer["capture"]
    planned = (answer["first_step"], answer["last_step"])
    print(f"capture {k}: steps {planned[0]}-{planned[1]} on {world} rank(s)", file=sys.stderr)
    got: list[dict] = []
    skips: list[dict] = []
    while time.monotonic() < deadline:
        got = rundir.capture_analyses(run_dir).get(k, [])
        # A rank that did not take the capture (the job's own profiler, its limits) says so: no
        # analysis of it will come.
        skips = rundir.capture_skips(run_dir, k)
        if len(got) + len(skips) >= world:
            break
        if time.monotonic() - checked >= ENDED_POLL_S:
            checked = time.monotonic()
            # Once the job is gone, only an analysis process still running can add a rank's summary.
            ended = rundir.run_ended(run_dir)
            if ended and not rundir.analyses_pending(run_dir, k):
                got = rundir.capture_analyses(run_dir).get(k, [])
                skips = rundir.capture_skips(run_dir, k)
                break
        time.sleep(0.5)
    for s in skips:
        why = s.get("skipped") or "no reason given"
        if s.get("detail"):
            why = f"{s['detail']} ({why})"
        print(f"stepwatch capture: rank {s['rank']} did not take capture {k}: {why}", file=sys.stderr)
    within = f"({ended})" if ended and len(got) + len(skips) < world else f"within {args.timeout:.0f} s"
    if not got:
        if skips and len(skips) >= world:
            print(f"stepwatch capture: error: capture {k} was not taken", file=sys.stderr)
        else:
            print(f"stepwatch capture: error: capture {k} not analysed {within}", file=sys.stderr)
        return 1
    for s in got:
        s.pop("_capture", None)
    _print(got, args.json)
    # What was captured, where it differs from what was planned (a capture cut short).
    for m in rundir.capture_metas(run_dir, k):
        steps = (m.get("first_step"), m.get("last_step"))
        if steps != planned or m.get("cut_short"):
            cut = f": cut short ({m['cut_short']})" if m.get("cut_short") else ""
            print(f"capture {k}: rank {m['rank']} captured steps {steps[0]}-{steps[1]} of {planned[0]}-{planned[1]}"
                  f"{cut}", file=sys.stderr)
    if len(got) < world:
        if len(got) + len(skips) >= world:  # the others said why above
            print(f"stepwatch capture: only {len(got)} of {world} ranks took capture {k}", file=sys.stderr)
        else:
            print(f"stepwatch capture: only {len(got)} of {world} ranks analysed {within}", file=sys.stderr)
        return 1
    return 0
