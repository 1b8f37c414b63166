"""Peak table: names as torch.cuda.get_device_name() / ROCm report them, dense numbers only, unknown
-> None with one log line, and the MFU arithmetic."""

from __future__ import annotations

import logging

import pytest

from stepwatch.metrics.peaks import (
    PeakResolver,
    compute_mfu,
    lookup_device,
    matmul_dtype_key,
)


@pytest.mark.parametrize(
    "name, model",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 SXM5 80GB", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100-SXM4-40GB", "A100"),
        ("NVIDIA A100-PCIE-40GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA B300 SXM6 AC", "B300"),
        ("NVIDIA GB200", "GB200"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L40", "L40"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA A10", "A10"),
        ("Tesla V100-SXM2-16GB", "V100 SXM2"),
        ("AMD Instinct MI300X", "MI300X"),
        ("AMD Instinct MI300X VF", "MI300X"),
        ("AMD Instinct MI325X", "MI325X"),
        ("AMD Instinct MI355X", "MI355X"),
    ],
)
def test_names_match(name, model):
    p = lookup_device(name)
    assert p is not None and p.model == model
    assert p.source


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA A10G",  # AWS part: not the A10's numbers
        "NVIDIA A100X-unknown-variant-MIG 1g.10gb",
        "NVIDIA H100 80GB HBM3 MIG 1g.10gb",  # a MIG slice has a fraction of the peak
        "NVIDIA GeForce RTX 4090",
        "AMD Instinct MI300A",
        "NVIDIA H100",  # form factor unknown: SXM and PCIe differ by 30%
        "",
        None,
    ],
)
def test_unknown_is_none(name):
    assert lookup_device(name) is None


def test_dense_not_sparse_and_dtype_ordering():
    h100 = lookup_device("NVIDIA H100 80GB HBM3").tflops
    # Datasheet BF16 "1,979 TFLOPS" carries the with-sparsity asterisk: dense is half.
    assert h100["bf16"] == pytest.approx(1979 / 2, rel=1e-3)
    assert lookup_device("NVIDIA A100-SXM4-80GB").tflops["bf16"] == 312.0
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA B200", "AMD Instinct MI300X", "NVIDIA L4"):
        t = lookup_device(name).tflops
        assert t["fp32"] < t["tf32"] < t["bf16"] == t["fp16"] < t["fp8"], name
    assert "fp8" not in lookup_device("NVIDIA A100-SXM4-80GB").tflops  # no FP8 on Ampere


def test_unknown_device_logs_one_line_naming_the_variable(caplog):
    r = PeakResolver()
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        assert r.peaks("NVIDIA Mystery 9000") is None
        assert r.peaks("NVIDIA Mystery 9000") is None
        assert r.peaks(None) is None
    lines = [rec.getMessage() for rec in caplog.records]
    assert len(lines) == 2  # once per distinct unknown device
    assert "STEPWATCH_PEAK_TFLOPS" in lines[0] and "NVIDIA Mystery 9000" in lines[0]


def test_override_applies_to_every_dtype_and_known_devices():
    r = PeakResolver(override_tflops=100.0)
    assert r.peaks(None) == 100.0
    assert r.peaks("NVIDIA H100 80GB HBM3") == 100.0
    with pytest.raises(ValueError, match="override_tflops"):
        PeakResolver(override_tflops=-1.0)
    with pytest.raises(TypeError, match="override_tflops"):
        PeakResolver(override_tflops="fast")


def test_mfu_math():
    peaks = {"bf16": 1000.0, "fp32": 100.0}
    # 500 TFLOP in bf16 at 1000 TFLOP/s = 0.5 s busy; 10 TFLOP fp32 at 100 = 0.1 s; step 1.2 s.
    assert compute_mfu({"bf16": 500e12, "fp32": 10e12}, 1.2, peaks) == pytest.approx(0.6 / 1.2)
    assert compute_mfu({"bf16": 500e12}, 1.0, 250.0) == pytest.approx(2.0)  # no clamp: a wrong peak shows
    assert compute_mfu({"bf16": 500e12, "fp8": 1e12}, 1.0, peaks) is None  # fp8 peak unknown
    assert compute_mfu({"bf16": 500e12}, 1.0, None) is None
    assert compute_mfu({"bf16": 500e12}, 0.0, peaks) is None
    assert compute_mfu(None, 1.0, peaks) is None
    assert compute_mfu({"fp8": 0}, 1.0, peaks) is None  # nothing counted: unknown, not 0


def test_matmul_dtype_key():
    import torch

    assert matmul_dtype_key(torch.float32) == "fp32"
    assert matmul_dtype_key(torch.float32, None, allow_tf32=True) == "tf32"
    assert matmul_dtype_key(torch.float32, torch.bfloat16, allow_tf32=True) == "bf16"
    assert matmul_dtype_key(torch.float16) == "fp16"
    assert matmul_dtype_key(torch.float8_e4m3fn) == "fp8"
    assert matmul_dtype_key(torch.int8) == "int8"
    with pytest.raises(ValueError, match="tensor_dtype"):
        matmul_dtype_key(torch.bool)


def test_mfu_drop_detector_uses_the_right_sign():
    from stepwatch.metrics.peaks import MfuDropDetector

    d = MfuDropDetector(points=5.0, window_s=600.0)
    t0 = 1_000_000.0
    # MFU rising by 10 points must NOT fire (the reference PromQL's sign error would).
    for i in range(0, 700, 10):
        assert d.observe_value(t0 + i, 0.40 + 0.10 * i / 700) is None
    d = MfuDropDetector(points=5.0, window_s=600.0)
    for i in range(0, 600, 10):
        assert d.observe_value(t0 + i, 0.45) is None
    assert d.observe_value(t0 + 600, 0.41) is None  # 4 points: under the threshold
    f = d.observe_value(t0 + 610, 0.38)  # 7 points below 10 minutes earlier
    assert f.kind == "mfu_drop" and f.data["mfu_before"] == pytest.approx(0.45)
    assert d.observe_value(t0 + 620, 0.37) is None  # one finding per episode
    assert len(d._samples) <= 601


def test_mfu_enricher_fills_record_with_flops_over_step_time_over_peak():
    import torch
    import torch.nn as nn

    from stepwatch.metrics.peaks import MfuDropDetector, MfuEnricher
    from stepwatch.metrics.tokens import ThroughputCollector
    from stepwatch.record import StepRecord

    m = nn.Linear(64, 32)
    col = ThroughputCollector()
    m.register_forward_pre_hook(lambda mod, a, k: col.on_forward(mod, a, k), with_kwargs=True)
    for _ in range(2):
        m(torch.randint(0, 5, (8, 64)).float()).sum().backward()
    rec = StepRecord(step=3, rank=0, time=5.0, step_s=0.25)
    peak = 1e-6  # TFLOP/s: what STEPWATCH_PEAK_TFLOPS would give on CPU
    assert MfuEnricher(PeakResolver(peak).peaks(None)).enrich(rec, {"throughput": col.take()}, force=False)
    want_flops = 2 * 3 * (2 * 8 * 64 * 32) - 2 * (2 * 8 * 64 * 32)  # no grad-input for the input
    assert rec.flops == want_flops
    assert rec.mfu == pytest.approx(rec.flops / rec.step_s / (peak * 1e12), rel=1e-12)
    assert rec.hfu == rec.mfu and rec.tokens is None
    # Unknown device: the record keeps flops, mfu stays null.
    rec2 = StepRecord(step=4, rank=0, time=6.0, step_s=0.25)
    m(torch.randn(8, 64)).sum().backward()
    assert MfuEnricher(None).enrich(rec2, {"throughput": col.take()}, force=False)
    assert rec2.flops is not None and rec2.mfu is None
    assert MfuDropDetector().observe(rec) == []


def test_mfu_enricher_reuses_the_last_counts_facts_and_gives_compute_mfus_numbers():
    """Steps of one signature share one FlopCount: the enricher keeps what follows from it and
    the peaks (dtype sums, the busy time) and divides by each step's time. The fields are the
    ones compute_mfu gives, for a shared count, a new one, recompute (HFU) and new peaks."""
    from types import SimpleNamespace

    from stepwatch.metrics.flops import FlopCount
    from stepwatch.metrics.peaks import MfuEnricher, compute_mfu

    a = FlopCount(forward={"bf16": 3e12, "fp32": 1e9}, backward={"bf16": 6e12})
    b = FlopCount(forward={"bf16": 2e12}, backward={"bf16": 4e12}, recompute={"bf16": 2e12})
    enr = MfuEnricher({"bf16": 989.0, "fp32": 67.0})
    for fc, step_s, peaks in ((a, 0.5, None), (a, 0.25, None), (b, 0.4, None), (b, 0.3, {"bf16": 400.0}),
                              (a, 0.0, None), (a, None, None), (b, 0.2, 50.0)):
        if peaks is not None:
            enr.peaks = peaks
        rec = SimpleNamespace(step_s=step_s, flops=None, mfu=None, hfu=None, mfu_dtype=None, peak_tflops=None,
                              tokens=None, samples=None)
        tp = SimpleNamespace(resolve=lambda fc=fc: (fc, 10, 2), flops=fc)
        assert enr.enrich(rec, {"throughput": tp}, force=False)
        want_mfu = compute_mfu(fc.by_dtype, step_s, enr.peaks)
        assert rec.mfu == want_mfu and rec.flops == float(fc.total)
        assert rec.hfu == (compute_mfu(fc.hfu_by_dtype, step_s, enr.peaks) if fc.recompute else want_mfu)
        assert rec.mfu_dtype == ("mixed" if fc is a else "bf16")
        assert rec.peak_tflops == (rec.flops / (rec.mfu * step_s) / 1e12 if rec.mfu and step_s else None)


def test_step_zeros_mfu_is_there_when_the_peak_is_known(sw):
    """The peak was set by a listener at the end of step 0, after its record went to the
    pipeline thread: that thread often built step 0 first, and its MFU was null (5 runs in 6 of
    a script's). A given peak, and a job without CUDA, have it from the start: before any step."""
    import torch
    import torch.nn as nn

    stepwatch, mem, start = sw
    for cfg in ({"peak_tflops": 1.0}, {}):
        s = start(**cfg)
        (tm,) = [f for f in s.features_started if getattr(f, "name", "") == "training_metrics"]
        assert tm.device == "cpu" and tm.mfu.peaks == cfg.get("peak_tflops"), (cfg, tm.device, tm.mfu.peaks)
        m = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        for _ in range(3):
            opt.zero_grad()
            m(torch.randn(32, 16)).sum().backward()
            opt.step()
        stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert recs[0].flops and recs[0].mfu is not None, recs[0]
