"""``stepwatch serve-vllm``: run (or attach to) a vLLM server and watch it.

    stepwatch serve-vllm [--run-dir D] [--stall-timeout S] [options] -- python -m vllm.entrypoints.openai.api_server ...
    stepwatch serve-vllm --attach http://127.0.0.1:8000 [--pid PID] [options]

Launched: the server runs as a child in its own process group (``--enable-server-load-tracking``
is added to a vLLM command); SIGINT/SIGTERM are forwarded to it, the whole process tree is stopped
when it or the wrapper ends, and the wrapper exits with the server's exit code (127 when the
command cannot be started, as ``stepwatch run``; 2 for bad arguments).
Attached with --pid, the watch ends when that process does: one line naming it, the findings
written, exporters flushed, exit status 3 (its own exit code is not ours to read); a --pid with no
running process is refused at start (2). Without --pid an attached watch runs until stopped.
Findings go to ``D/findings.serve.jsonl`` and to stderr; stall dumps to ``D/stall-<n>/``; the
``stepwatch_serving_*`` metrics to a Prometheus endpoint (``--prometheus-port``) and/or OTLP
(the standard ``OTEL_EXPORTER_OTLP_*`` variables).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
import time
from typing import Any

from .._argtypes import positive
from .._files import make_private_dir, private_run_dir

# The exit status of an attached watch whose --pid exited: neither 0 (stopped by SIGINT/SIGTERM),
# 1 (a stepwatch error), 2 (bad arguments) nor 127 (cannot start), so a supervisor can tell.
EXIT_SERVER_GONE = 3
# Once the watched server is gone, how long the watcher's last pass may take: a pass against a
# closed port ends at once; one in a call to a socket an orphan still holds would wait out the
# 10 s HTTP timeout (or --grace) for an answer that cannot matter any more.
GONE_JOIN_S = 1.0


# argparse's message already names the option ("argument --grace: ..."): these say what is valid
# (stepwatch/_argtypes.py holds the ones other commands use too).


def _seconds_or_zero(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {s!r}")
    return v


def _url(s: str) -> str:
    """An http(s) URL with a host (``localhost:8000`` has no scheme: urllib would not fetch it)."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(s)
        ok = u.scheme in ("http", "https") and bool(u.hostname)
        if ok:
            u.port  # noqa: B018  (raises ValueError on a port out of range or not a number)
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"expected an http(s) URL like http://127.0.0.1:8000, got {s!r}")
    return s


def _ratio(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number within (0, 1], got {s!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number within (0, 1], got {s!r}")
    return v


def _port(s: str) -> int:
    """A TCP port to listen on, 1-65535 (as ``STEPWATCH_PROMETHEUS_PORT``; 0, "any free port",
    would serve on a port nobody is told)."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port 1-65535, got {s!r}") from None
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 1-65535, got {s!r}")
    return v


def _windows(s: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds like 60,300, got {s!r}") from None
    if not out or any(not (w > 0 and math.isfinite(w)) for w in out):
        raise argparse.ArgumentTypeError(f"expected positive seconds like 60,300, got {s!r}")
    return out


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve-vllm",
        help="run or attach to a vLLM server: SLO metrics, KV-cache/queue/TTFT findings, stall dumps",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--run-dir", metavar="D", help="where findings and stall dumps go (default ./stepwatch-runs/serve-<time>)")
    p.add_argument("--stall-timeout", type=positive(float), default=60.0, metavar="S",
                   help="seconds without token progress, with requests in flight, that make a stall (default 60)")
    p.add_argument("--interval", type=positive(float), default=2.0, metavar="S",
                   help="seconds between scrapes (default 2)")
    p.add_argument("--attach", action="append", type=_url, metavar="URL",
                   help="watch a running server instead of launching one (repeat for several API servers)")
    p.add_argument("--pid", type=positive(int), metavar="PID",
                   help="with --attach: the server's top process, for stall stacks; the watch ends (exit status 3) when it exits")
    p.add_argument("--url", action="append", type=_url, metavar="URL",
                   help="launched: scrape this URL instead of the one from the command's --host/--port (repeatable)")
    p.add_argument("--ttft-slo", type=positive(float), metavar="S",
                   help="TTFT P99 SLO in seconds: a finding when the P99 over --slo-window exceeds it (default off)")
    p.add_argument("--e2e-slo", type=positive(float), metavar="S",
                   help="end-to-end latency P99 SLO in seconds, over --slo-window (default off)")
    p.add_argument("--itl-threshold", type=positive(float), default=0.1, metavar="S",
                   help="inter-token latency (was TPOT) P99 above which a finding fires, seconds (default 0.1, reference B.6)")
    p.add_argument("--max-num-seqs", type=positive(int), metavar="N",
                   help="the server's max_num_seqs, for the batch-full finding (default: read from the launched "
                        "command's --max-num-seqs; attached: off unless given)")
    p.add_argument("--queue-threshold", type=positive(float), default=50.0, metavar="N",
                   help="requests waiting above which a queue_depth finding fires (default 50, reference B.6)")
    p.add_argument("--kv-threshold", type=_ratio, default=0.82, metavar="R",
                   help="KV-cache usage (0-1) for the cascade finding (default 0.82, reference B.6)")
    p.add_argument("--kv-sustain", type=_seconds_or_zero, default=30.0, metavar="S",
                   help="seconds the KV-cache usage must stay above the threshold (default 30)")
    p.add_argument("--spec-threshold", type=_ratio, default=0.65, metavar="R",
                   help="speculative-decoding acceptance below which a finding fires (default 0.65, reference B.6)")
    p.add_argument("--error-threshold", type=_ratio, default=0.05, metavar="R",
                   help="share of failed requests that makes a serving_errors finding (default 0.05)")
    p.add_argument("--slo-window", type=positive(float), default=300.0, metavar="S",
                   help="window of the TTFT, spec-decode and error findings, seconds (default 300, as B.7's [5m])")
    p.add_argument("--windows", type=_windows, default="60,300", metavar="S,S",
                   help="windows of the exported quantiles and rates, seconds (default 60,300)")
    p.add_argument("--prometheus-port", type=_port, metavar="PORT",
                   help="serve the stepwatch_serving_* metrics on this TCP port, 1-65535 (default off)")
    p.add_argument("--prometheus-host", default="127.0.0.1", metavar="HOST", help="(default 127.0.0.1)")
    p.add_argument("--grace", type=positive(float), default=20.0, metavar="S",
                   help="seconds the server gets to stop after SIGTERM before its tree is killed (default 20)")
    p.add_argument("--no-load-tracking", action="store_true",
                   help="do not add --enable-server-load-tracking to the vLLM command")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the server command")
    p.set_defaults(func=run)


def build_exporters(args: argparse.Namespace, run_id: str, run_dir: str) -> list[Any]:
    """stepwatch's OTel exporter (Prometheus endpoint and/or OTLP) when asked for; else none."""
    from ..exporters.builtin import otlp_configured

    if args.prometheus_port is None and not otlp_configured():
        return []
    try:
        from ..context import RunContext
        from ..exporters.otel import OTelExporter
    except ImportError as e:
        print(f"stepwatch serve-vllm: metrics export is off: {e} (pip install opentelemetry-sdk "
              "opentelemetry-exporter-otlp)", file=sys.stderr)
        return []
    import socket

    ctx = RunContext(rank=0, local_rank=0, world_size=1, host=socket.gethostname(), run_id=run_id,
                     run_dir=run_dir, pid=os.getpid())
    return [OTelExporter(ctx, prometheus_port=args.prometheus_port, prometheus_host=args.prometheus_host,
                         prometheus_settings=("--prometheus-port", "--prometheus-host"), finding_kinds=False)]



def default_run_id() -> str:
    """``serve-<time>-<pid>``: two watchers started in one second wrote one run directory (one
    findings file, one ``stall-1/``) while the id was the time alone."""
    return time.strftime("serve-%Y%m%d-%H%M%S") + f"-{os.getpid()}"

def run(args: argparse.Namespace) -> int:
    from .._log import logger
    from .._os import procs
    from .detect import Thresholds
    from .watcher import ServeWatcher, WatchConfig

    cmd = list(args.command or [])
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if bool(cmd) == bool(args.attach):
        print("stepwatch serve-vllm: give either a server command after `--` or --attach URL", file=sys.stderr)
        return 2
    if args.pid is not None and not args.attach:
        print("stepwatch serve-vllm: --pid goes with --attach (a launched server's pid is known)", file=sys.stderr)
        return 2
    watched = None  # the --pid process (its start time tells it from a later one with its pid)
    if args.pid is not None:
        watched = procs.read_stat(args.pid)
        if watched is None or not procs.alive(watched.pid, watched.starttime):
            print(f"stepwatch serve-vllm: error: argument --pid: no process {args.pid} is running "
                  "(give the server's top process)", file=sys.stderr)
            return 2
    run_id = default_run_id()
    try:
        run_dir = private_run_dir(args.run_dir or os.path.join("stepwatch-runs", run_id))
        make_private_dir(run_dir)  # now, before a server starts: it was made later, unguarded
    except OSError as e:
        print(f"stepwatch serve-vllm: error: cannot use the run directory ({e}); choose another with --run-dir", file=sys.stderr)
        return 2
    seqs = args.max_num_seqs
    if seqs is None and cmd:
        from .wrapper import max_num_seqs

        seqs = max_num_seqs(cmd)
    try:
        thresholds = Thresholds(
            kv_cache=args.kv_threshold, kv_sustain_s=args.kv_sustain, queue_depth=args.queue_threshold,
            ttft_p99_s=args.ttft_slo, spec_acceptance=args.spec_threshold, error_ratio=args.error_threshold,
            e2e_p99_s=args.e2e_slo, itl_p99_s=args.itl_threshold, max_num_seqs=seqs,
            prefill_window_s=args.slo_window,
        )
    except ValueError as e:
        print(f"stepwatch serve-vllm: {e}", file=sys.stderr)
        return 2

    server = None
    if cmd:
        from .._os.procs import reap_zombies, set_child_subreaper
        from .wrapper import VllmServer

        # Orphans of the server (an engine whose API server died) re-parent to us, not to init.
        set_child_subreaper()
        server = VllmServer(cmd, add_load_tracking=not args.no_load_tracking, die_with_parent=True)
        urls = args.url or [server.url]
    else:
        urls = args.attach
    try:
        cfg = WatchConfig(urls=urls, run_dir=run_dir, interval_s=args.interval, stall_timeout_s=args.stall_timeout,
                          windows_s=args.windows, slo_window_s=args.slo_window, thresholds=thresholds)
    except ValueError as e:
        print(f"stepwatch serve-vllm: {e}", file=sys.stderr)
        return 2
    exporters = build_exporters(args, run_id, run_dir)

    stop = threading.Event()  # the watcher's: set by this thread once the loop below ends
    interrupts = Interrupts(server)
    got = interrupts.got
    server_gone = False  # the watch ended because the --pid process did

    old = {s: signal.signal(s, interrupts.handler) for s in (signal.SIGINT, signal.SIGTERM)}
    watcher = None
    t: threading.Thread | None = None
    try:
        if server is not None:
            try:
                server.start()
            except OSError as e:  # missing, not executable: one line, the shell's status
                from ..runner.cli import cannot_start

                for ex in exporters:
                    ex.shutdown()
                return cannot_start("serve-vllm", server.cmd[0], e)
            logger.info("serve-vllm: started pid %d: %s; watching %s; run dir %s", server.pid, " ".join(server.cmd), ", ".join(urls), run_dir)
        # on_gone: the end of the server is found and said here, once (below), not also as the
        # watcher's "is gone ... (still watching the URL)".
        watcher = ServeWatcher(cfg, exporters=exporters, root_pid=(server.pid if server is not None else args.pid),
                               on_gone=lambda url, pid: None)
        t = threading.Thread(target=watcher.run, args=(stop,), name="stepwatch-serve-watch", daemon=True)
        t.start()
        while not got:
            if server is not None:
                server.refresh_tree()
                if server.poll() is not None:
                    logger.info("serve-vllm: the server (pid %d) exited with %s", server.pid, server.exit_code())
                    break
                reap_zombies_safe(server)
            elif watched is not None and not procs.alive(watched.pid, watched.starttime):
                # The pid, not the scrapes: a server whose orphaned children still hold its socket
                # leaves them hanging, not refused; the start time tells a re-used pid apart.
                logger.warning("stepwatch serve-vllm: the watched server (--pid %d) has exited; stopping the watch "
                               "(run dir %s; exit status %d)", watched.pid, run_dir, EXIT_SERVER_GONE)
                server_gone = True
                break
            interrupts.sleep(0.5)
    finally:
        stop.set()
        rc = EXIT_SERVER_GONE if server_gone else 0
        # The server first: the watcher may sit in a 10 s HTTP call to a hung server (or in a
        # stall dump), and joining it first made shutdown take far longer than --grace.
        if server is not None:
            rc = server.stop(got[-1] if got else signal.SIGTERM, grace_s=args.grace)
            reap_zombies()
        if watcher is not None and t is not None:
            # Once the server is gone its calls fail at once; attached, a hung server's call
            # gets --grace to end, and GONE_JOIN_S once its --pid has exited (an orphan may still
            # hold the socket). A daemon thread still in a call is left to the exit.
            t.join(min(args.grace, GONE_JOIN_S) if server_gone else args.grace)
            if t.is_alive() and not server_gone:
                logger.info("serve-vllm: the watcher is still in a call to the server; not waiting for it")
        if watcher is not None:
            watcher.close()
        for s, h in old.items():
            signal.signal(s, h)
    return rc


class Interrupts:
    """SIGINT/SIGTERM for the wrapper's main loop: ``handler`` records the signal and passes it on
    to the server, and takes no lock. It used to set the watch's ``threading.Event``: a signal
    that landed while the main thread was inside that Event's ``wait``, holding its lock, made
    the handler wait for that lock forever, and ``serve-vllm`` never exited after SIGTERM (seen
    once in the suite, the server stopped and the wrapper asleep). ``sleep`` ends within 50 ms
    of a signal."""

    def __init__(self, server: Any = None) -> None:
        self.server = server
        self.got: list[int] = []

    def handler(self, signum: int, frame: Any) -> None:
        self.got.append(signum)
        if self.server is not None:
            self.server.send_signal(signum)  # the server shuts its tree down itself; we wait for it

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self.got:
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.05))


def reap_zombies_safe(server: Any) -> None:
    """Reap adopted orphans while the server runs, never the server itself (Popen reaps that)."""
    import os as _os

    from .._os import procs

    for p in procs.tree(_os.getpid()):
        if p.state == "Z" and p.ppid == _os.getpid() and p.pid != server.pid:
            try:
                _os.waitpid(p.pid, _os.WNOHANG)
            except ChildProcessError:
                pass
