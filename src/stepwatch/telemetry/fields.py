"""The GPU fields stepwatch samples, under the names the DCGM exporter gives them.

A sample is a plain dict: ``time`` (unix seconds), ``gpu`` (NVML index), ``uuid``,
``pci_bus_id``, ``name``, ``vendor``, and any of the keys below whose value was read. A field the
device does not support is absent, never zero: unknown is shown as unknown.

Ids and meanings are from DCGM's ``dcgmlib/dcgm_fields.h`` (NVIDIA/DCGM), not from the reference
sheet's B.4 table, whose ids are wrong (its "252" is FB_USED, its "1009" is PCIE_TX_BYTES).
Profiling fields (``DCGM_FI_PROF_*``) are ratios 0-1 as DCGM stores them: DCGM divides NVML GPM's
0-100 percentages by 100 (``DcgmGpmManager.cpp``), and byte rates are bytes per second.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    dcgm_id: int
    unit: str
    help: str
    # "gauge" or "counter" as the DCGM exporter's default-counters.csv declares it.
    kind: str = "gauge"


_F = Field

# Source: NVIDIA/DCGM dcgmlib/dcgm_fields.h (#define DCGM_FI_* <id>).
FIELDS: dict[str, Field] = {
    f.name: f
    for f in (
        _F("DCGM_FI_DEV_SM_CLOCK", 100, "MHz", "SM clock frequency."),
        _F("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", 112, "bitmask",
           "Why clocks are held down: NVML clocks-event reasons (decoded in `clocks_event_reasons`). "
           "Older DCGM called it DCGM_FI_DEV_CLOCK_THROTTLE_REASONS (same id)."),
        _F("DCGM_FI_DEV_MEMORY_TEMP", 140, "C", "Memory (HBM) temperature."),
        _F("DCGM_FI_DEV_GPU_TEMP", 150, "C", "GPU temperature."),
        _F("DCGM_FI_DEV_MEM_MAX_OP_TEMP", 151, "C",
           "Maximum operating temperature of the memory; above it the GPU slows down."),
        _F("DCGM_FI_DEV_POWER_USAGE", 155, "W", "Power draw."),
        _F("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", 164, "W",
           "Power limit the driver enforces after all limiters (nvmlDeviceGetEnforcedPowerLimit)."),
        _F("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 156, "mJ",
           "Energy since the driver was loaded (use rate() for watts).", "counter"),
        _F("DCGM_FI_DEV_GPU_UTIL", 203, "%",
           "Share of time any kernel ran. Misleading (reference B.4): one tiny kernel per sampling "
           "period reads 100%. Use DCGM_FI_PROF_SM_ACTIVE."),
        _F("DCGM_FI_DEV_XID_ERRORS", 230, "xid", "Value of the last XID error seen."),
        _F("DCGM_FI_DEV_FB_FREE", 251, "MiB", "Free framebuffer memory."),
        _F("DCGM_FI_DEV_FB_USED", 252, "MiB", "Used framebuffer memory."),
        _F("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", 310, "errors",
           "Single-bit (corrected) ECC errors since the driver was loaded.", "counter"),
        _F("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 311, "errors",
           "Double-bit (uncorrectable) ECC errors since the driver was loaded.", "counter"),
        _F("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", 409, "errors",
           "NVLink flow-control CRC errors, all links (per-link fields start at 400).", "counter"),
        _F("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 1001, "ratio", "Graphics/compute engine active."),
        _F("DCGM_FI_PROF_SM_ACTIVE", 1002, "ratio",
           "Ratio of cycles an SM has at least one warp assigned, over all SMs."),
        _F("DCGM_FI_PROF_SM_OCCUPANCY", 1003, "ratio", "Resident warps over the theoretical maximum."),
        _F("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 1004, "ratio", "Any tensor pipe active."),
        _F("DCGM_FI_PROF_DRAM_ACTIVE", 1005, "ratio", "DRAM bandwidth used over the peak."),
        _F("DCGM_FI_PROF_PIPE_FP64_ACTIVE", 1006, "ratio", "FP64 (non-tensor) pipe active."),
        _F("DCGM_FI_PROF_PIPE_FP32_ACTIVE", 1007, "ratio", "FP32 (non-tensor) pipe active."),
        _F("DCGM_FI_PROF_PIPE_FP16_ACTIVE", 1008, "ratio", "FP16 (non-tensor) pipe active."),
        _F("DCGM_FI_PROF_PCIE_TX_BYTES", 1009, "B/s", "PCIe bytes sent by the GPU per second."),
        _F("DCGM_FI_PROF_PCIE_RX_BYTES", 1010, "B/s", "PCIe bytes received by the GPU per second."),
        _F("DCGM_FI_PROF_NVLINK_TX_BYTES", 1011, "B/s", "NVLink bytes sent per second, all links."),
        _F("DCGM_FI_PROF_NVLINK_RX_BYTES", 1012, "B/s", "NVLink bytes received per second, all links."),
    )
}

# Keys of a sample that are not DCGM fields.
META_KEYS = ("time", "gpu", "uuid", "pci_bus_id", "name", "vendor", "rank")
# Decoded extras: a list of clocks-event reason names, and the XIDs seen since the last sample.
REASONS_KEY = "clocks_event_reasons"
XIDS_KEY = "xid_events"
