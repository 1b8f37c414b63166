"""``low_mfu`` (reference B.10): the detector's windows, episodes and configuration. The real CPU
training loops it is judged on are in tests/integration/test_low_mfu_loop.py: they time the
machine, and beside another test worker they read its load."""

from __future__ import annotations

import pytest

from stepwatch.metrics.lowmfu import LOW_MFU_MIN_STEPS, LowMfuDetector
from stepwatch.record import StepRecord


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


def test_a_cpu_jobs_low_mfu_gives_advice_for_a_cpu(sw):
    """A CPU job gets an MFU from a peak the user gives (docs/mfu.md). Its ``low_mfu`` finding
    told it to look for idle gaps between CUDA kernels with nsys, then at SM_ACTIVE and Tensor
    Core activity: none of which a CPU has."""
    import torch

    stepwatch, mem, start = sw
    start(peak_tflops=1000.0, console="off")
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for _ in range(LOW_MFU_MIN_STEPS + 10):
        opt.zero_grad()
        m(torch.randn(16, 32)).pow(2).mean().backward()
        opt.step()
    stepwatch.shutdown()
    (f,) = [f for f in mem.findings if f.kind == "low_mfu"]
    text = " ".join((f.summary, f.diagnosis, f.action))
    for gpu_only in ("SM_ACTIVE", "Tensor Core", "NCCL", "nccl", "--trace=cuda", "CUDA launches", "nccl-tests"):
        assert gpu_only not in text, (gpu_only, text)
    from stepwatch.metrics.lowmfu import _FIRST_LOOK_CPU

    assert f.summary.endswith(_FIRST_LOOK_CPU[f.data["look_first"]][1]), f.summary
