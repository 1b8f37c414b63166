"""``low_mfu`` (reference B.10) on a real CPU training loop, MFU from STEPWATCH_PEAK_TFLOPS.

The peak is the only thing set by hand: FLOPs, step times, phases and MFU are stepwatch's own
measurements of a real torch loop. The "healthy" case sets the peak to 1.1x the FLOP rate this
same process reached in its first 50 steps (MFU about 90%), because this VM's step time varies up
to 2x between runs; the detector judges the median of at least 100 steps.
"""

from __future__ import annotations

import os
import statistics

import pytest
import torch
import torch.nn as nn

from stepwatch.metrics.lowmfu import LOW_MFU_MIN_STEPS, LowMfuDetector
from stepwatch.record import StepRecord


def _train(steps: int) -> None:
    # One intra-op thread: on a shared 2-core VM two torch threads stall each other (steps of
    # 2 ms and 100 ms side by side); one thread keeps the rate steady within a run.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        x = torch.randn(128, 512)
        for _ in range(steps):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)


def test_cpu_loop_with_a_peak_far_above_the_cpu_gives_low_mfu(sw, monkeypatch):
    stepwatch, mem, start = sw
    monkeypatch.setenv("STEPWATCH_PEAK_TFLOPS", "1000")
    start()
    _train(LOW_MFU_MIN_STEPS + 10)
    stepwatch.shutdown()
    assert sum(r.mfu is not None for r in mem.records) >= LOW_MFU_MIN_STEPS
    got = [f for f in mem.findings if f.kind == "low_mfu"]
    assert len(got) == 1, [f.kind for f in mem.findings]
    f = got[0]
    assert f.data["mfu_median"] < 0.01 and f.data["steps"] == LOW_MFU_MIN_STEPS
    assert "40%" in f.diagnosis and "idle gaps between kernels" in f.action
    # Where the time goes, and what to look at first (no data wait, no comm: the compute itself).
    assert "forward" in f.summary and "backward" in f.summary and "Look first at" in f.summary
    assert f.data["look_first"] in ("compute", "other")
    assert set(f.data["share"]) == {"data_wait", "forward", "backward", "optimizer", "other"}


def test_peak_at_1_1x_the_achieved_rate_gives_no_low_mfu(sw, monkeypatch, tmp_path):
    stepwatch, mem, start = sw
    monkeypatch.setenv("STEPWATCH_PEAK_TFLOPS", "1000")
    start(dir=str(tmp_path / "probe"))
    _train(50)
    stepwatch.shutdown()
    rates = [r.flops / r.step_s for r in mem.records if r.flops and r.step_s > 0]
    assert len(rates) >= 45
    achieved = statistics.median(rates)  # FLOP/s this process reached
    monkeypatch.setenv("STEPWATCH_PEAK_TFLOPS", repr(1.1 * achieved / 1e12))
    mem.records.clear()
    mem.findings.clear()
    start(dir=str(tmp_path / "run"))
    _train(2 * LOW_MFU_MIN_STEPS + 10)
    stepwatch.shutdown()
    mfus = [r.mfu for r in mem.records if r.mfu is not None]
    assert len(mfus) >= 2 * LOW_MFU_MIN_STEPS  # two windows were judged
    assert statistics.median(mfus) > 0.4
    assert [f for f in mem.findings if f.kind == "low_mfu"] == []


def _rec(i: int, mfu: float | None, **kw) -> StepRecord:
    return StepRecord(step=i, rank=2, time=100.0 + i, step_s=0.1, mfu=mfu, **kw)


def test_once_per_episode_where_to_look_first_and_the_capture_path(tmp_path):
    caps = tmp_path / "captures"
    caps.mkdir()
    d = LowMfuDetector(0.4, window=50, captures_dir=str(caps))
    assert d.window == LOW_MFU_MIN_STEPS
    waity = dict(data_wait_s=0.03, forward_s=0.02, backward_s=0.03, optimizer_s=0.01, other_s=0.01)
    out = [f for i in range(99) for f in d.observe(_rec(i, 0.2, **waity))]
    assert out == []
    (caps / "capture-1-steps10-12.rank2.trace.json.gz").write_bytes(b"x")
    (caps / "capture-1-steps10-12.rank0.trace.json.gz").write_bytes(b"x")  # another rank's
    out = d.observe(_rec(99, 0.2, **waity))
    assert len(out) == 1
    f = out[0]
    assert f.data["look_first"] == "data" and "data loading" in f.summary and "num_workers" in f.summary
    assert f.data["share"]["data_wait"] == pytest.approx(0.3)
    assert f.data["capture"] == str(caps / "capture-1-steps10-12.rank2.trace.json.gz")
    assert f.data["capture"] in f.summary
    # Still low: the same episode, no second finding.
    assert [g for i in range(100, 300) for g in d.observe(_rec(i, 0.2, **waity))] == []
    # Exposed communication dominates; healthy windows end the episode, a new low one fires again.
    assert [g for i in range(300, 400) for g in d.observe(_rec(i, 0.6))] == []
    commy = dict(forward_s=0.02, backward_s=0.06, optimizer_s=0.01, other_s=0.01, comm_exposed_s=0.04)
    again = [g for i in range(400, 500) for g in d.observe(_rec(i, 0.3, **commy))]
    assert len(again) == 1 and again[0].data["look_first"] == "comm" and "busbw" in again[0].summary
    # Unknown MFU is never judged.
    d2 = LowMfuDetector(0.4, window=10)
    assert [g for i in range(500) for g in d2.observe(_rec(i, None))] == []
    with pytest.raises(ValueError, match="threshold"):
        LowMfuDetector(1.5, 10)


def test_threshold_variable_is_validated_with_its_name():
    from stepwatch.config import Config, ConfigError

    assert Config.from_env({}).low_mfu == 0.4
    assert Config.from_env({"STEPWATCH_LOW_MFU": "0.3"}).low_mfu == 0.3
    with pytest.raises(ConfigError, match="STEPWATCH_LOW_MFU='40'"):
        Config.from_env({"STEPWATCH_LOW_MFU": "40"})
