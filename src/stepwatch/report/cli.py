"""``stepwatch report RUN_DIR [--compare OTHER_RUN_DIR] [--html PATH] [--no-html]``."""

from __future__ import annotations

import argparse
import os
import sys

from .._files import write_private


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="summarize a run directory in the terminal and as a self-contained report.html",
        description=(
            "Read a run directory (steps.rank<R>.jsonl, findings.rank<R>.jsonl, run.json), print "
            "a summary, and write an HTML report that opens offline."
        ),
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, e.g. stepwatch-runs/<id>")
    p.add_argument("--compare", metavar="OTHER_RUN_DIR",
                   help="a second run directory to put beside RUN_DIR (A = RUN_DIR, B = this one)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--html", metavar="PATH",
                     help="where to write the HTML report (default: RUN_DIR/report.html, or "
                          "RUN_DIR/compare-<OTHER>.html with --compare)")
    out.add_argument("--no-html", action="store_true", help="print the summary only")
    p.set_defaults(func=run_report)


def default_html_path(run_dir: str, other: str | None) -> str:
    if other is None:
        return os.path.join(run_dir, "report.html")
    # A comparison must not overwrite the run's own report. The directory's own name, not the
    # path as typed: `--compare .` wrote "compare-..html".
    name = os.path.basename(os.path.realpath(other)) or "other"
    return os.path.join(run_dir, f"compare-{name}.html")


def run_report(args: argparse.Namespace) -> int:
    from .. import _terminal as terminal
    from . import page, tables
    from .load import ReportError, load_run
    from .summary import compare, summarize

    try:
        a = summarize(load_run(args.run_dir))
        b = summarize(load_run(args.compare)) if args.compare else None
    except ReportError as e:
        print(f"stepwatch report: error: {e}", file=sys.stderr)
        return 2

    # The page before the summary: a reader that stops early (`stepwatch report RUN | head`)
    # ends the printing (cli.main), and the report.html written unasked must be this run's all the
    # same, not missing or one of before.
    path: str | None = None
    html_error: OSError | None = None
    if not args.no_html:
        path = args.html or default_html_path(args.run_dir, args.compare)
        text = page.render_html(a) if b is None else page.render_compare_html(a, b)
        # Inside the run directory the report keeps the records' privacy (the writer makes them
        # 0600): it holds the same command line and hosts. A path of the user's choice gets the
        # usual umask. Atomic, never through a planted link (a reader never sees half a page).
        try:
            write_private(path, text, mode=0o666 if args.html else 0o600)
        except OSError as e:
            html_error = e

    if b is None:
        job = a.run.path  # where the records were read (a shared run dir's private-<uid>), as the page
        terminal.render(tables.all_tables(a) + page.capture_tables(job))
        tl = page.comm_timeline(job)
        if tl:
            print(tl + "\n")
    else:
        ta, tb = tables.all_tables(a), tables.all_tables(b)
        for t, label in ((ta, "A"), (tb, "B")):
            for x in t:
                x.title = f"{label}: {x.title}"
        cmp = tables.comparison(compare(a, b), a.run.name, b.run.name)
        # Run info first so A and B are named, then the side-by-side table, then the details.
        terminal.render([ta[0], tb[0], cmp, ta[3], tb[3], ta[4], tb[4]])

    if path is None:
        return 0
    if html_error is not None:
        print(f"stepwatch report: error: cannot write the HTML report to {path!r} "
              f"({html_error.strerror}); choose another place with --html PATH or skip it with --no-html",
              file=sys.stderr)
        return 1
    print(f"HTML report: {terminal.printable(path)}")
    return 0
