"""DCGM's profiling fields from NVML's GPM API (Hopper and newer), with no DCGM daemon.

DCGM itself computes ``DCGM_FI_PROF_*`` on these GPUs from two GPM samples and
``nvmlGpmMetricsGet`` (``DcgmGpmManager.cpp``), mapping each field to an NVML GPM metric in
``DcgmFieldIdToNvmlGpmMetricId`` (``dcgm_fields.cpp``) and dividing percentages by 100. This module
does the same: the table below is that mapping, read from DCGM's source and the ``nvmlGpmMetricId_t``
comments in nvml.h (percentages 0-100; PCIe and NVLink rates in MiB/s).

NVML needs the two samples at least 100 ms apart (nvml.h, ``nvmlGpmMetricsGet``); the sampler
runs at 1 Hz, and a pair closer than that is skipped, never reported.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("stepwatch.telemetry")

MIN_INTERVAL_S = 0.1  # nvml.h: GPM samples must be >= 100 ms apart.
_MIB = 1024 * 1024

# DCGM field -> (pynvml constant name, scale to the DCGM unit).
# Percent -> ratio: / 100 (DcgmGpmManager.cpp). MiB/s -> bytes/s: * 2**20.
GPM_FIELDS: dict[str, tuple[str, float]] = {
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": ("NVML_GPM_METRIC_GRAPHICS_UTIL", 0.01),
    "DCGM_FI_PROF_SM_ACTIVE": ("NVML_GPM_METRIC_SM_UTIL", 0.01),
    "DCGM_FI_PROF_SM_OCCUPANCY": ("NVML_GPM_METRIC_SM_OCCUPANCY", 0.01),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": ("NVML_GPM_METRIC_ANY_TENSOR_UTIL", 0.01),
    "DCGM_FI_PROF_DRAM_ACTIVE": ("NVML_GPM_METRIC_DRAM_BW_UTIL", 0.01),
    "DCGM_FI_PROF_PIPE_FP64_ACTIVE": ("NVML_GPM_METRIC_FP64_UTIL", 0.01),
    "DCGM_FI_PROF_PIPE_FP32_ACTIVE": ("NVML_GPM_METRIC_FP32_UTIL", 0.01),
    "DCGM_FI_PROF_PIPE_FP16_ACTIVE": ("NVML_GPM_METRIC_FP16_UTIL", 0.01),
    "DCGM_FI_PROF_PCIE_TX_BYTES": ("NVML_GPM_METRIC_PCIE_TX_PER_SEC", _MIB),
    "DCGM_FI_PROF_PCIE_RX_BYTES": ("NVML_GPM_METRIC_PCIE_RX_PER_SEC", _MIB),
    "DCGM_FI_PROF_NVLINK_TX_BYTES": ("NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC", _MIB),
    "DCGM_FI_PROF_NVLINK_RX_BYTES": ("NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC", _MIB),
}


def gpm_supported(nvml: Any, handle: Any) -> bool:
    """Whether the device supports GPM (Hopper or newer, per nvml.h); False on any NVML error."""
    try:
        return bool(nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
    except (nvml.NVMLError, AttributeError):
        return False


class GpmReader:
    """Keeps the previous GPM sample and turns each new one into DCGM profiling fields.

    Not thread-safe: one reader per sampler thread. ``nvml`` is the ``pynvml`` module (or a
    stand-in with the same functions, in tests).
    """

    def __init__(self, nvml: Any, handle: Any, clock=time.monotonic) -> None:
        self._nvml = nvml
        self._handle = handle
        self._clock = clock
        self._fields: list[tuple[str, int, float]] = []
        for name, (const, scale) in GPM_FIELDS.items():
            mid = getattr(nvml, const, None)
            if mid is not None:  # older nvidia-ml-py lacks some metrics
                self._fields.append((name, int(mid), scale))
        self._prev = nvml.nvmlGpmSampleAlloc()
        self._cur = nvml.nvmlGpmSampleAlloc()
        self._prev_t: float | None = None
        self._dead: set[str] = set()
        self.errors = 0

    def read(self) -> dict[str, float]:
        """Take a sample; return the fields over the interval since the previous one ({} first)."""
        nvml = self._nvml
        nvml.nvmlGpmSampleGet(self._handle, self._cur)
        now = self._clock()
        if self._prev_t is None:
            self._prev, self._cur = self._cur, self._prev
            self._prev_t = now
            return {}
        if now - self._prev_t < MIN_INTERVAL_S:
            return {}  # too close: keep the older sample as the baseline
        out = self._metrics(self._prev, self._cur)
        self._prev, self._cur = self._cur, self._prev
        self._prev_t = now
        return out

    def _metrics(self, s1: Any, s2: Any) -> dict[str, float]:
        nvml = self._nvml
        fields = [f for f in self._fields if f[0] not in self._dead]
        if not fields:
            return {}
        mg = nvml.c_nvmlGpmMetricsGet_t()
        mg.version = nvml.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = len(fields)
        mg.sample1 = s1
        mg.sample2 = s2
        for i, (_, mid, _) in enumerate(fields):
            mg.metrics[i].metricId = mid
        nvml.nvmlGpmMetricsGet(mg)
        out: dict[str, float] = {}
        for i, (name, _, scale) in enumerate(fields):
            m = mg.metrics[i]
            if m.nvmlReturn == nvml.NVML_ERROR_NOT_SUPPORTED:
                self._dead.add(name)  # e.g. NVLink on a PCIe card: stays absent
                continue
            if m.nvmlReturn != nvml.NVML_SUCCESS:
                self.errors += 1
                continue
            v = float(m.value)
            if v != v:  # NaN: DCGM reports it as blank
                continue
            out[name] = v * scale
        return out

    def close(self) -> None:
        for s in (self._prev, self._cur):
            try:
                self._nvml.nvmlGpmSampleFree(s)
            except self._nvml.NVMLError:
                log.debug("nvmlGpmSampleFree failed", exc_info=True)
