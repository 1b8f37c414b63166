"""AMD GPUs through ``amdsmi`` (ROCm's AMD SMI Python package), in the same role as NVML.

``import amdsmi`` raises ``KeyError`` (not ``ImportError``) when the package is installed but its
shared library is missing, so the import is guarded for both, and for ``OSError`` from the loader.

Readings go under the DCGM names where the meaning is the same (temperature, power, energy,
memory, ECC, "any engine busy" utilisation) so one dashboard serves both vendors; AMD-only
readings are named ``stepwatch_gpu_amd_*`` (exported as plain gauges). Function names and units:
AMD SMI Python API reference (rocm.docs.amd.com/projects/amdsmi, "Python API"): temperatures in
C, power in W, energy as an accumulator times its resolution in microjoules, VRAM in MB, activity
in percent. No profiling (GPM-like) fields on AMD; events (GPU reset, thermal throttle, VM fault)
are carried in the sample as ``amd_events`` but not yet turned into findings.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Mapping

log = logging.getLogger("stepwatch.telemetry")


def load_amdsmi() -> tuple[Any | None, str | None]:
    """(module, None) or (None, why not)."""
    try:
        import amdsmi  # type: ignore[import-not-found]
    except (ImportError, KeyError, OSError) as e:
        return None, f"amdsmi not usable: {type(e).__name__}: {e}"
    return amdsmi, None


def _num(v: Any) -> float | None:
    """amdsmi returns "N/A" (a string) for readings the device lacks."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def pick_index(env: Mapping[str, str] | None = None) -> int:
    """The rank's AMD GPU among amdsmi's devices, from the visible-devices variables and LOCAL_RANK.

    HIP honours ``HIP_VISIBLE_DEVICES``, then ``CUDA_VISIBLE_DEVICES``; ``ROCR_VISIBLE_DEVICES``
    filters below both. Integer entries are taken as amdsmi indices (same enumeration order on
    nodes of one GPU model).
    """
    env = os.environ if env is None else env
    try:
        local = int(env.get("LOCAL_RANK", "0"))
    except ValueError:
        local = 0
    for var in ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        raw = env.get(var)
        if raw:
            entries = [e.strip() for e in raw.split(",") if e.strip()]
            if len(entries) == 1:
                local = 0
            if local < len(entries) and entries[local].isdigit():
                return int(entries[local])
    return local


class AmdDevice:
    vendor = "amd"

    def __init__(self, amdsmi: Any, handle: Any, index: int, *, clock=time.time) -> None:
        self.smi = amdsmi
        self.handle = handle
        self.index = index
        self._clock = clock
        self._unsupported: set[str] = set()
        self.errors = 0
        self.gpm = None
        self._reader: Any = None
        self.uuid = str(self._get("uuid", "amdsmi_get_gpu_device_uuid") or "")
        self.pci_bus_id = str(self._get("bdf", "amdsmi_get_gpu_device_bdf") or "")
        asic = self._get("asic", "amdsmi_get_gpu_asic_info") or {}
        self.name = str(asic.get("market_name", "")) if isinstance(asic, dict) else ""

    def _get(self, key: str, fn_name: str, *args: Any) -> Any:
        if key in self._unsupported:
            return None
        fn = getattr(self.smi, fn_name, None)
        if fn is None:
            self._unsupported.add(key)
            return None
        # amdsmi's errors derive from amdsmi.AmdSmiException (amdsmi_exception.py).
        smi_error = getattr(self.smi, "AmdSmiException", None) or Exception
        try:
            return fn(self.handle, *args)
        except smi_error:
            # Most failures are "not supported on this ASIC": stop asking, keep the field absent.
            self._unsupported.add(key)
            self.errors += 1
            return None

    def _temp(self, key: str, sensor: str) -> float | None:
        types = getattr(self.smi, "AmdSmiTemperatureType", None)
        metrics = getattr(self.smi, "AmdSmiTemperatureMetric", None)
        if types is None or metrics is None or not hasattr(types, sensor):
            return None
        return _num(self._get(key, "amdsmi_get_temp_metric", getattr(types, sensor), metrics.CURRENT))

    def sample(self) -> dict[str, Any]:
        s: dict[str, Any] = {
            "time": self._clock(), "gpu": self.index, "uuid": self.uuid,
            "pci_bus_id": self.pci_bus_id, "name": self.name, "vendor": self.vendor,
        }
        # Hotspot (junction) is the die reading, like NVIDIA's GPU temperature; edge is the fallback.
        t = self._temp("temp_hotspot", "HOTSPOT")
        if t is None:
            t = self._temp("temp_edge", "EDGE")
        if t is not None:
            s["DCGM_FI_DEV_GPU_TEMP"] = t
        t = self._temp("temp_vram", "VRAM")
        if t is not None:
            s["DCGM_FI_DEV_MEMORY_TEMP"] = t
        p = self._get("power", "amdsmi_get_power_info")
        if isinstance(p, dict):
            w = _num(p.get("current_socket_power"))
            if w is None:
                w = _num(p.get("average_socket_power"))
            if w is not None:
                s["DCGM_FI_DEV_POWER_USAGE"] = w
        e = self._get("energy", "amdsmi_get_energy_count")
        if isinstance(e, dict):
            acc = _num(e.get("energy_accumulator", e.get("power")))
            res = _num(e.get("counter_resolution"))
            if acc is not None and res is not None:
                s["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] = int(acc * res / 1000.0)  # uJ -> mJ
        a = self._get("activity", "amdsmi_get_gpu_activity")
        if isinstance(a, dict):
            gfx = _num(a.get("gfx_activity"))
            if gfx is not None:
                s["DCGM_FI_DEV_GPU_UTIL"] = gfx
            umc = _num(a.get("umc_activity"))
            if umc is not None:
                s["stepwatch_gpu_amd_umc_activity"] = umc / 100.0
        v = self._get("vram", "amdsmi_get_gpu_vram_usage")
        if isinstance(v, dict):
            total, used = _num(v.get("vram_total")), _num(v.get("vram_used"))
            if used is not None:
                s["DCGM_FI_DEV_FB_USED"] = used
                if total is not None:
                    s["DCGM_FI_DEV_FB_FREE"] = total - used
        c = self._get("ecc", "amdsmi_get_gpu_total_ecc_count")
        if isinstance(c, dict):
            ce, ue = _num(c.get("correctable_count")), _num(c.get("uncorrectable_count"))
            if ce is not None:
                s["DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"] = int(ce)
            if ue is not None:
                s["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"] = int(ue)
        # Throttling: MI300 and newer report it through the violation API (throttle_status is N/A
        # there); older GPUs through gpu_metrics (AMD SMI docs, "GPU violations").
        viol = self._get("violations", "amdsmi_get_violation_status")
        if isinstance(viol, dict):
            active = sorted(k[len("active_"):] for k, v in viol.items()
                            if k.startswith("active_") and _num(v) not in (None, 0.0))
            s["amd_violations"] = active
            s["stepwatch_gpu_amd_violations_active"] = len(active)
        else:
            m = self._get("metrics", "amdsmi_get_gpu_metrics_info")
            if isinstance(m, dict):
                thn = _num(m.get("throttle_status"))
                if thn is not None:
                    s["stepwatch_gpu_amd_throttle_status"] = int(thn)
        events = self._events()
        if events:
            s["amd_events"] = events
        return s

    def _events(self) -> list[dict[str, str]]:
        """GPU reset / thermal / VM-fault notifications since the last sample (AmdSmiEventReader)."""
        if "events" in self._unsupported:
            return []
        smi_error = getattr(self.smi, "AmdSmiException", None) or Exception
        try:
            if self._reader is None:
                kinds = getattr(self.smi, "AmdSmiEvtNotificationType", None)
                reader_cls = getattr(self.smi, "AmdSmiEventReader", None)
                wanted = [getattr(kinds, n) for n in ("GPU_PRE_RESET", "GPU_POST_RESET", "THERMAL_THROTTLE",
                                                      "VMFAULT") if kinds is not None and hasattr(kinds, n)]
                if reader_cls is None or not wanted:
                    self._unsupported.add("events")
                    return []
                self._reader = reader_cls(self.handle, wanted)
            got = self._reader.read(0) or []
        except smi_error:
            self._unsupported.add("events")
            return []
        return [{"event": str(e.get("event", "")), "message": str(e.get("message", ""))}
                for e in got if isinstance(e, dict)]

    def close(self) -> None:
        if self._reader is not None:
            stop = getattr(self._reader, "stop", None)
            if stop is not None:
                try:
                    stop()
                except (getattr(self.smi, "AmdSmiException", None) or Exception):
                    pass


def open_amd(amdsmi: Any, env: Mapping[str, str] | None = None) -> tuple[AmdDevice, str]:
    amdsmi.amdsmi_init()
    handles = amdsmi.amdsmi_get_processor_handles()
    if not handles:
        raise LookupError("amdsmi found no AMD GPU")
    i = pick_index(env)
    if i >= len(handles):
        raise LookupError(f"GPU index {i} out of range: amdsmi sees {len(handles)} GPUs")
    return AmdDevice(amdsmi, handles[i], i), f"amdsmi index {i}"
