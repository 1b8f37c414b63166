"""Tables and diagnosis: throttle bits against pynvml, the XID table, the SM activity matrix joined
with step records, stragglers across ranks, checkpoint share, the per-window ``gpu`` object, and
the amdsmi import guard. Samples here are plain dicts as the sampler makes them (see
test_telemetry_nvml.py for the sampler itself); amdsmi is not installed, so its stand-in is a
small fake module (no AMD GPU here)."""

from __future__ import annotations

import builtins
import sys
import types

import pynvml
import pytest

from stepwatch.analysis.kinds import KINDS
from stepwatch.record import StepRecord
from stepwatch.telemetry import find_gpu_stragglers, summarize_window
from stepwatch.telemetry.amd import AmdDevice, load_amdsmi, pick_index
from stepwatch.telemetry.diagnose import Analyzer, CheckpointWatch, checkpoint_fields, classify
from stepwatch.telemetry.fields import FIELDS
from stepwatch.telemetry.gpm import GPM_FIELDS
from stepwatch.telemetry.throttle import REASONS, decode
from stepwatch.telemetry.xid import describe


def test_throttle_table_matches_pynvml_constants():
    for r in REASONS:
        assert getattr(pynvml, f"nvmlClocksEventReason{r.name}") == r.bit, r.name
    # Every named NVML reason bit is in the table (aliases such as UserDefinedClocks share a bit).
    named = {getattr(pynvml, n) for n in dir(pynvml)
             if n.startswith("nvmlClocksEventReason") and n not in ("nvmlClocksEventReasonAll",
                                                                      "nvmlClocksEventReasonNone")}
    assert named == {r.bit for r in REASONS}
    assert decode(0) == []
    assert decode(pynvml.nvmlClocksEventReasonGpuIdle) == ["GpuIdle"]
    assert decode(0x4 | 0x40) == ["SwPowerCap", "HwThermalSlowdown"]
    assert decode(0x1000) == ["0x1000"]
    with pytest.raises(ValueError, match="mask"):
        decode(-1)


def test_gpm_mapping_uses_existing_pynvml_metrics_and_dcgm_fields():
    for field, (const, scale) in GPM_FIELDS.items():
        assert field in FIELDS
        assert isinstance(getattr(pynvml, const), int), const
        assert scale in (0.01, 1024 * 1024)
    # The ids the issue pins (dcgm_fields.h), not the reference sheet's.
    ids = {k: f.dcgm_id for k, f in FIELDS.items()}
    assert ids["DCGM_FI_DEV_GPU_TEMP"] == 150 and ids["DCGM_FI_DEV_MEM_MAX_OP_TEMP"] == 151
    assert ids["DCGM_FI_DEV_POWER_USAGE"] == 155 and ids["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] == 156
    assert ids["DCGM_FI_DEV_XID_ERRORS"] == 230 and ids["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"] == 112
    assert ids["DCGM_FI_DEV_GPU_UTIL"] == 203 and ids["DCGM_FI_PROF_SM_ACTIVE"] == 1002
    assert ids["DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"] == 1004 and ids["DCGM_FI_PROF_DRAM_ACTIVE"] == 1005
    assert ids["DCGM_FI_PROF_PCIE_TX_BYTES"] == 1009 and ids["DCGM_FI_DEV_FB_USED"] == 252


def test_xid_table_severity_and_unknown_codes():
    assert describe(79)[1] == "critical"
    assert describe(63)[1] == "warning"
    assert describe(80)[1] == "info"
    name, sev, action = describe(31)
    assert "not in stepwatch's table" in name and sev == "warning" and "Xid catalog" in action


def test_new_kinds_are_registered():
    for k in ("thermal_throttle", "xid", "ecc_uncorrectable", "nvlink_degraded", "sm_activity",
              "gpu_straggler", "slow_checkpoint"):
        assert k in KINDS and KINDS[k].source


@pytest.mark.parametrize("sm,tensor,dram,fp64,wait,share,row", [
    (0.92, 0.70, 0.30, 0.0, None, None, None),           # healthy compute-bound
    (0.92, 0.70, 0.80, 0.0, None, None, None),           # healthy bandwidth-bound decode
    (0.92, 0.05, 0.20, 0.0, None, None, "tensor_unused"),
    (0.92, 0.05, 0.80, 0.0, None, None, "memory_bound"),
    (0.20, 0.02, 0.10, 0.0, 0.080, 0.45, "data_stall"),
    (0.20, 0.02, 0.10, 0.0, 0.001, 0.01, "launch_overhead"),
    (0.20, 0.02, 0.10, 0.0, 0.015, 0.003, "launch_overhead"),  # 15 ms on a 5 s step: not the loader
    (0.70, 0.30, 0.30, 0.0, None, None, None),           # in between: no row
    (0.92, 0.70, 0.30, 0.09, None, None, "fp64"),
])
def test_sm_activity_matrix_rows(sm, tensor, dram, fp64, wait, share, row):
    assert classify(sm, tensor, dram, fp64, wait, share) == row


def _gpu_samples(t0, n, sm, tensor, dram, gpu=0):
    return [{"time": t0 + i, "gpu": gpu, "DCGM_FI_PROF_SM_ACTIVE": sm, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": tensor,
             "DCGM_FI_PROF_DRAM_ACTIVE": dram, "DCGM_FI_PROF_PIPE_FP64_ACTIVE": 0.0} for i in range(n)]


def _records(t0, n, step_s, wait_s):
    return [StepRecord(step=i, rank=0, time=t0 + i * step_s, step_s=step_s, data_wait_s=wait_s) for i in range(n)]


def test_low_sm_with_high_data_wait_blames_the_data_loader():
    t0 = 1000.0
    a = Analyzer(rank=1)
    fs = a.analyze(_gpu_samples(t0, 61, 0.15, 0.03, 0.05), _records(t0, 200, 0.3, 0.12))
    assert [f.kind for f in fs] == ["sm_activity"]
    f = fs[0]
    assert f.data["row"] == "data_stall" and "data loader" in f.diagnosis and "num_workers" in f.action
    assert f.data["data_wait_share"] == pytest.approx(0.4)
    # Same GPU picture, no data wait: launch overhead, with the nsys action.
    b = Analyzer()
    fs = b.analyze(_gpu_samples(t0, 61, 0.15, 0.03, 0.05), _records(t0, 200, 0.3, 0.0005))
    assert fs[0].data["row"] == "launch_overhead" and "nsys" in fs[0].action


def test_matrix_needs_a_window_and_does_not_repeat():
    a = Analyzer()
    assert a.analyze(_gpu_samples(0.0, 3, 0.95, 0.02, 0.1)) == []  # too few samples
    fs = a.analyze(_gpu_samples(3.0, 60, 0.95, 0.02, 0.1))
    assert [f.data["row"] for f in fs] == ["tensor_unused"]
    # Another minute of the same: not repeated within 10 minutes.
    assert a.analyze(_gpu_samples(70.0, 61, 0.95, 0.02, 0.1)) == []
    # Healthy samples produce nothing.
    assert Analyzer().analyze(_gpu_samples(0.0, 70, 0.93, 0.7, 0.3)) == []


def test_straggler_is_the_rank_that_varies_while_others_hold():
    steady = [0.91, 0.92, 0.90, 0.91, 0.92, 0.91, 0.90, 0.92]
    wobbly = [0.91, 0.55, 0.88, 0.40, 0.90, 0.62, 0.35, 0.89]
    fs = find_gpu_stragglers({0: steady, 1: steady[::-1], 2: wobbly, 3: steady}, rank=0, step=42)
    assert [f.data["straggler_rank"] for f in fs] == [2]
    assert fs[0].kind == "gpu_straggler" and fs[0].step == 42
    # Everyone varying (a job-wide phase change): nobody is singled out.
    assert find_gpu_stragglers({0: wobbly, 1: wobbly[::-1], 2: wobbly}) == []
    assert find_gpu_stragglers({0: steady}) == []


def test_checkpoint_share_and_throughput():
    w = CheckpointWatch(rank=0)
    recs = [StepRecord(step=i, rank=0, time=float(i), step_s=1.0) for i in range(95)]
    slow = StepRecord(step=95, rank=0, time=95.0, step_s=1.0, checkpoint_s=20.0,
                      scalars={"checkpoint_bytes": 14e9})
    fs = w.update(recs + [slow])
    assert [f.kind for f in fs] == ["slow_checkpoint"]
    assert fs[0].data["share"] == pytest.approx(20 / 116)
    assert fs[0].data["gb_per_s"] == pytest.approx(0.7)
    assert "< 2 GB/s" in fs[0].summary
    ok = CheckpointWatch()
    fast = StepRecord(step=99, rank=0, time=99.0, step_s=1.0, checkpoint_s=3.0, scalars={"checkpoint_bytes": 140e9})
    assert ok.update(recs + [fast]) == []  # 3% of run time at 47 GB/s: normal
    # A tiny save (2 KB in 10 ms, within 8% of run time) measures latency, not storage: no verdict.
    tiny = StepRecord(step=99, rank=0, time=99.0, step_s=1.0, checkpoint_s=0.01, checkpoint_bytes=2048)
    assert CheckpointWatch().update(recs + [tiny]) == []
    assert checkpoint_fields(14_000_000_000, 7.0) == {"checkpoint_bytes": 14_000_000_000, "checkpoint_gbps": 2.0}
    assert checkpoint_fields(None, 7.0)["checkpoint_gbps"] is None


def test_summarize_window():
    assert summarize_window([]) is None
    s = [{"time": 1.0, "gpu": 0, "uuid": "GPU-x", "DCGM_FI_DEV_GPU_TEMP": 70, "DCGM_FI_DEV_POWER_USAGE": 600.0,
          "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 1_000_000, "DCGM_FI_DEV_SM_CLOCK": 1980,
          "clocks_event_reasons": []},
         {"time": 2.0, "gpu": 0, "uuid": "GPU-x", "DCGM_FI_DEV_GPU_TEMP": 80, "DCGM_FI_DEV_POWER_USAGE": 700.0,
          "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 1_650_000, "DCGM_FI_DEV_SM_CLOCK": 1500,
          "DCGM_FI_PROF_SM_ACTIVE": 0.9, "clocks_event_reasons": ["SwPowerCap"]}]
    g = summarize_window(s)
    assert g["samples"] == 2 and g["uuid"] == "GPU-x"
    assert g["temp_max_c"] == 80 and g["temp_mean_c"] == 75
    assert g["power_mean_w"] == 650.0 and g["energy_j"] == pytest.approx(650.0)
    assert g["sm_clock_min_mhz"] == 1500 and g["sm_active"] == 0.9
    assert g["clocks_event_reasons"] == ["SwPowerCap"]
    assert "tensor_active" not in g  # unknown stays absent


def test_amdsmi_import_guard_handles_keyerror(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name == "amdsmi":
            raise KeyError("ROCM_PATH")  # what amdsmi does when its library is missing
        return real_import(name, *a, **k)

    monkeypatch.delitem(sys.modules, "amdsmi", raising=False)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    mod, why = load_amdsmi()
    assert mod is None and "KeyError" in why


def test_amd_device_maps_to_dcgm_names():
    class AmdSmiException(Exception):
        pass

    smi = types.SimpleNamespace(
        AmdSmiException=AmdSmiException,
        AmdSmiTemperatureType=types.SimpleNamespace(EDGE="edge", HOTSPOT="hotspot", VRAM="vram"),
        AmdSmiTemperatureMetric=types.SimpleNamespace(CURRENT="current"),
        amdsmi_get_gpu_device_uuid=lambda h: "amd-uuid-1",
        amdsmi_get_gpu_device_bdf=lambda h: "0000:c1:00.0",
        amdsmi_get_gpu_asic_info=lambda h: {"market_name": "MI300X"},
        amdsmi_get_temp_metric=lambda h, t, m: {"hotspot": 88, "vram": 77}[t],
        amdsmi_get_power_info=lambda h: {"current_socket_power": "N/A", "average_socket_power": 550},
        amdsmi_get_energy_count=lambda h: {"energy_accumulator": 2_000_000, "counter_resolution": 15.3},
        amdsmi_get_gpu_activity=lambda h: {"gfx_activity": 97, "umc_activity": 40, "mm_activity": "N/A"},
        amdsmi_get_gpu_vram_usage=lambda h: {"vram_total": 196_592, "vram_used": 150_000},
        amdsmi_get_gpu_total_ecc_count=lambda h: {"correctable_count": 0, "uncorrectable_count": 0},
    )

    def metrics(h):
        raise AmdSmiException("not supported")

    smi.amdsmi_get_gpu_metrics_info = metrics
    dev = AmdDevice(smi, "h0", 0, clock=lambda: 5.0)
    s = dev.sample()
    assert s["vendor"] == "amd" and s["name"] == "MI300X" and s["pci_bus_id"] == "0000:c1:00.0"
    assert s["DCGM_FI_DEV_GPU_TEMP"] == 88 and s["DCGM_FI_DEV_MEMORY_TEMP"] == 77
    assert s["DCGM_FI_DEV_POWER_USAGE"] == 550  # "N/A" current falls back to the average
    assert s["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] == int(2_000_000 * 15.3 / 1000)
    assert s["DCGM_FI_DEV_GPU_UTIL"] == 97 and s["stepwatch_gpu_amd_umc_activity"] == 0.4
    assert s["DCGM_FI_DEV_FB_FREE"] == 46_592
    assert "stepwatch_gpu_amd_throttle_status" not in s
    dev.sample()
    assert "metrics" in dev._unsupported  # asked once, then left alone
    assert pick_index({"HIP_VISIBLE_DEVICES": "3", "LOCAL_RANK": "2"}) == 3
    assert pick_index({"LOCAL_RANK": "2"}) == 2


def test_amd_violations_and_events():
    class AmdSmiException(Exception):
        pass

    class Reader:
        def __init__(self, handle, kinds):
            self.kinds = kinds
            self.queue = [[{"event": "GPU_PRE_RESET", "message": "reset requested"}], []]
            self.stopped = False

        def read(self, timeout_ms):
            return self.queue.pop(0) if self.queue else []

        def stop(self):
            self.stopped = True

    smi = types.SimpleNamespace(
        AmdSmiException=AmdSmiException,
        AmdSmiEvtNotificationType=types.SimpleNamespace(GPU_PRE_RESET=1, GPU_POST_RESET=2, THERMAL_THROTTLE=3),
        AmdSmiEventReader=Reader,
        amdsmi_get_violation_status=lambda h: {"active_prochot_thrm": 1, "active_ppt_pwr": 0, "per_ppt_pwr": 3},
    )
    dev = AmdDevice(smi, "h0", 0, clock=lambda: 1.0)
    s1, s2 = dev.sample(), dev.sample()
    assert s1["amd_violations"] == ["prochot_thrm"] and s1["stepwatch_gpu_amd_violations_active"] == 1
    assert s1["amd_events"] == [{"event": "GPU_PRE_RESET", "message": "reset requested"}]
    assert "amd_events" not in s2
    assert dev._reader.kinds == [1, 2, 3]
    dev.close()
    assert dev._reader.stopped


def test_a_save_at_the_start_or_in_a_short_run_is_not_judged_a_share_of_the_run():
    """Saving the initial weights, then training: judged at that save, the share was the save
    over itself and step 0 (40-100% "of run time") in a run where it was under 1%. The share is
    judged once a minute of run time is behind it; a slow write is judged at once."""
    w = CheckpointWatch(rank=0)
    first = StepRecord(step=0, rank=0, time=0.0, step_s=0.01, checkpoint_s=0.02, checkpoint_bytes=4_000_000)
    recs = [first] + [StepRecord(step=i, rank=0, time=i * 0.1, step_s=0.1) for i in range(1, 1200)]
    assert w.update(recs) == []
    # A minute on, the same share is judged: a later save that brings it over 8%.
    late = StepRecord(step=1200, rank=0, time=120.0, step_s=0.1, checkpoint_s=15.0, checkpoint_bytes=4_000_000)
    (f,) = w.update([late])
    assert f.kind == "slow_checkpoint" and "in 2 steps with a save" in f.summary, f.summary
    # A write under 2 GB/s is storage, whatever the run's length.
    slow = StepRecord(step=0, rank=0, time=0.0, step_s=0.01, checkpoint_s=10.0, checkpoint_bytes=10_000_000_000)
    assert [f.kind for f in CheckpointWatch().update([slow])] == ["slow_checkpoint"]


@pytest.mark.parametrize("gpu_telemetry", [True, False])
def test_a_slow_save_is_found_with_gpu_telemetry_on_or_off(sw, gpu_telemetry):
    """The checkpoint rules (B.9) read the step records only, but ran inside the GPU sampler's
    analysis: a CPU job that set ``gpu_telemetry=False`` never got ``slow_checkpoint``. A save of
    100 MB that takes 0.3 s (under 2 GB/s) is found either way, and the summary leads with the
    rule that fired (the share of run time needs a minute of run behind it, not there yet)."""
    import io
    import time

    import torch
    import torch.nn as nn

    class SlowFile(io.BytesIO):  # storage that writes at ~0.3 GB/s
        slept = False

        def write(self, b):
            if not self.slept:
                self.slept = True
                time.sleep(0.3)
            return super().write(b)

    stepwatch, mem, start = sw
    start(gpu_telemetry=gpu_telemetry)
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    big = torch.zeros(25_000_000)  # 100 MB
    for step in range(20):
        m(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 10:
            torch.save(big, SlowFile())
    stepwatch.shutdown()
    rec = next(r for r in mem.records if r.checkpoint_s > 0)
    assert rec.checkpoint_bytes >= 100_000_000 and rec.checkpoint_gbps < 2.0, rec
    (f,) = [f for f in mem.findings if f.kind == "slow_checkpoint"]
    assert f.summary.startswith("saves wrote 0."), f.summary
    # A save's speed is the serializer's too: the disk is not named as the cause, and the summary
    # says how to tell (it said "storage degraded" of a healthy disk under torch.save's own 0.7 GB/s).
    assert "the storage may be degraded" in f.summary and "doctor --storage" in f.summary, f.summary
    assert "storage degraded)" not in f.summary, f.summary
