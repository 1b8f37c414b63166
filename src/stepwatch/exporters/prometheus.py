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
import logging
import os
import socket
import threading
import weakref
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

log = logging.getLogger("stepwatch.exporters.prometheus")


def make_reader(registry: CollectorRegistry) -> "PrometheusReader":
    """A reader on ``registry``. Its histograms are explicit-bucket (the SDK default, with the
    boundaries each instrument advises); Prometheus' text format has no exponential histogram, so
    only OTLP may ask for those. No scope labels: all stepwatch series come from one scope."""
    from ._prom_reader import PrometheusReader

    return PrometheusReader(registry)


class _Handler(BaseHTTPRequestHandler):
    registry: CollectorRegistry  # set on the per-endpoint subclass

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404, "stepwatch serves /metrics")
            return
        try:
            body = generate_latest(self.registry)
        except Exception as e:  # a collect failure must answer the scraper, not kill the thread
            log.warning("stepwatch: Prometheus collect failed: %r", e)
            self.send_error(500, "collect failed")
            return
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        return None  # one line per scrape would flood the training log


def _close_in_child(ref: "weakref.ref[PrometheusEndpoint]") -> None:
    ep = ref()
    server = ep._server if ep is not None else None
    if server is not None:
        ep._server = None
        ep.bound = False
        try:
            server.socket.close()
        except OSError:
            pass


class PrometheusEndpoint:
    """Serve ``registry`` on ``host:port`` from a daemon thread. ``port`` 0 picks a free one.

    A port that is taken (another job, or two ranks given one port) is one warning and no
    endpoint: the job goes on. ``bound`` says whether it is serving.
    """

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.bound = False
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        handler = type("StepwatchMetricsHandler", (_Handler,), {"registry": registry})
        server_cls = ThreadingHTTPServer
        if ":" in host:  # an IPv6 address such as ::1 or ::
            server_cls = type("StepwatchHTTPServer6", (ThreadingHTTPServer,), {"address_family": socket.AF_INET6})
        try:
            server = server_cls((host, port), handler)
        except (OSError, OverflowError) as e:  # OverflowError: base + local rank above 65535
            if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
                reason, fix = "port already in use", "Set STEPWATCH_PROMETHEUS_PORT to a free base port (each rank serves base + local rank)."
            elif isinstance(e, OverflowError):
                reason, fix = str(e), "Set STEPWATCH_PROMETHEUS_PORT so that base + local rank stays below 65536."
            else:
                reason, fix = e.strerror or str(e), "Check STEPWATCH_PROMETHEUS_HOST (an address of this host, or 0.0.0.0)."
            log.warning(
                "stepwatch: Prometheus endpoint not started on %s:%d (%s); metrics go on to the other exporters. %s",
                host, port, reason, fix,
            )
            return
        server.daemon_threads = True
        self._server = server
        self.port = server.server_address[1]
        self.bound = True
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.5}, name="stepwatch-prometheus", daemon=True
        )
        self._thread.start()
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
        server.shutdown()
        server.server_close()
        self.bound = False
