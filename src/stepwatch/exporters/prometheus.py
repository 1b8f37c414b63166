"""The per-rank Prometheus scrape endpoint: stepwatch's OTel reader (``_prom_reader``) on its own
``prometheus_client`` registry, served over HTTP in the text format 0.0.4.

Why not ``prometheus_client.start_http_server``: it negotiates the format from the scraper's
``Accept`` header, and Prometheus asks for OpenMetrics first; prometheus_client 0.26 then
rewrites ``:`` to ``_`` in sample lines (prometheus/client_python#1177). The text format 0.0.4 is
what every Prometheus reads, so this endpoint serves only that.

Imported only when the endpoint is enabled (``STEPWATCH_PROMETHEUS_PORT``).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import weakref

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from ._http import BoundedHTTPServer

log = logging.getLogger("stepwatch.exporters.prometheus")


def make_reader(registry: CollectorRegistry) -> "PrometheusReader":
    """A reader on ``registry``. Its histograms are explicit-bucket (the SDK default, with the
    boundaries each instrument advises); Prometheus' text format has no exponential histogram, so
    only OTLP may ask for those. No scope labels: all stepwatch series come from one scope."""
    from ._prom_reader import PrometheusReader

    return PrometheusReader(registry)


def _respond(registry: CollectorRegistry, path: str) -> tuple[int, str, bytes]:
    if path.split("?", 1)[0] not in ("/metrics", "/"):
        return 404, "text/plain; charset=utf-8", b"stepwatch serves /metrics\n"
    try:
        return 200, CONTENT_TYPE_PLAIN_0_0_4, generate_latest(registry)
    except Exception as e:  # a collect failure must answer the scraper, not kill the worker
        log.warning("stepwatch: Prometheus collect failed: %r", e)
        return 500, "text/plain; charset=utf-8", b"collect failed\n"


def _close_in_child(ref: "weakref.ref[PrometheusEndpoint]") -> None:
    ep = ref()
    server = ep._server if ep is not None else None
    if server is not None:
        ep._server = None
        ep.bound = False
        server.close_in_child()


class PrometheusEndpoint:
    """Serve ``registry`` on ``host:port``. ``port`` 0 picks a free one. Threads and descriptors
    are fixed whatever scrapers do (:mod:`stepwatch.exporters._http`): 3 threads, a bounded
    number of connections, each given 5 s to send its request; the excess is closed unanswered.

    A port that is taken (another job, or two ranks given one port) is one warning and no
    endpoint: the job goes on. ``bound`` says whether it is serving.
    """

    # The settings a warning names: a training job's variables, or the command's own options
    # (``stepwatch serve-vllm --prometheus-port``).
    JOB_SETTINGS = ("STEPWATCH_PROMETHEUS_PORT", "STEPWATCH_PROMETHEUS_HOST")

    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 settings: tuple[str, str] = JOB_SETTINGS) -> None:
        self.host = host
        self.port = port
        self.bound = False
        self._server: BoundedHTTPServer | None = None
        try:
            server = BoundedHTTPServer(
                host, port, functools.partial(_respond, registry), name="stepwatch-prometheus"
            )
        except (OSError, OverflowError) as e:  # OverflowError: base + local rank above 65535
            port_name, host_name = settings
            ranks = settings == self.JOB_SETTINGS  # a job's ranks serve base + local rank
            if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
                reason = "port already in use"
                fix = (f"Set {port_name} to a free base port (each rank serves base + local rank)." if ranks
                       else f"Give {port_name} a free port.")
            elif isinstance(e, OverflowError):
                reason, fix = str(e), f"Set {port_name} so that base + local rank stays below 65536."
            else:
                reason, fix = e.strerror or str(e), f"Check {host_name} (an address of this host, or 0.0.0.0)."
            log.warning(
                "stepwatch: Prometheus endpoint not started on %s:%d (%s); metrics go on to the other exporters. %s",
                host, port, reason, fix,
            )
            return
        self._server = server
        self.port = server.port
        self.bound = True
        # A forked child (DataLoader worker) inherits the listening socket but not the thread
        # serving it: close the child's copy so the port is the parent's alone.
        if hasattr(os, "register_at_fork"):
            ref = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: _close_in_child(ref))

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        self.bound = False
