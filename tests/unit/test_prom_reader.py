"""stepwatch's OTel -> Prometheus translation (the endpoint's reader), on a real SDK and registry."""

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource

from stepwatch.exporters._prom_reader import PrometheusReader, prom_label, prom_name, prom_unit


def test_families_names_units_and_target_info():
    reg = CollectorRegistry()
    mp = MeterProvider(metric_readers=[PrometheusReader(reg)],
                       resource=Resource.create({"service.name": "job", "host.name": "h1"}))
    m = mp.get_meter("stepwatch")
    h = m.create_histogram("training_step_seconds", unit="s", explicit_bucket_boundaries_advisory=(0.1, 1.0))
    c = m.create_counter("training_data_wait_seconds_total", unit="s")
    g = m.create_gauge("training_mfu")
    u = m.create_up_down_counter("queue.depth")
    for v in (0.05, 0.5, 5.0):
        h.record(v, {"rank": 0})
    c.add(1.5, {"rank": 0})
    g.set(0.25, {"rank": 1, "kind": "a.b"})
    u.add(3)
    lines = generate_latest(reg).decode().splitlines()
    assert 'training_step_seconds_bucket{le="0.1",rank="0"} 1.0' in lines
    assert 'training_step_seconds_bucket{le="+Inf",rank="0"} 3.0' in lines
    assert 'training_step_seconds_count{rank="0"} 3.0' in lines
    assert 'training_step_seconds_sum{rank="0"} 5.55' in lines
    assert 'training_data_wait_seconds_total{rank="0"} 1.5' in lines
    assert "# TYPE training_data_wait_seconds_total counter" in lines
    assert 'training_mfu{kind="a.b",rank="1"} 0.25' in lines
    assert "# TYPE queue_depth gauge" in lines and "queue_depth 3.0" in lines  # non-monotonic sum
    info = [l for l in lines if l.startswith("target_info{")]
    assert len(info) == 1 and 'host_name="h1"' in info[0] and 'service_name="job"' in info[0]
    mp.shutdown()
    assert generate_latest(reg) == b""  # unregistered at shutdown


def test_name_label_unit_sanitising():
    assert prom_name("dcgm.fi-dev") == "dcgm_fi_dev" and prom_name("1abc") == "_abc"
    assert prom_label("host.name") == "host_name" and prom_label("a:b") == "a_b"
    assert prom_unit("s") == "seconds" and prom_unit("{request}") == "" and prom_unit("By") == "bytes"
