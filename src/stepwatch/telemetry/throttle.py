"""Decoding NVML's clocks-event (throttle) reasons bitmask, table-driven.

The bits are NVML's ``nvmlClocksEventReason*`` constants (nvml.h; the same values in
``pynvml``), which DCGM passes through 1:1 in ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS``. The reference
sheet's B.4 table numbers them differently and is wrong: bit 0x1 is *GPU idle*, not HW slowdown,
so a bare ``> 0`` alert fires on every idle GPU. A test checks this table against ``pynvml``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Reason:
    bit: int
    name: str
    # "idle", "setting", "power", "thermal", "sync", "hw": what kind of cause it is.
    cause: str
    meaning: str
    action: str


# Source: nvml.h "nvmlClocksEventReasons" (NVML API reference, Clocks Event Reasons); the
# meanings paraphrase its comments; the actions follow the reference sheet's B.4 decode table.
REASONS: tuple[Reason, ...] = (
    Reason(0x1, "GpuIdle", "idle", "Nothing is running; clocks drop to idle.", "None: normal when idle."),
    Reason(0x2, "ApplicationsClocksSetting", "setting",
           "Clocks are limited by the applications-clocks setting.",
           "Check `nvidia-smi -q -d CLOCK`; reset with `nvidia-smi -rac`."),
    Reason(0x4, "SwPowerCap", "power",
           "The power-management algorithm holds clocks down to stay under the power cap.",
           "Power cap below workload demand: check `nvidia-smi -q -d POWER`."),
    Reason(0x8, "HwSlowdown", "hw",
           "Hardware slowdown (clocks cut by 2x or more): too hot, external power brake, or power "
           "draw too high.",
           "Check temperature, power supply and cooling; reduce workload."),
    Reason(0x10, "SyncBoost", "sync",
           "Clocks are held to the slowest GPU of a sync-boost group.",
           "Normal in some configurations; check the other GPUs in the group."),
    Reason(0x20, "SwThermalSlowdown", "thermal",
           "Software thermal slowdown: GPU or memory temperature above its maximum operating "
           "temperature.",
           "Improve cooling or airflow; reduce workload."),
    Reason(0x40, "HwThermalSlowdown", "thermal",
           "Hardware thermal slowdown: temperature too high.",
           "Thermal emergency: reduce workload immediately; inspect cooling."),
    Reason(0x80, "HwPowerBrakeSlowdown", "power",
           "Hardware power brake: the power supply (PSU, switch) asserted a slowdown.",
           "Upstream power is limited: check the node's power supply."),
    Reason(0x100, "DisplayClockSetting", "setting",
           "Clocks are limited by the display clock setting.",
           "Remove display use from compute nodes."),
)

BY_NAME = {r.name: r for r in REASONS}
THERMAL_BITS = sum(r.bit for r in REASONS if r.cause == "thermal")
# Reasons that mean the GPU is slower than it could be (idle and sync boost are benign).
SLOWDOWN_BITS = sum(r.bit for r in REASONS if r.cause in ("power", "thermal", "hw", "setting"))


def decode(mask: int) -> list[str]:
    """Names of the bits set in ``mask``; unknown bits come back as ``"0x..."``."""
    if not isinstance(mask, int) or isinstance(mask, bool) or mask < 0:
        raise ValueError(f"mask must be a non-negative int, got {mask!r}")
    names = [r.name for r in REASONS if mask & r.bit]
    rest = mask & ~sum(r.bit for r in REASONS)
    bit = 1
    while rest:
        if rest & bit:
            names.append(hex(bit))
            rest &= ~bit
        bit <<= 1
    return names


def is_thermal(mask: int) -> bool:
    """A thermal reason is set (SW or HW thermal slowdown; HW slowdown counts when it is hot)."""
    return bool(mask & THERMAL_BITS)
