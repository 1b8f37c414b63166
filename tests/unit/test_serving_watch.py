"""serve-vllm: findings, the scrape loop and the OTel re-export, against a real HTTP stand-in.

The stand-in is a real HTTP server on loopback that serves the real vLLM 0.32 scrapes (and the
v0-name fixtures) at /metrics and a settable in-flight count at /load, as vLLM does with
--enable-server-load-tracking. No GPU or vLLM is needed; the integration test runs a real vLLM.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from stepwatch.exporters.base import InMemoryExporter
from stepwatch.serving import names as N
from stepwatch.serving.detect import Detectors, Thresholds
from stepwatch.serving.parse import parse_metrics
from stepwatch.serving.slo import Scrape, Window
from stepwatch.serving.stall import StallDetector
from stepwatch.serving.watcher import ServeWatcher, WatchConfig

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "vllm")
OLD = (("model_name", "opt-125m"),)


def text(name: str) -> str:
    with open(os.path.join(FIX, name), encoding="utf-8") as f:
        return f.read()


class _Loopback:
    """A threaded HTTP server on 127.0.0.1 (``url``) with the handler a subclass gives."""

    def _start(self, handler) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class StandIn(_Loopback):
    """A loopback HTTP server with vLLM's /metrics and /load."""

    def __init__(self) -> None:
        self.metrics = ""
        self.load: int | None = 0  # None: answer 404 like a vLLM without load tracking
        self.status = 200
        owner = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/metrics" and owner.status == 200:
                    body = owner.metrics.encode()
                elif self.path == "/load" and owner.load is not None:
                    body = json.dumps({"server_load": owner.load}).encode()
                else:
                    self.send_error(404 if self.path != "/metrics" else owner.status)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a) -> None:
                pass

        self._start(H)


@pytest.fixture
def standin():
    s = StandIn()
    yield s
    s.close()


def old_windows(seconds: float = 30.0) -> tuple[Window, Window]:
    a = Scrape(0.0, 0.0, parse_metrics(text("metrics-v0-oldnames-t0.txt")))
    b = Scrape(seconds, seconds, parse_metrics(text("metrics-v0-oldnames-t1.txt")))
    w = Window(a, b)
    return w, w


# -- findings ----------------------------------------------------------------------------------


def test_old_name_fixture_fires_queue_spec_ttft_and_kv_findings():
    d = Detectors(Thresholds(ttft_p99_s=0.5, kv_sustain_s=20.0))
    latest, slo = old_windows()
    kinds = {f.kind: f for f in d.check("http://a", latest, slo)}
    assert kinds["queue_depth"].data["waiting"] == 60.0
    assert kinds["spec_decode_acceptance"].data["acceptance"] == pytest.approx(0.5)
    assert kinds["ttft_slo"].data["ttft_p99_s"] == pytest.approx(0.875)
    assert "kv_cache_cascade" not in kinds  # over 0.82, but not yet for 20 s
    # 25 s later, still 0.9, and preemptions rose 10 -> 12 since it crossed: critical
    b2 = parse_metrics(text("metrics-v0-oldnames-t1.txt").replace(
        'vllm:num_preemptions_total{model_name="opt-125m"} 10.0', 'vllm:num_preemptions_total{model_name="opt-125m"} 12.0'))
    w2 = Window(latest.new, Scrape(55.0, 55.0, b2))
    f = {f.kind: f for f in d.check("http://a", w2, w2)}
    kv = f["kv_cache_cascade"]
    assert kv.severity == "critical" and kv.data["preemptions_since"] == 2.0 and kv.data["sustained_s"] == 25.0
    assert "reduce max_num_seqs" in kv.action.lower()
    # cooldown: the queue finding does not repeat 25 s later
    assert "queue_depth" not in f


def test_kv_sustained_without_preemptions_is_a_warning_and_dropping_below_resets():
    d = Detectors(Thresholds(kv_sustain_s=10.0))
    s = parse_metrics(text("metrics-v0-oldnames-t1.txt"))
    low = parse_metrics(text("metrics-v0-oldnames-t1.txt").replace("gpu_cache_usage_perc{model_name=\"opt-125m\"} 0.9", "gpu_cache_usage_perc{model_name=\"opt-125m\"} 0.5"))
    seq = [(0, s), (6, low), (8, s), (16, s), (19, s)]
    fired = []
    prev = None
    for t, samples in seq:
        cur = Scrape(float(t), float(t), samples)
        w = Window(prev, cur)
        fired += [(t, f.severity) for f in d.check("u", w, w) if f.kind == "kv_cache_cascade"]
        prev = cur
    assert fired == [(19, "warning")]  # 8 -> 19 held 11 s; 0 -> 6 was broken by the dip


def test_errors_by_finished_reason():
    a = text("metrics-0.32.0-midflight.txt")
    b = text("metrics-0.32.0-idle-after-load.txt").replace(
        'vllm:request_success_total{engine="0",finished_reason="error",model_name="tiny-llama"} 0.0',
        'vllm:request_success_total{engine="0",finished_reason="error",model_name="tiny-llama"} 4.0')
    w = Window(Scrape(0, 0, parse_metrics(a)), Scrape(60, 60, parse_metrics(b)))
    f = [x for x in Detectors(Thresholds()).check("u", w, w) if x.kind == "serving_errors"]
    assert len(f) == 1
    assert f[0].data["errors"] == 4.0 and f[0].data["finished"] == 36.0
    assert " over 60 s on " in f[0].summary, f[0].summary
    # a short scrape window says its length, not "over 0 s"
    w = Window(Scrape(0, 0, parse_metrics(a)), Scrape(0.5, 0.5, parse_metrics(b)))
    f = [x for x in Detectors(Thresholds()).check("u", w, w) if x.kind == "serving_errors"]
    assert " over 0.5 s on " in f[0].summary, f[0].summary
    # the real window has no errors: no finding
    w0 = Window(Scrape(0, 0, parse_metrics(a)), Scrape(60, 60, parse_metrics(text("metrics-0.32.0-idle-after-load.txt"))))
    assert not [x for x in Detectors(Thresholds()).check("u", w0, w0) if x.kind == "serving_errors"]


@pytest.mark.parametrize("kw,msg", [({"kv_cache": 1.5}, "kv_cache"), ({"ttft_p99_s": 0}, "ttft_p99_s"),
                                    ({"queue_depth": -1}, "queue_depth"), ({"kv_sustain_s": float("nan")}, "kv_sustain_s")])
def test_bad_thresholds_name_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Thresholds(**kw)


# -- the stall detector ------------------------------------------------------------------------


def test_stall_detector_fires_once_per_episode_and_not_when_idle():
    s = StallDetector(10.0)
    assert not s.update(0, in_flight=0, progress=(1, 1, 1))
    assert not s.update(50, in_flight=0, progress=(1, 1, 1))  # idle for long: not a stall
    assert not s.update(51, in_flight=3, progress=(1, 1, 1))  # busy from 51
    assert not s.update(60, in_flight=3, progress=(1, 1, 1))
    assert s.update(61.5, in_flight=3, progress=(1, 1, 1))  # 10.5 s busy without progress
    assert not s.update(70, in_flight=3, progress=(1, 1, 1))  # same episode: once
    assert not s.update(71, in_flight=3, progress=(2, 1, 1))  # progress: re-armed
    assert s.update(82, in_flight=None, progress=None)  # server no longer answers: stalled too
    with pytest.raises(ValueError, match="stall timeout"):
        StallDetector(0)


def test_stall_detector_waits_for_the_server_to_come_up():
    s = StallDetector(1.0)
    assert not s.update(0, in_flight=None, progress=None)
    assert not s.update(100, in_flight=None, progress=None)


# -- the loop over HTTP ------------------------------------------------------------------------


def test_watcher_reexports_samples_and_writes_findings(standin, tmp_path):
    mem = InMemoryExporter()
    cfg = WatchConfig(urls=[standin.url], run_dir=str(tmp_path), interval_s=1.0, windows_s=(60.0,),
                      thresholds=Thresholds(queue_depth=10))
    w = ServeWatcher(cfg, exporters=[mem], root_pid=None)
    standin.metrics = text("metrics-0.32.0-midflight.txt")
    standin.load = 32
    b1 = w.tick()
    standin.metrics = text("metrics-0.32.0-idle-after-load.txt")
    standin.load = 0
    b2 = w.tick()
    assert [f.kind for f in b1.findings] == ["queue_depth"]  # 24 waiting > 10
    assert not b2.findings
    lines = (tmp_path / "findings.serve.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["kind"] == "queue_depth"
    serving = [s for s in mem.samples if s.get("source") == "serving"]
    assert all(k.startswith("stepwatch_serving_") for s in serving for k in s if k not in ("source", "time", "labels"))
    waiting = [s[N.OUT_WAITING] for s in serving if N.OUT_WAITING in s]
    assert waiting == [24.0, 0.0]
    ttft = [s for s in serving if N.OUT_TTFT in s and s["labels"].get("quantile") == "0.99"]
    assert len(ttft) == 1 and ttft[0]["labels"]["window"] == "1m" and ttft[0]["labels"]["engine"] == "0"
    assert ttft[0][N.OUT_TTFT] > 0
    reasons = {s["labels"]["reason"]: s[N.OUT_FINISHED] for s in serving if N.OUT_FINISHED in s}
    assert reasons["length"] > 0 and reasons["error"] == 0.0
    in_flight = [s[N.OUT_IN_FLIGHT] for s in mem.samples if N.OUT_IN_FLIGHT in s]
    assert in_flight == [32.0, 0.0]


def test_two_api_servers_are_watched_apart(standin, tmp_path):
    other = StandIn()
    try:
        standin.metrics = text("metrics-0.32.0-midflight.txt")
        other.metrics = text("metrics-v0-oldnames-t1.txt")
        mem = InMemoryExporter()
        w = ServeWatcher(WatchConfig(urls=[standin.url, other.url], run_dir=str(tmp_path)), exporters=[mem])
        w.tick()
        kv = {s["labels"]["server"]: s[N.OUT_KV] for s in mem.samples if N.OUT_KV in s}
        assert kv == {standin.url: pytest.approx(0.0009766221082829762), other.url: 0.9}
    finally:
        other.close()


def test_broken_server_answers_are_counted_never_raised(standin, tmp_path):
    mem = InMemoryExporter()
    w = ServeWatcher(WatchConfig(urls=[standin.url], run_dir=str(tmp_path), stall_timeout_s=1000), exporters=[mem])
    standin.metrics = text("metrics-0.32.0-midflight.txt")[:30000]  # cut mid-line
    w.tick()
    assert w.parse_errors.count >= 1
    standin.status = 500
    w.tick()
    assert w.scrape_failures == 1
    standin.status = 200
    standin.metrics = "\x00garbage{{{\n"
    w.tick()
    errs = [s[N.OUT_SCRAPE_ERRORS] for s in mem.samples if N.OUT_SCRAPE_ERRORS in s]
    assert errs[-1] >= 3 and errs == sorted(errs)


def test_without_load_endpoint_falls_back_to_running_plus_waiting(standin, tmp_path):
    standin.load = None
    standin.metrics = text("metrics-0.32.0-midflight.txt")
    mem = InMemoryExporter()
    w = ServeWatcher(WatchConfig(urls=[standin.url], run_dir=str(tmp_path)), exporters=[mem])
    w.tick()
    assert [s[N.OUT_IN_FLIGHT] for s in mem.samples if N.OUT_IN_FLIGHT in s] == [32.0]  # 8 running + 24 waiting


def test_stall_without_pid_is_a_finding_without_dumps(standin, tmp_path):
    standin.metrics = text("metrics-0.32.0-midflight.txt")
    standin.load = 40  # more than the engine's 8 running + 24 waiting: /load is the count
    w = ServeWatcher(WatchConfig(urls=[standin.url], run_dir=str(tmp_path), stall_timeout_s=0.3, interval_s=0.1))
    import time

    w.tick()
    time.sleep(0.2)
    w.tick()  # busy from here
    time.sleep(0.4)
    b = w.tick()
    stall = [f for f in b.findings if f.kind == "stall"]
    assert len(stall) == 1 and stall[0].severity == "critical"
    assert stall[0].data["in_flight"] == 40.0 and stall[0].data["dumped"] == 0
    assert not list(tmp_path.glob("stall-*"))


def test_exporter_failure_does_not_stop_the_loop(standin, tmp_path):
    class Boom(InMemoryExporter):
        def export(self, batch):
            raise RuntimeError("sink down")

    standin.metrics = text("metrics-0.32.0-midflight.txt")
    mem = InMemoryExporter()
    w = ServeWatcher(WatchConfig(urls=[standin.url], run_dir=str(tmp_path)), exporters=[Boom(), mem])
    w.tick()
    w.tick()
    assert w.export_failures == 2 and len(mem.samples) > 0


@pytest.mark.parametrize("kw,msg", [({"urls": []}, "urls"), ({"urls": ["localhost:8000"]}, "http"),
                                    ({"interval_s": 0}, "interval_s"), ({"windows_s": (0,)}, "windows_s"),
                                    ({"interval_s": float("inf")}, "interval_s"), ({"stall_timeout_s": float("nan")}, "stall_timeout_s"),
                                    ({"urls": ["http://"]}, "http")])
def test_bad_watch_config_names_the_field(kw, msg, tmp_path):
    args = {"urls": ["http://127.0.0.1:1"], "run_dir": str(tmp_path), **kw}
    with pytest.raises(ValueError, match=msg):
        WatchConfig(**args)


# -- through stepwatch's OTel exporter ---------------------------------------------------------


def test_samples_become_stepwatch_serving_series_in_otel(standin, tmp_path):
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from stepwatch.context import RunContext
    from stepwatch.exporters.otel import OTelExporter

    reader = InMemoryMetricReader()
    ctx = RunContext(rank=0, local_rank=0, world_size=1, host="h", run_id="r", run_dir=str(tmp_path))
    otel = OTelExporter(ctx, otlp=False, readers=[reader], environ={})
    try:
        w = ServeWatcher(WatchConfig(urls=[standin.url], run_dir=str(tmp_path), windows_s=(60.0,)), exporters=[otel])
        standin.metrics = text("metrics-0.32.0-midflight.txt")
        w.tick()
        standin.metrics = text("metrics-0.32.0-idle-after-load.txt")
        w.tick()
        data = reader.get_metrics_data()
        got = {}
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    got[m.name] = [dict(p.attributes) | {"value": p.value} for p in m.data.data_points]
        for name in (N.OUT_TTFT, N.OUT_ITL, N.OUT_E2E, N.OUT_RUNNING, N.OUT_WAITING, N.OUT_KV, N.OUT_PREEMPT,
                     N.OUT_PREFIX_HIT, N.OUT_GEN_TPS, N.OUT_FINISHED):
            assert name in got, name
        assert not any(":" in n for n in got)
        p99 = [p for p in got[N.OUT_TTFT] if p["quantile"] == "0.99"]
        assert p99 and p99[0]["engine"] == "0" and p99[0]["server"] == standin.url and p99[0]["value"] > 0
        assert otel.dropped() == 0
    finally:
        otel.shutdown()


def _served(reader) -> dict[str, list[dict]]:
    got: dict[str, list[dict]] = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                got[m.name] = [dict(p.attributes) | {"value": p.value} for p in m.data.data_points]
    return got


def test_a_window_without_requests_serves_no_value_not_the_last_burst(standin, tmp_path):
    """No request finished in the window: its quantiles and ratios are NaN in the samples and no
    series at the endpoint and in OTLP (PromQL's histogram_quantile over zero rates has no number
    either), never the last burst's values, which the endpoint went on serving for minutes on an
    idle server. A series that never had a value (speculative decoding off) stays absent. The
    token rate is 0, as it was."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from stepwatch.context import RunContext
    from stepwatch.exporters.otel import OTelExporter

    reader = InMemoryMetricReader()
    ctx = RunContext(rank=0, local_rank=0, world_size=1, host="h", run_id="r", run_dir=str(tmp_path))
    otel = OTelExporter(ctx, otlp=False, readers=[reader], environ={})
    mem = InMemoryExporter()
    try:
        w = ServeWatcher(WatchConfig(urls=[standin.url], run_dir=str(tmp_path), windows_s=(1.0,)), exporters=[otel, mem])
        standin.metrics = text("metrics-0.32.0-midflight.txt")
        w.tick()
        standin.metrics = text("metrics-0.32.0-idle-after-load.txt")
        w.tick()  # requests finished between the two scrapes: values
        first = {k: v for s in mem.samples if s.get("labels", {}).get("quantile") == "0.99" for k, v in s.items()}
        assert first[N.OUT_TTFT] > 0
        assert [p["value"] > 0 for p in _served(reader)[N.OUT_TTFT] if p["quantile"] == "0.99"] == [True]
        time.sleep(1.1)
        w.tick()  # the same counters a window later: nothing happened in it
        last = [s for s in mem.samples if s.get("labels", {}).get("window") == "1s"][-8:]
        p99 = [s for s in last if s["labels"].get("quantile") == "0.99"][-1]
        assert all(math.isnan(p99[n]) for n in (N.OUT_TTFT, N.OUT_ITL, N.OUT_E2E)), p99
        rates = [s for s in last if N.OUT_GEN_TPS in s][-1]
        assert rates[N.OUT_GEN_TPS] == 0.0
        assert math.isnan(rates[N.OUT_PREFIX_HIT]) and math.isnan(rates[N.OUT_ERROR_RATIO])
        assert not any(N.OUT_SPEC_ACCEPT in s for s in mem.samples)
        # What the endpoint and OTLP serve: no series for those windows any more
        served = [p for p in _served(reader).get(N.OUT_TTFT, []) if p["window"] == "1s"]
        assert not served, served
    finally:
        otel.shutdown()


# -- B.6 rows: inter-token latency, e2e SLO, a full batch, prefill rate ---------------------------

REAL = (("engine", "0"), ("model_name", "tiny-llama"))
PROMPT = 'vllm:prompt_tokens_total{engine="0",model_name="tiny-llama"} '


def real_window() -> Window:
    """The two real vLLM 0.32 scrapes, 60 s apart: mid-burst, then idle after it."""
    return Window(Scrape(0, 0, parse_metrics(text("metrics-0.32.0-midflight.txt"))),
                  Scrape(60, 60, parse_metrics(text("metrics-0.32.0-idle-after-load.txt"))))


def _kinds(d: Detectors, w: Window, kind: str):
    return [f for f in d.check("http://a", w, w) if f.kind == kind]


def test_inter_token_latency_p99_both_names():
    # Real 0.32 scrapes (vllm:inter_token_latency_seconds): P99 18 ms over the window.
    w = real_window()
    assert _kinds(Detectors(Thresholds()), w, "inter_token_latency") == []  # < 100 ms (B.6 default)
    f = _kinds(Detectors(Thresholds(itl_p99_s=0.015)), w, "inter_token_latency")
    assert len(f) == 1 and f[0].data["p99_s"] == pytest.approx(0.0183, abs=1e-3) and "decode" in f[0].diagnosis
    # The v0 name (vllm:time_per_output_token_seconds): P99 98.75 ms, just under the sheet's 100 ms.
    old, _ = old_windows()
    assert _kinds(Detectors(Thresholds()), old, "inter_token_latency") == []
    d = Detectors(Thresholds(itl_p99_s=0.09))
    assert len(_kinds(d, old, "inter_token_latency")) == 1
    assert _kinds(d, old, "inter_token_latency") == []  # same episode: once


def test_e2e_p99_over_the_slo():
    w = real_window()  # e2e P99 4.95 s
    assert _kinds(Detectors(Thresholds()), w, "e2e_slo") == []  # no SLO: off
    assert _kinds(Detectors(Thresholds(e2e_p99_s=6.0)), w, "e2e_slo") == []
    f = _kinds(Detectors(Thresholds(e2e_p99_s=4.0)), w, "e2e_slo")
    assert len(f) == 1 and f[0].data["p99_s"] == pytest.approx(4.95) and f[0].data["threshold_s"] == 4.0


def test_running_at_max_num_seqs_while_requests_wait():
    mid = parse_metrics(text("metrics-0.32.0-midflight.txt"))  # 8 running, 24 waiting (--max-num-seqs 8)
    idle = parse_metrics(text("metrics-0.32.0-idle-after-load.txt"))
    assert _kinds(Detectors(Thresholds()), Window(None, Scrape(0, 0, mid)), "max_num_seqs_saturated") == []  # cap unknown
    assert _kinds(Detectors(Thresholds(max_num_seqs=16)), Window(None, Scrape(0, 0, mid)), "max_num_seqs_saturated") == []
    d = Detectors(Thresholds(max_num_seqs=8))
    fired = []
    prev = None
    for t, smp in enumerate([mid, mid, idle, mid]):
        cur = Scrape(float(t), float(t), smp)
        fired += [(t, f) for f in _kinds(d, Window(prev, cur), "max_num_seqs_saturated")]
        prev = cur
    assert [t for t, _ in fired] == [0, 3]  # once per episode; the idle scrape ended the first
    f = fired[0][1]
    assert f.data["running"] == 8 and f.data["waiting"] == 24 and "max_num_seqs" in f.action


def test_prompt_token_rate_below_half_its_median_while_requests_wait():
    mid = text("metrics-0.32.0-midflight.txt")
    idle = text("metrics-0.32.0-idle-after-load.txt")
    d = Detectors(Thresholds())
    total, prev, fired = 0.0, None, []
    # (tokens since the last scrape, 2 s before): after the first scrape, 100/s for 5 intervals, then 30/s while 24 wait (fires
    # once), back to 100/s (ends it), 30/s with nothing waiting (silent), 30/s waiting again (fires).
    seq = [(200, mid)] * 6 + [(60, mid), (60, mid), (200, mid), (60, idle), (60, mid)]
    for i, (tokens, base) in enumerate(seq):
        total += tokens
        smp = parse_metrics(base.replace(PROMPT + ("1799.0" if base is mid else "1943.0"), PROMPT + f"{total}"))
        cur = Scrape(2.0 * i, 2.0 * i, smp)
        fired += [(i, f) for f in _kinds(d, Window(prev, cur), "prefill_rate_drop")]
        prev = cur
    assert [i for i, _ in fired] == [6, 10], [f.summary for _, f in fired]
    f = fired[0][1]
    assert f.data["prompt_tokens_per_s"] == pytest.approx(30.0) and f.data["median_per_s"] == pytest.approx(100.0)
    assert f.data["waiting"] == 24


@pytest.mark.parametrize("kw,msg", [({"itl_p99_s": 0}, "itl_p99_s"), ({"e2e_p99_s": -1}, "e2e_p99_s"),
                                    ({"max_num_seqs": 0}, "max_num_seqs"), ({"prefill_drop": 1.5}, "prefill_drop")])
def test_bad_new_thresholds_name_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Thresholds(**kw)


def test_max_num_seqs_is_read_from_the_launched_command():
    from stepwatch.serving.wrapper import max_num_seqs

    assert max_num_seqs(["python", "-m", "vllm.entrypoints.openai.api_server", "--max-num-seqs", "8"]) == 8
    assert max_num_seqs(["vllm", "serve", "m", "--max-num-seqs=32"]) == 32
    assert max_num_seqs(["vllm", "serve", "m"]) is None


# -- fixes: in-flight without load tracking, a gone server, a silent URL -------------------------


def test_load_zero_without_load_tracking_falls_back_to_the_engine_count_and_stalls(standin, tmp_path):
    """vLLM 0.32 answers /load with 200 {"server_load": 0} even without
    --enable-server-load-tracking: that 0 must not hide the 8 running + 24 waiting of a frozen
    engine (it did: in-flight read 0 and no stall ever fired)."""
    import time

    standin.metrics = text("metrics-0.32.0-midflight.txt")  # frozen: the counters never move
    standin.load = 0
    mem = InMemoryExporter()
    w = ServeWatcher(WatchConfig(urls=[standin.url], run_dir=str(tmp_path), stall_timeout_s=0.3, interval_s=0.1,
                                 thresholds=Thresholds(queue_depth=1000)), exporters=[mem])
    w.tick()
    time.sleep(0.4)
    b = w.tick()
    assert [s[N.OUT_IN_FLIGHT] for s in mem.samples if N.OUT_IN_FLIGHT in s] == [32.0, 32.0]
    assert [f.kind for f in b.findings] == ["stall"] and b.findings[0].data["in_flight"] == 32.0
    # /load above the engine's count (an engine whose gauges froze at 0) still wins: the larger one
    standin.load = 40
    w.tick()
    assert [s[N.OUT_IN_FLIGHT] for s in mem.samples if N.OUT_IN_FLIGHT in s][-1] == 40.0


def _refused_url() -> str:
    """A loopback URL where nothing listens (connection refused)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_server_that_went_away_is_one_message_not_a_stall(tmp_path, caplog):
    """Attached with --pid, the server exits: connection refused and its pid dead. That was a
    critical "engine stalled: None request(s) in flight" with an empty stall dump; it is one
    warning that the server is gone, no finding, no stall-<n>/."""
    import subprocess
    import sys
    import time

    srv = StandIn()
    srv.metrics = text("metrics-0.32.0-idle-after-load.txt")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    w = ServeWatcher(WatchConfig(urls=[srv.url], run_dir=str(tmp_path), stall_timeout_s=0.2, interval_s=0.1),
                     root_pid=dead.pid)
    w.tick()
    srv.close()  # gone: nothing listens there any more
    caplog.set_level("WARNING", logger="stepwatch.serving")
    findings = []
    for _ in range(4):
        time.sleep(0.1)
        findings += w.tick().findings
    assert findings == [] and w.stalls == 0
    assert not list(tmp_path.glob("stall-*"))
    gone = [r.getMessage() for r in caplog.records if "gone" in r.getMessage()]
    assert len(gone) == 1, caplog.text
    assert srv.url in gone[0] and f"pid {dead.pid}" in gone[0]
    assert "None" not in caplog.text


def test_stall_detector_does_not_count_an_unreachable_server_as_busy():
    s = StallDetector(1.0)
    assert not s.update(0, in_flight=3, progress=(1, 1, 1))
    assert not s.update(5, in_flight=None, progress=None, unreachable=True)  # refused: gone, not stuck
    assert not s.update(10, in_flight=None, progress=None, unreachable=True)
    assert not s.update(20, in_flight=None, progress=None)  # answers nothing, not refused: busy from here
    assert s.update(21.5, in_flight=None, progress=None)  # ... and stuck


def test_stall_summary_never_prints_none():
    from stepwatch.serving.stall import summary

    text_ = summary({"in_flight": None, "seconds_without_progress": 61.0, "stuck": None, "dumped": 0})
    assert "None" not in text_ and "in flight" in text_
    assert summary({"in_flight": 32.0, "seconds_without_progress": 61.0, "stuck": None}).startswith(
        "engine stalled: 32 request(s) in flight")


def test_a_url_that_never_answers_is_warned_about_once(tmp_path, caplog):
    """Attached to a port where nothing listens (or a launched server that never gets ready):
    there was no message at all. One warning naming the URL and the error, after a bounded
    time, and not on every scrape."""
    import time

    url = _refused_url()
    caplog.set_level("WARNING", logger="stepwatch.serving")
    w = ServeWatcher(WatchConfig(urls=[url], run_dir=str(tmp_path), interval_s=0.05, silent_warn_s=0.2))
    w.tick()
    assert not caplog.records  # not at once: a server loading its model is silent for a while
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:
        w.tick()
        time.sleep(0.02)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1, msgs
    assert url in msgs[0] and "refused" in msgs[0]


def test_a_huge_interval_does_not_kill_the_watch_loop(tmp_path):
    """--interval 1e300 (finite, so accepted) made stop.wait() raise OverflowError and ended the
    watcher thread; the wait is capped."""
    import threading

    w = ServeWatcher(WatchConfig(urls=[_refused_url()], run_dir=str(tmp_path), interval_s=1e300))
    stop = threading.Event()
    t = threading.Thread(target=w.run, args=(stop,), daemon=True)
    t.start()
    t.join(0.5)
    assert t.is_alive()
    stop.set()
    t.join(5)
    assert not t.is_alive()


# -- the finding limiter: servers, engines and episodes apart ------------------------------------


def test_two_servers_findings_are_not_merged_by_the_limiter(standin, tmp_path):
    """Both servers have 60 waiting: each gets its queue_depth finding at once (the second one's
    was held back as part of the first's episode and appeared only at shutdown)."""
    other = StandIn()
    try:
        standin.metrics = other.metrics = text("metrics-v0-oldnames-t1.txt")
        w = ServeWatcher(WatchConfig(urls=[standin.url, other.url], run_dir=str(tmp_path),
                                     thresholds=Thresholds(kv_sustain_s=1000)))
        b = w.tick()
        assert sorted(f.data["server"] for f in b.findings if f.kind == "queue_depth") == sorted([standin.url, other.url])
        assert all(f.data["subject"].startswith(f.data["server"]) for f in b.findings)
    finally:
        other.close()


def test_engines_are_apart_in_the_limiter():
    from stepwatch.analysis.ratelimit import FindingLimiter

    two = text("metrics-v0-oldnames-t1.txt")
    two += two.replace('model_name="opt-125m"', 'model_name="opt-125m",engine="1"')
    d = Detectors(Thresholds(kv_sustain_s=1000))
    w = Window(None, Scrape(0.0, 0.0, parse_metrics(two)))
    q = [f for f in d.check("http://a", w, w) if f.kind == "queue_depth"]
    assert len(q) == 2
    lim = FindingLimiter(300.0, 20, position=lambda f: f.time, unit="s")
    assert len(lim.filter(q, now=0.0)) == 2


def test_a_new_episode_after_a_healthy_stretch_is_reported_live():
    """max_num_seqs_saturated bad -> good -> bad: the second episode is its own finding (it was
    held back by the limiter for its whole window); episodes that start again within the
    cooldown (a), a minute, are counted in the one before, not dropped."""
    from stepwatch.analysis.ratelimit import FindingLimiter

    mid = parse_metrics(text("metrics-0.32.0-midflight.txt"))  # 8 running, 24 waiting
    idle = parse_metrics(text("metrics-0.32.0-idle-after-load.txt"))
    d = Detectors(Thresholds(max_num_seqs=8, queue_depth=1000, kv_sustain_s=1000))
    lim = FindingLimiter(300.0, 20, position=lambda f: f.time, unit="s")
    out = []
    prev = None
    for t, smp in [(0, mid), (30, idle), (70, mid), (75, idle), (80, mid), (90, mid)]:
        cur = Scrape(float(t), float(t), smp)
        fs = [f for f in d.check("http://a", Window(prev, cur), Window(prev, cur)) if f.kind == "max_num_seqs_saturated"]
        out += [(t, f) for f in lim.filter(fs, now=float(t))]
        prev = cur
    assert [t for t, _ in out] == [0, 70]
    closing = lim.flush()
    assert len(closing) == 1 and closing[0].data["episode"]["count"] == 2  # the one at 80, counted
    assert out[0][1].data["subject"] != out[1][1].data["subject"]


def test_on_gone_replaces_the_gone_warning(tmp_path, caplog):
    """An owner that ends the watch itself (the CLI) is told once that the server is gone; the
    watcher's own "is gone ... (still watching the URL)" line is not printed as well."""
    import subprocess
    import sys
    import time

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    told = []
    w = ServeWatcher(WatchConfig(urls=[_refused_url()], run_dir=str(tmp_path), stall_timeout_s=0.2, interval_s=0.1),
                     root_pid=dead.pid, on_gone=lambda url, pid: told.append((url, pid)))
    caplog.set_level("WARNING", logger="stepwatch.serving")
    for _ in range(3):
        w.tick()
        time.sleep(0.05)
    assert told == [(w.servers[0].url, dead.pid)]
    assert "gone" not in caplog.text and w.stalls == 0


# -- the forty-first session's defects ----------------------------------------------------------


class BrokenHTTP(_Loopback):
    """A loopback port that answers /metrics with a chunked body cut short (a proxy, a server
    dying mid-reply): http.client raises IncompleteRead, an HTTPException."""

    def __init__(self) -> None:
        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.write(b"10\r\nvllm:num_requ")  # 16 announced, 13 sent, then closed
                self.wfile.flush()
                self.close_connection = True

            def log_message(self, *a) -> None:
                pass

        self._start(H)


def test_a_server_that_answers_broken_http_blinds_only_itself(standin, tmp_path):
    """``--attach GOOD --attach BAD``, BAD's reply cut short: IncompleteRead (an HTTPException, not
    an OSError) escaped the scrape and ended every pass: no samples, findings or stall detection
    for any server. BAD is now one that did not answer (counted); GOOD is watched."""
    standin.metrics = text("metrics-0.32.0-midflight.txt")
    bad = BrokenHTTP()
    try:
        mem = InMemoryExporter()
        w = ServeWatcher(WatchConfig(urls=[standin.url, bad.url], run_dir=str(tmp_path), stall_timeout_s=1000),
                         exporters=[mem])
        b = w.tick()
        assert b is not None and b.samples, b  # GOOD's
        good, broken = w.servers
        assert good.down_since is None and broken.down_since is not None and "IncompleteRead" in broken.error, broken.error
    finally:
        bad.close()


def test_the_findings_file_is_bounded_across_watchers_of_one_run_dir(tmp_path, monkeypatch):
    """The findings file's bound counted this process's writes only: a watcher restarted with the
    same --run-dir (a supervisor's) appended up to another 16 MiB each time."""
    from stepwatch.record import Finding
    from stepwatch.serving import watcher as W

    monkeypatch.setattr(W, "FINDINGS_FILE_BYTES", 4096)
    path = tmp_path / "findings.serve.jsonl"
    path.write_text("x" * 4000 + "\n")
    os.chmod(path, 0o600)
    w = ServeWatcher(WatchConfig(urls=["http://127.0.0.1:9"], run_dir=str(tmp_path)))
    f = Finding(time=1.0, step=None, rank=0, kind="stall", severity="critical", summary="s" * 200, diagnosis="d",
                action="a", data={})
    w._write_finding(f)
    assert path.stat().st_size == 4001


def test_a_stall_without_dumps_says_why_in_its_summary(standin, tmp_path):
    """No --pid: the summary said "dumped 0 process(es), no single stuck process found", and the
    action pointed at stall-<n>/ files that are not there; the watcher knew why (no server pid)
    and dropped it."""
    standin.metrics = text("metrics-0.32.0-midflight.txt")
    standin.load = 40
    w = ServeWatcher(WatchConfig(urls=[standin.url], run_dir=str(tmp_path), stall_timeout_s=0.3, interval_s=0.1))
    w.tick()
    time.sleep(0.2)
    w.tick()
    time.sleep(0.4)
    (stall,) = [f for f in w.tick().findings if f.kind == "stall"]
    assert "no server pid (attach with --pid PID to get stacks)" in stall.summary, stall.summary
    assert stall.data["note"] == "no server pid (attach with --pid PID to get stacks)"


def test_a_server_that_died_is_not_exported_as_busy(tmp_path):
    """After an attached server died (connection refused), ``--prometheus-port`` kept serving its
    last values (``requests_running 4``, tokens/s) with no end: a dashboard saw a busy server. Its
    series are set to NaN once (no data, as an empty window's), and come back when it answers."""
    s = StandIn()
    s.metrics = text("metrics-0.32.0-midflight.txt")
    mem = InMemoryExporter()
    w = ServeWatcher(WatchConfig(urls=[s.url], run_dir=str(tmp_path), stall_timeout_s=1000), exporters=[mem])
    def of_server(batch):  # its series (not the watch's own: scrape errors, in flight)
        return [x for x in batch.samples if x["labels"].get("server") == s.url and N.OUT_SCRAPE_ERRORS not in x]

    mine = of_server(w.tick())
    assert mine and any(x.get(N.OUT_RUNNING) == 8.0 for x in mine), mine
    s.close()  # the server dies
    after = w.tick()
    gone = of_server(after)
    # the watch's own in-flight count: unknown with every server gone, not the last one left served
    (own,) = [x for x in after.samples if N.OUT_SCRAPE_ERRORS in x]
    assert math.isnan(own[N.OUT_IN_FLIGHT]), own
    assert gone and {tuple(sorted(x["labels"].items())) for x in gone} == {tuple(sorted(x["labels"].items())) for x in mine}
    assert all(math.isnan(v) for x in gone for k, v in x.items() if k not in ("source", "time", "labels")), gone
    assert not of_server(w.tick())  # once


def test_a_watcher_started_again_on_a_run_dir_keeps_the_last_ones_stall_dumps(standin, tmp_path):
    """Each watcher numbered its stalls from 1: a serve-vllm started again with the same --run-dir
    (a supervisor's restart) wrote its first stall's stacks and report.json over the last one's
    stall-1/. The next free stall-<k> is taken now, as oom-<n> is."""
    import subprocess
    import sys

    standin.metrics = text("metrics-0.32.0-midflight.txt")
    standin.load = 40
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        reports = []
        for _ in range(2):
            w = ServeWatcher(WatchConfig(urls=[standin.url], run_dir=str(tmp_path), stall_timeout_s=0.3,
                                         interval_s=0.1, pyspy=str(tmp_path / "no-py-spy")), root_pid=server.pid)
            w.tick()
            time.sleep(0.2)
            w.tick()
            time.sleep(0.4)
            (stall,) = [f for f in w.tick().findings if f.kind == "stall"]
            reports.append(stall.data["dir"])
            assert stall.data["stall"] == 1  # this watcher's first
    finally:
        server.kill()
        server.wait()
    assert reports == [str(tmp_path / "stall-1"), str(tmp_path / "stall-2")]
    first = json.loads((tmp_path / "stall-1" / "report.json").read_text())
    second = json.loads((tmp_path / "stall-2" / "report.json").read_text())
    assert first["time"] < second["time"]


def test_a_stall_whose_dumps_cannot_be_written_is_still_a_finding(standin, tmp_path, monkeypatch):
    """A full disk at the stall (simulated: the dump directory cannot be made) raised out of the
    pass, and the stall's finding was lost with it; it is a finding that says why no stacks."""
    import errno

    from stepwatch.serving import watcher as W

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(W, "numbered_subdir", full)
    standin.metrics = text("metrics-0.32.0-midflight.txt")
    standin.load = 40
    w = ServeWatcher(WatchConfig(urls=[standin.url], run_dir=str(tmp_path), stall_timeout_s=0.3, interval_s=0.1),
                     root_pid=os.getpid())
    w.tick()
    time.sleep(0.2)
    w.tick()
    time.sleep(0.4)
    (stall,) = [f for f in w.tick().findings if f.kind == "stall"]
    assert "stacks not written" in stall.summary and "No space left" in stall.summary, stall.summary
    assert stall.data["dumped"] == 0 and stall.data["dir"] is None
