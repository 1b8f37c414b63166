"""The NVML sampler against a fake NVML, at the ``pynvml`` function boundary.

No GPU here, so ``FakeNvml`` stands in for the ``pynvml`` module: it implements the NVML
*functions* the sampler calls and takes everything else (constants, ctypes structs, ``NVMLError``)
from the real ``pynvml``. It replays a script of readings, one entry per sample: values in the
ranges of an H100 SXM under training load, hand-entered (not recorded from a device), with a
thermal-throttle episode (86 C, SwThermalSlowdown+HwThermalSlowdown, SM clock 1980 -> 1395 MHz),
a GPM pair per sample and an XID 79 delivered through the event API. Everything the sampler does
with those readings -- field names, units, GPM ratios, throttle decoding, findings -- is the real
code.
"""

from __future__ import annotations

import ctypes
import sys
import queue
import time
from types import SimpleNamespace

import pynvml
import pytest

from stepwatch.record import StepRecord
from stepwatch.telemetry import TelemetrySource, summarize_window
from stepwatch.telemetry.diagnose import Analyzer
from stepwatch.telemetry.fields import FIELDS
from stepwatch.telemetry.nvml import NvmlDevice, XidWatcher, attach_xids, resolve_device, DeviceNotFound

UUIDS = ["GPU-0f1e2d3c-aaaa-bbbb-cccc-000000000000", "GPU-7a6b5c4d-aaaa-bbbb-cccc-111111111111"]
BUSIDS = ["00000000:19:00.0", "00000000:3B:00.0"]

G = pynvml  # GPM metric ids


def _tick(temp, clock, reasons, sm, tensor, dram, *, power=650_000, dbe=0, crc=0, fp64=0.0, gr=None,
          occupancy=0.41, mem_temp=None, power_limit=700_000, sbe=2, nvlink=None):
    """One sample's readings. ``nvlink``: bytes/s each way (default ~157 GB/s); ``power*`` in mW
    (700 W: an H100 SXM's default limit); ``mem_temp`` defaults to 6 C under the GPU's."""
    nv_mib = (150_000.0, 149_000.0) if nvlink is None else (nvlink / 2**20, nvlink / 2**20)
    return {
        "temp": temp, "clock": clock, "reasons": reasons, "power_mw": power, "dbe": dbe, "crc": crc,
        "mem_temp": temp - 6 if mem_temp is None else mem_temp, "power_limit_mw": power_limit, "sbe": sbe,
        "gpm": {G.NVML_GPM_METRIC_GRAPHICS_UTIL: sm * 100 + 3 if gr is None else gr * 100,
                G.NVML_GPM_METRIC_SM_UTIL: sm * 100,
                G.NVML_GPM_METRIC_SM_OCCUPANCY: occupancy * 100, G.NVML_GPM_METRIC_ANY_TENSOR_UTIL: tensor * 100,
                G.NVML_GPM_METRIC_DRAM_BW_UTIL: dram * 100, G.NVML_GPM_METRIC_FP64_UTIL: fp64 * 100,
                G.NVML_GPM_METRIC_FP32_UTIL: 7.5, G.NVML_GPM_METRIC_FP16_UTIL: 1.25,
                G.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 512.0, G.NVML_GPM_METRIC_PCIE_RX_PER_SEC: 2048.0,
                G.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: nv_mib[0],
                G.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: nv_mib[1]},
    }


THERMAL = pynvml.nvmlClocksEventReasonSwThermalSlowdown | pynvml.nvmlClocksEventReasonHwThermalSlowdown
# One entry per sample. Healthy, then a thermal episode, then recovery.
SCRIPT = [
    _tick(71, 1980, 0, 0.91, 0.66, 0.35),
    _tick(74, 1980, 0, 0.92, 0.67, 0.36),
    _tick(79, 1965, pynvml.nvmlClocksEventReasonSwPowerCap, 0.92, 0.66, 0.35),
    _tick(86, 1395, THERMAL, 0.90, 0.64, 0.34, crc=0),
    _tick(87, 1380, THERMAL, 0.89, 0.63, 0.33, crc=3),
    _tick(81, 1950, 0, 0.91, 0.66, 0.35, crc=3, dbe=1),
    _tick(78, 1980, 0, 0.92, 0.67, 0.36, crc=3, dbe=1),
]


class FakeNvml:
    """The NVML functions the sampler uses; constants and structs come from the real pynvml."""

    def __init__(self, script=SCRIPT, *, gpm_supported=True, uuids=UUIDS, busids=BUSIDS):
        self.script = script
        self.i = -1  # current script entry; advanced by each temperature read (the first read of a sample)
        self.gpm_supported = gpm_supported
        self.uuids = uuids
        self.busids = busids
        self.inits = 0
        self._samples: dict[int, int] = {}  # GPM sample address -> script entry it was taken at
        self._buffers = []
        self._events: queue.Queue[int] = queue.Queue()
        self.freed_event_sets = 0

    def __getattr__(self, name):
        if name.startswith("nvml") and callable(getattr(pynvml, name, None)) and not name.startswith("nvmlClocks") \
                and not name.startswith("nvmlEventType"):
            raise AttributeError(f"FakeNvml does not implement {name}")
        return getattr(pynvml, name)

    @property
    def cur(self):
        return self.script[min(max(self.i, 0), len(self.script) - 1)]

    # lifecycle and device lookup
    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.inits -= 1

    def nvmlDeviceGetCount(self):
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i):
        if not 0 <= i < len(self.uuids):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ("h", i)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        u = uuid.decode() if isinstance(uuid, bytes) else uuid
        if u not in self.uuids:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return ("h", self.uuids.index(u))

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        b = bus.upper()
        for i, x in enumerate(self.busids):
            if x.upper() == b or x.upper().endswith(b):
                return ("h", i)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    # static info
    def nvmlSystemGetDriverVersion(self):
        return "550.54.15"

    def nvmlSystemGetCudaDriverVersion_v2(self):
        return 12040

    def nvmlDeviceGetRemappedRows(self, h):
        return (0, self.cur["dbe"], 0, 0)

    def nvmlDeviceGetIndex(self, h):
        return h[1]

    def nvmlDeviceGetUUID(self, h):
        return self.uuids[h[1]].encode()  # pynvml returns bytes here

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self.busids[h[1]].encode())

    def nvmlDeviceGetName(self, h):
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetMaxClockInfo(self, h, kind):
        return 1980

    def nvmlDeviceGetTemperatureThreshold(self, h, kind):
        assert kind == pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX
        return 95

    # per-sample readings
    def nvmlDeviceGetTemperature(self, h, sensor):
        self.i += 1
        return self.cur["temp"]

    def nvmlDeviceGetPowerUsage(self, h):
        return self.cur["power_mw"]

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self.cur["power_limit_mw"]

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        return 1_000_000 + 650_000 * max(self.i, 0)  # 650 W for 1 s per sample, in mJ

    def nvmlDeviceGetClockInfo(self, h, kind):
        assert kind == pynvml.NVML_CLOCK_SM
        return self.cur["clock"]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self.cur["reasons"]

    def nvmlDeviceGetUtilizationRates(self, h):
        return pynvml.c_nvmlUtilization_t(gpu=100, memory=40)  # the misleading 100%

    def nvmlDeviceGetMemoryInfo(self, h):
        total = 80 * 1024 ** 3
        used = 61 * 1024 ** 3
        return SimpleNamespace(total=total, free=total - used, used=used)

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        assert counter == pynvml.NVML_VOLATILE_ECC
        return self.cur["dbe"] if kind == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else self.cur["sbe"]

    def nvmlDeviceGetFieldValues(self, h, ids):
        arr = (pynvml.c_nvmlFieldValue_t * len(ids))()
        for k, fid in enumerate(ids):
            arr[k].fieldId = fid
            arr[k].nvmlReturn = pynvml.NVML_SUCCESS
            arr[k].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            if fid == pynvml.NVML_FI_DEV_MEMORY_TEMP:
                arr[k].value.ullVal = self.cur["mem_temp"]
            elif fid == pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL:
                arr[k].value.ullVal = self.cur["crc"]
            else:
                arr[k].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return arr

    # GPM
    def nvmlGpmQueryDeviceSupport(self, h):
        return SimpleNamespace(isSupportedDevice=int(self.gpm_supported))

    def nvmlGpmSampleAlloc(self):
        buf = ctypes.c_int64(0)
        self._buffers.append(buf)
        return ctypes.cast(ctypes.pointer(buf), pynvml.c_nvmlGpmSample_t)

    def nvmlGpmSampleFree(self, s):
        return None

    def nvmlGpmSampleGet(self, h, s):
        self._samples[ctypes.cast(s, ctypes.c_void_p).value] = self.i
        return s

    def nvmlGpmMetricsGet(self, mg):
        a = self._samples[ctypes.cast(mg.sample1, ctypes.c_void_p).value]
        b = self._samples[ctypes.cast(mg.sample2, ctypes.c_void_p).value]
        assert b > a, "GPM pair out of order"
        values = self.script[b]["gpm"]
        for k in range(mg.numMetrics):
            m = mg.metrics[k]
            if m.metricId in values:
                m.value = values[m.metricId]
                m.nvmlReturn = pynvml.NVML_SUCCESS
            else:
                m.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return mg

    # events
    def emit_xid(self, code):
        self._events.put(code)

    def nvmlDeviceGetSupportedEventTypes(self, h):
        return pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError

    def nvmlEventSetCreate(self):
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h, types, es):
        assert types & pynvml.nvmlEventTypeXidCriticalError

    def nvmlEventSetWait(self, es, timeout_ms):
        try:
            code = self._events.get(timeout=timeout_ms / 1000.0)
        except queue.Empty:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT) from None
        d = pynvml.c_nvmlEventData_t()
        d.eventType = pynvml.nvmlEventTypeXidCriticalError
        d.eventData = code
        return d

    def nvmlEventSetFree(self, es):
        self.freed_event_sets += 1


class Ticker:
    """A clock that moves 1 s per call (one sample per second), for deterministic GPM pairs."""

    def __init__(self, t0=1_700_000_000.0):
        self.t = t0

    def __call__(self):
        self.t += 1.0
        return self.t


def _run_script(nvml, n=None):
    dev = NvmlDevice(nvml, nvml.nvmlDeviceGetHandleByIndex(1), clock=Ticker(), mono=Ticker(0.0))
    return dev, [dev.sample() for _ in range(n or len(nvml.script))]


def test_samples_carry_dcgm_names_units_and_gpm_ratios():
    nvml = FakeNvml()
    dev, samples = _run_script(nvml)
    first, second = samples[0], samples[1]
    # Identity: matched device, NVML index, UUID as text (pynvml gives bytes).
    assert (first["gpu"], first["uuid"], first["pci_bus_id"]) == (1, UUIDS[1], BUSIDS[1])
    assert first["DCGM_FI_DEV_GPU_TEMP"] == 71
    assert first["DCGM_FI_DEV_MEMORY_TEMP"] == 65
    assert first["DCGM_FI_DEV_MEM_MAX_OP_TEMP"] == 95
    assert first["DCGM_FI_DEV_POWER_USAGE"] == pytest.approx(650.0)  # mW -> W
    assert first["DCGM_FI_DEV_FB_USED"] == pytest.approx(61 * 1024)  # MiB
    assert first["DCGM_FI_DEV_GPU_UTIL"] == 100
    assert first["DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"] == 2
    # GPM needs a pair: nothing on the first sample, ratios from the second on.
    assert not any(k.startswith("DCGM_FI_PROF_") for k in first)
    assert second["DCGM_FI_PROF_SM_ACTIVE"] == pytest.approx(0.92)
    assert second["DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"] == pytest.approx(0.67)
    assert second["DCGM_FI_PROF_DRAM_ACTIVE"] == pytest.approx(0.36)
    assert second["DCGM_FI_PROF_SM_OCCUPANCY"] == pytest.approx(0.41)
    assert second["DCGM_FI_PROF_PCIE_RX_BYTES"] == pytest.approx(2048 * 1024 * 1024)  # MiB/s -> B/s
    assert second["DCGM_FI_PROF_NVLINK_TX_BYTES"] == pytest.approx(150_000 * 1024 * 1024)
    # Every numeric key is a declared DCGM field (what the exporters will map).
    for s in samples:
        for k in s:
            if k.startswith("DCGM_FI_"):
                assert k in FIELDS, k
    # Throttle decoding, table-driven.
    assert samples[2]["clocks_event_reasons"] == ["SwPowerCap"]
    assert samples[3]["clocks_event_reasons"] == ["SwThermalSlowdown", "HwThermalSlowdown"]
    assert samples[3]["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"] == 0x60


def test_gpm_pair_closer_than_100ms_is_not_reported():
    nvml = FakeNvml()
    mono = iter([0.0, 0.05, 1.05]).__next__
    dev = NvmlDevice(nvml, nvml.nvmlDeviceGetHandleByIndex(0), clock=Ticker(), mono=mono)
    s1, s2, s3 = dev.sample(), dev.sample(), dev.sample()
    assert "DCGM_FI_PROF_SM_ACTIVE" not in s2  # 50 ms after the first: skipped, baseline kept
    # The third pairs with the first (the kept baseline), and reports the third entry's interval.
    assert s3["DCGM_FI_PROF_SM_ACTIVE"] == pytest.approx(SCRIPT[2]["gpm"][G.NVML_GPM_METRIC_SM_UTIL] / 100)


def test_no_gpm_on_older_gpus_leaves_profiling_fields_absent():
    nvml = FakeNvml(gpm_supported=False)
    dev, samples = _run_script(nvml, 3)
    assert dev.gpm is None
    assert not any(k.startswith("DCGM_FI_PROF_") for s in samples for k in s)
    assert samples[2]["DCGM_FI_DEV_GPU_TEMP"] == 79


def test_findings_from_the_script_throttle_ecc_nvlink_and_xid():
    nvml = FakeNvml()
    dev, samples = _run_script(nvml)
    samples[4]["xid_events"] = []  # attach an XID the way the watcher does
    attach_xids(samples[4], [{"xid": 79, "time": samples[4]["time"]}])
    assert samples[4]["DCGM_FI_DEV_XID_ERRORS"] == 79
    findings = Analyzer(rank=3).analyze(samples)
    kinds = [f.kind for f in findings]
    # One finding per throttle episode, not one per hot sample.
    assert kinds.count("thermal_throttle") == 1
    th = next(f for f in findings if f.kind == "thermal_throttle")
    assert th.data["temp_c"] == 86 and th.data["sm_clock_mhz"] == 1395
    assert th.data["baseline_clock_mhz"] == 1980
    assert th.data["reasons"] == ["SwThermalSlowdown", "HwThermalSlowdown"]
    assert th.rank == 3 and th.severity == "critical"
    xid = next(f for f in findings if f.kind == "xid")
    assert xid.severity == "critical" and "drain" in xid.summary.lower()
    ecc = next(f for f in findings if f.kind == "ecc_uncorrectable")
    assert ecc.data["dbe_new"] == 1
    nv = next(f for f in findings if f.kind == "nvlink_degraded")
    assert nv.data["crc_new"] == 3


# B.4 rows: (kind, readings above the threshold, readings just on the healthy side). Each is a
# minute-plus of samples; NVLink is judged with comm taking 80% of the step time (records below).
GPU_ROWS = [
    ("gpu_overhead_bound", {"gr": 0.45}, {"gr": 0.65}),
    # judged while the tensor cores are not the busy pipe (a CUDA-core kernel short of warps)
    ("low_sm_occupancy", {"occupancy": 0.18, "tensor": 0.40}, {"occupancy": 0.30, "tensor": 0.40}),
    ("dram_bandwidth_bound", {"dram": 0.99}, {"dram": 0.90}),
    ("hbm_thermal", {"mem_temp": 93}, {"mem_temp": 89}),
    ("power_limited", {"power": 695_000}, {"power": 640_000}),  # limit 700 W: 99% vs 91%
    ("nvlink_low_bandwidth", {"nvlink": 200e9}, {"nvlink": 320e9}),  # / 0.8 comm: 250 vs 400 GB/s
    ("ecc_sbe_rate", {"sbe_per_s": 0.5}, {"sbe_per_s": 0.2}),  # 1,800/h vs 720/h
]


def _row_script(n, kw, t_sbe0=0):
    kw = dict(kw)
    rate = kw.pop("sbe_per_s", 0.0)
    dram = kw.pop("dram", 0.35)
    tensor = kw.pop("tensor", 0.66)
    kw.setdefault("nvlink", 400e9)  # healthy links unless the row is NVLink's
    return [_tick(70, 1980, 0, 0.91, tensor, dram, sbe=int(t_sbe0 + i * rate), **kw) for i in range(n)]


def _judge(script):
    """Sample the fake device once per (fake) second and analyze as the session does each pass."""
    dev, samples = _run_script(FakeNvml(script))
    a = Analyzer(rank=0)
    out = []
    for i, smp in enumerate(samples):
        rec = StepRecord(step=i, rank=0, time=smp["time"], step_s=1.0, comm_s=0.8)
        out += a.analyze([smp], [rec])
    return out


@pytest.mark.parametrize("kind,above,below", GPU_ROWS, ids=[r[0] for r in GPU_ROWS])
def test_each_b4_row_fires_above_is_silent_below_and_once_per_episode(kind, above, below):
    """Through the fake NVML/GPM and the real sampler code: three minutes above the threshold
    give one finding (one episode), the same below give none, and a recovery starts a new episode."""
    fired = [f for f in _judge(_row_script(185, above)) if f.kind == kind]
    assert len(fired) == 1, [f.summary for f in fired]
    f = fired[0]
    assert f.diagnosis and f.action and f.data["samples"] >= 5 and "GPU 1" in f.summary
    assert [f.kind for f in _judge(_row_script(185, below))] == []
    # above, recovered, above again: two episodes.
    script = _row_script(65, above) + _row_script(130, below, 40) + _row_script(130, above, 40)
    assert len([f for f in _judge(script) if f.kind == kind]) == 2


def test_rows_that_cannot_be_judged_stay_silent():
    # NVLink on a GPU without a baseline in the reference (H100 PCIe), and SM occupancy while SMs idle.
    class Pcie(FakeNvml):
        def nvmlDeviceGetName(self, h):
            return "NVIDIA H100 PCIe"

    dev, samples = _run_script(Pcie(_row_script(70, {"nvlink": 50e9})))
    a = Analyzer()
    kinds = [f.kind for i, s in enumerate(samples)
             for f in a.analyze([s], [StepRecord(step=i, rank=0, time=s["time"], step_s=1.0, comm_s=0.9)])]
    assert "nvlink_low_bandwidth" not in kinds
    idle = [_tick(70, 1980, 0, 0.20, 0.05, 0.1, occupancy=0.05, gr=0.7) for _ in range(70)]
    assert "low_sm_occupancy" not in [f.kind for f in _judge(idle)]
    # A healthy bf16 GEMM load as an H200 read it (scripts/gpu_check.sh, 2026-12-04: cuBLAS at ~790
    # TFLOP/s, SM active 87%, tensor active 84%, occupancy 12.8%): Hopper's tensor-core GEMMs run one
    # block of 2-3 warpgroups per SM by design, so low occupancy there is no limiter.
    gemm = [_tick(64, 1515, 0, 0.87, 0.84, 0.16, occupancy=0.128, gr=0.90) for _ in range(70)]
    assert "low_sm_occupancy" not in [f.kind for f in _judge(gemm)]
    # The same load, then idle, in one window (the check's busy then idle seconds): the idle seconds
    # neither dilute the tensor activity nor the occupancy; only samples with busy SMs are judged.
    idle = [_tick(40, 1980, 0, 0.0, 0.0, 0.0, occupancy=0.0, gr=0.0) for _ in range(25)]
    assert "low_sm_occupancy" not in [f.kind for f in _judge(gemm[:45] + idle)]
    short = [_tick(64, 1515, 0, 0.87, 0.40, 0.16, occupancy=0.18, gr=0.90) for _ in range(45)]  # CUDA cores
    assert "low_sm_occupancy" in [f.kind for f in _judge(short + idle)]
    # Without comm timing (a single-GPU job) the NVLink average is not judged either.
    dev, samples = _run_script(FakeNvml(_row_script(70, {"nvlink": 50e9})))
    a = Analyzer()
    assert [f.kind for s in samples for f in a.analyze([s])] == []


def test_hot_without_clock_drop_or_thermal_bit_is_not_throttling():
    hot_power_capped = [
        _tick(70, 1980, 0, 0.9, 0.6, 0.3),
        _tick(85, 1700, pynvml.nvmlClocksEventReasonSwPowerCap, 0.9, 0.6, 0.3),  # hot, power cap only
        _tick(85, 1975, THERMAL, 0.9, 0.6, 0.3),  # thermal bit but clock holds
    ]
    dev, samples = _run_script(FakeNvml(hot_power_capped))
    assert [f.kind for f in Analyzer().analyze(samples)] == []


def test_xid_event_thread_delivers_through_the_event_api():
    nvml = FakeNvml()
    w = XidWatcher(nvml, nvml.nvmlDeviceGetHandleByIndex(0), wait_ms=20)
    assert w.start()
    nvml.emit_xid(48)
    deadline = time.monotonic() + 5
    got = []
    while not got and time.monotonic() < deadline:
        got = w.drain()
        time.sleep(0.01)
    w.stop()
    assert [e["xid"] for e in got] == [48]
    assert nvml.freed_event_sets == 1


def test_a_mig_instance_named_by_torch_without_prefix_is_found():
    """torch's uuid of a MIG instance carries no prefix; NVML knows it as MIG-<uuid>."""
    mig = "MIG-0d1e2f3a-4b5c-6d7e-8f90-a1b2c3d4e5f6"
    nvml = FakeNvml(uuids=[*UUIDS, mig])
    h, _ = resolve_device(nvml, env={}, torch_uuid=lambda env: "GPU-" + mig[4:])
    assert h == ("h", len(UUIDS))


def test_device_matching_by_uuid_pci_and_visible_devices():
    nvml = FakeNvml()
    no_torch = lambda env: None  # noqa: E731
    h, how = resolve_device(nvml, env={"CUDA_VISIBLE_DEVICES": f"{UUIDS[1]},{UUIDS[0]}", "LOCAL_RANK": "1"},
                            torch_uuid=no_torch)
    assert h == ("h", 0) and "LOCAL_RANK=1" in how
    # A UUID prefix, as CUDA accepts.
    h, _ = resolve_device(nvml, env={"CUDA_VISIBLE_DEVICES": "GPU-7a6b5c4d", "LOCAL_RANK": "5"}, torch_uuid=no_torch)
    assert h == ("h", 1)
    # Index entries are NVML indices; CUDA's renumbering (the rank sees "cuda:0") does not matter.
    h, _ = resolve_device(nvml, env={"CUDA_VISIBLE_DEVICES": "1", "LOCAL_RANK": "0"}, torch_uuid=no_torch)
    assert h == ("h", 1)
    h, _ = resolve_device(nvml, device="0000:3b:00.0", env={}, torch_uuid=no_torch)
    assert h == ("h", 1)
    # An initialised CUDA context wins over the environment.
    h, how = resolve_device(nvml, env={"LOCAL_RANK": "0"}, torch_uuid=lambda env: UUIDS[1])
    assert h == ("h", 1) and "torch" in how
    with pytest.raises(DeviceNotFound, match="LOCAL_RANK=3"):
        resolve_device(nvml, env={"CUDA_VISIBLE_DEVICES": "0,1", "LOCAL_RANK": "3"}, torch_uuid=no_torch)
    with pytest.raises(DeviceNotFound, match="not a GPU-/MIG- UUID"):
        resolve_device(nvml, device="cuda:0", env={}, torch_uuid=no_torch)


def test_telemetry_source_thread_end_to_end():
    """The real sampler thread, fake NVML: samples flow, the XID arrives, findings come out, stop is clean."""
    nvml = FakeNvml()
    src = TelemetrySource(rank=0, hz=10, nvml=nvml, env={"LOCAL_RANK": "0"})
    src.start()
    assert src.wait_ready(5)
    assert src.status["running"] and src.status["gpm"] and src.status["xid"]
    assert src.status["uuid"] == UUIDS[0]
    nvml.emit_xid(79)
    samples = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (len(samples) < len(SCRIPT) or not any("xid_events" in s for s in samples)):
        samples.extend(src.drain())
        time.sleep(0.05)
    src.stop()
    assert not src.status["running"]
    assert nvml.inits == 0  # nvmlShutdown matched nvmlInit
    assert len(samples) >= len(SCRIPT)
    assert all(s["rank"] == 0 and s["gpu"] == 0 for s in samples)
    recs = [StepRecord(step=i, rank=0, time=samples[0]["time"] + i * 0.1, step_s=0.1) for i in range(5)]
    kinds = {f.kind for f in src.analyze(samples, recs)}
    assert {"thermal_throttle", "xid", "ecc_uncorrectable", "nvlink_degraded"} <= kinds
    gpu = summarize_window(samples)
    assert gpu["temp_max_c"] == 87 and gpu["xids"] == [79]
    # The same through window(), from the drained samples it keeps.
    assert src.window(samples[0]["time"], samples[-1]["time"]) == gpu
    assert src.window(0.0, 1.0) is None
    assert "HwThermalSlowdown" in gpu["clocks_event_reasons"]


def test_telemetry_source_without_driver_stays_off_and_says_why():
    class NoDriver(FakeNvml):
        def nvmlInit(self):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    class NoAmd:
        def amdsmi_init(self):
            raise OSError("libamd_smi.so: cannot open shared object file")

    src = TelemetrySource(nvml=NoDriver(), amdsmi=NoAmd())
    src.start()
    assert src.wait_ready(5)
    src.stop()
    assert not src.status["running"]
    assert "NVIDIA driver not found" in src.status["error"]
    assert src.drain() == []
    # analyze still works (records-only parts), with no samples.
    assert src.analyze([], [StepRecord(step=0, rank=0, time=1.0, step_s=0.5)]) == []


def test_bad_rate_is_rejected_with_the_argument_named():
    with pytest.raises(ValueError, match="hz must be"):
        TelemetrySource(hz=50)


def test_torch_uuid_only_when_cuda_is_already_up(monkeypatch):
    """Real torch (no CUDA here): nothing is initialised to find the device. A stand-in torch with
    CUDA up shows the LOCAL_RANK ordinal and the per-thread current device being used."""
    import torch

    from stepwatch.telemetry.nvml import _torch_local_uuid, current_cuda_uuid

    assert current_cuda_uuid() is None and _torch_local_uuid({"LOCAL_RANK": "0"}) is None
    assert not torch.cuda.is_initialized()
    fake_cuda = SimpleNamespace(is_initialized=lambda: True, device_count=lambda: 2, current_device=lambda: 1,
                                get_device_properties=lambda i: SimpleNamespace(uuid=f"7a6b5c4d-{i}"))
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=fake_cuda))
    assert _torch_local_uuid({"LOCAL_RANK": "0"}) == "GPU-7a6b5c4d-0"
    assert _torch_local_uuid({"LOCAL_RANK": "5"}) is None  # ambiguous: fall back to the environment
    assert current_cuda_uuid() == "GPU-7a6b5c4d-1"
