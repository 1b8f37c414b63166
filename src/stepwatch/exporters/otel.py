"""OpenTelemetry metrics: step records, findings and GPU samples into OTel SDK instruments, read
by OTLP (when an endpoint is configured) and by the per-rank Prometheus endpoint (when
``STEPWATCH_PROMETHEUS_PORT`` is set).

``export`` runs on stepwatch's background thread: every SDK call (a few microseconds each) stays
off the training thread. The SDK holds one aggregate per series, so memory does not grow with
steps; OTLP sends from the SDK's own reader thread, and a collector that is down costs that thread
its retries, never the job. What could not be delivered is counted (:meth:`OTelExporter.dropped`)
and exported as ``stepwatch_exporter_dropped_total``.

Names live in :mod:`stepwatch.exporters.names`; docs/metrics.md lists them.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.metrics.view import View
from opentelemetry.sdk.resources import Resource

from .._os.threads import start
from . import names as N
from .base import Batch, Exporter

if TYPE_CHECKING:
    from ..context import RunContext
    from ..record import Finding, StepRecord

log = logging.getLogger("stepwatch.exporters.otel")

from ._otlp_env import (  # noqa: F401 (names this module's users read from it)
    DEFAULT_SERVICE_NAME, ENDPOINT_VARS, OTEL_METRICS_EXPORTER, OTEL_RESOURCE_ATTRIBUTES, OTEL_SDK_DISABLED,
    OTEL_SERVICE_NAME, PROTOCOL_VARS, PROTOCOLS, otlp_endpoint, tls_by_default,
)

_EXTRA_NAME = re.compile(r"^stepwatch_[a-z0-9_]{1,120}$")


def otlp_protocol(environ: Mapping[str, str]) -> str:
    for var in PROTOCOL_VARS:
        v = environ.get(var, "").strip().lower()
        if v:
            if v not in PROTOCOLS:
                raise ValueError(f"{var}={v!r} is not supported by stepwatch's OTLP export; valid: {', '.join(PROTOCOLS)}")
            return v
    return "grpc"


def build_resource(ctx: "RunContext", environ: Mapping[str, str]) -> Resource:
    """service.name: OTEL_SERVICE_NAME, else service.name in OTEL_RESOURCE_ATTRIBUTES, else
    ``stepwatch``; OTEL_RESOURCE_ATTRIBUTES is honoured for everything else it sets, except the
    per-process identity below (one env is shared by every rank, so it cannot name a rank)."""
    ours: dict[str, Any] = {
        "service.instance.id": f"{ctx.run_id}/rank{ctx.rank}",
        "host.name": ctx.host,
        "process.pid": ctx.pid or os.getpid(),
        "stepwatch.job.id": ctx.run_id,
        "stepwatch.rank": ctx.rank,
        "stepwatch.local_rank": ctx.local_rank,
        "stepwatch.world_size": ctx.world_size,
    }
    from_env = _parse_resource_attributes(environ.get(OTEL_RESOURCE_ATTRIBUTES, ""))
    service = environ.get(OTEL_SERVICE_NAME, "").strip() or from_env.get("service.name") or DEFAULT_SERVICE_NAME
    attrs = {**from_env, **ours, "service.name": service}
    # Resource() (not Resource.create): create() would read the process's own os.environ, and
    # this function must honour the mapping it is given.
    return Resource(attrs)


def _parse_resource_attributes(s: str) -> dict[str, str]:
    """``key1=value1,key2=value2`` (W3C Baggage-style, values percent-encoded), as the spec says."""
    from urllib.parse import unquote

    out: dict[str, str] = {}
    for part in s.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            log.warning("stepwatch: ignoring malformed %s entry %r (want key=value)", OTEL_RESOURCE_ATTRIBUTES, part)
            continue
        out[unquote(key.strip())] = unquote(value.strip())
    return out


# The OTel SDK's OTLP exporters log every retry ("Transient error ... retrying") and every failed
# export ("Failed to export ...") on these loggers: with the collector down, a line or more per
# export interval for as long as it stays down. While stepwatch's own export runs (its reader's
# thread, inside :meth:`_CountingExporter.export`), their lines are held back and counted; the
# first failure's warning (stepwatch's, one line) says what the SDK said first. Anything else
# logged there (the user's own OTel exporters, on their own calls) passes untouched.
_SDK_EXPORT_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.exporter.otlp.common.http",
)
_in_export = threading.local()


class _OwnExportLogFilter(logging.Filter):
    """Holds back the SDK exporter's lines logged inside stepwatch's export call; counts them on
    that exporter (:attr:`_CountingExporter.sdk_lines_held`), keeps the first one's text."""

    def filter(self, record: logging.LogRecord) -> bool:
        owner = getattr(_in_export, "owner", None)
        if owner is None:
            return True
        try:
            owner._held(record)
        except Exception:  # noqa: BLE001 - a log filter must not raise
            pass
        return False


_LOG_FILTER = _OwnExportLogFilter()


def _install_log_filter() -> None:
    for name in _SDK_EXPORT_LOGGERS:
        lg = logging.getLogger(name)
        if _LOG_FILTER not in lg.filters:
            lg.addFilter(_LOG_FILTER)


class _CountingExporter(MetricExporter):
    """Wraps the OTLP exporter: a failed or raising export counts its data points as dropped.

    The OTLP exporters return FAILURE after their retries (collector down) and may raise on
    encoding problems; either way the data is gone, and the user should see how much.
    """

    def __init__(self, inner: MetricExporter) -> None:
        super().__init__(
            preferred_temporality=getattr(inner, "_preferred_temporality", None),
            preferred_aggregation=getattr(inner, "_preferred_aggregation", None),
        )
        self.inner = inner
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self.dropped_points = 0
        self.failed_exports = 0
        self._warned = False
        self.sdk_lines_held = 0  # the SDK exporter's log lines held back (see _OwnExportLogFilter)
        self._first_sdk_line: str | None = None
        _install_log_filter()

    def _held(self, record: logging.LogRecord) -> None:
        with self._lock:
            self.sdk_lines_held += 1
            if self._first_sdk_line is None and record.levelno >= logging.WARNING:
                self._first_sdk_line = record.getMessage()[:300]

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        if os.getpid() != self._pid:
            # A forked child (a DataLoader worker): the SDK restarts its reader thread there, but
            # the child's metrics are a copy of the parent's under the parent's identity. Sending
            # them would double-count, so the child sends nothing.
            return MetricExportResult.SUCCESS
        outer = getattr(_in_export, "owner", None)
        _in_export.owner = self
        try:
            result = self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception as e:  # the reader thread must survive any exporter bug
            log.debug("stepwatch: OTLP export raised %r", e)
            result = MetricExportResult.FAILURE
        finally:
            _in_export.owner = outer
        if result is not MetricExportResult.SUCCESS:
            n = _count_points(metrics_data)
            with self._lock:
                self.dropped_points += n
                self.failed_exports += 1
                first = not self._warned
                self._warned = True
                said = self._first_sdk_line
            if first:
                log.warning(
                    "stepwatch: OTLP export failed (collector unreachable?)%s; dropping %d data points. "
                    "Training is unaffected; further drops are counted in stepwatch_exporter_dropped_total "
                    "(the OTel SDK's own retry and failure lines for them are not shown).",
                    f" [{said}]" if said else "",
                    n,
                )
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)


def _count_points(data: MetricsData) -> int:
    n = 0
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                n += len(m.data.data_points)
    return n


# The OTLP metric exporter's module for each protocol (also preloaded: exporters/builtin.py).
OTLP_MODULES = {
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.metric_exporter",
}


# OTEL_EXPORTER_OTLP[_METRICS]_COMPRESSION values the SDK's exporters take (its Compression enum).
COMPRESSION_VARS = ("OTEL_EXPORTER_OTLP_METRICS_COMPRESSION", "OTEL_EXPORTER_OTLP_COMPRESSION")
COMPRESSIONS = ("gzip", "deflate", "none")


def _make_otlp_exporter(environ: Mapping[str, str]) -> MetricExporter:
    import importlib

    for var in COMPRESSION_VARS:  # the SDK raises its own exception from deep inside for these
        v = environ.get(var, "").strip().lower()
        if v:
            if v not in COMPRESSIONS:
                raise ValueError(f"{var}={v!r} is not a compression the OTLP exporter knows; valid: {', '.join(COMPRESSIONS)}")
            break
    OTLPMetricExporter = importlib.import_module(OTLP_MODULES[otlp_protocol(environ)]).OTLPMetricExporter
    tls = tls_by_default(environ)
    if tls:
        log.warning(tls)
    # Endpoint, headers, timeout, compression, TLS, temporality and histogram aggregation
    # (OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION=base2_exponential_bucket_histogram
    # for exponential ones): the exporter reads the standard variables itself. Explicit buckets
    # take the boundaries the step-time histogram advises.
    return OTLPMetricExporter()


class OTelExporter(Exporter):
    """stepwatch -> OpenTelemetry SDK. One per rank; see the module docstring.

    ``readers`` adds metric readers (tests pass the SDK's ``InMemoryMetricReader``).
    ``otlp``: None = on when an OTLP endpoint is configured in ``environ``; False = off.
    ``prometheus_port``: None = no endpoint; the rank serves ``prometheus_port + local_rank``.
    ``prometheus_settings``: the (port, host) settings a warning about the endpoint names; the
    job's ``STEPWATCH_PROMETHEUS_*`` variables by default. ``finding_kinds``: every finding kind's
    ``stepwatch_findings_total`` series starts at 0 (a training job's; ``serve-vllm`` has its own).
    """

    name = "otel"

    def __init__(
        self,
        ctx: "RunContext",
        *,
        prometheus_port: int | None = None,
        prometheus_host: str = "127.0.0.1",
        otlp: bool | None = None,
        environ: Mapping[str, str] | None = None,
        readers: Iterable[MetricReader] = (),
        export_interval_ms: float | None = None,
        buckets: Sequence[float] = N.STEP_SECONDS_BUCKETS,
        shutdown_timeout_s: float = 5.0,
        prometheus_settings: tuple[str, str] | None = None,
        finding_kinds: bool = True,
    ) -> None:
        env = os.environ if environ is None else environ
        self.ctx = ctx
        self._shutdown_timeout_s = shutdown_timeout_s
        self._lock = threading.Lock()
        self._unmapped = 0
        self._warned_unmapped: set[str] = set()
        self._otlp: _CountingExporter | None = None
        self._flush_thread: threading.Thread | None = None
        self._flush_ok = False
        self.prometheus = None
        all_readers: list[MetricReader] = list(readers)

        endpoint = otlp_endpoint(env) if otlp is not False else None
        if otlp is True and endpoint is None:
            log.warning("stepwatch: OTLP export asked for but no %s is set; OTLP is off", " or ".join(ENDPOINT_VARS))
        if endpoint is not None:
            self._otlp = _CountingExporter(_make_otlp_exporter(env))
            all_readers.append(PeriodicExportingMetricReader(self._otlp, export_interval_millis=export_interval_ms))
            self.otlp_endpoint: str | None = endpoint
        else:
            self.otlp_endpoint = None

        if prometheus_port is not None:
            from prometheus_client import CollectorRegistry

            from .prometheus import PrometheusEndpoint, make_reader

            registry = CollectorRegistry(auto_describe=False)
            all_readers.append(make_reader(registry))
            self.prometheus = PrometheusEndpoint(registry, prometheus_host, prometheus_port + ctx.local_rank,
                                                 prometheus_settings or PrometheusEndpoint.JOB_SETTINGS)

        views = [View(instrument_name=f.lower(), name=f) for f in N.DCGM_FIELDS]
        # Before the provider registers its at-fork handler: the SDK's handler submits to a
        # ThreadPoolExecutor in the child, and concurrent.futures.thread reinitialises its global
        # lock (held across the fork) in a handler of its own, run after those registered before
        # it. Imported later (the first ThreadPoolExecutor after this), every fork's child hung
        # in the SDK's handler: a DataLoader worker that never started.
        import concurrent.futures.thread  # noqa: F401

        self.provider = MeterProvider(
            metric_readers=all_readers,
            resource=build_resource(ctx, env),
            views=views,
            # stepwatch's session shuts exporters down; an atexit hook of the SDK's own would
            # run a second, possibly slow, final export.
            shutdown_on_exit=False,
        )
        from .._version import __version__

        m = self.provider.get_meter("stepwatch", __version__)
        self._m = m
        # The advisory boundaries apply wherever a reader uses explicit buckets without its own
        # (Prometheus always, OTLP by default); the SDK's defaults are for milliseconds.
        self._step_hist = m.create_histogram(
            N.STEP_SECONDS.name, unit=N.STEP_SECONDS.unit, description=N.STEP_SECONDS.description,
            explicit_bucket_boundaries_advisory=list(buckets),
        )
        self._steps = m.create_counter(N.STEPS_TOTAL.name, unit=N.STEPS_TOTAL.unit, description=N.STEPS_TOTAL.description)
        self._gauges = [(d, self._last_values(d.name, unit=d.unit, description=d.description)) for d in N.RECORD_GAUGES]
        self._counters = [(d, m.create_counter(d.name, unit=d.unit, description=d.description)) for d in N.RECORD_COUNTERS]
        self._phases = m.create_counter(N.PHASE_SECONDS.name, unit=N.PHASE_SECONDS.unit, description=N.PHASE_SECONDS.description)
        self._scalars = self._last_values(N.SCALAR.name, description=N.SCALAR.description)
        self._findings = m.create_counter(N.FINDINGS_TOTAL.name, description=N.FINDINGS_TOTAL.description)
        if finding_kinds:
            # Every kind's series at 0 from the start, at its catalogue severity: a series that
            # appears at 1 has no increase() in PromQL (its first sample is the base), and the
            # first nonfinite_grads or straggler finding raised no alert (StepwatchCriticalFinding,
            # TrainingStraggler). A kind raised at another severity than its own starts at 1.
            from ..analysis.kinds import KINDS

            for k in KINDS.values():
                self._findings.add(0, {"rank": ctx.rank, "kind": k.name, "severity": k.severity})
        self._throttle = m.create_gauge(N.GPU_THROTTLE.name, description=N.GPU_THROTTLE.description)
        self._dcgm = {f: m.create_gauge(f.lower(), description=doc) for f, doc in N.DCGM_FIELDS.items()}
        self._extra: dict[str, Any] = {}
        m.create_observable_counter(
            N.DROPPED_TOTAL.name, callbacks=[self._observe_dropped], description=N.DROPPED_TOTAL.description
        )
        self._phase_names: set[str] = set(N.BUILTIN_PHASES)
        self._scalar_names: set[str] = set()
        self._rank_attrs: dict[int, dict[str, Any]] = {}

    # -- what the console and tests read --------------------------------------------------------

    def dropped(self) -> int:
        """Data points this exporter could not deliver, since start (what the console and
        ``run.json``'s ``exporter_drops`` count as lost). Values with no series to go in (past
        the names' bounds, not a number) are no loss of a record: they are counted apart, in
        ``stepwatch_exporter_dropped_total{exporter="unmapped"}`` (:meth:`dropped_by`); the
        console read "240 dropped" for 70 names when no record was lost."""
        return self._otlp.dropped_points if self._otlp else 0

    def dropped_by(self) -> dict[str, int]:
        with self._lock:
            out = {"unmapped": self._unmapped}
        if self._otlp is not None:
            out["otlp"] = self._otlp.dropped_points
        return out

    def _observe_dropped(self, options: CallbackOptions) -> Iterable[Observation]:
        rank = self.ctx.rank
        for exporter, n in self.dropped_by().items():
            yield Observation(n, {"rank": rank, "exporter": exporter})

    # -- the contract ---------------------------------------------------------------------------

    def export(self, batch: Batch) -> None:
        if batch.records:
            self._records(batch.records)
        for f in batch.findings:
            self._finding(f)
        for s in batch.samples:
            self._sample(s)

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Collect and send now; returns within ``timeout_s`` even when the collector is down.

        The OTLP exporters retry for their own timeout (``OTEL_EXPORTER_OTLP_TIMEOUT``, 10 s)
        whatever the reader asks, so the flush runs on a helper thread that is waited for at most
        ``timeout_s``; a flush still running is not started twice. True means "handed to the
        SDK in time", not "delivered": delivery failures show in :meth:`dropped`.
        """
        with self._lock:
            t = self._flush_thread
            if t is not None and t.is_alive():
                busy = True
            else:
                busy = False
                t = self._flush_thread = threading.Thread(
                    target=self._flush_now, args=(timeout_s,), name="stepwatch-otel-flush", daemon=True
                )
        if not busy and not start(t):  # the interpreter refuses a thread at its exit (_os/threads.py)
            self._flush_now(timeout_s)  # here: within the OTLP exporter's own timeout (10 s, a collector down)
            return self._flush_ok
        t.join(timeout_s)
        return not t.is_alive() and self._flush_ok

    def _flush_now(self, timeout_s: float) -> None:
        try:
            self._flush_ok = bool(self.provider.force_flush(timeout_millis=timeout_s * 1000.0))
        except Exception as e:  # a flush must never take the background thread down
            log.debug("stepwatch: OTel flush raised %r", e)
            self._flush_ok = False

    def shutdown(self) -> None:
        try:
            # Bounded: a collector that is down must not hold the job's exit for the SDK's 30 s
            # (the reader's final export waits this long, then the exporter's retries are cut).
            self.provider.shutdown(timeout_millis=self._shutdown_timeout_s * 1000.0)
        finally:
            if self.prometheus is not None:
                self.prometheus.close()

    # -- records ---------------------------------------------------------------------------------

    def _attrs(self, rank: int) -> dict[str, Any]:
        a = self._rank_attrs.get(rank)
        if a is None:
            a = self._rank_attrs[rank] = {"rank": rank}
        return a

    def _records(self, records: Sequence["StepRecord"]) -> None:
        """One pass's records, folded per rank before they reach the SDK: counters add their sum,
        gauges take the last known value, the histogram records every step. Same series as one
        call per record, a fraction of the SDK calls when steps are short and a pass holds many."""
        by_rank: dict[int, list["StepRecord"]] = {}
        for r in records:
            by_rank.setdefault(r.rank, []).append(r)
        for rank, rs in by_rank.items():
            attrs = self._attrs(rank)
            steps = [r for r in rs if not r.tail]  # a tail record (eval after the last step) is no step
            if steps:
                self._steps.add(len(steps), attrs)
            for r in steps:
                if r.step_s is not None and math.isfinite(r.step_s) and r.step_s >= 0:
                    self._step_hist.record(r.step_s, attrs)
            for d, gauge in self._gauges:
                for r in reversed(rs):
                    v = d.value(r)  # type: ignore[misc]
                    if v is not None:
                        gauge.set(v, attrs)
                        break
            for d, counter in self._counters:
                total = 0.0
                for r in rs:
                    v = d.value(r)  # type: ignore[misc]
                    if v is not None and math.isfinite(v) and v > 0:
                        total += v
                if total > 0:
                    counter.add(total, attrs)
            phases: dict[str, float] = {}
            scalars: dict[str, float] = {}
            for r in rs:
                for phase in N.BUILTIN_PHASES:
                    v = getattr(r, f"{phase}_s", None)
                    if v and math.isfinite(v) and v > 0:
                        phases[phase] = phases.get(phase, 0.0) + v
                for phase, v in (r.phases or {}).items():
                    if v and math.isfinite(v) and v > 0 and phase not in N.BUILTIN_PHASES:
                        if self._admit(self._phase_names, phase, N.MAX_PHASE_NAMES + len(N.BUILTIN_PHASES)):
                            phases[phase] = phases.get(phase, 0.0) + v
                for name, v in (r.scalars or {}).items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        if self._admit(self._scalar_names, name, N.MAX_SCALAR_NAMES):
                            scalars[name] = float(v)
                    elif v is not None:
                        self._count_unmapped(f"scalar {name!r} is not a number")
            for phase, v in phases.items():
                self._phases.add(v, {"rank": rank, "phase": _utf8(phase)})
            for name, v in scalars.items():
                self._scalars.set(v, {"rank": rank, "name": _utf8(name)})

    def _admit(self, seen: set[str], name: str, limit: int) -> bool:
        if name in seen:
            return True
        if len(seen) >= limit:
            self._count_unmapped(f"more than {limit} distinct names (e.g. {name!r})", kind=f"names>{limit}")
            return False
        seen.add(name)
        return True

    def _finding(self, f: "Finding") -> None:
        self._findings.add(1, {"rank": f.rank, "kind": f.kind, "severity": f.severity})

    # -- GPU samples -----------------------------------------------------------------------------

    def _sample(self, s: Mapping[str, Any]) -> None:
        attrs: dict[str, Any] = {"rank": s.get("rank", self.ctx.rank), "Hostname": s.get("Hostname", self.ctx.host)}
        for key, label in N.DCGM_LABELS.items():
            v = s.get(key)
            if v is not None:
                attrs[label] = str(v)
        labels = s.get("labels")
        for key, v in s.items():
            if not isinstance(key, str) or v is None or isinstance(v, (dict, list, tuple, str, bool)):
                continue
            gauge = self._dcgm.get(key)
            if gauge is not None:
                gauge.set(float(v), attrs)
                if key in N.THROTTLE_FIELDS:
                    for reason, on in N.decode_clocks_event_reasons(int(v)).items():
                        self._throttle.set(on, {**attrs, "reason": reason})
            elif key.startswith("DCGM_FI_"):
                self._count_unmapped(f"unknown DCGM field {key}")
            elif key.startswith(N.EXTRA_SAMPLE_PREFIX):
                g = self._extra_gauge(key)
                if g is not None:
                    extra_attrs = {"rank": attrs["rank"], **({_utf8(str(k)): _utf8(str(x)) for k, x in labels.items()} if isinstance(labels, dict) else {})}
                    if not g.set(float(v), extra_attrs):
                        self._count_unmapped(f"more than {_LastValues.MAX_SERIES} series of {key}")

    def _extra_gauge(self, key: str) -> Any:
        g = self._extra.get(key)
        if g is None:
            if not _EXTRA_NAME.match(key):
                self._count_unmapped(f"sample key {key!r} is not a valid metric name")
                return None
            if len(self._extra) >= N.MAX_EXTRA_SAMPLE_NAMES:
                self._count_unmapped(f"more than {N.MAX_EXTRA_SAMPLE_NAMES} sample metric names")
                return None
            g = self._extra[key] = self._last_values(key)
        return g

    def _last_values(self, name: str, **kw: Any) -> "_LastValues":
        g = _LastValues()
        self._m.create_observable_gauge(name, callbacks=[g.observe], **kw)
        return g

    def _count_unmapped(self, why: str, *, kind: str | None = None) -> None:
        """Count one value not exported; say ``why`` once per ``kind`` (default: ``why`` itself)."""
        kind = why if kind is None else kind
        with self._lock:
            self._unmapped += 1
            first = kind not in self._warned_unmapped and len(self._warned_unmapped) < 16
            if first:
                self._warned_unmapped.add(kind)
        if first:
            log.warning("stepwatch: not exported: %s (counted in stepwatch_exporter_dropped_total)", why)


def _utf8(name: str) -> str:
    """A user's name as a label value every exporter can encode: a lone surrogate (a file name
    read with ``os.fsdecode``: ``acc_shard_\\udcff.bin``) made every /metrics scrape fail (500)
    for the rest of the job, and OTLP print a traceback at each export. It is written escaped."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return name.encode("utf-8", "backslashreplace").decode("utf-8")
    return name


class _LastValues:
    """A gauge read when a reader collects: each series' last value, and no series where the last
    value was not finite. The SDK's own gauges (synchronous or observable) ignore a NaN or an
    infinity, log a line for each, and keep serving the value before it: a serving window with no
    request in it went on showing the last burst's P99, and a job whose gradients had gone NaN
    showed its last finite ``train_grad_norm`` and loss (and the SDK's line every pass)."""

    MAX_SERIES = 4096

    def __init__(self) -> None:
        self._values: dict[tuple[tuple[str, Any], ...], float] = {}

    def set(self, value: float, attrs: Mapping[str, Any]) -> bool:
        """False when the series is new and the gauge holds ``MAX_SERIES`` already (not kept)."""
        key = tuple(sorted(attrs.items()))
        if not math.isfinite(value):
            self._values.pop(key, None)
        elif key in self._values or len(self._values) < self.MAX_SERIES:
            self._values[key] = value
        else:
            return False
        return True

    def observe(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(v, dict(k)) for k, v in tuple(self._values.items())]


__all__ = ["OTelExporter", "build_resource", "otlp_endpoint", "otlp_protocol"]
