"""The scrape loop: every ``interval_s``, read each server's ``/metrics`` and ``/load``, turn the
windows into ``stepwatch_serving_*`` samples and findings, watch for stalls, and hand it all to
stepwatch's exporters as one :class:`~stepwatch.exporters.base.Batch` per pass.

Samples are plain dicts in ``Batch.samples``: ``{"source": "serving", "time": ..., "labels":
{...}, "stepwatch_serving_<name>": value, ...}``. stepwatch's OTel exporter turns every
``stepwatch_*`` key of a sample into a gauge of that name with the sample's ``labels`` as
attributes (``exporters/names.py`` EXTRA_SAMPLE_PREFIX), so the Prometheus endpoint and OTLP carry
them with no serving-specific code there.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .._files import make_private_dir, numbered_subdir, open_private
from .._log import warn_once
from ..exporters.base import Batch, Exporter
from ..record import Finding
from . import names as N
from .detect import Detectors, Thresholds, http_error_ratio
from .parse import ParseErrors, parse_metrics
from .slo import Scrape, Window
from .stall import StallDetector, capture_stall, summary as stall_summary

log = logging.getLogger("stepwatch.serving")

QUANTILES = (0.5, 0.99)
# Bounds: the findings file of one serve-vllm run, the findings kept in memory.
FINDINGS_FILE_BYTES = 16 * 1024 * 1024
FINDINGS_KEPT = 1000
# Windowed series remembered as having had a value (ServeWatcher._had_value): bounded.
MAX_WINDOWED_SERIES = 10_000


@dataclass(kw_only=True)
class WatchConfig:
    urls: Sequence[str]
    run_dir: str
    interval_s: float = 2.0
    # stepwatch default: a minute without a token while requests wait is far beyond any decode
    # step (ms on a GPU, < 1 s on this project's CPU test server).
    stall_timeout_s: float = 60.0
    # Windows of the exported quantiles and rates; B.7's queries use [1m] (tokens/s) and [5m] (P99).
    windows_s: tuple[float, ...] = (60.0, 300.0)
    # Window of the TTFT, spec-decode and error findings: B.7's TTFT P99 query uses [5m].
    slo_window_s: float = 300.0
    thresholds: Thresholds = field(default_factory=Thresholds)
    # Prometheus's default scrape_timeout. An overloaded API server answers slowly, and that is
    # when its numbers matter: at 3 s a run here lost every scrape of a 64-request burst on a
    # busy machine, and a minute of unanswered scrapes with requests in flight reads as a stall.
    http_timeout_s: float = 10.0
    max_stall_dumps: int = 5
    pyspy: str | None = None  # None: found next to this Python or on PATH
    # A URL that has never answered is warned about after this long (a server loading its model
    # is silent for a while), one that answered and stopped at once; either again at most every
    # ``silent_repeat_s`` while it stays silent.
    silent_warn_s: float = 30.0
    silent_repeat_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("urls: need at least one server URL (http://host:port)")
        for u in self.urls:
            if not (u.startswith(("http://", "https://")) and urllib.parse.urlsplit(u).hostname):
                raise ValueError(f"urls: {u!r} is not an http(s) URL (e.g. http://127.0.0.1:8000)")
        for name in ("interval_s", "stall_timeout_s", "slo_window_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if not self.windows_s or any(not (w > 0 and math.isfinite(w)) for w in self.windows_s):
            raise ValueError(f"windows_s must be positive seconds, got {self.windows_s!r}")
        if self.max_stall_dumps < 0:
            raise ValueError(f"max_stall_dumps must be >= 0, got {self.max_stall_dumps!r}")
        for name in ("silent_warn_s", "silent_repeat_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)!r}")


def _window_label(s: float) -> str:
    return f"{s / 60:g}m" if s >= 60 and s % 60 == 0 else f"{s:g}s"


class _Server:
    def __init__(self, url: str, keep_s: float) -> None:
        self.url = url.rstrip("/")
        self.history: deque[Scrape] = deque()
        self.keep_s = keep_s
        self.ever_up = False
        self.load_supported: bool | None = None
        # The current outage: since when (mono), the last error, whether the connection was
        # refused (nothing listens: gone or restarting, not stuck); when it was last warned about.
        self.down_since: float | None = None
        self.error = ""
        self.refused = False
        self.warned_mono: float | None = None
        self.outage_warned = False  # this outage was warned about (then its end is said too)
        self.gone_warned = False
        # The series last exported for this server: (labels, value names), set to NaN once when
        # it stops answering (a dead server's last values stayed served: "4 requests running").
        self.emitted: list[tuple[dict[str, str], list[str]]] = []

    def add(self, s: Scrape) -> None:
        self.history.append(s)
        while len(self.history) > 2 and s.mono - self.history[1].mono >= self.keep_s:
            self.history.popleft()

    def window(self, seconds: float) -> Window | None:
        """From the oldest scrape no more than ``seconds`` back (plus half a tick) to the newest."""
        if not self.history:
            return None
        hist = list(self.history)
        new = hist[-1]
        i = next((i for i, s in enumerate(hist[:-1]) if new.mono - s.mono <= seconds * 1.05), None)
        if i is None and len(hist) >= 2:
            i = len(hist) - 2
        if i is None:
            return Window(None, new)
        return Window(hist[i], new, hist[i + 1:-1])


class ServeWatcher:
    """Watches one or more API servers of one deployment. ``root_pid``: the server's top process
    (an int or a callable returning it), whose whole tree is dumped on a stall. ``on_gone(url,
    pid)``: called (from the watching thread, once per outage) instead of the "is gone" warning
    when a URL refuses and ``root_pid`` has exited, for an owner that ends the watch and says so
    itself; without it the watcher warns and keeps watching the URL."""

    def __init__(
        self,
        config: WatchConfig,
        *,
        exporters: Sequence[Exporter] = (),
        root_pid: int | Callable[[], int | None] | None = None,
        opener: urllib.request.OpenerDirector | None = None,
        on_gone: Callable[[str, int], None] | None = None,
    ) -> None:
        self.cfg = config
        self.exporters = list(exporters)
        self._root_pid = root_pid
        self._on_gone = on_gone
        keep = max(max(config.windows_s), config.slo_window_s) + 2 * config.interval_s
        self.servers = [_Server(u, keep) for u in config.urls]
        self.detectors = Detectors(config.thresholds)
        self.stall = StallDetector(config.stall_timeout_s)
        self.parse_errors = ParseErrors()
        self.scrape_failures = 0
        self.export_failures = 0
        self.stalls = 0
        # The windowed series (a quantile, a ratio) that have had a value: an empty window sets
        # them to NaN from then on, not leaving the last burst's value served (_samples).
        self._had_value: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        self.stall_reports: list[dict[str, Any]] = []
        self._in_flight_shown = False  # the last pass exported an in-flight count
        self.findings: deque[Finding] = deque(maxlen=FINDINGS_KEPT)
        # The same rate limit as a training session's (analysis/ratelimit.py), in seconds: one
        # finding per episode, repeated at most every 20 SLO windows, with its count.
        from ..analysis.ratelimit import FindingLimiter

        self.limiter = FindingLimiter(config.slo_window_s, 20, position=lambda f: f.time, unit="s")
        # Loopback servers: never through an HTTP proxy from the environment.
        self._opener = opener or urllib.request.build_opener(urllib.request.ProxyHandler({}))
        make_private_dir(config.run_dir)
        self.findings_path = os.path.join(config.run_dir, "findings.serve.jsonl")
        # The file's bound counts what an earlier watcher of this run dir wrote (a supervisor's
        # restart appended up to another FINDINGS_FILE_BYTES each time).
        try:
            self._findings_bytes = os.stat(self.findings_path).st_size
        except OSError:
            self._findings_bytes = 0
        self._lock = threading.Lock()
        self.last_error: BaseException | None = None  # why the last _get got no answer
        if config.pyspy is None:
            from .._os.ptrace import find_pyspy

            self.pyspy = find_pyspy()
        else:
            self.pyspy = config.pyspy

    # -- HTTP ------------------------------------------------------------------------------------

    def _get(self, url: str) -> tuple[int, bytes] | None:
        """(status, body), or None when no answer came (``self.last_error`` says why)."""
        self.last_error = None
        try:
            with self._opener.open(url, timeout=self.cfg.http_timeout_s) as r:
                return r.status, r.read(32 * 1024 * 1024)
        except urllib.error.HTTPError as e:
            return e.code, b""
        except (OSError, ValueError, http.client.HTTPException) as e:
            # refused, timeout, reset, bad URL; a reply cut short or no HTTP at all (IncompleteRead,
            # BadStatusLine: HTTPException, no OSError) escaped and ended every pass, for every server
            log.debug("GET %s failed: %r", url, e)
            self.last_error = e
            return None

    @staticmethod
    def _why(e: BaseException | None) -> tuple[str, bool]:
        """(what went wrong in words, whether the connection was refused)."""
        reason = e.reason if isinstance(e, urllib.error.URLError) and isinstance(e.reason, BaseException) else e
        if isinstance(reason, ConnectionRefusedError):
            return "connection refused", True
        if isinstance(reason, TimeoutError):
            return "no answer within the timeout", False
        if isinstance(e, urllib.error.URLError):
            return str(e.reason), False
        return (str(e) or type(e).__name__) if e is not None else "no response", False

    def _server_gone(self) -> int | None:
        """The server's pid when it is known and has exited, else None."""
        from .._os import procs

        try:
            pid = self.root_pid()
        except Exception:  # a callable from the embedding code: never fatal here
            return None
        return pid if pid is not None and not procs.alive(pid) else None

    def _down(self, srv: _Server, status: int | None) -> None:
        """A scrape got no good answer: count it, and say so at most rarely."""
        now = time.monotonic()
        if status is None:
            srv.error, srv.refused = self._why(self.last_error)
        else:
            srv.error, srv.refused = f"HTTP {status}", False
        if srv.down_since is None:
            srv.down_since = now
        if srv.ever_up:
            self.scrape_failures += 1
        gone = self._server_gone() if srv.refused else None
        if gone is not None:
            if not srv.gone_warned:
                srv.gone_warned = True
                if self._on_gone is not None:
                    try:
                        self._on_gone(srv.url, gone)
                    except Exception as e:  # the embedding code's: never fatal here
                        self._warn_once("on_gone", "stepwatch serve-vllm: on_gone failed: %r", e)
                    return
                log.warning("stepwatch serve-vllm: the server at %s (pid %d) is gone: the connection is refused "
                            "and the process has exited; no stall is reported for it (still watching the URL)",
                            srv.url, gone)
            return
        if srv.warned_mono is not None and now - srv.warned_mono < self.cfg.silent_repeat_s:
            return
        silent_for = now - srv.down_since
        if srv.ever_up:  # it answered before: say so at the first failure
            srv.warned_mono, srv.outage_warned = now, True
            log.warning("stepwatch serve-vllm: %s/metrics did not answer (%s)%s; counted in %s", srv.url, srv.error,
                        f" for {silent_for:.0f} s" if silent_for > 0 else "", N.OUT_SCRAPE_ERRORS)
        elif silent_for >= self.cfg.silent_warn_s:
            srv.warned_mono, srv.outage_warned = now, True
            log.warning("stepwatch serve-vllm: %s/metrics has not answered for %.0f s (%s): is the URL right, and "
                        "is the server up? Still trying", srv.url, silent_for, srv.error)

    def _up(self, srv: _Server) -> None:
        if srv.down_since is not None and (srv.outage_warned or srv.gone_warned):
            log.warning("stepwatch serve-vllm: %s answers again", srv.url)
        srv.ever_up = True
        srv.down_since, srv.error, srv.refused, srv.gone_warned, srv.outage_warned = None, "", False, False, False

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        warn_once(f"serving.{key}", msg, *args, log=log)

    def scrape(self, srv: _Server) -> Scrape | None:
        got = self._get(srv.url + "/metrics")
        if got is None or got[0] != 200:
            self._down(srv, None if got is None else got[0])
            return None
        self._up(srv)
        text = got[1].decode("utf-8", "replace")
        return Scrape(time.monotonic(), time.time(), parse_metrics(text, self.parse_errors))

    def in_flight(self, srv: _Server, scrape: Scrape | None) -> float | None:
        """Requests in flight at this API server: the larger of ``/load`` and running + waiting
        from /metrics when both are known, else whichever is. vLLM counts requests at ``/load``
        only with --enable-server-load-tracking, yet 0.32 answers ``{"server_load": 0}`` without
        it too, so a 0 there cannot be trusted over an engine that reports requests; and the
        engine's gauges freeze with a frozen engine (a weaker signal), so they cannot be trusted
        over a ``/load`` that counts more. None: unknown (the server did not answer)."""
        load: float | None = None
        if srv.load_supported is not False:
            got = self._get(srv.url + "/load")
            if got is not None and got[0] == 200:
                try:
                    load = float(json.loads(got[1])["server_load"])
                    srv.load_supported = True
                except (ValueError, KeyError, TypeError):
                    pass
            if got is not None and got[0] == 404:
                srv.load_supported = False
                self._warn_once(f"load:{srv.url}", "stepwatch serve-vllm: %s has no /load; start vLLM with "
                                "--enable-server-load-tracking for reliable stall detection", srv.url)
            elif got is None:
                return None
        if scrape is None:
            return load
        w = Window(None, scrape)
        engine = sum(w.gauge(N.RUNNING).values()) + sum(w.gauge(N.WAITING).values())
        return engine if load is None else max(load, engine)

    # -- one pass --------------------------------------------------------------------------------

    def tick(self) -> Batch:
        batch = Batch()
        progress: list[float] = [0.0, 0.0, 0.0]
        progress_known = False
        in_flight: float | None = 0.0
        counted = 0  # servers whose in-flight count is known, or unknown but not refused
        for srv in self.servers:
            sc = self.scrape(srv)
            if sc is None and srv.emitted:  # no data: its series read NaN, as an empty window's
                t = time.time()
                batch.samples.extend({"source": "serving", "time": t, "labels": labels, **dict.fromkeys(keys, math.nan)}
                                     for labels, keys in srv.emitted)
                srv.emitted = []
            if sc is None and srv.refused:
                continue  # nothing listens there: no requests in flight at it, and no /load to ask
            load = self.in_flight(srv, sc)
            counted += 1
            in_flight = None if (in_flight is None or load is None) else in_flight + load
            if sc is None:
                continue
            srv.add(sc)
            w = Window(None, sc)
            progress[0] += sum(w.gauge(N.GEN_TOKENS).values())
            progress[1] += sum(w.gauge(N.PROMPT_TOKENS).values())
            progress[2] += sum(w.gauge(tuple(b + "_count" for b in N.ITERATION_TOKENS)).values())
            progress_known = True
            got = self._samples(srv, load)
            srv.emitted = [(x["labels"], [k for k in x if k not in ("source", "time", "labels")]) for x in got]
            batch.samples.extend(got)
            latest = srv.window(self.cfg.interval_s)
            slo = srv.window(self.cfg.slo_window_s)
            if latest is not None and slo is not None:
                batch.findings.extend(self.detectors.check(srv.url, latest, slo))
        now = time.monotonic()
        # Every server refused the connection: gone (or restarting), not stuck.
        unreachable = counted == 0
        if unreachable:
            in_flight = None
        if not progress_known and not any(s.ever_up for s in self.servers):
            in_flight = 0.0  # still starting: nothing to stall
        began = self.stall.update(now, in_flight=in_flight, progress=tuple(progress) if progress_known else None,
                                  unreachable=unreachable)
        since = self.stall.seconds_since_progress(now)
        # in flight unknown (every server gone): NaN once, not the last count left served
        flight = in_flight if in_flight is not None else (math.nan if self._in_flight_shown else None)
        self._in_flight_shown = in_flight is not None
        batch.samples.append({
            "source": "serving", "time": time.time(), "labels": {"server": ",".join(s.url for s in self.servers)},
            N.OUT_SCRAPE_ERRORS: float(self.parse_errors.count + self.scrape_failures),
            **({N.OUT_SINCE_PROGRESS: since} if since is not None else {}),
            **({N.OUT_IN_FLIGHT: flight} if flight is not None else {}),
        })
        if began:
            batch.findings.append(self._on_stall(in_flight, since or 0.0))
        self._emit(batch)
        return batch

    def run(self, stop: threading.Event) -> None:
        """Tick every ``interval_s`` until ``stop`` is set. Never raises: a failing pass is logged."""
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                self.tick()
            except Exception as e:  # the watcher must outlive any bug of its own
                self._warn_once(f"tick:{type(e).__name__}", "stepwatch serve-vllm: a scrape pass failed: %r", e)
                log.debug("tick failed", exc_info=True)
            # Capped: a wait longer than TIMEOUT_MAX raises OverflowError and would end the watch.
            stop.wait(min(threading.TIMEOUT_MAX, max(0.05, self.cfg.interval_s - (time.monotonic() - t0))))

    def close(self) -> None:
        closing = self.limiter.flush()
        if closing:
            self._emit(Batch(findings=closing), limit=False)
        for e in self.exporters:
            try:
                e.force_flush(5.0)
                e.shutdown()
            except Exception as ex:
                log.warning("stepwatch serve-vllm: exporter %s failed to shut down: %r", getattr(e, "name", e), ex)

    # -- samples ---------------------------------------------------------------------------------

    def _samples(self, srv: _Server, load: float | None) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        last = srv.history[-1]
        now_w = Window(None, last)
        t = last.wall

        def emit(labels: dict[str, str], values: dict[str, float | None], windowed: bool = False) -> None:
            vals = {k: float(v) for k, v in values.items() if v is not None}
            if windowed:
                # No data in the window: NaN where the series had a value (PromQL's
                # histogram_quantile over zero rates gives NaN too); an OTel gauge keeps its last
                # value until told another, and that was the last burst's. Never had one: absent.
                key = tuple(sorted(labels.items()))
                for k, v in values.items():
                    if v is not None:
                        if len(self._had_value) < MAX_WINDOWED_SERIES:
                            self._had_value.add((k, key))
                    elif (k, key) in self._had_value:
                        vals[k] = math.nan
            if vals:
                out.append({"source": "serving", "time": t, "labels": labels, **vals})

        running, waiting = now_w.gauge(N.RUNNING), now_w.gauge(N.WAITING)
        kv, pre = now_w.gauge(N.KV_USAGE), now_w.gauge(N.PREEMPTIONS)
        series = now_w.series()
        for key in series:
            base = {"server": srv.url, **dict(key)}
            emit(base, {N.OUT_RUNNING: running.get(key), N.OUT_WAITING: waiting.get(key),
                        N.OUT_KV: kv.get(key), N.OUT_PREEMPT: pre.get(key)})
        if len(srv.history) < 2:
            return out  # windows need two scrapes
        for wsec in self.cfg.windows_s:
            w = srv.window(wsec)
            assert w is not None
            wl = _window_label(wsec)
            gen, prompt = w.rate(N.GEN_TOKENS), w.rate(N.PROMPT_TOKENS)
            prate = w.rate(N.PREEMPTIONS)
            hit = w.ratio(N.PREFIX_HITS, N.PREFIX_QUERIES)
            hit_gauge = w.gauge(N.PREFIX_HIT_RATE_GAUGE)
            acc = w.ratio(N.SPEC_ACCEPTED, N.SPEC_DRAFT)
            acc_gauge = w.gauge(N.SPEC_ACCEPT_GAUGE)
            finished = w.increase(N.REQUEST_SUCCESS)
            errors = w.increase(N.REQUEST_SUCCESS, {"finished_reason": {"error"}})
            qs = {k: w.quantiles(bases, QUANTILES) for k, bases in N.HISTOGRAMS.items()}
            for key in series:
                base = {"server": srv.url, **dict(key), "window": wl}
                total = finished.get(key)
                emit(base, {
                    N.OUT_GEN_TPS: gen.get(key), N.OUT_PROMPT_TPS: prompt.get(key), N.OUT_PREEMPT_RATE: prate.get(key),
                    N.OUT_PREFIX_HIT: hit.get(key) if hit.get(key) is not None else hit_gauge.get(key),
                    N.OUT_SPEC_ACCEPT: acc.get(key) if acc.get(key) is not None else acc_gauge.get(key),
                    N.OUT_ERROR_RATIO: (errors.get(key, 0.0) / total) if total else None,
                }, windowed=True)
                for q in QUANTILES:
                    emit({**base, "quantile": f"{q:g}"},
                         {N.OUT_HISTOGRAMS[k]: qs[k].get(key, {}).get(q) for k in N.HISTOGRAMS}, windowed=True)
            if w.seconds > 0:
                by_reason: dict[tuple[Any, str], float] = {}
                name = N.REQUEST_SUCCESS[0]
                for labels in last.samples.get(name, {}):
                    reason = dict(labels).get("finished_reason")
                    if reason is None:
                        continue
                    inc = w.increase(N.REQUEST_SUCCESS, {"finished_reason": {reason}})
                    for key, v in inc.items():
                        by_reason[(key, reason)] = v / w.seconds
                for (key, reason), v in by_reason.items():
                    emit({"server": srv.url, **dict(key), "window": wl, "reason": reason}, {N.OUT_FINISHED: v})
            http = http_error_ratio(w)
            if http is not None and http[1] > 0:
                emit({"server": srv.url, "window": wl, "source": "http"}, {N.OUT_ERROR_RATIO: http[0] / http[1]})
        return out

    # -- stalls, findings, exporters ---------------------------------------------------------------

    def root_pid(self) -> int | None:
        r = self._root_pid
        return r() if callable(r) else r

    def _on_stall(self, in_flight: float | None, since: float) -> Finding:
        from ..analysis.kinds import make_finding

        self.stalls += 1
        n = self.stalls
        info = {"stall": n, "in_flight": in_flight, "seconds_without_progress": round(since, 1),
                "servers": [s.url for s in self.servers], "stall_timeout_s": self.cfg.stall_timeout_s}
        root = self.root_pid()
        report: dict[str, Any]
        if root is None:
            report = {**info, "stuck": None, "dumped": 0, "note": "no server pid (attach with --pid PID to get stacks)"}
        elif n > self.cfg.max_stall_dumps:
            report = {**info, "stuck": None, "dumped": 0, "note": f"more than {self.cfg.max_stall_dumps} stalls: no more dumps"}
        else:
            try:  # the next free stall-<k>: a watcher started again on this run dir keeps the last one's
                out_dir = numbered_subdir(self.cfg.run_dir, "stall-")[0]
                report = capture_stall(root, out_dir, pyspy=self.pyspy, info=info)
                report["dir"] = out_dir
            except OSError as e:  # a full disk, a run dir gone: the finding still says there was a stall
                report = {**info, "stuck": None, "dumped": 0, "note": f"stacks not written: {e}"}
        self.stall_reports.append(report)
        stuck = report.get("stuck") or {}
        return make_finding(
            "stall", rank=0, step=None,  # data.subject: each stall is its own episode (its own dump)
            summary=stall_summary(report) + (f"; stacks in {report['dir']}" if "dir" in report else "")
            + (f"; {report['note']}" if report.get("note") else ""),
            data={**info, "dir": report.get("dir"), "dumped": report.get("dumped", 0), "note": report.get("note"),
                  "stuck_pid": stuck.get("pid"), "stuck_name": stuck.get("name"), "stuck_state": stuck.get("state"),
                  "why": stuck.get("why"), "where": (stuck.get("where") or {}).get("frames", [None])[:3],
                  "subject": f"stall {n}"},
        )

    def _emit(self, batch: Batch, *, limit: bool = True) -> None:
        if limit:
            batch.findings = self.limiter.filter(batch.findings, now=time.time())
        for f in batch.findings:
            self.findings.append(f)
            log.warning("stepwatch serve-vllm [%s] %s: %s", f.severity, f.kind, f.summary)
            self._write_finding(f)
        if not batch:
            return
        for e in self.exporters:
            try:
                e.export(batch)
            except Exception as ex:  # an exporter bug must not stop the watch
                self.export_failures += 1
                self._warn_once(f"export:{getattr(e, 'name', e)}", "stepwatch serve-vllm: exporter %s failed: %r",
                                getattr(e, "name", e), ex)

    def _write_finding(self, f: Finding) -> None:
        line = json.dumps(f.to_dict(), default=str) + "\n"
        with self._lock:
            if self._findings_bytes + len(line) > FINDINGS_FILE_BYTES:
                self._warn_once("findings-full", "stepwatch serve-vllm: %s reached %d bytes; further findings are not written",
                                self.findings_path, FINDINGS_FILE_BYTES)
                return
            try:
                with open_private(self.findings_path, exclusive=False) as fh:
                    fh.write(line)
                self._findings_bytes += len(line)
            except OSError as e:
                self._warn_once("findings-write", "stepwatch serve-vllm: cannot write %s: %s", self.findings_path, e)
