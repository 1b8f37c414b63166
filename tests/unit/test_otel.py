"""The OTel exporter: names, units, attributes and resource as the SDK's InMemoryMetricReader and
the real Prometheus endpoint (HTTP, text format 0.0.4) see them. No hardware involved: GPU
samples are plain dicts shaped like the telemetry sampler's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from opentelemetry.sdk.metrics.export import (
    ExponentialHistogramDataPoint,
    HistogramDataPoint,
    InMemoryMetricReader,
)
from stepwatch.context import RunContext
from stepwatch.exporters import names as N
from stepwatch.exporters.base import Batch
from stepwatch.exporters.otel import OTelExporter, build_resource, otlp_endpoint, otlp_protocol
from stepwatch.record import Finding, StepRecord


def ctx(rank=1, local_rank=1, world=2):
    return RunContext(rank=rank, local_rank=local_rank, world_size=world, host="node7", run_id="job42", run_dir="/tmp/x", pid=1234)


def rec(step, rank=1, **kw):
    base = dict(step=step, rank=rank, time=time.time(), step_s=0.2)
    base.update(kw)
    return StepRecord(**base)


def metrics(reader):
    out = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = m
    return out, data


@pytest.fixture
def mem_exporter():
    made = []

    def make(**kw):
        reader = InMemoryMetricReader()
        kw.setdefault("environ", {})
        e = OTelExporter(kw.pop("ctx", ctx()), readers=[reader, *kw.pop("readers", ())], **kw)
        made.append(e)
        return e, reader

    yield make
    for e in made:
        e.shutdown()


def test_step_metrics_names_units_values_and_rank_attribute(mem_exporter):
    e, reader = mem_exporter()
    e.export(Batch(records=[
        rec(1, step_s=0.2, mfu=0.41, grad_norm=3.5, allreduce_s=0.0125, data_wait_s=0.02, forward_s=0.05,
            backward_s=0.1, tokens=4096, comm_s=0.02, comm_exposed_s=0.005, overlap=0.75, scalars={"loss": 2.5}),
        rec(2, step_s=0.4, mfu=0.39, grad_norm=4.0, allreduce_s=0.015, data_wait_s=0.01, tokens=4096, phases={"fetch": 0.003},
            busbw_gbps=150.0),
    ]))
    ms, _ = metrics(reader)
    # Names as the reference sheet's PromQL uses them.
    for name in ("training_step_seconds", "training_mfu", "train_grad_norm", "allreduce_time_ms", "training_steps_total"):
        assert name in ms, name
    for m in ms.values():
        for p in m.data.data_points:
            assert p.attributes.get("rank") == 1, (m.name, dict(p.attributes))
    assert ms["training_step_seconds"].unit == "s"
    assert ms["allreduce_time_ms"].unit == ""  # a unit would make Prometheus append _milliseconds
    h = ms["training_step_seconds"].data.data_points[0]
    assert isinstance(h, HistogramDataPoint)
    assert h.count == 2 and h.sum == pytest.approx(0.6)
    assert tuple(h.explicit_bounds) == N.STEP_SECONDS_BUCKETS  # 1 ms .. minutes, not the SDK's ms defaults
    assert ms["training_steps_total"].data.data_points[0].value == 2
    assert ms["training_steps_total"].data.is_monotonic
    # Gauges keep the last step's value.
    assert ms["training_mfu"].data.data_points[0].value == pytest.approx(0.39)
    assert ms["train_grad_norm"].data.data_points[0].value == pytest.approx(4.0)
    assert ms["allreduce_time_ms"].data.data_points[0].value == pytest.approx(15.0)
    # Counters add.
    assert ms["training_data_wait_seconds_total"].data.data_points[0].value == pytest.approx(0.03)
    assert ms["training_tokens_total"].data.data_points[0].value == 8192
    phases = {p.attributes["phase"]: p.value for p in ms["training_phase_seconds_total"].data.data_points}
    assert phases == pytest.approx({"forward": 0.05, "backward": 0.1, "fetch": 0.003})
    assert ms["training_comm_overlap_ratio"].data.data_points[0].value == pytest.approx(0.75)
    assert ms["training_comm_exposed_seconds_total"].data.data_points[0].value == pytest.approx(0.005)
    assert ms["training_allreduce_busbw_gbps"].data.data_points[0].value == pytest.approx(150.0)
    assert ms["training_tokens_per_second"].data.data_points[0].value == pytest.approx(4096 / 0.4)
    scal = {p.attributes["name"]: p.value for p in ms["training_scalar"].data.data_points}
    assert scal["loss"] == 2.5


def test_none_fields_export_no_value(mem_exporter):
    """A user's own scalar named like a field (``stepwatch.log(busbw_gbps=3.0)``) is a scalar, not
    the field: it was served as the AllReduce bus-bandwidth gauge of a job with no collective."""
    e, reader = mem_exporter()
    e.export(Batch(records=[rec(1, scalars={"busbw_gbps": 3.0})]))  # mfu, grad_norm, allreduce_s ... are None
    ms, _ = metrics(reader)
    for name in ("training_mfu", "train_grad_norm", "allreduce_time_ms", "training_comm_overlap_ratio",
                 "training_tokens_total", "training_allreduce_busbw_gbps"):
        assert name not in ms or not ms[name].data.data_points, name
    assert ms["training_steps_total"].data.data_points[0].value == 1


def test_resource_attributes_and_service_name_precedence():
    c = ctx(rank=3, local_rank=1, world=8)
    r = build_resource(c, {}).attributes
    assert r["service.name"] == "stepwatch"
    assert (r["stepwatch.rank"], r["stepwatch.local_rank"], r["stepwatch.world_size"]) == (3, 1, 8)
    assert r["stepwatch.job.id"] == "job42" and r["host.name"] == "node7"
    env = {"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,service.name=from-attrs,team=ml%20infra"}
    r = build_resource(c, env).attributes
    assert r["service.name"] == "from-attrs" and r["deployment.environment"] == "prod" and r["team"] == "ml infra"
    r = build_resource(c, {**env, "OTEL_SERVICE_NAME": "trainer"}).attributes
    assert r["service.name"] == "trainer"
    # One environment is shared by all ranks: it cannot override who this process is.
    r = build_resource(c, {"OTEL_RESOURCE_ATTRIBUTES": "stepwatch.rank=0"}).attributes
    assert r["stepwatch.rank"] == 3


def test_resource_reaches_the_reader(mem_exporter):
    e, reader = mem_exporter(environ={"OTEL_SERVICE_NAME": "svc"})
    e.export(Batch(records=[rec(1)]))
    _, data = metrics(reader)
    attrs = data.resource_metrics[0].resource.attributes
    assert attrs["service.name"] == "svc" and attrs["stepwatch.rank"] == 1


def test_findings_by_kind_and_severity(mem_exporter):
    e, reader = mem_exporter()
    f = lambda kind, sev: Finding(time=0.0, step=1, rank=1, kind=kind, severity=sev, summary="", diagnosis="", action="")
    e.export(Batch(findings=[f("data_loading", "warning"), f("data_loading", "warning"), f("straggler", "critical")]))
    ms, _ = metrics(reader)
    got = {(p.attributes["kind"], p.attributes["severity"], p.attributes["rank"]): p.value for p in ms["stepwatch_findings_total"].data.data_points}
    assert {k: v for k, v in got.items() if v} == {("data_loading", "warning", 1): 2, ("straggler", "critical", 1): 1}
    # Every kind's series exists from the start at 0, at its own severity (PromQL's increase()
    # takes a series' first sample as its base: one that appeared at 1 never "increased")
    from stepwatch.analysis.kinds import KINDS

    assert {k for k, v in got.items() if not v} == {(k.name, k.severity, 1) for k in KINDS.values()} - {("data_loading", "warning", 1)}


def test_a_first_finding_is_an_increase_from_zero(mem_exporter):
    """Before any finding, ``nonfinite_grads`` (critical) and ``straggler`` (warning) read 0: the
    first one of each is a 0 -> 1 increase for StepwatchCriticalFinding and TrainingStraggler."""
    e, reader = mem_exporter()
    e.export(Batch(records=[rec(1)]))
    ms, _ = metrics(reader)
    before = {(p.attributes["kind"], p.attributes["severity"]): p.value for p in ms["stepwatch_findings_total"].data.data_points}
    assert before[("nonfinite_grads", "critical")] == 0 and before[("straggler", "warning")] == 0
    e.export(Batch(findings=[Finding(time=0.0, step=2, rank=1, kind="nonfinite_grads", severity="critical",
                                     summary="", diagnosis="", action="")]))
    ms, _ = metrics(reader)
    after = {(p.attributes["kind"], p.attributes["severity"]): p.value for p in ms["stepwatch_findings_total"].data.data_points}
    assert after[("nonfinite_grads", "critical")] == 1


def test_a_nan_grad_norm_or_loss_serves_no_value_not_the_last_finite_one(mem_exporter, caplog):
    """Gradients gone NaN: the gauges had gone on serving the last finite grad norm and loss (the
    SDK ignores a non-finite gauge value) and the SDK logged a line for each, every pass. Now the
    series is absent while the value is not finite, and nothing is logged."""
    e, reader = mem_exporter()
    e.export(Batch(records=[rec(1, grad_norm=5.7, scalars={"loss": 4.7})]))
    ms, _ = metrics(reader)
    assert ms["train_grad_norm"].data.data_points[0].value == 5.7
    with caplog.at_level("WARNING"):
        for s in (2, 3):
            e.export(Batch(records=[rec(s, grad_norm=float("nan"), scalars={"loss": float("nan")})]))
            ms, _ = metrics(reader)
    assert "train_grad_norm" not in ms or not ms["train_grad_norm"].data.data_points
    assert not [p for p in ms["training_scalar"].data.data_points if p.attributes["name"] == "loss"] if "training_scalar" in ms else True
    assert not [r for r in caplog.records if "not finite" in r.getMessage()]
    e.export(Batch(records=[rec(4, grad_norm=0.5, scalars={"loss": 1.0})]))
    ms, _ = metrics(reader)
    assert ms["train_grad_norm"].data.data_points[0].value == 0.5


def test_a_tail_record_is_no_training_step(mem_exporter):
    """Evaluation after the last optimizer step comes as a tail record: no step in
    training_steps_total and no 0 s step in the histogram (its eval time is still counted)."""
    e, reader = mem_exporter()
    e.export(Batch(records=[rec(1), rec(2), rec(3, step_s=0.0, eval_s=1.5, tail=True)]))
    ms, _ = metrics(reader)
    assert ms["training_steps_total"].data.data_points[0].value == 2
    assert ms["training_step_seconds"].data.data_points[0].count == 2


def test_gpu_samples_keep_dcgm_upper_case_names_and_labels(mem_exporter):
    e, reader = mem_exporter()
    e.export(Batch(samples=[{
        "time": 1.0, "gpu": 0, "uuid": "GPU-abc", "name": "NVIDIA H100", "vendor": "nvidia",
        "DCGM_FI_DEV_GPU_TEMP": 71, "DCGM_FI_PROF_SM_ACTIVE": 0.82,
        # 0x1 GpuIdle | 0x40 HwThermalSlowdown (nvml.h)
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": 0x41,
        "clocks_event_reasons": ["gpu_idle", "hw_thermal_slowdown"],
    }]))
    ms, _ = metrics(reader)
    assert "DCGM_FI_DEV_GPU_TEMP" in ms and "dcgm_fi_dev_gpu_temp" not in ms
    p = ms["DCGM_FI_PROF_SM_ACTIVE"].data.data_points[0]
    assert p.value == pytest.approx(0.82)
    assert dict(p.attributes) == {"rank": 1, "Hostname": "node7", "gpu": "0", "UUID": "GPU-abc", "modelName": "NVIDIA H100"}
    reasons = {pt.attributes["reason"]: pt.value for pt in ms["stepwatch_gpu_clocks_event_active"].data.data_points}
    assert reasons["gpu_idle"] == 1 and reasons["hw_thermal_slowdown"] == 1 and reasons["hw_slowdown"] == 0
    assert sum(reasons.values()) == 2


def test_old_throttle_field_name_is_decoded_too(mem_exporter):
    e, reader = mem_exporter()
    e.export(Batch(samples=[{"gpu": 1, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": 0x4}]))
    ms, _ = metrics(reader)
    assert "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS" in ms
    on = [pt.attributes["reason"] for pt in ms["stepwatch_gpu_clocks_event_active"].data.data_points if pt.value]
    assert on == ["sw_power_cap"]


def test_throttle_bits_match_pynvml_constants():
    pynvml = pytest.importorskip("pynvml")
    names = {
        "gpu_idle": "nvmlClocksEventReasonGpuIdle",
        "applications_clocks_setting": "nvmlClocksEventReasonApplicationsClocksSetting",
        "sw_power_cap": "nvmlClocksEventReasonSwPowerCap",
        "hw_slowdown": "nvmlClocksThrottleReasonHwSlowdown",
        "sync_boost": "nvmlClocksEventReasonSyncBoost",
        "sw_thermal_slowdown": "nvmlClocksEventReasonSwThermalSlowdown",
        "hw_thermal_slowdown": "nvmlClocksThrottleReasonHwThermalSlowdown",
        "hw_power_brake_slowdown": "nvmlClocksThrottleReasonHwPowerBrakeSlowdown",
        "display_clock_setting": "nvmlClocksEventReasonDisplayClockSetting",
    }
    for bit, name in N.CLOCKS_EVENT_BITS:
        assert getattr(pynvml, names[name]) == bit, name


def test_telemetry_fields_all_have_a_dcgm_name():
    fields = pytest.importorskip("stepwatch.telemetry.fields")
    missing = set(fields.FIELDS) - set(N.DCGM_FIELDS)
    assert not missing, f"sampler fields without an export name: {sorted(missing)}"


def test_unknown_and_bounded_names_are_counted_not_exported(mem_exporter, caplog):
    e, reader = mem_exporter()
    recs = [rec(i, scalars={f"s{i}": 1.0}) for i in range(N.MAX_SCALAR_NAMES + 5)]
    e.export(Batch(records=recs, samples=[{"gpu": 0, "DCGM_FI_DEV_NOT_A_FIELD": 1.0, "stepwatch_serving_ttft_p99_seconds": 0.5, "labels": {"engine": "0"}}]))
    ms, _ = metrics(reader)
    assert len(ms["training_scalar"].data.data_points) == N.MAX_SCALAR_NAMES
    assert e.dropped_by()["unmapped"] == 5 + 1
    assert e.dropped() == 0  # no record lost: no series for them, counted apart (unmapped)
    dp = {p.attributes["exporter"]: p.value for p in ms["stepwatch_exporter_dropped_total"].data.data_points}
    assert dp == {"unmapped": 6}
    # One line for the names past the bound, not one per name (there were one per name, up to 16).
    said = [r.getMessage() for r in caplog.records if "distinct names" in r.getMessage()]
    assert len(said) == 1, said
    extra = ms["stepwatch_serving_ttft_p99_seconds"].data.data_points[0]
    assert extra.value == 0.5 and dict(extra.attributes) == {"rank": 1, "engine": "0"}


def test_memory_is_bounded_by_series_not_steps(mem_exporter):
    import tracemalloc

    e, reader = mem_exporter()
    batch = lambda k: Batch(records=[rec(k * 10 + i, mfu=0.4, grad_norm=1.0, allreduce_s=0.01, tokens=10, data_wait_s=0.01, forward_s=0.1) for i in range(10)])
    for k in range(50):
        e.export(batch(k))
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for k in range(50, 550):
        e.export(batch(k))
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert grown < 200_000, f"memory grew {grown} bytes over 5000 steps"
    ms, _ = metrics(reader)
    assert ms["training_steps_total"].data.data_points[0].value == 5500


# -- Prometheus endpoint ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prometheus_endpoint_text_format_0_0_4_per_local_rank(mem_exporter):
    base = _free_port() - 1  # this rank has local rank 1: serves base + 1
    e, _ = mem_exporter(prometheus_port=base)
    assert e.prometheus is not None and e.prometheus.bound and e.prometheus.port == base + 1
    e.export(Batch(records=[rec(1, mfu=0.5, allreduce_s=0.002, grad_norm=1.0)], samples=[{"gpu": 0, "DCGM_FI_DEV_GPU_TEMP": 60}]))
    req = urllib.request.Request(e.prometheus.url, headers={
        # What Prometheus 2.x sends: OpenMetrics first. The endpoint must still answer 0.0.4.
        "Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"})
    with urllib.request.urlopen(req, timeout=5) as r:
        ctype = r.headers["Content-Type"]
        body = r.read().decode()
    assert ctype.startswith("text/plain") and "version=0.0.4" in ctype
    lines = body.splitlines()
    assert 'training_mfu{rank="1"} 0.5' in lines
    assert 'allreduce_time_ms{rank="1"} 2.0' in lines
    assert 'training_steps_total{rank="1"} 1.0' in lines
    assert 'training_step_seconds_bucket{le="0.25",rank="1"} 1.0' in lines
    assert 'training_step_seconds_bucket{le="0.1",rank="1"} 0.0' in lines
    assert any(l.startswith("DCGM_FI_DEV_GPU_TEMP{") for l in lines)
    assert "# TYPE training_step_seconds histogram" in lines
    assert "# TYPE training_steps_total counter" in lines
    assert not any("_milliseconds" in l for l in lines)
    assert not any("otel_scope_name" in l for l in lines)


def test_prometheus_uses_explicit_buckets_even_when_otlp_wants_exponential(mem_exporter):
    """The SDK's exponential histograms make the Prometheus exporter answer 500: a reader that
    prefers them (as OTLP may) must not change what Prometheus serves."""
    from opentelemetry.sdk.metrics import Histogram
    from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation

    expo = InMemoryMetricReader(preferred_aggregation={Histogram: ExponentialBucketHistogramAggregation()})
    e, _ = mem_exporter(prometheus_port=_free_port() - 1, readers=[expo])
    e.export(Batch(records=[rec(1), rec(2, step_s=3.0)]))
    ms, _ = metrics(expo)
    assert isinstance(ms["training_step_seconds"].data.data_points[0], ExponentialHistogramDataPoint)
    with urllib.request.urlopen(e.prometheus.url, timeout=5) as r:
        assert r.status == 200
        body = r.read().decode()
    assert 'training_step_seconds_bucket{le="5.0",rank="1"} 2.0' in body


def test_taken_port_is_one_warning_not_a_crash(mem_exporter, caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with caplog.at_level("WARNING"):
            e, reader = mem_exporter(prometheus_port=port - 1)  # local rank 1 -> the taken port
        assert not e.prometheus.bound
        msgs = [r.getMessage() for r in caplog.records if "Prometheus endpoint not started" in r.getMessage()]
        assert len(msgs) == 1 and "in use" in msgs[0] and str(port) in msgs[0]
        assert "Set STEPWATCH_PROMETHEUS_PORT to a free base port" in msgs[0]
        e.export(Batch(records=[rec(1, mfu=0.3)]))  # the other readers still work
        ms, _ = metrics(reader)
        assert ms["training_mfu"].data.data_points[0].value == 0.3


def test_serve_vllm_taken_port_names_its_option_not_the_jobs_variable(tmp_path, caplog):
    """``stepwatch serve-vllm --prometheus-port`` on a taken port: the warning says which option
    to change (it named STEPWATCH_PROMETHEUS_PORT, which the command does not read)."""
    import argparse

    from stepwatch.serving.cli import build_exporters, register

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers(dest="cmd"))
        args = parser.parse_args(["serve-vllm", "--prometheus-port", str(port), "--", "true"])
        with caplog.at_level("WARNING"):
            (e,) = build_exporters(args, "r", str(tmp_path))
        try:
            msgs = [r.getMessage() for r in caplog.records if "Prometheus endpoint not started" in r.getMessage()]
            assert len(msgs) == 1 and "Give --prometheus-port a free port." in msgs[0], msgs
            assert "STEPWATCH_PROMETHEUS" not in msgs[0]
        finally:
            e.shutdown()


# -- configuration --------------------------------------------------------------------------------


def test_otlp_endpoint_and_protocol_from_standard_variables():
    assert otlp_endpoint({}) is None
    assert otlp_endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}) == "http://c:4317"
    assert otlp_endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://b"}) == "http://b"
    assert otlp_endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a", "OTEL_SDK_DISABLED": "true"}) is None
    assert otlp_endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a", "OTEL_METRICS_EXPORTER": "none"}) is None
    assert otlp_protocol({}) == "grpc"
    assert otlp_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) == "http/protobuf"
    assert otlp_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc"}) == "grpc"
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL='http/json'.*grpc, http/protobuf"):
        otlp_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_a_bad_otlp_compression_names_the_variable_not_an_internal_error(tmp_path, caplog):
    """``OTEL_EXPORTER_OTLP_COMPRESSION=zip``: the SDK's own exception from inside its exporter
    became a stepwatch internal error with a traceback; now one line names the variable and the
    valid values, as a bad protocol does, and the job goes on without OTLP."""
    from stepwatch.context import RunContext

    ctx = RunContext(rank=0, local_rank=0, world_size=1, host="h", run_id="r", run_dir=str(tmp_path))
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_COMPRESSION": "zip"}
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_COMPRESSION='zip'.*gzip, deflate, none"):
        OTelExporter(ctx, environ=env)
    ok = OTelExporter(ctx, environ={**env, "OTEL_EXPORTER_OTLP_COMPRESSION": "GZIP"})
    ok.shutdown()


@pytest.mark.parametrize("env, says", [
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "collector:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://localhost:4317"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4317"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4317", "OTEL_EXPORTER_OTLP_INSECURE": "true"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4317", "OTEL_EXPORTER_OTLP_METRICS_INSECURE": "false"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4317", "OTEL_EXPORTER_OTLP_CERTIFICATE": "/etc/ca.pem"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, False),
])
def test_an_endpoint_without_a_scheme_is_said_to_mean_tls(env, says):
    """``OTEL_EXPORTER_OTLP_ENDPOINT=localhost:4317`` (no scheme, nothing said about TLS): the SDK's
    gRPC exporter connects with TLS, a plaintext collector refuses the handshake, and gRPC's own C
    logging printed a handshake failure about once a second while stepwatch said only "collector
    unreachable?". Only that case gets a line; a scheme, an explicit INSECURE or a certificate
    is the user's choice, and HTTP has no such default."""
    from stepwatch.exporters._otlp_env import tls_by_default

    said = tls_by_default(env)
    if says:
        assert next(iter(env)) in said and "http://" in said and "OTEL_EXPORTER_OTLP_INSECURE=true" in said, said
    else:
        assert said is None


def test_the_exporter_says_it_once_at_start(tmp_path, caplog, monkeypatch):
    import logging

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "0.2")  # the SDK's: its last export's wait

    from stepwatch.context import RunContext

    ctx = RunContext(rank=0, local_rank=0, world_size=1, host="h", run_id="r", run_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        OTelExporter(ctx, environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "127.0.0.1:9"}, export_interval_ms=60_000).shutdown()
    lines = [r.getMessage() for r in caplog.records if "TLS" in r.getMessage()]
    assert len(lines) == 1 and "OTEL_EXPORTER_OTLP_ENDPOINT='127.0.0.1:9'" in lines[0], lines


def test_no_otlp_without_endpoint(mem_exporter):
    e, _ = mem_exporter()
    assert e.otlp_endpoint is None and e.dropped_by() == {"unmapped": 0}


def test_config_fields_and_build_exporters(monkeypatch):
    from stepwatch.config import Config, ConfigError
    from stepwatch.exporters.builtin import build_exporters

    for v in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        monkeypatch.delenv(v, raising=False)
    c = Config.from_env({})
    assert c.prometheus_port is None and c.prometheus_host == "127.0.0.1"
    with pytest.raises(ConfigError, match="STEPWATCH_PROMETHEUS_PORT='70000'.*1-65535"):
        Config.from_env({"STEPWATCH_PROMETHEUS_PORT": "70000"})
    with pytest.raises(ConfigError, match="STEPWATCH_PROMETHEUS_PORT='abc'"):
        Config.from_env({"STEPWATCH_PROMETHEUS_PORT": "abc"})
    cfg = Config.from_env({"STEPWATCH_PROMETHEUS_PORT": str(_free_port())}, records=False, console="off")
    exps = build_exporters(cfg, ctx(rank=0, local_rank=0, world=1))
    otel = [x for x in exps if isinstance(x, OTelExporter)]
    try:
        assert len(otel) == 1 and otel[0].prometheus.bound
    finally:
        for x in otel:
            x.shutdown()
    off = build_exporters(Config.from_env({}, records=False, console="off"), ctx(rank=0, local_rank=0, world=1))
    assert not any(isinstance(x, OTelExporter) for x in off)


def test_docs_list_every_exported_name():
    import os

    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "metrics.md"), encoding="utf-8").read()
    missing = [m.name for m in N.ALL if f"`{m.name}" not in doc] + [f for f in N.DCGM_FIELDS if f"`{f}`" not in doc]
    assert not missing, f"docs/metrics.md does not list: {missing}"


def test_a_fork_after_the_first_thread_pool_does_not_hang_the_child(tmp_path):
    """The OTel SDK's MeterProvider registers an at-fork handler that submits to a thread pool in
    the child; ``concurrent.futures.thread`` reinitialises the lock it holds across a fork in its
    own handler, which ran after the SDK's when the module was first imported after the exporter
    was made (the first ThreadPoolExecutor of the job). Every fork's child then hung: a DataLoader
    worker that never starts. A fresh interpreter, so that the module is not imported yet."""
    script = textwrap.dedent(f"""
        import os, sys, time
        from stepwatch.context import RunContext
        from stepwatch.exporters.otel import OTelExporter
        assert "concurrent.futures.thread" not in sys.modules
        e = OTelExporter(RunContext(rank=0, local_rank=0, world_size=1, host="h", run_id="r",
                                    run_dir={str(tmp_path)!r}), environ={{}})
        import concurrent.futures
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            ex.submit(int)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if os.waitpid(pid, os.WNOHANG)[0]:
                print("CHILD EXITED")
                break
            time.sleep(0.02)
        else:
            os.kill(pid, 9)
            print("CHILD HUNG")
        e.shutdown()
    """)
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPWATCH_", "OTEL_"))}
    env["PYTHONPATH"] = src
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert "CHILD EXITED" in p.stdout, (p.stdout, p.stderr[-2000:])


def test_forked_child_does_not_keep_the_endpoint_socket(mem_exporter):
    """A DataLoader worker is a fork: it must not hold the rank's port."""
    import os

    e, _ = mem_exporter(prometheus_port=_free_port() - 1)
    port = e.prometheus.port
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report whether our copy of the listening socket is closed
        try:
            os.write(w, b"closed" if e.prometheus._server is None else b"open")
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 16)
    os.waitpid(pid, 0)
    os.close(r)
    assert got == b"closed"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:  # parent still serves
        assert resp.status == 200


def test_counting_exporter_counts_failures_and_sends_nothing_from_a_fork():
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

    from stepwatch.exporters.otel import _CountingExporter

    class Inner(MetricExporter):
        """A real exporter that answers what it is told to (the collector's verdict)."""

        def __init__(self):
            super().__init__()
            self.calls, self.answer = 0, MetricExportResult.FAILURE

        def export(self, metrics_data, timeout_millis=10_000, **kw):
            self.calls += 1
            if self.answer is None:
                raise ConnectionError("collector gone")
            return self.answer

        def force_flush(self, timeout_millis=10_000):
            return True

        def shutdown(self, timeout_millis=30_000, **kw):
            pass

    src = InMemoryMetricReader()
    e = OTelExporter(ctx(), readers=[src], environ={})
    e.export(Batch(records=[rec(1, mfu=0.5)]))
    data = src.get_metrics_data()
    points = sum(len(m.data.data_points) for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics)
    inner = Inner()
    c = _CountingExporter(inner)
    assert c.export(data) is MetricExportResult.FAILURE and c.dropped_points == points
    inner.answer = None
    assert c.export(data) is MetricExportResult.FAILURE and c.dropped_points == 2 * points
    inner.answer = MetricExportResult.SUCCESS
    assert c.export(data) is MetricExportResult.SUCCESS and c.dropped_points == 2 * points
    c._pid = -1  # as seen from a forked child
    calls = inner.calls
    assert c.export(data) is MetricExportResult.SUCCESS and inner.calls == calls
    e.shutdown()


def test_a_flush_runs_here_where_the_interpreter_refuses_its_thread(refuse_threads):
    """Python 3.12.0-3.12.2 refuse a new thread in an atexit hook (CPython gh-113964), where the
    exit shutdown flushes: the flush's helper thread raised, and the last metrics were not sent.
    Now the flush runs on the calling thread. Simulated (the suite runs on 3.11): ``Thread.start``
    raises as those releases do, for the flush's thread only."""
    src = InMemoryMetricReader()
    e = OTelExporter(ctx(), readers=[src], environ={})
    e.export(Batch(records=[rec(1, mfu=0.5)]))
    refuse_threads("stepwatch-otel-flush")
    try:
        assert e.force_flush(2.0) is True
    finally:
        e.shutdown()
