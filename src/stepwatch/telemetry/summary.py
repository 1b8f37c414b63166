"""The per-step-window ``gpu`` object of a record, summarised from telemetry samples."""

from __future__ import annotations

from typing import Any, Iterable

from .fields import REASONS_KEY, XIDS_KEY

# record key -> (DCGM field, how to reduce)
_REDUCE: tuple[tuple[str, str, str], ...] = (
    ("temp_max_c", "DCGM_FI_DEV_GPU_TEMP", "max"),
    ("temp_mean_c", "DCGM_FI_DEV_GPU_TEMP", "mean"),
    ("mem_temp_max_c", "DCGM_FI_DEV_MEMORY_TEMP", "max"),
    ("power_mean_w", "DCGM_FI_DEV_POWER_USAGE", "mean"),
    ("power_limit_w", "DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "min"),
    ("sm_clock_min_mhz", "DCGM_FI_DEV_SM_CLOCK", "min"),
    ("sm_clock_mean_mhz", "DCGM_FI_DEV_SM_CLOCK", "mean"),
    ("fb_free_min_mib", "DCGM_FI_DEV_FB_FREE", "min"),
    ("gpu_util_mean", "DCGM_FI_DEV_GPU_UTIL", "mean"),
    ("gr_engine_active", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "mean"),
    ("sm_active", "DCGM_FI_PROF_SM_ACTIVE", "mean"),
    ("sm_occupancy", "DCGM_FI_PROF_SM_OCCUPANCY", "mean"),
    ("tensor_active", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "mean"),
    ("dram_active", "DCGM_FI_PROF_DRAM_ACTIVE", "mean"),
    ("fp64_active", "DCGM_FI_PROF_PIPE_FP64_ACTIVE", "mean"),
    ("fp32_active", "DCGM_FI_PROF_PIPE_FP32_ACTIVE", "mean"),
    ("fp16_active", "DCGM_FI_PROF_PIPE_FP16_ACTIVE", "mean"),
    ("pcie_tx_bytes_per_s", "DCGM_FI_PROF_PCIE_TX_BYTES", "mean"),
    ("pcie_rx_bytes_per_s", "DCGM_FI_PROF_PCIE_RX_BYTES", "mean"),
    ("nvlink_tx_bytes_per_s", "DCGM_FI_PROF_NVLINK_TX_BYTES", "mean"),
    ("nvlink_rx_bytes_per_s", "DCGM_FI_PROF_NVLINK_RX_BYTES", "mean"),
)
# Counters: the increase over the window (needs two samples).
_DELTA: tuple[tuple[str, str, float], ...] = (
    ("energy_j", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 1e-3),
    ("ecc_sbe_new", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", 1),
    ("ecc_dbe_new", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 1),
    ("nvlink_crc_new", "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", 1),
)


def samples_between(samples: Iterable[dict[str, Any]], t0: float, t1: float) -> list[dict[str, Any]]:
    """Samples with ``t0 <= time <= t1`` (unix seconds)."""
    return [s for s in samples if t0 <= s.get("time", -1.0) <= t1]


def summarize_window(samples: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The record's ``gpu`` object for the samples of one step window; None when there are none.

    Keys appear only when some sample carried the field (unknown stays absent). Activity values are
    DCGM ratios 0-1; ``gpu_util_mean`` is NVML's misleading percent (reference B.4), kept for
    comparison with ``nvidia-smi``.
    """
    if not samples:
        return None
    out: dict[str, Any] = {"samples": len(samples)}
    last = samples[-1]
    for k in ("gpu", "uuid"):
        if k in last:
            out[k] = last[k]
    for key, field, how in _REDUCE:
        vals = [s[field] for s in samples if s.get(field) is not None]
        if not vals:
            continue
        if how == "max":
            out[key] = max(vals)
        elif how == "min":
            out[key] = min(vals)
        else:
            out[key] = sum(vals) / len(vals)
    for key, field, scale in _DELTA:
        vals = [s[field] for s in samples if s.get(field) is not None]
        if len(vals) >= 2:
            out[key] = max(vals[-1] - vals[0], 0) * scale
    reasons: list[str] = []
    for s in samples:
        for r in s.get(REASONS_KEY) or ():
            if r not in reasons:
                reasons.append(r)
    if any(REASONS_KEY in s for s in samples):
        out["clocks_event_reasons"] = reasons
    xids = [e["xid"] for s in samples for e in s.get(XIDS_KEY) or ()]
    if xids:
        out["xids"] = xids
    return out
