"""``TelemetrySource``: the per-rank GPU sampler thread and its analysis, as the session sees it.

The session (background thread) calls ``start()`` once, then each pass ``drain()`` for the new
samples (into ``Batch.samples``) and ``analyze(samples, records)`` for findings, and ``stop()`` at
shutdown. The sampler runs on its own daemon thread: NVML/amdsmi calls never touch the training
thread, never create a CUDA context, and any failure turns telemetry off with one log line.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any, Mapping, Sequence

from .._log import warn_once
from ..record import Finding, StepRecord
from .diagnose import Analyzer
from .summary import samples_between, summarize_window

log = logging.getLogger("stepwatch.telemetry")

# stepwatch: an hour of 1 Hz samples at most waits for drain(); older ones are dropped and counted.
MAX_PENDING = 3600
# stepwatch: consecutive failed samples before the sampler gives up.
MAX_CONSECUTIVE_ERRORS = 10


def load_nvml() -> tuple[Any | None, str | None]:
    """(pynvml, None) or (None, why not). ``nvidia-ml-py`` provides the ``pynvml`` module."""
    try:
        import pynvml
    except ImportError as e:
        return None, f"nvidia-ml-py is not installed ({e}); pip install nvidia-ml-py"
    return pynvml, None


def driver_problem(nvml: Any, err: Exception) -> str:
    """A sentence for why NVML would not start."""
    value = getattr(err, "value", None)
    if value == getattr(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", object()):
        return ("NVIDIA driver not found: libnvidia-ml.so.1 (NVML, shipped with the driver) could "
                "not be loaded")
    if value == getattr(nvml, "NVML_ERROR_DRIVER_NOT_LOADED", object()):
        return "NVIDIA driver not loaded (the kernel module is not running)"
    return f"NVML failed to start: {err}"


class TelemetrySource:
    """GPU health for this rank's GPU. Cheap to construct; nothing runs until ``start()``.

    ``nvml`` / ``amdsmi``: the modules to use (default: import ``pynvml``, then ``amdsmi``);
    tests pass stand-ins with the same functions.
    """

    def __init__(
        self,
        *,
        rank: int = 0,
        hz: float = 1.0,
        device: str | int | None = None,
        enabled: bool = True,
        nvml: Any = None,
        amdsmi: Any = None,
        env: Mapping[str, str] | None = None,
        xid_events: bool = True,
        clock=time.time,
    ) -> None:
        if not (0 < hz <= 10):
            raise ValueError(f"hz must be > 0 and <= 10 (GPM needs samples >= 100 ms apart), got {hz!r}")
        self.rank = rank
        self.hz = hz
        self.device_arg = device
        self.enabled = enabled
        self._nvml = nvml
        self._amdsmi = amdsmi
        self._env = dict(os.environ if env is None else env)
        self._xid_events = xid_events
        self._clock = clock
        self._pending: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_PENDING)
        # Drained samples of the last ~2 minutes, for window(); touched by the session's thread only.
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=max(2, int(120 * hz)))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._analyzer = Analyzer(rank)
        self.dropped = 0
        self.errors = 0
        self.status: dict[str, Any] = {"enabled": enabled, "running": False}

    @classmethod
    def from_config(cls, config: Any, ctx: Any, **kw: Any) -> "TelemetrySource":
        """From the session's ``Config`` (gpu_telemetry, gpu_sample_hz, gpu_device) and ``RunContext``.
        Pass ``device=config.gpu_device or current_cuda_uuid()`` (computed on the training thread) to
        follow ``torch.cuda.set_device``; without ``device`` it is ``config.gpu_device``."""
        kw.setdefault("device", config.gpu_device)
        return cls(rank=ctx.rank, hz=config.gpu_sample_hz, enabled=config.gpu_telemetry, **kw)

    # -- lifecycle --
    def start(self) -> None:
        """Start the sampler thread (returns at once; the device opens on that thread)."""
        if not self.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"stepwatch-gpu-r{self.rank}", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float = 5.0) -> bool:
        """Block until the device is open (or telemetry gave up). For tests and the doctor."""
        return self._ready.wait(timeout)

    def stop(self, timeout: float = 3.0) -> None:
        self._stop.set()
        t = self._thread
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                log.warning("stepwatch: GPU sampler did not stop within %.1f s; left as a daemon thread", timeout)

    # -- the session's side --
    def drain(self) -> list[dict[str, Any]]:
        """Samples taken since the last call (oldest first). Also kept for :meth:`window`."""
        with self._lock:
            out = list(self._pending)
            self._pending.clear()
        self._recent.extend(out)
        return out

    def window(self, t0: float, t1: float) -> dict[str, Any] | None:
        """The record's ``gpu`` object for a step from ``t0`` to ``t1`` (unix s), from drained samples
        of the last two minutes; None when no sample fell in it (steps shorter than the period)."""
        return summarize_window(samples_between(self._recent, t0, t1))

    def analyze(self, samples: Sequence[dict[str, Any]], records: Sequence[StepRecord] = ()) -> list[Finding]:
        """Findings from new samples and records (the checkpoint rules are a detector of the
        session's own: analysis/checkpoint.py)."""
        return self._analyzer.analyze(samples, records)

    # -- the sampler thread --
    def _open(self) -> tuple[Any, Any, Any] | None:
        """(device, xid watcher or None, shutdown callable) or None with status['error'] set."""
        nvml = self._nvml
        why = None
        if nvml is None:
            nvml, why = load_nvml()
        if nvml is not None:
            try:
                nvml.nvmlInit()
            except nvml.NVMLError as e:
                why = driver_problem(nvml, e)
            else:
                return self._open_nvidia(nvml)
        amd = self._amdsmi
        amd_why = None
        if amd is None:
            from .amd import load_amdsmi

            amd, amd_why = load_amdsmi()
        if amd is not None:
            from .amd import open_amd

            try:
                dev, how = open_amd(amd, self._env)
            except Exception as e:  # amdsmi's exception family has no importable base without amdsmi
                amd_why = f"amdsmi: {type(e).__name__}: {e}"
            else:
                self.status.update(backend="amdsmi", matched_by=how, gpu=dev.index, uuid=dev.uuid,
                                   name=dev.name, gpm=False, xid=False)
                return dev, None, getattr(amd, "amdsmi_shut_down", lambda: None)
        self.status["error"] = f"{why}; {amd_why}" if amd_why and why else (why or amd_why or "no GPU")
        return None

    def _open_nvidia(self, nvml: Any) -> tuple[Any, Any, Any] | None:
        from .nvml import DeviceNotFound, NvmlDevice, XidWatcher, resolve_device

        try:
            handle, how = resolve_device(nvml, device=self.device_arg, env=self._env)
            dev = NvmlDevice(nvml, handle, clock=self._clock)
        except (DeviceNotFound, nvml.NVMLError) as e:
            self.status["error"] = f"GPU not matched: {e}"
            nvml.nvmlShutdown()
            return None
        xid = None
        if self._xid_events:
            xid = XidWatcher(nvml, handle, clock=self._clock)
            if not xid.start():
                self.status["xid_error"] = xid.error
                xid = None
        self.status.update(backend="nvml", matched_by=how, gpu=dev.index, uuid=dev.uuid, name=dev.name,
                           pci_bus_id=dev.pci_bus_id, gpm=dev.gpm is not None, xid=xid is not None)
        return dev, xid, nvml.nvmlShutdown

    def _run(self) -> None:
        try:
            opened = self._open()
        except Exception as e:  # never let a driver quirk reach the training job
            log.warning("stepwatch: GPU telemetry off: %s: %s", type(e).__name__, e, exc_info=True)
            self.status["error"] = f"{type(e).__name__}: {e}"
            opened = None
        if opened is None:
            # Once per process: a job that starts several sessions need not hear it again.
            msg = f"GPU telemetry off on rank {self.rank}: {self.status.get('error')}"
            warn_once(f"telemetry.off.{msg}", "stepwatch: %s", msg, level=logging.INFO, log=log)
            self._ready.set()
            return
        dev, xid, shutdown = opened
        self.status["running"] = True
        self._ready.set()
        period = 1.0 / self.hz
        failures = 0
        from .nvml import attach_xids

        try:
            next_t = time.monotonic()
            while not self._stop.is_set():
                try:
                    s = dev.sample()
                    s["rank"] = self.rank
                    if xid is not None:
                        attach_xids(s, xid.drain())
                    failures = 0
                except Exception as e:  # counted; MAX_CONSECUTIVE_ERRORS in a row turn the sampler off
                    self.errors += 1
                    failures += 1
                    if failures == 1:
                        log.warning("stepwatch: GPU sample failed: %s: %s", type(e).__name__, e)
                    if failures >= MAX_CONSECUTIVE_ERRORS:
                        self.status["error"] = f"sampling failed {failures} times in a row: {e}"
                        log.warning("stepwatch: GPU telemetry off: %s", self.status["error"])
                        break
                else:
                    with self._lock:
                        if len(self._pending) == self._pending.maxlen:
                            self.dropped += 1
                        self._pending.append(s)
                next_t += period
                self._stop.wait(max(0.0, next_t - time.monotonic()))
                if time.monotonic() - next_t > period:  # fell behind (suspended): do not burst
                    next_t = time.monotonic()
        finally:
            self.status["running"] = False
            if xid is not None:
                xid.stop()
            try:
                dev.close()
                shutdown()
            except Exception as e:  # shutdown errors must not escape a daemon thread
                log.debug("stepwatch: GPU telemetry shutdown: %s", e)
