"""Every metric name stepwatch exports, in one place: the OTel exporter, the Prometheus endpoint,
the alert rules, the dashboard and docs/metrics.md all read this table.

Names are what Prometheus shows. The training names follow the reference sheet's PromQL
(``profiling-quick-reference.txt`` B.7: ``training_mfu``, ``training_step_seconds_bucket``,
``allreduce_time_ms``, ``train_grad_norm``) so its queries run unchanged where they are right.
GPU fields keep the DCGM exporter's names (``DCGM_FI_*``, NVIDIA/dcgm-exporter
``etc/default-counters.csv``) so existing DCGM dashboards and alerts keep working.

Pure data: importing this module imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..record import StepRecord

# Instrument kinds, as the OTel API names its factories.
COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"

# Step-time buckets in seconds, 1 ms .. 10 min. The SDK's default boundaries (0, 5, 10, 25 ...
# 10000) assume milliseconds and would put every step under 5 s into one or two buckets.
STEP_SECONDS_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)


@dataclass(frozen=True, slots=True)
class MetricName:
    name: str
    kind: str
    # OTel unit. Empty where a unit would make the Prometheus exporter append a suffix the name
    # must not have (``allreduce_time_ms`` + unit "ms" -> ``allreduce_time_ms_milliseconds``).
    unit: str
    description: str
    # Where the value comes from; None = not from a StepRecord field.
    source: str | None = None
    # StepRecord -> value to record, or None for "unknown this step: export nothing".
    value: Callable[[StepRecord], float | None] | None = None


def _field(name: str, scale: float = 1.0) -> Callable[[StepRecord], float | None]:
    def get(r: StepRecord) -> float | None:
        v = getattr(r, name, None)
        return None if v is None else float(v) * scale

    return get


def _tokens_per_s(r: StepRecord) -> float | None:
    if r.tokens is None or not r.step_s or r.step_s <= 0:
        return None
    return r.tokens / r.step_s


# --- per-step training metrics (one data point per StepRecord, attribute ``rank``) -----------

STEP_SECONDS = MetricName(
    "training_step_seconds", HISTOGRAM, "s",
    "Wall time of one optimizer step on this rank (reference B.7: histogram_quantile over _bucket).",
    "step_s", _field("step_s"),
)
STEPS_TOTAL = MetricName(
    "training_steps_total", COUNTER, "",
    "Steps completed. Alert on rate(training_steps_total[2m]) == 0: a gauge keeps its last value "
    "when a job hangs, a counter's rate drops to zero.",
)
MFU = MetricName(
    "training_mfu", GAUGE, "",
    "Model FLOPs utilisation, 0-1 (needs the peak FLOPS: STEPWATCH_PEAK_TFLOPS or a known GPU).",
    "mfu", _field("mfu"),
)
HFU = MetricName(
    "training_hfu", GAUGE, "",
    "Hardware FLOPs utilisation (counts recomputation), 0-1.",
    "hfu", _field("hfu"),
)
GRAD_NORM = MetricName(
    "train_grad_norm", GAUGE, "",
    "Global gradient norm of the last step (reference B.7: train_grad_norm > 10 = instability).",
    "grad_norm", _field("grad_norm"),
)
ALLREDUCE_MS = MetricName(
    "allreduce_time_ms", GAUGE, "",
    "AllReduce time of the last step in milliseconds (1000 x allreduce_s; reference B.7).",
    "allreduce_s", _field("allreduce_s", 1000.0),
)
DATA_WAIT = MetricName(
    "training_data_wait_seconds_total", COUNTER, "s",
    "Seconds spent waiting on the DataLoader. Mean wait per step = rate(this) / "
    "rate(training_steps_total); reference B.9 alerts above 10 ms.",
    "data_wait_s", _field("data_wait_s"),
)
PHASE_SECONDS = MetricName(
    "training_phase_seconds_total", COUNTER, "s",
    "Seconds spent per phase (attribute ``phase``: forward, backward, optimizer, other, eval, "
    "checkpoint, and user phases).",
)
TOKENS_TOTAL = MetricName(
    "training_tokens_total", COUNTER, "",
    "Tokens processed; rate(training_tokens_total[1m]) is tokens/s.",
    "tokens", _field("tokens"),
)
TOKENS_PER_S = MetricName(
    "training_tokens_per_second", GAUGE, "",
    "Tokens/s of the last step (tokens / step_s), for backends without rate().",
    "tokens", _tokens_per_s,
)
COMM_SECONDS = MetricName(
    "training_comm_seconds_total", COUNTER, "s",
    "Seconds of communication (union of this rank's collective spans).",
    "comm_s", _field("comm_s"),
)
COMM_EXPOSED = MetricName(
    "training_comm_exposed_seconds_total", COUNTER, "s",
    "Seconds of communication not hidden behind backward compute. Exposed share of step time = "
    "rate(this) / rate(training_step_seconds_sum).",
    "comm_exposed_s", _field("comm_exposed_s"),
)
OVERLAP = MetricName(
    "training_comm_overlap_ratio", GAUGE, "",
    "Share of communication hidden behind backward in the last step, 0-1 (target > 0.8).",
    "overlap", _field("overlap"),
)
BUSBW = MetricName(
    "training_allreduce_busbw_gbps", GAUGE, "",
    "AllReduce bus bandwidth of the last step in GB/s (nccl-tests' busbw = algbw x 2(n-1)/n).",
    "busbw_gbps", _field("busbw_gbps"),
)
MEM_PEAK = MetricName(
    "training_memory_peak_bytes", GAUGE, "",
    "Peak CUDA memory allocated since the previous memory read (STEPWATCH_MEMORY_EVERY steps); "
    "on CPU the process's peak resident set.",
    "mem_peak_bytes", _field("mem_peak_bytes"),
)
MEM_ALLOCATED = MetricName(
    "training_memory_allocated_bytes", GAUGE, "",
    "CUDA memory allocated by tensors at the last memory read (caching allocator).",
    "mem_allocated_bytes", _field("mem_allocated_bytes"),
)
MEM_RESERVED = MetricName(
    "training_memory_reserved_bytes", GAUGE, "",
    "CUDA memory reserved by the caching allocator at the last memory read.",
    "mem_reserved_bytes", _field("mem_reserved_bytes"),
)
MEM_FRAGMENTATION = MetricName(
    "training_memory_fragmentation_bytes", GAUGE, "",
    "CUDA memory reserved beyond the peak in use (reserved - peak allocated): cache the step never used.",
    "mem_fragmentation_bytes", _field("mem_fragmentation_bytes"),
)
MEM_DEVICE_FREE = MetricName(
    "training_memory_device_free_bytes", GAUGE, "",
    "Free device memory (cudaMemGetInfo, all processes); the OOM-risk line is 5000 MiB (B.7).",
    "mem_device_free_bytes", _field("mem_device_free_bytes"),
)
HOST_RSS = MetricName(
    "training_host_rss_bytes", GAUGE, "",
    "The trainer's current resident set (not the high-water mark).",
    "host_rss_bytes", _field("host_rss_bytes"),
)
WORKERS_USS = MetricName(
    "training_dataloader_workers_uss_bytes", GAUGE, "",
    "DataLoader workers' summed unique set (pages only they hold; smaps_rollup).",
    "workers_uss_bytes", _field("workers_uss_bytes"),
)
WORKERS_PSS = MetricName(
    "training_dataloader_workers_pss_bytes", GAUGE, "",
    "DataLoader workers' summed proportional set (shared pages divided among their sharers).",
    "workers_pss_bytes", _field("workers_pss_bytes"),
)
MEM_RETRIES = MetricName(
    "training_memory_alloc_retries_total", COUNTER, "",
    "CUDA allocations that failed, freed the cache and retried (num_alloc_retries): fragmentation.",
    "mem_alloc_retries", _field("mem_alloc_retries"),
)
MEM_OOMS = MetricName(
    "training_memory_ooms_total", COUNTER, "",
    "CUDA out-of-memory errors the caching allocator raised (num_ooms).",
    "mem_ooms", _field("mem_ooms"),
)
# Bounds on user-chosen attribute values, so a loop that logs a new name per step cannot grow
# memory without limit.
MAX_PHASE_NAMES = 64
MAX_SCALAR_NAMES = 64
MAX_EXTRA_SAMPLE_NAMES = 256

SCALAR = MetricName(
    "training_scalar", GAUGE, "",
    f"Scalars logged with stepwatch.log() (attribute ``name``; at most {MAX_SCALAR_NAMES} names).",
)

# --- stepwatch's own health ------------------------------------------------------------------

FINDINGS_TOTAL = MetricName(
    "stepwatch_findings_total", COUNTER, "",
    "Findings raised (attributes ``kind``, ``severity``).",
)
DROPPED_TOTAL = MetricName(
    "stepwatch_exporter_dropped_total", COUNTER, "",
    "Data points an exporter could not deliver (attribute ``exporter``: otlp), or samples it "
    "could not map (``exporter``: unmapped).",
)
GPU_THROTTLE = MetricName(
    "stepwatch_gpu_clocks_event_active", GAUGE, "",
    "Decoded clocks-event (throttle) reasons: 1 while the bit is set (attribute ``reason``). "
    "PromQL has no bitwise AND, so alerts use these series, not the raw bitmask.",
)

# Gauges recorded straight from a StepRecord field, in export order.
RECORD_GAUGES: tuple[MetricName, ...] = (MFU, HFU, GRAD_NORM, ALLREDUCE_MS, OVERLAP, BUSBW, MEM_PEAK, TOKENS_PER_S,
                                         MEM_ALLOCATED, MEM_RESERVED, MEM_FRAGMENTATION, MEM_DEVICE_FREE,
                                         HOST_RSS, WORKERS_USS, WORKERS_PSS)
# Counters that add a StepRecord field.
RECORD_COUNTERS: tuple[MetricName, ...] = (DATA_WAIT, TOKENS_TOTAL, COMM_SECONDS, COMM_EXPOSED, MEM_RETRIES, MEM_OOMS)

# The phases that are StepRecord fields (the rest come from ``StepRecord.phases``).
BUILTIN_PHASES: tuple[str, ...] = ("forward", "backward", "optimizer", "other", "eval", "checkpoint")

# --- GPU fields under the DCGM exporter's names ----------------------------------------------
# Source: NVIDIA/dcgm-exporter etc/dcp-metrics-included.csv and default-counters.csv (names and
# units), dcgm_fields.h (field ids). Profiling fields are ratios 0-1 there, not percent.
DCGM_FIELDS: dict[str, str] = {
    "DCGM_FI_DEV_GPU_TEMP": "GPU temperature (C).",
    "DCGM_FI_DEV_MEMORY_TEMP": "Memory temperature (C).",
    "DCGM_FI_DEV_MEM_MAX_OP_TEMP": "Maximum memory operating temperature (C).",
    "DCGM_FI_DEV_POWER_USAGE": "Power draw (W).",
    "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": "Power limit the driver enforces (W).",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "Total energy since boot (mJ); use rate().",
    "DCGM_FI_DEV_SM_CLOCK": "SM clock (MHz).",
    "DCGM_FI_DEV_MEM_CLOCK": "Memory clock (MHz).",
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": "Clocks-event (throttle) reasons bitmask (NVML bits).",
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": "Old name of DCGM_FI_DEV_CLOCKS_EVENT_REASONS.",
    "DCGM_FI_DEV_XID_ERRORS": "Value of the last XID error.",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "Volatile single-bit ECC errors.",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "Volatile double-bit ECC errors.",
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": "NVLink flit CRC errors, all links.",
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_L0": "NVLink flit CRC errors, link 0.",
    "DCGM_FI_DEV_FB_FREE": "Framebuffer memory free (MiB).",
    "DCGM_FI_DEV_FB_USED": "Framebuffer memory used (MiB).",
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilisation (%); misleading, prefer DCGM_FI_PROF_SM_ACTIVE (ref. B.4).",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "PCIe replays.",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "Graphics engine active, ratio 0-1.",
    "DCGM_FI_PROF_SM_ACTIVE": "SM active, ratio 0-1.",
    "DCGM_FI_PROF_SM_OCCUPANCY": "SM occupancy, ratio 0-1.",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": "Tensor pipe active, ratio 0-1.",
    "DCGM_FI_PROF_DRAM_ACTIVE": "DRAM active, ratio 0-1.",
    "DCGM_FI_PROF_PIPE_FP64_ACTIVE": "FP64 pipe active, ratio 0-1.",
    "DCGM_FI_PROF_PIPE_FP32_ACTIVE": "FP32 pipe active, ratio 0-1.",
    "DCGM_FI_PROF_PIPE_FP16_ACTIVE": "FP16 pipe active, ratio 0-1.",
    "DCGM_FI_PROF_PCIE_TX_BYTES": "PCIe transmitted bytes/s.",
    "DCGM_FI_PROF_PCIE_RX_BYTES": "PCIe received bytes/s.",
    "DCGM_FI_PROF_NVLINK_TX_BYTES": "NVLink transmitted bytes/s.",
    "DCGM_FI_PROF_NVLINK_RX_BYTES": "NVLink received bytes/s.",
}

# Sample keys that become attributes of the DCGM series, mapped to the DCGM exporter's label names.
DCGM_LABELS: dict[str, str] = {
    "gpu": "gpu",
    "index": "gpu",
    "uuid": "UUID",
    "UUID": "UUID",
    "device": "device",
    "name": "modelName",
    "modelName": "modelName",
    "pci_bus_id": "pci_bus_id",
}

THROTTLE_FIELDS = ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")

# NVML clocks-event reason bits (nvml.h ``nvmlClocksEventReason*``; pynvml
# ``nvmlClocksEventReason*`` constants). The reference sheet's table (B.4) is shifted by one
# bit: 0x1 is "GPU idle", not "HW slowdown".
CLOCKS_EVENT_BITS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)

# A sample key with this prefix and a lower-case name is exported as a gauge under that name
# (e.g. the vLLM wrapper's ``stepwatch_serving_*``), attributes from the sample's ``labels``.
EXTRA_SAMPLE_PREFIX = "stepwatch_"

ALL: tuple[MetricName, ...] = (
    STEP_SECONDS, STEPS_TOTAL, MFU, HFU, GRAD_NORM, ALLREDUCE_MS, DATA_WAIT, PHASE_SECONDS,
    TOKENS_TOTAL, TOKENS_PER_S, COMM_SECONDS, COMM_EXPOSED, OVERLAP, BUSBW, MEM_PEAK, SCALAR,
    MEM_ALLOCATED, MEM_RESERVED, MEM_FRAGMENTATION, MEM_DEVICE_FREE, HOST_RSS, WORKERS_USS, WORKERS_PSS,
    MEM_RETRIES, MEM_OOMS,
    FINDINGS_TOTAL, DROPPED_TOTAL, GPU_THROTTLE,
)


def decode_clocks_event_reasons(mask: int) -> dict[str, int]:
    """Bitmask -> {reason: 0 or 1} for every known NVML bit."""
    m = int(mask)
    return {name: 1 if m & bit else 0 for bit, name in CLOCKS_EVENT_BITS}
