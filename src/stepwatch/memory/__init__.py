"""Memory as a session feature: where it goes, when it leaks, and what killed the job.

Training thread: :class:`~.probe.MemoryProbe` (a collector) reads the trainer's current RSS and,
once CUDA is in use, the caching allocator's counters every ``STEPWATCH_MEMORY_EVERY`` step ends
-- host-side counters, no device sync. An OOM passing through a hooked phase (forward, backward,
data fetch; an optimizer step through the uncaught-exception hook) is written down at once
(:mod:`.oom`). Background thread: this feature, as an enricher, fills the record's memory fields,
samples the DataLoader workers' USS/PSS, the host limit and the device's free memory at most once a
second (a record carries the latest sample), and feeds the detectors (:mod:`.detect`). A growth
or near-limit finding switches on CUDA's bounded allocation history (``STEPWATCH_MEMORY_HISTORY``;
the training thread does it at its next step end) so that a later ``oom-<n>/`` holds a snapshot
that opens in PyTorch's memory visualizer.
"""

from __future__ import annotations

import collections
import os
import resource
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from .._excepthook import pass_on
from ..record import Finding, StepRecord
from .detect import FragmentationDetector, MemoryGrowthDetector, NearLimitDetector, MiB
from .host import HostLimit, own_peak_rss, parent_pid, smaps_rollup
from .oom import OomForensics, is_oom
from .probe import MemoryProbe

if TYPE_CHECKING:
    from .._feature import Hub

# Background samples (workers' smaps_rollup, limit, device free) at most this often, seconds.
SAMPLE_EVERY_S = 1.0
# Records kept for oom-<n>/records.jsonl.
LAST_RECORDS = 64


# The attribute that marks an OOM exception as written down already (``_on_exception``).
_SEEN = "_stepwatch_oom_seen"


class MemoryFeature:
    name = "memory"

    def __init__(self, hub: "Hub") -> None:
        cfg = hub.config
        self.hub = hub
        self._err = hub.report_error
        self.probe = MemoryProbe(cfg.memory_every, reset_peak=cfg.memory_peak_reset, on_error=self._err)
        self.limit = HostLimit()
        self.history_mode = cfg.memory_history
        self.history_entries = cfg.memory_history_entries
        self.history_on = False
        self._history_asked = False
        self._last: collections.deque[StepRecord] = collections.deque(maxlen=LAST_RECORDS)
        self._iters: collections.deque[Any] = collections.deque(maxlen=64)  # weakrefs to DataLoader iterators
        self._next_sample = 0.0
        self._next_rusage = 0.0
        self._peak_rss: int | None = None
        self._workers: tuple[int | None, int | None, int] = (None, None, 0)
        self._device: tuple[int | None, int | None] = (None, None)  # free, total
        self._host_used: int | None = None
        self._prev_cuda: tuple[int, int] | None = None  # retries, ooms at the previous read
        self._oom_findings: list[Finding] = []
        self._oom_lock = threading.Lock()
        self._seen_exc: collections.deque[int] = collections.deque(maxlen=8)
        self._stopped = False
        self.oom = OomForensics(hub.ctx.run_dir, hub.ctx.rank, records=self._last_dicts,
                                host=self._host_now, cuda_device=lambda: self.probe.device)
        hub.add_collector(self.probe.collector())
        hub.add_enricher(self)
        # A window of fewer than 8 reads is never judged (detect.growth_of): at memory_every 30 a
        # 200-step window held 7, and a leak of 325 MiB in 1000 steps went unreported.
        window = max(cfg.memory_growth_window, 8 * cfg.memory_every)
        hub.add_detector(MemoryGrowthDetector(window, cfg.memory_growth_mib * MiB, headroom=self._headroom))
        hub.add_detector(FragmentationDetector(cfg.window))
        hub.add_detector(NearLimitDetector(cfg.window, host=self._host_sample))
        hub.add_exception_observer(self._on_exception)
        self._prev_hook = sys.excepthook
        sys.excepthook = self._excepthook
        self._patched: tuple[Any, Any, Any, list[Any]] | None = None
        self._patch_dataloader()

    # -- training thread ---------------------------------------------------------------------------

    def _patch_dataloader(self) -> None:
        """Remember each multi-process DataLoader iterator (weakly) to find its worker pids."""
        from torch.utils.data import dataloader

        cls = dataloader._MultiProcessingDataLoaderIter
        orig = cls.__dict__["__init__"]
        # Emptied by _unpatch_dataloader: a wrapper left in place there (one wrapped around it
        # later) only passes the call on.
        keep: list[Any] = [self._iters]

        def __init__(it: Any, *args: Any, **kwargs: Any) -> None:
            orig(it, *args, **kwargs)
            for iters in keep:
                iters.append(weakref.ref(it))

        __init__.__wrapped__ = orig  # type: ignore[attr-defined]
        cls.__init__ = __init__
        self._patched = (cls, orig, __init__, keep)

    def _unpatch_dataloader(self) -> None:
        """Put the iterator's ``__init__`` back, whichever comes off first, this or the
        instrumentation's wrapper under it (``hooks.install``, which puts back what it found, ours
        or not; the session uninstalls it before the features stop). Only our own wrapper is
        replaced: one that is not on top any more was put back already (the original is there)
        or has another wrapped around it, which is left as it is."""
        if self._patched is None:
            return
        cls, orig, mine, keep = self._patched
        self._patched = None
        keep.clear()
        if cls.__dict__.get("__init__") is mine:
            cls.__init__ = orig

    def _on_exception(self, phase: str, exc: BaseException) -> None:
        """An exception passes through a hooked phase (training thread). Only OOMs are kept, each
        once however many hooked phases it passes: the exception object itself is marked. (By
        ``id`` alone, a loop that catches and drops its OOMs saw only the first: the next
        MemoryError was made at the freed one's address. An id is kept only for an exception that
        takes no attribute.)"""
        if not is_oom(exc) or getattr(exc, _SEEN, False) or id(exc) in self._seen_exc:
            return
        try:
            setattr(exc, _SEEN, True)
        except Exception:  # noqa: BLE001 - an exception type without attributes: by id, as before
            self._seen_exc.append(id(exc))
        try:
            f = self.oom.handle(exc, phase=phase, step=self.hub.step)
            with self._oom_lock:
                self._oom_findings.append(f)
        except Exception as e:
            self._err("memory.oom", e)

    def _excepthook(self, t: Any, v: Any, tb: Any) -> None:
        # An OOM that no hooked phase saw on its way out (optimizer.step, user code): still written
        # down, in the phase the tracker was in; then the previous hook prints it as before.
        try:
            # (a forked child inherits the hook: the parent's session is not its to write for; a
            # hook left in the chain after stop -- another was installed on top of it -- writes
            # nothing into the run dir of a session that is over)
            if v is not None and not self._stopped and os.getpid() == self.hub.pid:
                self._on_exception(self.hub.phase_now(), v)
        except Exception as e:
            self._err("memory.excepthook", e)
        pass_on(self._excepthook, self._prev_hook, t, v, tb)

    # -- background thread ----------------------------------------------------------------------

    def enrich(self, rec: StepRecord, extras: dict[str, Any], *, force: bool) -> bool:
        now = time.monotonic()
        if now >= self._next_sample:
            self._next_sample = now + SAMPLE_EVERY_S
            try:
                self._sample()
            except Exception as e:  # the samples stop; the per-step fields go on
                self._next_sample = float("inf")
                self._err("memory.sample", e)
        got = extras.get("memory")
        if got is not None:
            rss, cuda = got
            rec.host_rss_bytes = rss
            if cuda is not None:
                alloc, reserved, peak, retries, ooms = cuda
                rec.mem_allocated_bytes = alloc
                rec.mem_reserved_bytes = reserved
                rec.mem_peak_bytes = peak
                rec.mem_fragmentation_bytes = max(reserved - max(peak, alloc), 0)
                prev = self._prev_cuda or (retries, ooms)
                rec.mem_alloc_retries = retries - prev[0]
                rec.mem_ooms = ooms - prev[1]
                self._prev_cuda = (retries, ooms)
        if rec.mem_peak_bytes is None and self.probe.device is None:
            if now >= self._next_rusage:
                self._next_rusage = now + 0.05
                # never below a record's RSS already taken as the mark (the high-water mark comes
                # in under a statm read by up to 0.4 MiB: the peak fell from one record to the next).
                # This process's own VmHWM: ru_maxrss holds a launcher's mark (host.own_peak_rss).
                hwm = own_peak_rss()
                if hwm is None:
                    hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                self._peak_rss = max(hwm, self._peak_rss or 0)
            # a high-water mark is at least the record's own RSS (read on the training thread,
            # after the cached maximum: peak below rss in 28 of 60 reads, by up to 0.24 MiB)
            if rec.host_rss_bytes is not None and rec.host_rss_bytes > self._peak_rss:
                self._peak_rss = rec.host_rss_bytes
            rec.mem_peak_bytes = self._peak_rss
        uss, pss, n = self._workers
        if n:
            rec.workers_uss_bytes, rec.workers_pss_bytes, rec.dataloader_workers = uss, pss, n
        rec.mem_device_free_bytes = self._device[0]
        self._last.append(rec)
        return True

    def _sample(self) -> None:
        self._workers = self._read_workers()
        self._host_used = self.limit.used()
        dev = self.probe.device
        if dev is not None:
            if self.history_mode == "on":
                self._ask_history()
            self._device = tuple(self.probe.cuda.mem_get_info(dev))

    def _read_workers(self) -> tuple[int | None, int | None, int]:
        me = os.getpid()
        uss = pss = 0
        n = 0
        for ref in list(self._iters):
            it = ref()
            if it is None or getattr(it, "_shutdown", True):
                continue
            for w in list(getattr(it, "_workers", ())):
                pid = getattr(w, "pid", None)
                if pid is None:
                    continue
                ppid = parent_pid(pid)
                # gone, or its pid reused: neither our child nor a child of one of ours (the
                # forkserver this process started, for multiprocessing_context="forkserver",
                # Python 3.14's default; those workers were never read)
                if ppid is None or (ppid != me and parent_pid(ppid) != me):
                    continue
                got = smaps_rollup(pid)
                if got is None:
                    continue
                uss += got[0]
                pss += got[1]
                n += 1
        return (uss, pss, n) if n else (None, None, 0)

    def _host_sample(self) -> tuple[int | None, int | None, str] | None:
        if self._host_used is None or not self.limit.limit:
            return None
        return self._host_used, self.limit.limit, self.limit.kind

    def _headroom(self, series: str) -> tuple[int, int | None, str] | None:
        if series == "device":
            free, total = self._device
            return None if total is None else (total, free, "device total")
        if not self.limit.limit:
            return None
        free = None if self._host_used is None else self.limit.limit - self._host_used
        return self.limit.limit, free, self.limit.kind

    def _host_now(self) -> dict[str, Any]:
        uss, pss, n = self._read_workers()
        return {"rss_bytes": self.probe._rss(), "workers": n, "workers_uss_bytes": uss,
                "workers_pss_bytes": pss, "limit_bytes": self.limit.limit, "limit_kind": self.limit.kind,
                "used_bytes": self.limit.used()}

    def _last_dicts(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in list(self._last)]

    def _ask_history(self) -> None:
        """(background) Have the training thread switch the history on at its next step end."""
        if not self._history_asked:
            self._history_asked = True
            self.hub.add_listener(self._history_listener)

    def _history_listener(self, step: int) -> None:
        """(training thread, once) torch keeps the history's RecordFunction callbacks per thread
        (2.11): switched on and off on the thread that allocates, not the pipeline's, which also
        keeps torch's "Requested callback is not found" out of the job's log at shutdown."""
        self.hub.remove_listener(self._history_listener)
        try:
            self._history(True)
        except Exception as e:
            self._err("memory.history", e)

    def _history(self, on: bool) -> None:
        """CUDA's allocation history, bounded to ``history_entries`` alloc/free events."""
        record = self.probe.cuda.memory._record_memory_history
        if on:
            record(enabled="all", context="all", stacks="python", max_entries=self.history_entries)
        else:
            record(enabled=None)
        self.history_on = on

    def collect(self, records: list[StepRecord]) -> tuple[list[dict[str, Any]], list[Finding]]:
        with self._oom_lock:
            got, self._oom_findings = self._oom_findings, []
        if self.oom.pending:
            self.oom.write_records(self._last[-1].step if self._last else None, final=False)
        return [], got

    def on_findings(self, findings: list[Finding]) -> None:
        if self.history_mode != "auto" or self.history_on or self.probe.device is None:
            return
        if any(f.kind in ("memory_growth", "memory_near_limit") and f.rank == self.hub.ctx.rank for f in findings):
            self._ask_history()

    def stop(self) -> None:
        self._stopped = True
        # ``==``, not ``is``: each access to self._excepthook makes a new bound method.
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_hook
        self._unpatch_dataloader()
        self.hub.remove_exception_observer(self._on_exception)
        self.hub.remove_listener(self._history_listener)
        if self.history_on:
            try:
                self._history(False)
            except Exception as e:
                self._err("memory.history", e)
        if self.oom.pending:  # after the session's last pass: every record there will be is in
            self.oom.write_records(None, final=True)
        self.probe.close()

    def status(self) -> dict[str, Any]:
        return {
            "cuda_device": self.probe.device,
            "every": self.probe.every,
            "peak_reset": self.probe.reset_peak,
            "host_limit_bytes": self.limit.limit,
            "host_limit_kind": self.limit.kind,
            "history": "recording" if self.history_on else self.history_mode,
            "ooms": self.oom.seen,
            "oom_dirs": [os.path.basename(d) for d in self.oom.dumps],
        }


def install(hub: "Hub") -> MemoryFeature:
    return MemoryFeature(hub)
