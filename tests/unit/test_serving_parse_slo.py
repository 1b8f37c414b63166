"""serve-vllm: /metrics parsing and SLO math against real vLLM 0.32 scrapes and v0-name fixtures.

The 0.32 scrapes are real (tests/fixtures/vllm/README.md); the midflight one was taken first, the
idle one after the burst, so (midflight -> idle) is a real window. Expected numbers are computed
here from the raw sample lines with PromQL's rules, independently of the code under test.
"""

from __future__ import annotations

import logging
import math
import os
import re

import pytest

from stepwatch.serving import names as N
from stepwatch.serving.parse import ParseErrors, parse_metrics
from stepwatch.serving.slo import Scrape, Window, counter_increase, histogram_quantile

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "vllm")
ENGINE0 = (("engine", "0"), ("model_name", "tiny-llama"))
OLD = (("model_name", "opt-125m"),)


def text(name: str) -> str:
    with open(os.path.join(FIX, name), encoding="utf-8") as f:
        return f.read()


def raw(name: str, sample: str, **labels: str) -> float:
    """The value of one sample line, read with a regex (not with the parser under test)."""
    for line in text(name).splitlines():
        if not line.startswith(sample + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError((sample, labels))


def real_window() -> Window:
    a = parse_metrics(text("metrics-0.32.0-midflight.txt"))
    b = parse_metrics(text("metrics-0.32.0-idle-after-load.txt"))
    return Window(Scrape(100.0, 1.0, a), Scrape(130.0, 31.0, b))


def old_window() -> Window:
    a = parse_metrics(text("metrics-v0-oldnames-t0.txt"))
    b = parse_metrics(text("metrics-v0-oldnames-t1.txt"))
    return Window(Scrape(0.0, 0.0, a), Scrape(30.0, 30.0, b))


def promql_quantile(q: float, bounds: list[float], deltas: list[float]) -> float:
    """A second, plain transcription of Prometheus' bucketQuantile for the expected values."""
    total = deltas[-1]
    rank = q * total
    i = next(i for i, c in enumerate(deltas) if c >= rank)
    if math.isinf(bounds[i]):
        return bounds[i - 1]
    lo = bounds[i - 1] if i else 0.0
    below = deltas[i - 1] if i else 0.0
    return lo + (bounds[i] - lo) * (rank - below) / (deltas[i] - below)


def bucket_deltas(base: str) -> tuple[list[float], list[float]]:
    bounds = []
    for line in text("metrics-0.32.0-idle-after-load.txt").splitlines():
        if line.startswith(base + "_bucket{"):
            bounds.append(float(re.search(r'le="([^"]+)"', line).group(1)))
    deltas = [
        raw("metrics-0.32.0-idle-after-load.txt", base + "_bucket", le=_le(b))
        - raw("metrics-0.32.0-midflight.txt", base + "_bucket", le=_le(b))
        for b in bounds
    ]
    return bounds, deltas


def _le(b: float) -> str:
    return "+Inf" if math.isinf(b) else repr(b)


def test_real_032_scrape_parses_cleanly_and_keeps_what_the_watcher_needs():
    errs = ParseErrors()
    s = parse_metrics(text("metrics-0.32.0-midflight.txt"), errs)
    assert errs.count == 0
    assert s["vllm:num_requests_waiting"][ENGINE0] == raw("metrics-0.32.0-midflight.txt", "vllm:num_requests_waiting") == 24.0
    assert s["vllm:kv_cache_usage_perc"][ENGINE0] == raw("metrics-0.32.0-midflight.txt", "vllm:kv_cache_usage_perc")
    assert "vllm:iteration_tokens_total_count" in s  # a histogram whose name ends in _total
    assert "python_gc_objects_collected_total" not in s  # filtered out
    assert not any(k.endswith("_created") for k in s)


@pytest.mark.parametrize("base", ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds"])
def test_real_window_quantiles_match_promql(base):
    bounds, deltas = bucket_deltas(base)
    assert deltas[-1] > 0, "the fixture window must hold observations"
    key = {"vllm:time_to_first_token_seconds": N.TTFT, "vllm:inter_token_latency_seconds": N.ITL,
           "vllm:e2e_request_latency_seconds": N.E2E}[base]
    got = real_window().quantiles(key, (0.5, 0.99))[ENGINE0]
    for q in (0.5, 0.99):
        assert got[q] == pytest.approx(promql_quantile(q, bounds, deltas))


def test_real_window_rates_and_ratios():
    w = real_window()
    a, b = "metrics-0.32.0-midflight.txt", "metrics-0.32.0-idle-after-load.txt"
    gen = raw(b, "vllm:generation_tokens_total") - raw(a, "vllm:generation_tokens_total")
    assert w.rate(N.GEN_TOKENS)[ENGINE0] == pytest.approx(gen / 30.0)
    hits = raw(b, "vllm:prefix_cache_hits_total") - raw(a, "vllm:prefix_cache_hits_total")
    queries = raw(b, "vllm:prefix_cache_queries_total") - raw(a, "vllm:prefix_cache_queries_total")
    assert w.ratio(N.PREFIX_HITS, N.PREFIX_QUERIES)[ENGINE0] == pytest.approx(hits / queries)
    finished = sum(raw(b, "vllm:request_success_total", finished_reason=r) - raw(a, "vllm:request_success_total", finished_reason=r)
                   for r in ("stop", "length", "abort", "error", "repetition"))
    assert w.increase(N.REQUEST_SUCCESS)[ENGINE0] == finished == 32.0
    # no speculative decoding on this server: no acceptance, not a made-up one
    assert w.ratio(N.SPEC_ACCEPTED, N.SPEC_DRAFT) == {}
    assert w.gauge(N.KV_USAGE)[ENGINE0] == 0.0


def test_old_generation_names_give_the_same_slos():
    w = old_window()
    q = w.quantiles(N.TTFT, (0.5, 0.99))[OLD]
    # Hand-computed from the fixture's deltas (README): P50 rank 50 in (0.08, 0.1] -> 0.1;
    # P99 rank 99 in (0.75, 1.0] with 98 below -> 0.75 + 0.25 * 1/2.
    assert q[0.5] == pytest.approx(0.1)
    assert q[0.99] == pytest.approx(0.875)
    itl = w.quantiles(N.ITL, (0.5, 0.99))[OLD]  # from time_per_output_token_seconds
    assert itl[0.5] == pytest.approx(0.05 + 0.025 * 100 / 400)
    assert itl[0.99] == pytest.approx(0.075 + 0.025 * 190 / 200)
    assert w.gauge(N.KV_USAGE)[OLD] == 0.9  # from gpu_cache_usage_perc
    assert w.ratio(N.SPEC_ACCEPTED, N.SPEC_DRAFT)[OLD] == pytest.approx(300 / 600)
    assert w.increase(N.PREEMPTIONS)[OLD] == 7.0
    assert w.rate(N.GEN_TOKENS)[OLD] == pytest.approx(6000 / 30)


def test_multiple_engines_stay_apart():
    t0, t1 = text("metrics-0.32.0-midflight.txt"), text("metrics-0.32.0-idle-after-load.txt")
    # engine 1: the same server shape, relabelled; its window sees the reversed order (a restart)
    a = parse_metrics(t0 + t1.replace('engine="0"', 'engine="1"'))
    b = parse_metrics(t1 + t0.replace('engine="0"', 'engine="1"'))
    w = Window(Scrape(0, 0, a), Scrape(30, 30, b))
    e1 = (("engine", "1"), ("model_name", "tiny-llama"))
    assert w.series() == {ENGINE0, e1}
    gen = w.increase(N.GEN_TOKENS)
    assert gen[ENGINE0] == 10720.0 - 5614.0
    assert gen[e1] == 5614.0  # went down: counted as a restart from zero
    assert w.gauge(N.WAITING) == {ENGINE0: 0.0, e1: 24.0}


def test_histogram_quantile_edges():
    inf = math.inf
    assert histogram_quantile(0.5, [(1.0, 0.0), (inf, 0.0)]) is None  # no observations
    assert histogram_quantile(0.99, [(1.0, 1.0), (inf, 10.0)]) == 1.0  # in +Inf: the highest bound
    assert histogram_quantile(0.5, [(1.0, 2.0)]) is None  # no +Inf bucket: not a histogram
    assert histogram_quantile(0.5, [(1.0, 5.0), (2.0, 3.0), (inf, 6.0)]) is None  # counts going down
    assert histogram_quantile(0.5, [(2.0, 4.0), (inf, 4.0)]) == pytest.approx(1.0)  # first bucket from 0
    with pytest.raises(ValueError, match="q must be"):
        histogram_quantile(1.5, [(inf, 1.0)])
    assert counter_increase(None, 5.0) == 0.0
    assert counter_increase(10.0, 4.0) == 4.0
    assert counter_increase(4.0, 10.0) == 6.0


def test_first_scrape_window_is_since_start_without_rates():
    s = parse_metrics(text("metrics-0.32.0-midflight.txt"))
    w = Window(None, Scrape(0, 0, s))
    assert w.increase(N.GEN_TOKENS)[ENGINE0] == 5614.0
    assert w.rate(N.GEN_TOKENS)[ENGINE0] is None


def test_malformed_lines_are_counted_and_skipped(caplog):
    good = text("metrics-0.32.0-midflight.txt")
    bad = good.replace(
        'vllm:num_requests_running{engine="0",model_name="tiny-llama"} 8.0',
        'vllm:num_requests_running{engine="0",model_name="tiny-llama"} eight',
    ).replace("# TYPE vllm:kv_cache_usage_perc gauge", "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{ 1")
    errs = ParseErrors()
    with caplog.at_level(logging.WARNING, logger="stepwatch.serving"):
        s = parse_metrics(bad, errs)
    assert errs.count == 2
    assert "skipped unreadable /metrics text" in caplog.text
    assert "vllm:num_requests_running" not in s  # the bad line is gone ...
    assert s["vllm:num_requests_waiting"][ENGINE0] == 24.0  # ... its neighbours are not
    assert s["vllm:kv_cache_usage_perc"][ENGINE0] == raw("metrics-0.32.0-midflight.txt", "vllm:kv_cache_usage_perc")


@pytest.mark.parametrize("cut", [0.1, 0.5, 0.9, 0.999])
def test_truncated_text_never_crashes_and_drops_the_cut_line(cut):
    full = text("metrics-0.32.0-midflight.txt")
    part = full[: int(len(full) * cut)]
    errs = ParseErrors()
    s = parse_metrics(part, errs)
    assert errs.count >= 1  # at least the cut line
    ref = parse_metrics(full)
    for name, per in s.items():  # whatever survived is exactly what the full text says
        for labels, v in per.items():
            assert ref[name][labels] == v, (name, labels)
    # A truncated histogram (no +Inf bucket yet) gives no quantile rather than a wrong one.
    w = Window(None, Scrape(0, 0, s))
    for qs in w.quantiles(N.TTFT, (0.99,)).values():
        assert qs[0.99] is None or "vllm:time_to_first_token_seconds_count" in s


@pytest.mark.parametrize("junk", ["", "\n\n", "garbage\n", "\x00\x01\x02\n", "# TYPE x histogram\nx_bucket{le=\"a\"} 1\n", b"bytes"])
def test_junk_is_not_fatal(junk):
    errs = ParseErrors()
    s = parse_metrics(junk, errs)  # type: ignore[arg-type]
    assert isinstance(s, dict)


def test_a_server_restarted_mid_window_counts_before_and_after_the_restart():
    """PromQL's increase() and rate() look for a reset at every sample in the range. Scrapes
    midflight -> idle -> (restart) midflight -> idle: the ends alone read idle - midflight, one
    burst, and missed the other two; the whole window holds (idle - midflight) + midflight +
    (idle - midflight). The window's histogram deltas add up the same way."""
    a_txt, b_txt = "metrics-0.32.0-midflight.txt", "metrics-0.32.0-idle-after-load.txt"
    a, b = parse_metrics(text(a_txt)), parse_metrics(text(b_txt))
    chain = [Scrape(0.0, 0.0, a), Scrape(10.0, 10.0, b), Scrape(20.0, 20.0, a), Scrape(30.0, 30.0, b)]
    w = Window(chain[0], chain[-1], chain[1:-1])
    ga, gb = raw(a_txt, "vllm:generation_tokens_total"), raw(b_txt, "vllm:generation_tokens_total")
    assert ga < gb
    assert w.increase(N.GEN_TOKENS)[ENGINE0] == pytest.approx(2 * gb - ga)
    assert w.rate(N.GEN_TOKENS)[ENGINE0] == pytest.approx((2 * gb - ga) / 30.0)
    base = "vllm:time_to_first_token_seconds"
    bounds, _ = bucket_deltas(base)
    deltas = [2 * raw(b_txt, base + "_bucket", le=_le(x)) - raw(a_txt, base + "_bucket", le=_le(x)) for x in bounds]
    got = w.quantiles(N.TTFT, (0.5, 0.99))[ENGINE0]
    for q in (0.5, 0.99):
        assert got[q] == pytest.approx(promql_quantile(q, bounds, deltas))
    # The watcher's windows hand over the scrapes between their ends.
    from stepwatch.serving.watcher import _Server

    srv = _Server("http://127.0.0.1:1", keep_s=600.0)
    for s in chain:
        srv.add(s)
    assert srv.window(60.0).increase(N.GEN_TOKENS)[ENGINE0] == pytest.approx(2 * gb - ga)
    assert srv.window(10.0).increase(N.GEN_TOKENS)[ENGINE0] == pytest.approx(gb - ga)  # the last two only
