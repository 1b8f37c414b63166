"""The training thread's side of memory: a collector read at step ends, every ``every`` steps.

One read is the trainer's current RSS (one ``pread`` of ``/proc/self/statm``) and, once CUDA is
in use, one call of the caching allocator's nested statistics (``torch._C._cuda_memoryStats``,
what ``torch.cuda.memory_stats_as_nested_dict`` returns). Those are host-side counters the
allocator keeps under its own lock: no kernel, no stream wait, no device sync (checked under
``torch.cuda.set_sync_debug_mode("error")`` in scripts/gpu_check_session.py). One call gives
everything; ``torch.cuda.memory_allocated()``, ``memory_reserved()`` and ``max_memory_allocated()``
would each build and flatten the whole dictionary again. ROCm's torch answers the same calls.

Peak reset: after each read the allocator's peak counters are reset
(``reset_peak_memory_stats``), so the next read's peak is the peak *since this read*. That is what
makes a per-step peak possible, and it means the user's own ``torch.cuda.max_memory_allocated()``
reads the peak since stepwatch's last read, not since the start; ``STEPWATCH_MEMORY_PEAK_RESET=0``
stops the reset (the peak is then the run's high-water mark, as on the CPU).
"""

from __future__ import annotations

import sys
from typing import Any

from ..hooks.phases import Collector
from .host import StatmReader

try:  # take()'s countdown in C (src/stepwatch/_speedups.c); optional
    from .._speedups import Every as _Every
except ImportError:
    _Every = None


def cuda_numbers(stats: dict[str, Any]) -> tuple[int, int, int, int, int]:
    """(allocated, reserved, peak allocated, alloc retries, OOMs) from a *nested* memory_stats dict."""
    a = stats["allocated_bytes"]["all"]
    return (
        int(a["current"]),
        int(stats["reserved_bytes"]["all"]["current"]),
        int(a["peak"]),
        int(stats.get("num_alloc_retries", 0)),
        int(stats.get("num_ooms", 0)),
    )


def flat_numbers(stats: dict[str, Any]) -> tuple[int, int, int, int, int]:
    """The same from a flat ``torch.cuda.memory_stats()`` dict (as saved in ``oom-<n>/``)."""
    return (
        int(stats.get("allocated_bytes.all.current", 0)),
        int(stats.get("reserved_bytes.all.current", 0)),
        int(stats.get("allocated_bytes.all.peak", 0)),
        int(stats.get("num_alloc_retries", 0)),
        int(stats.get("num_ooms", 0)),
    )


class MemoryProbe(Collector):
    """``take()`` at every step end: nothing most steps; every ``every``-th step one
    :meth:`read`, ``(rss_bytes, cuda_tuple_or_None)``. ``cuda`` (the torch.cuda module or a stand-in with the
    same ``_C``-level functions) is found lazily: only once CUDA is initialized by the user."""

    name = "memory"

    def __init__(self, every: int = 10, *, reset_peak: bool = True, cuda: Any = None,
                 on_error: Any = None) -> None:
        self.every = every
        self.reset_peak = reset_peak
        self._left = 1  # the first step end reads
        self._rss = StatmReader()
        self._stats: Any = None
        self._reset: Any = None
        self.device: int | None = None
        self.cuda: Any = None  # the torch.cuda in use, once found (the background thread asks it too)
        self._cuda = cuda
        self._on_error = on_error
        self._cuda_off = False  # the allocator's statistics failed once: host numbers only from then on

    def _find_cuda(self) -> None:
        cuda = self._cuda
        if cuda is None:
            torch = sys.modules.get("torch")
            if torch is None:
                return
            cuda = torch.cuda
        if not cuda.is_initialized():  # never create a CUDA context ourselves
            return
        self.device = int(cuda.current_device())
        fn = None
        if self._cuda is None:  # the C binding itself: memory_stats_as_nested_dict adds only checks
            fn = getattr(sys.modules["torch"]._C, "_cuda_memoryStats", None)
        self._stats = fn or cuda.memory_stats_as_nested_dict
        self._reset = cuda.reset_peak_memory_stats
        self.cuda = cuda

    def take(self) -> Any:
        self._left -= 1
        if self._left > 0:
            return None
        self._left = self.every
        return self.read()

    def collector(self) -> Any:
        """What the step tracker calls: this probe, or where ``_speedups`` was built the same
        countdown in C (``Every``: no Python frame at the steps that read nothing), from the
        probe's state now."""
        if _Every is None:
            return self
        e = _Every()
        e.name, e.read, e.every, e._left = self.name, self.read, self.every, self._left
        return e

    def read(self) -> Any:
        """One read: ``(rss_bytes, cuda_tuple_or_None)``."""
        cuda = None
        try:
            if self._stats is None and not self._cuda_off:
                self._find_cuda()
            if self._stats is not None:
                cuda = cuda_numbers(self._stats(self.device))
                if self.reset_peak:
                    self._reset(self.device)
        except Exception as e:  # never into the step tracker: that would stop step tracking too
            cuda = None
            self._stats = None
            self._cuda_off = True
            if self._on_error is not None:
                self._on_error("memory.cuda", e)
        return self._rss(), cuda

    def close(self) -> None:
        self._rss.close()
