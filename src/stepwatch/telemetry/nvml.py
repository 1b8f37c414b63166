"""Reading one NVIDIA GPU through NVML (``nvidia-ml-py``, import name ``pynvml``).

Everything here takes the NVML module as an argument (``nvml``): the real ``pynvml`` in
production, a stand-in with the same functions in tests. NVML never creates a CUDA context, so
nothing here can change what the training process allocates on the device.

Which GPU is this rank's? ``CUDA_VISIBLE_DEVICES`` renumbers devices, so the CUDA ordinal is not
the NVML index. The device is matched, in this order:

1. an explicit ``device`` (a ``GPU-...``/``MIG-...`` UUID, a PCI bus id ``0000:3b:00.0``, or an
   NVML index);
2. when the process has *already* initialised CUDA (torch imported and ``torch.cuda`` initialised),
   the UUID of CUDA device ``LOCAL_RANK`` (or of the only visible one) from
   ``torch.cuda.get_device_properties`` — CUDA's numbering, so ``CUDA_VISIBLE_DEVICES`` is already
   applied; this never initialises CUDA itself. (The *current* device is per thread and the sampler
   runs on its own thread: to follow ``torch.cuda.set_device`` exactly, call
   :func:`current_cuda_uuid` on the training thread and pass it as ``device``);
3. otherwise ``LOCAL_RANK`` (default 0) picks the entry of ``CUDA_VISIBLE_DEVICES``: a UUID (or
   UUID prefix, as CUDA accepts) is matched by UUID; an integer is taken as the NVML index. A single
   visible device is used whatever ``LOCAL_RANK`` says (one GPU per task, as SLURM gives it).
   Integers assume ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` ordering, which is NVML's; CUDA's default
   "fastest first" order agrees on nodes of identical GPUs. Set the variable, or pass ``device``,
   on mixed nodes;
4. with no ``CUDA_VISIBLE_DEVICES``: NVML index ``LOCAL_RANK``.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import sys
import threading
import time
from typing import Any, Callable, Mapping

from .fields import REASONS_KEY, XIDS_KEY
from .throttle import decode

log = logging.getLogger("stepwatch.telemetry")


def text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, (bytes, bytearray)) else str(v)


# PCI bus id as NVML prints it: [domain:]bus:device.function, e.g. 00000000:3B:00.0.
_PCI = re.compile(r"^([0-9a-fA-F]{1,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


class DeviceNotFound(LookupError):
    """The rank's GPU could not be matched; the message says what was tried."""


def _uuid_text(uuid: Any) -> str:
    s = str(uuid)
    # torch prints the bare UUID; NVML's form is "GPU-<uuid>".
    return s if s.startswith(("GPU-", "MIG-")) else f"GPU-{s}"


def current_cuda_uuid() -> str | None:
    """UUID of the calling thread's current CUDA device, only if CUDA is already initialised.

    CUDA's current device is per thread: call this on the training thread (e.g. at ``init``) and
    pass the result as ``device``. Never initialises CUDA; None when torch or CUDA is not up.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
    except (RuntimeError, AssertionError, AttributeError):
        return None
    return None if uuid is None else _uuid_text(uuid)


def _torch_local_uuid(env: Mapping[str, str]) -> str | None:
    """From any thread, once CUDA is initialised: the UUID of CUDA ordinal ``LOCAL_RANK`` (the
    device a DDP rank uses by convention), or of the only visible device. CUDA's own numbering, so
    ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` are already applied."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        n = torch.cuda.device_count()
        try:
            local = int(env.get("LOCAL_RANK", "0"))
        except ValueError:
            local = 0
        ordinal = local if local < n else (0 if n == 1 else None)
        if ordinal is None:
            return None
        uuid = getattr(torch.cuda.get_device_properties(ordinal), "uuid", None)
    except (RuntimeError, AssertionError, AttributeError):
        return None
    return None if uuid is None else _uuid_text(uuid)


def _by_uuid_prefix(nvml: Any, prefix: str) -> Any:
    try:
        return nvml.nvmlDeviceGetHandleByUUID(prefix)
    except nvml.NVMLError:
        pass
    if prefix.startswith("GPU-"):
        # torch prints a MIG instance's UUID bare too, and _uuid_text guessed "GPU-": NVML knows
        # a MIG instance by "MIG-<uuid>" (its handle, not its parent GPU's, found by index below).
        try:
            return nvml.nvmlDeviceGetHandleByUUID("MIG-" + prefix[4:])
        except nvml.NVMLError:
            pass
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        if text(nvml.nvmlDeviceGetUUID(h)).startswith(prefix):
            return h
    raise DeviceNotFound(f"no GPU has a UUID starting with {prefix!r}")


def resolve_device(
    nvml: Any,
    *,
    device: str | int | None = None,
    env: Mapping[str, str] | None = None,
    torch_uuid: Callable[[Mapping[str, str]], str | None] = _torch_local_uuid,
) -> tuple[Any, str]:
    """(NVML handle, how it was matched) for this rank's GPU. Raises :class:`DeviceNotFound`."""
    env = os.environ if env is None else env
    try:
        if device is not None and str(device).strip() != "":
            d = str(device).strip()
            if d.startswith(("GPU-", "MIG-")):
                return _by_uuid_prefix(nvml, d), f"device={d} (UUID)"
            if _PCI.match(d):
                return nvml.nvmlDeviceGetHandleByPciBusId(d), f"device={d} (PCI bus id)"
            if d.isdigit():
                return nvml.nvmlDeviceGetHandleByIndex(int(d)), f"device={d} (NVML index)"
            raise DeviceNotFound(
                f"device={d!r} is not a GPU-/MIG- UUID, a PCI bus id (0000:3b:00.0) or an NVML index"
            )
        uuid = torch_uuid(env)
        if uuid:
            return _by_uuid_prefix(nvml, uuid), f"{uuid} (torch.cuda device LOCAL_RANK, CUDA already initialised)"
        try:
            local = int(env.get("LOCAL_RANK", "0"))
        except ValueError:
            local = 0
        cvd = env.get("CUDA_VISIBLE_DEVICES")
        if cvd is not None:
            entries = [e.strip() for e in cvd.split(",") if e.strip()]
            if not entries:
                raise DeviceNotFound("CUDA_VISIBLE_DEVICES is empty: this process sees no GPU")
            if len(entries) == 1:
                entry = entries[0]
            elif local < len(entries):
                entry = entries[local]
            else:
                raise DeviceNotFound(
                    f"LOCAL_RANK={local} but CUDA_VISIBLE_DEVICES={cvd!r} lists {len(entries)} devices"
                )
            how = f"CUDA_VISIBLE_DEVICES={cvd!r}, LOCAL_RANK={local} -> {entry}"
            if entry.startswith(("GPU-", "MIG-")):
                return _by_uuid_prefix(nvml, entry), how
            if entry.isdigit():
                return nvml.nvmlDeviceGetHandleByIndex(int(entry)), how + " (NVML index)"
            raise DeviceNotFound(f"cannot read CUDA_VISIBLE_DEVICES entry {entry!r}")
        return nvml.nvmlDeviceGetHandleByIndex(local), f"LOCAL_RANK={local} (NVML index)"
    except nvml.NVMLError as e:
        raise DeviceNotFound(f"NVML could not find the device: {e}") from None


class NvmlDevice:
    """One GPU's readings, as a DCGM-named sample dict. Not thread-safe: one sampler thread."""

    vendor = "nvidia"

    def __init__(self, nvml: Any, handle: Any, *, gpm: bool = True, clock=time.time,
                 mono=time.monotonic) -> None:
        self.nvml = nvml
        self.handle = handle
        self._clock = clock
        self._unsupported: set[str] = set()
        self.errors = 0
        self.index = self._get("index", "nvmlDeviceGetIndex", handle)
        self.uuid = text(self._get("uuid", "nvmlDeviceGetUUID", handle) or "")
        pci = self._get("pci", "nvmlDeviceGetPciInfo", handle)
        self.pci_bus_id = text(getattr(pci, "busId", "")) if pci is not None else ""
        self.name = text(self._get("name", "nvmlDeviceGetName", handle) or "")
        self.max_sm_clock = self._get("max_sm_clock", "nvmlDeviceGetMaxClockInfo", handle, nvml.NVML_CLOCK_SM)
        # A threshold, not a reading: read once.
        self.mem_max_op_temp = self._get(
            "mem_max_op_temp", "nvmlDeviceGetTemperatureThreshold", handle,
            nvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX,
        )
        self.gpm = None
        if gpm:
            from .gpm import GpmReader, gpm_supported

            if gpm_supported(nvml, handle):
                try:
                    self.gpm = GpmReader(nvml, handle, clock=mono)
                except nvml.NVMLError as e:
                    log.info("stepwatch: GPM unavailable on GPU %s (%s); profiling fields off", self.index, e)

    def _get(self, key: str, fn: "Callable[..., Any] | str", *args: Any) -> Any:
        """Call NVML (a function or the name of one); None when unsupported (remembered) or on
        error (counted). A name this pynvml lacks counts as unsupported."""
        if key in self._unsupported:
            return None
        if isinstance(fn, str):
            f = getattr(self.nvml, fn, None)
            if f is None:
                self._unsupported.add(key)
                return None
            fn = f
        try:
            return fn(*args)
        except self.nvml.NVMLError as e:
            if e.value in (self.nvml.NVML_ERROR_NOT_SUPPORTED, self.nvml.NVML_ERROR_FUNCTION_NOT_FOUND,
                           self.nvml.NVML_ERROR_NO_PERMISSION):
                self._unsupported.add(key)
            else:
                self.errors += 1
            return None

    def _field_values(self) -> dict[str, float]:
        """Memory temperature and NVLink CRC flit errors through nvmlDeviceGetFieldValues."""
        nvml = self.nvml
        wanted = []
        for key, const in (("DCGM_FI_DEV_MEMORY_TEMP", "NVML_FI_DEV_MEMORY_TEMP"),
                           ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
                            "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL")):
            fid = getattr(nvml, const, None)
            if fid is not None and key not in self._unsupported:
                wanted.append((key, fid))
        if not wanted:
            return {}
        vals = self._get("field_values", "nvmlDeviceGetFieldValues", self.handle, [f for _, f in wanted])
        out: dict[str, float] = {}
        if vals is None:
            return out
        for (key, _), fv in zip(wanted, vals):
            if fv.nvmlReturn == nvml.NVML_ERROR_NOT_SUPPORTED:
                self._unsupported.add(key)
                continue
            if fv.nvmlReturn != nvml.NVML_SUCCESS:
                continue
            out[key] = _field_value(nvml, fv)
        return out

    def sample(self) -> dict[str, Any]:
        nvml, h, g = self.nvml, self.handle, self._get
        s: dict[str, Any] = {
            "time": self._clock(),
            "gpu": self.index,
            "uuid": self.uuid,
            "pci_bus_id": self.pci_bus_id,
            "name": self.name,
            "vendor": self.vendor,
        }
        v = g("temp", "nvmlDeviceGetTemperature", h, nvml.NVML_TEMPERATURE_GPU)
        if v is None and "temp" in self._unsupported:
            # nvmlDeviceGetTemperature is deprecated (to be removed in CUDA 14, nvml.h); V is its successor.
            v = g("temp_v", "nvmlDeviceGetTemperatureV", h, nvml.NVML_TEMPERATURE_GPU)
        if v is not None:
            s["DCGM_FI_DEV_GPU_TEMP"] = int(v)
        if self.mem_max_op_temp is not None:
            s["DCGM_FI_DEV_MEM_MAX_OP_TEMP"] = int(self.mem_max_op_temp)
        v = g("power", "nvmlDeviceGetPowerUsage", h)
        if v is not None:
            s["DCGM_FI_DEV_POWER_USAGE"] = v / 1000.0  # NVML: milliwatts
        v = g("power_limit", "nvmlDeviceGetEnforcedPowerLimit", h)
        if v is not None:
            s["DCGM_FI_DEV_ENFORCED_POWER_LIMIT"] = v / 1000.0  # NVML: milliwatts
        v = g("energy", "nvmlDeviceGetTotalEnergyConsumption", h)
        if v is not None:
            s["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] = int(v)  # NVML: millijoules, as DCGM
        v = g("sm_clock", "nvmlDeviceGetClockInfo", h, nvml.NVML_CLOCK_SM)
        if v is not None:
            s["DCGM_FI_DEV_SM_CLOCK"] = int(v)
        # ClocksEventReasons is the current name; ClocksThrottleReasons the one older pynvml has.
        reasons_fn = "nvmlDeviceGetCurrentClocksEventReasons"
        if not hasattr(nvml, reasons_fn):
            reasons_fn = "nvmlDeviceGetCurrentClocksThrottleReasons"
        v = g("reasons", reasons_fn, h)
        if v is not None:
            s["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"] = int(v)
            s[REASONS_KEY] = decode(int(v))
        v = g("util", "nvmlDeviceGetUtilizationRates", h)
        if v is not None:
            s["DCGM_FI_DEV_GPU_UTIL"] = int(v.gpu)
        v = g("mem", "nvmlDeviceGetMemoryInfo", h)
        if v is not None:
            s["DCGM_FI_DEV_FB_FREE"] = v.free / (1024 * 1024)
            s["DCGM_FI_DEV_FB_USED"] = v.used / (1024 * 1024)
        for key, kind in (("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                          ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
            v = g(key, "nvmlDeviceGetTotalEccErrors", h, kind, nvml.NVML_VOLATILE_ECC)
            if v is not None:
                s[key] = int(v)
        s.update(self._field_values())
        if self.gpm is not None:
            try:
                s.update(self.gpm.read())
            except nvml.NVMLError:
                self.errors += 1
        return s

    def close(self) -> None:
        if self.gpm is not None:
            self.gpm.close()


def _field_value(nvml: Any, fv: Any) -> float:
    t = fv.valueType
    v = fv.value
    if t == nvml.NVML_VALUE_TYPE_DOUBLE:
        return float(v.dVal)
    if t == nvml.NVML_VALUE_TYPE_UNSIGNED_INT:
        return v.uiVal
    if t == nvml.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return v.ulVal
    if t == nvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return v.sllVal
    if t == getattr(nvml, "NVML_VALUE_TYPE_SIGNED_INT", -1):
        return v.siVal
    return v.ullVal


class XidWatcher:
    """Waits on NVML's event API for XID (and double-bit ECC) events, on its own thread.

    ``nvmlEventSetWait`` blocks in C with the GIL released; it wakes every ``wait_ms`` to check
    for stop. Events land in a bounded deque that the sampler drains into its next sample.
    """

    def __init__(self, nvml: Any, handle: Any, *, wait_ms: int = 500, clock=time.time) -> None:
        self.nvml = nvml
        self.handle = handle
        self.wait_ms = wait_ms
        self._clock = clock
        self._events: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._set = None
        self.error: str | None = None

    def start(self) -> bool:
        nvml = self.nvml
        want = nvml.nvmlEventTypeXidCriticalError | nvml.nvmlEventTypeDoubleBitEccError
        try:
            supported = nvml.nvmlDeviceGetSupportedEventTypes(self.handle)
            types = want & supported
            if not types & nvml.nvmlEventTypeXidCriticalError:
                self.error = "XID events not supported on this device"
                return False
            self._set = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(self.handle, types, self._set)
        except nvml.NVMLError as e:
            self.error = f"cannot register XID events: {e}"
            self._free()
            return False
        self._thread = threading.Thread(target=self._run, name="stepwatch-xid", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        nvml = self.nvml
        while not self._stop.is_set():
            try:
                data = nvml.nvmlEventSetWait(self._set, self.wait_ms)
            except nvml.NVMLError as e:
                if e.value == nvml.NVML_ERROR_TIMEOUT:
                    continue
                self.error = f"nvmlEventSetWait failed: {e}"
                log.warning("stepwatch: XID watcher stopped: %s", e)
                return
            ev = {"time": self._clock(), "event_type": int(data.eventType), "data": int(data.eventData)}
            if data.eventType == nvml.nvmlEventTypeXidCriticalError:
                ev["xid"] = int(data.eventData)
            elif data.eventType == nvml.nvmlEventTypeDoubleBitEccError:
                ev["dbe"] = True
            with self._lock:
                self._events.append(ev)

    def drain(self) -> list[dict[str, Any]]:
        with self._lock:
            out = list(self._events)
            self._events.clear()
        return out

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self._free()

    def _free(self) -> None:
        if self._set is not None:
            try:
                self.nvml.nvmlEventSetFree(self._set)
            except self.nvml.NVMLError:
                pass
            self._set = None


def attach_xids(sample: dict[str, Any], events: list[dict[str, Any]]) -> None:
    """Put the XIDs seen since the last sample into it, DCGM-style (last XID as the field)."""
    xids = [e for e in events if "xid" in e]
    if xids:
        sample[XIDS_KEY] = [{"xid": e["xid"], "time": e["time"]} for e in xids]
        sample["DCGM_FI_DEV_XID_ERRORS"] = xids[-1]["xid"]
