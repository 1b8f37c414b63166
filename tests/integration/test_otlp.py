"""OTLP/gRPC export against a real receiver: opentelemetry-proto's MetricsService servicer on
grpcio, on 127.0.0.1 and a random port, in this process. With the receiver down, recording stays
fast, memory stays flat, drops are counted, and flush/shutdown return in bounded time."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures

import grpc
import pytest

from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from stepwatch.context import RunContext
from stepwatch.exporters.base import Batch
from stepwatch.exporters.otel import OTelExporter
from stepwatch.record import Finding, StepRecord

pytestmark = pytest.mark.integration


class Receiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self) -> None:
        self.requests: list = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (generated name)
        with self.lock:
            self.requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def metrics(self):
        """name -> list of (resource attrs, metric) over everything received."""
        out: dict = {}
        with self.lock:
            reqs = list(self.requests)
        for req in reqs:
            for rm in req.resource_metrics:
                res = {kv.key: _val(kv.value) for kv in rm.resource.attributes}
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        out.setdefault(m.name, []).append((res, m))
        return out


def _val(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _num(dp):
    return dp.as_int if dp.WhichOneof("value") == "as_int" else dp.as_double


def _attrs(dp):
    return {kv.key: _val(kv.value) for kv in dp.attributes}


def start_receiver(port: int = 0):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rec = Receiver()
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(rec, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, rec, bound


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CTX = RunContext(rank=1, local_rank=1, world_size=2, host="node3", run_id="job-otlp", run_dir="/tmp/x", pid=77)


def records(n, start=0):
    return [
        StepRecord(step=i, rank=1, time=time.time(), step_s=0.12, mfu=0.42, grad_norm=2.0, allreduce_s=0.004,
                   data_wait_s=0.003, tokens=512)
        for i in range(start, start + n)
    ]


@pytest.fixture
def otlp_env(monkeypatch):
    # The OTLP exporter reads the process environment itself.
    for k in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
              "OTEL_SDK_DISABLED", "OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(k, raising=False)

    def set_endpoint(port, **extra):
        import os

        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        for k, v in extra.items():
            monkeypatch.setenv(k, v)
        return os.environ

    return set_endpoint


def test_receiver_gets_names_attributes_and_resource(otlp_env):
    server, rec, port = start_receiver()
    env = otlp_env(port, OTEL_SERVICE_NAME="trainer-x", OTEL_RESOURCE_ATTRIBUTES="deployment.environment=test")
    e = OTelExporter(CTX, environ=env, export_interval_ms=60_000)
    try:
        assert e.otlp_endpoint == f"http://127.0.0.1:{port}"
        e.export(Batch(
            records=records(5),
            findings=[Finding(time=0.0, step=3, rank=1, kind="data_loading", severity="warning", summary="", diagnosis="", action="")],
            samples=[{"gpu": 0, "uuid": "GPU-1", "DCGM_FI_DEV_GPU_TEMP": 66, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": 0x8}],
        ))
        assert e.force_flush(timeout_s=10)
    finally:
        e.shutdown()
        server.stop(0)
    got = rec.metrics()
    for name in ("training_step_seconds", "training_mfu", "train_grad_norm", "allreduce_time_ms", "training_steps_total",
                 "stepwatch_findings_total", "DCGM_FI_DEV_GPU_TEMP", "stepwatch_gpu_clocks_event_active"):
        assert name in got, f"{name} not received; got {sorted(got)}"
    res, m = got["training_mfu"][-1]
    assert res["service.name"] == "trainer-x" and res["deployment.environment"] == "test"
    assert res["stepwatch.rank"] == 1 and res["stepwatch.local_rank"] == 1 and res["stepwatch.world_size"] == 2
    assert res["stepwatch.job.id"] == "job-otlp" and res["host.name"] == "node3"
    assert _num(m.gauge.data_points[0]) == pytest.approx(0.42)
    assert _attrs(m.gauge.data_points[0]) == {"rank": 1}
    _, steps = got["training_steps_total"][-1]
    assert steps.sum.is_monotonic and _num(steps.sum.data_points[0]) == 5 and _attrs(steps.sum.data_points[0]) == {"rank": 1}
    _, hist = got["training_step_seconds"][-1]
    hp = hist.histogram.data_points[0]
    assert hist.unit == "s" and hp.count == 5 and list(hp.explicit_bounds)[0] == 0.001
    _, ar = got["allreduce_time_ms"][-1]
    assert ar.unit == "" and _num(ar.gauge.data_points[0]) == pytest.approx(4.0)
    _, thr = got["stepwatch_gpu_clocks_event_active"][-1]
    on = {_attrs(dp)["reason"] for dp in thr.gauge.data_points if _num(dp)}
    assert on == {"hw_slowdown"}
    assert e.dropped() == 0


def test_exponential_histograms_on_otlp_when_asked(otlp_env):
    server, rec, port = start_receiver()
    env = otlp_env(port, OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION="base2_exponential_bucket_histogram")
    e = OTelExporter(CTX, environ=env, export_interval_ms=60_000, prometheus_port=free_port() - 1)
    try:
        e.export(Batch(records=records(3)))
        assert e.force_flush(timeout_s=10)
        import urllib.request

        with urllib.request.urlopen(e.prometheus.url, timeout=5) as r:  # Prometheus still answers, with buckets
            assert r.status == 200 and "training_step_seconds_bucket" in r.read().decode()
    finally:
        e.shutdown()
        server.stop(0)
    _, hist = rec.metrics()["training_step_seconds"][-1]
    assert hist.WhichOneof("data") == "exponential_histogram"


def test_receiver_down_is_bounded_counted_and_recovers(otlp_env):
    import tracemalloc

    port = free_port()  # nothing listens here yet
    env = otlp_env(port, OTEL_EXPORTER_OTLP_TIMEOUT="1")
    e = OTelExporter(CTX, environ=env, export_interval_ms=200, shutdown_timeout_s=1.0)
    try:
        worst = 0.0
        tracemalloc.start()
        snap0 = None
        deadline = time.monotonic() + 20
        k = 0
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            e.export(Batch(records=records(10, k * 10)))
            worst = max(worst, time.perf_counter() - t0)
            k += 1
            if k == 20:
                snap0 = tracemalloc.take_snapshot()
            if e.dropped_by().get("otlp", 0) > 0 and k > 60:
                break
            time.sleep(0.02)
        snap1 = tracemalloc.take_snapshot()
        tracemalloc.stop()
        assert e.dropped_by()["otlp"] > 0, "failed exports were not counted"
        assert worst < 0.25, f"recording a batch took {worst * 1000:.1f} ms while the collector was down"
        grown = sum(s.size_diff for s in snap1.compare_to(snap0, "filename"))
        assert grown < 500_000, f"memory grew {grown} bytes while the collector was down"
        t0 = time.monotonic()
        e.force_flush(timeout_s=2.0)  # True or False: what counts is that it came back
        assert time.monotonic() - t0 < 3.0

        # The collector comes back on the same port: the cumulative counters arrive whole.
        server, rec, _ = start_receiver(port)
        try:
            t_end = time.monotonic() + 15
            while time.monotonic() < t_end and "training_steps_total" not in rec.metrics():
                time.sleep(0.2)
            got = rec.metrics()
            assert "training_steps_total" in got, "nothing arrived after the collector came back"
            _, steps = got["training_steps_total"][-1]
            assert _num(steps.sum.data_points[0]) == 10 * k
        finally:
            server.stop(0)
    finally:
        t0 = time.monotonic()
        e.shutdown()
        shutdown_s = time.monotonic() - t0
    assert shutdown_s < 4.0


def test_shutdown_is_bounded_with_the_collector_down(otlp_env):
    port = free_port()
    env = otlp_env(port)  # default OTLP timeout: 10 s of retries per export
    e = OTelExporter(CTX, environ=env, export_interval_ms=60_000, shutdown_timeout_s=1.0)
    e.export(Batch(records=records(3)))
    t0 = time.monotonic()
    e.shutdown()
    assert time.monotonic() - t0 < 4.0
