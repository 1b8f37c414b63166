"""Low-overhead interval timing: a pre-allocated ring of timing slots, native when it can be.

One API, four backends (``Timer.name``):

- ``"native cuda"`` / ``"native hip"``: the C extension records CUDA/HIP events on the raw stream
  you pass; the runtime is loaded with dlopen at run time (torch's copy first).
- ``"native host"``: the same C ring with CLOCK_MONOTONIC stamps.
- ``"python"``: the pure-Python ring (``perf_counter_ns`` on host, ``torch.cuda.Event`` on device),
  used when the extension is not built or no runtime loads.

Use::

    timer = get_timer("cuda")                      # or get_timer() for host time
    stream = torch.cuda.current_stream().cuda_stream   # look up once, not per call
    slot = timer.begin(stream, "forward")          # -1 when nothing was recorded
    ...
    timer.end(slot, stream)
    for tag, slot, elapsed_s in timer.poll():      # background thread; never blocks
        ...

``with timer.region("forward", stream):`` does the same as a context manager (reentrant; lets
exceptions through). ``begin``/``end`` never raise for run-time conditions: a full ring, a stream
capturing a CUDA graph, or a runtime error is counted (``dropped``, ``captured``, ``errors``).
See docs/timing.md.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from stepwatch._log import warn_once
from stepwatch.cuda_ext._python import PyHostRing, TorchEventRing, _Region, check_capacity

__all__ = [
    "RuntimeUnavailable",
    "Timer",
    "backend_name",
    "backend_status",
    "event_done",
    "event_elapsed_s",
    "get_timer",
    "native_status",
]

_log = logging.getLogger("stepwatch.cuda_ext")

try:  # the one seam where the optional extension is guarded
    _native = importlib.import_module("stepwatch.cuda_ext._native")

    _NATIVE_ERROR: str | None = None
    RuntimeUnavailable: type[RuntimeError] = _native.RuntimeUnavailable
except ImportError as exc:  # not built (no compiler at install time) or built for another Python
    _native = None  # type: ignore[assignment]
    _NATIVE_ERROR = (
        f"the native extension stepwatch.cuda_ext._native is not available ({exc}); "
        "reinstall with a C compiler present (`pip install --force-reinstall --no-deps stepwatch` "
        "with gcc/cc on PATH) to build it"
    )

    class RuntimeUnavailable(RuntimeError):  # type: ignore[no-redef]
        """No CUDA/HIP runtime library could be loaded; the message lists what was tried."""


def _warn_once(msg: str) -> None:
    warn_once(f"cuda_ext.{msg}", "%s", msg, log=_log)


def native_ring_class(module: Any) -> type:
    """The C ``Ring`` of ``module`` plus the Python conveniences; calls still go straight to C."""

    class NativeRing(module.Ring):
        __slots__ = ()

        @property
        def name(self) -> str:
            return "native " + self.backend

        def region(self, tag: Any, stream: Any = None) -> _Region:
            return _Region(self, tag, stream)

        def __enter__(self) -> "NativeRing":
            return self

        def __exit__(self, *exc: object) -> bool:
            self.close()
            return False

        def __repr__(self) -> str:
            return f"<{self.name} timer capacity={self.capacity} pending={self.pending} dropped={self.dropped}>"

    return NativeRing


NativeRing = native_ring_class(_native) if _native is not None else None

#: Any of the ring classes; they share begin/end/cancel/poll/region/stats/close and the counters.
Timer = Any


def _device_index(device: Any) -> int | None:
    """None -> host; else the CUDA device index (-1: the current device)."""
    if device is None:
        return None
    if isinstance(device, bool):
        raise ValueError(f"device must be None, 'cpu', 'cuda', 'cuda:N', an int >= 0 or a torch.device, got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device must be an int >= 0, got {device}")
        return device
    text = str(device)  # torch.device prints as 'cuda:0' / 'cpu'
    if text == "cpu":
        return None
    if text == "cuda":
        return -1
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise ValueError(f"device must be None, 'cpu', 'cuda', 'cuda:N', an int >= 0 or a torch.device, got {device!r}")


def get_timer(
    device: Any = None,
    capacity: int = 1024,
    *,
    native: bool | None = None,
    library: str | None = None,
) -> Any:
    """The best available timer for ``device``.

    device: None or "cpu" -> host clock; "cuda", "cuda:N", N or a torch.device -> device events
      (CUDA or ROCm torch alike: ROCm torch calls its devices "cuda" too).
    capacity: slots in the ring (2..65536, rounded up to a power of two); a full ring drops.
    native: None -> native when available, else Python with one warning; True -> native or raise
      RuntimeUnavailable / ImportError; False -> the pure-Python ring.
    library: path of a CUDA/HIP runtime to dlopen instead of searching (tests, unusual installs).

    A device timer needs a GPU: without one (and without a loadable runtime) this raises
    RuntimeError naming what was tried. Create it on the thread and device that will time work.
    """
    check_capacity(capacity)
    if native not in (None, True, False):
        raise ValueError(f"native must be None, True or False, got {native!r}")
    index = _device_index(device)
    if index is None:
        if library is not None:
            raise ValueError("library applies only to a device timer (device='cuda'), not to host timing")
        if native is not False and _native is not None:
            return NativeRing(capacity, "host")
        if native is True:
            raise ImportError(_NATIVE_ERROR)
        return PyHostRing(capacity)

    dev = None if index < 0 else index
    problem = _NATIVE_ERROR
    if native is not False and _native is not None:
        if library is None:
            try:  # load torch's runtime first so our events share it (dlopen RTLD_NOLOAD finds it)
                import torch  # noqa: F401
            except ImportError:
                pass
        try:
            return NativeRing(capacity, "device", library, dev)
        except RuntimeUnavailable as exc:
            if native is True:
                raise
            problem = str(exc)
    elif native is True:
        raise ImportError(_NATIVE_ERROR)

    try:
        import torch
    except ImportError:
        raise RuntimeError(f"device timing needs torch with CUDA or ROCm; {problem or 'torch is not installed'}") from None
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"device timing needs a CUDA or ROCm GPU: torch.cuda.is_available() is False"
            + (f"; native: {problem}" if problem else "")
        )
    if problem:
        _warn_once(f"stepwatch: native device timer unavailable, using torch.cuda.Event instead: {problem}")
    return TorchEventRing(capacity, dev)


_backends: dict[Any, tuple[str, str | None]] = {}


def backend_status(device: Any = None) -> tuple[str, str | None]:
    """``(backend_name(device), why)``: ``why`` is the error that made it "unavailable" (what was
    tried and what failed), else None. For ``stepwatch doctor``."""
    key = _device_index(device)
    if key not in _backends:
        try:
            with get_timer(device, capacity=2) as t:
                _backends[key] = (t.name, None)
        except (RuntimeError, ImportError) as exc:
            _backends[key] = ("unavailable", str(exc))
    return _backends[key]


def backend_name(device: Any = None) -> str:
    """What ``get_timer(device)`` would use: "native cuda", "native hip", "native host", "python",
    or "unavailable" for a device timer on a machine without a GPU."""
    return backend_status(device)[0]


def native_status() -> dict[str, Any]:
    """Whether the extension is built and which runtime it would load (no device is touched)."""
    status: dict[str, Any] = {"extension": _native is not None, "error": _NATIVE_ERROR, "runtime": None}
    if _native is not None:
        try:
            kind, path = _native.load_runtime("device")
            status["runtime"] = {"kind": kind, "library": path}
        except RuntimeUnavailable as exc:
            status["runtime_error"] = str(exc)
    return status


# -- torch.cuda.Event queries from stepwatch's background thread -----------------------------------
#
# Two things go wrong when a background thread calls torch.cuda.Event.query() / elapsed_time():
# 1. the thread has never set a device, so the call initializes a CUDA context on device 0 (every
#    rank of a node would put one on GPU 0);
# 2. in the default capture mode ("global", torch.cuda.graph's), an event query from any thread
#    while another thread captures a CUDA graph is a prohibited call that invalidates the capture.
# The native functions run the query on the event's device and in relaxed capture mode; without
# the extension, torch's device guard fixes (1) (it restores only a device that has a context).

_direct: Any = None  # the extension once its runtime loaded; False when it cannot


def _direct_module() -> Any:
    global _direct
    if _direct is None:
        _direct = False
        if _native is not None:
            try:
                _native.load_runtime("device")
                _direct = _native
            except RuntimeUnavailable as exc:
                _log.debug("stepwatch: event queries through torch (%s)", exc)
    return _direct or None


def event_done(event: Any, device: int) -> bool:
    """Has ``event`` (a ``torch.cuda.Event``, recorded on CUDA device ``device``) completed?
    Never blocks; safe from a background thread. An event never recorded counts as done."""
    native = _direct_module()
    if native is not None:
        return native.event_query(event.cuda_event, device)
    import torch

    with torch.cuda.device(device):
        return bool(event.query())


class Pending:
    """A value the training thread took from a CUDA tensor (a scalar logged as one; a fused
    optimizer's found_inf under GradScaler): copied to host without blocking, read by the
    background thread (stepwatch._pipeline) once its event says the copy is done."""

    __slots__ = ("host", "event", "device")
    # Set by the first one made: until then no record can hold one, and the pass does not look.
    made = False

    def __init__(self, host: Any, event: Any, device: int) -> None:
        self.host = host
        self.event = event
        self.device = device
        Pending.made = True


def copy_to_host(t: Any) -> tuple[Any, Any, int]:
    """Start copying CUDA tensor ``t`` into pinned host memory without waiting for it:
    ``(host tensor, event, device)``. Read the host tensor once ``event_done(event, device)``.
    The copy runs on ``t``'s device's current stream, which need not be the current device's:
    the event is recorded there."""
    import torch

    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return host, event, t.device.index


def event_elapsed_s(start: Any, end: Any, device: int) -> float:
    """Seconds from ``start`` to ``end`` (completed ``torch.cuda.Event`` s with timing, on
    ``device``); as ``event_done``. RuntimeError when ``end`` has not completed."""
    native = _direct_module()
    if native is not None:
        return native.event_elapsed_ms(start.cuda_event, end.cuda_event, device) * 1e-3
    import torch

    with torch.cuda.device(device):
        return start.elapsed_time(end) * 1e-3
