"""``stepwatch rules`` and ``stepwatch dashboard``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .._argtypes import grafana_uid, non_empty, positive


def register(sub: Any) -> None:
    p = sub.add_parser(
        "rules",
        help="write Prometheus alerting rules (training, GPU health, serving)",
        description="Write Prometheus alerting rules for stepwatch's training metrics, GPU health under the "
        "DCGM exporter's names, and vLLM serving; --tests also writes a `promtool test rules` file.",
    )
    p.add_argument("-o", "--output", default="-", help="rules file, its missing folders made (default: stdout)")
    p.add_argument("--tests", metavar="FILE", help="also write a promtool test file for the rules (needs -o FILE)")
    p.add_argument("--ttft-p99-slo", type=positive(), default=2.0, metavar="S", help="TTFT P99 SLO in seconds (default 2)")
    p.add_argument("--itl-p99-slo", type=positive(), default=0.1, metavar="S", help="inter-token latency P99 SLO in seconds (default 0.1)")
    p.set_defaults(func=_rules)

    d = sub.add_parser("dashboard", help="write a Grafana dashboard JSON", description="Write a Grafana dashboard for stepwatch's metrics.")
    d.add_argument("-o", "--output", default="-", help="dashboard file, its missing folders made (default: stdout)")
    d.add_argument("--title", type=non_empty, default="stepwatch", help="dashboard title (default stepwatch)")
    d.add_argument("--uid", type=grafana_uid, default="stepwatch",
                   help="dashboard uid: 1-40 letters, digits, '-' or '_' (default stepwatch)")
    d.set_defaults(func=_dashboard)


def _write(path: str, text: str, cmd: str, option: str) -> bool:
    """``text`` to ``path`` (its missing folders made), or to stdout for ``-``. A path that cannot
    be written (a directory, a read-only place) is one line naming it and ``option``, not a
    traceback: False."""
    if path == "-":
        sys.stdout.write(text)
        return True
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        why = e.strerror or str(e)
        if isinstance(e, (FileExistsError, NotADirectoryError)):  # "File exists" named no file
            up = os.path.dirname(os.path.abspath(path))
            while up and not os.path.lexists(up) and up != os.path.dirname(up):
                up = os.path.dirname(up)
            if os.path.lexists(up) and not os.path.isdir(up):
                why = f"{up!r} is a file, not a folder"
        print(f"stepwatch {cmd}: error: cannot write {path!r} ({why}); choose another file with "
              f"{option}", file=sys.stderr)
        return False
    return True


def _rules(args: argparse.Namespace) -> int:
    from . import _yaml, alerts

    if args.tests and args.output == "-":
        print("stepwatch rules: --tests needs -o FILE (the test file names the rules file)", file=sys.stderr)
        return 2
    # -o F --tests F wrote the tests over the rules without a word: compared as resolved paths
    # (another spelling, a symlink).
    if args.tests and os.path.realpath(args.tests) == os.path.realpath(args.output):
        print(f"stepwatch rules: -o FILE and --tests FILE are the same file ({os.path.realpath(args.output)!r}): "
              "the tests would overwrite the rules; give the test file another name", file=sys.stderr)
        return 2
    t = alerts.Thresholds(ttft_p99_s=args.ttft_p99_slo, itl_p99_s=args.itl_p99_slo)
    al = alerts.build(t)
    header = "Prometheus alerting rules written by `stepwatch rules`. Names: docs/metrics.md."
    if not _write(args.output, _yaml.dump(alerts.rules_doc(al), header), "rules", "-o FILE"):
        return 1
    if args.tests:
        rel = os.path.relpath(os.path.abspath(args.output), os.path.dirname(os.path.abspath(args.tests)))
        doc = _yaml.dump(alerts.tests_doc(al, rel), "Run: promtool test rules " + os.path.basename(args.tests))
        if not _write(args.tests, doc, "rules", "--tests FILE"):
            return 1
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    from . import dashboard

    text = json.dumps(dashboard.build(args.title, args.uid), indent=2) + "\n"
    return 0 if _write(args.output, text, "dashboard", "-o FILE") else 1
