"""Pure-Python event rings: the fallback when the native extension is not built or no runtime loads.

Same API and semantics as the native ``Ring`` (see ``__init__``): a fixed ring of slots, ``begin``
returns a slot or -1, ``end`` ignores -1 and stale slots, ``poll`` never blocks and returns
``(tag, slot, elapsed_s)`` oldest first, a full ring drops and counts. Two clocks:

- ``PyHostRing``: ``time.perf_counter_ns`` (CLOCK_MONOTONIC on Linux, like the native host ring).
- ``TorchEventRing``: pre-created ``torch.cuda.Event(enable_timing=True)`` pairs; ``poll`` uses
  ``Event.query()`` (non-blocking) before ``elapsed_time``.
"""

from __future__ import annotations

import abc
import os
import threading
import weakref
from time import perf_counter_ns
from typing import Any

_FREE, _BEGUN, _ENDED = 0, 1, 2
MAX_CAPACITY = 1 << 16  # same bound as the native ring (module.c MAX_CAPACITY)

_live: "weakref.WeakSet[_PyRing]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for ring in list(_live):
        ring._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def check_capacity(capacity: Any) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not 2 <= capacity <= MAX_CAPACITY:
        raise ValueError(
            f"capacity must be an int in [2, {MAX_CAPACITY}] (rounded up to a power of two), got {capacity!r}"
        )
    n = 2
    while n < capacity:
        n <<= 1
    return n


class _Region:
    """``with ring.region(tag, stream):`` — one interval; reentrant, lets exceptions through."""

    __slots__ = ("_ring", "_tag", "_stream", "slot")

    def __init__(self, ring: Any, tag: Any, stream: Any) -> None:
        self._ring = ring
        self._tag = tag
        self._stream = stream
        self.slot = -1

    def __enter__(self) -> "_Region":
        self.slot = self._ring.begin(self._stream, self._tag)
        return self

    def __exit__(self, *exc: object) -> bool:
        self._ring.end(self.slot, self._stream)
        return False


class _PyRing(abc.ABC):
    """Ring bookkeeping shared by the Python backends; subclasses stamp and resolve a slot."""

    name = "python"
    backend = "host"

    def __init__(self, capacity: int = 1024) -> None:
        cap = check_capacity(capacity)
        self._cap = cap
        self._mask = cap - 1
        self._seq = [-1] * cap
        self._state = bytearray(cap)
        self._tags: list[Any] = [None] * cap
        self._head = 0
        self._tail = 0
        # _advance runs on the poller's thread and, when end() gives a slot up, on the training
        # thread: `_tail += 1` from both at once could move the tail back or past the head.
        self._advance_lock = threading.Lock()
        self._reset_seq = 0
        self.dropped = 0
        self.captured = 0
        self.errors = 0
        self.completed = 0
        self.bad_end = 0
        self.closed = False
        self.disabled: str | None = None
        _live.add(self)

    # -- subclass hooks --
    @abc.abstractmethod
    def _stamp_begin(self, i: int, stream: Any) -> bool:
        """Stamp slot ``i``'s start; False when nothing was recorded."""

    @abc.abstractmethod
    def _stamp_end(self, i: int, stream: Any) -> bool:
        """Stamp slot ``i``'s end; False when nothing was recorded."""

    @abc.abstractmethod
    def _resolve(self, i: int) -> float | None:
        """Seconds of slot ``i``; None when not ready yet; raises on failure."""

    # -- the ring API --
    @property
    def capacity(self) -> int:
        return self._cap

    @property
    def pending(self) -> int:
        return self._head - self._tail

    library = None
    device = None

    def begin(self, stream: Any, tag: Any) -> int:
        if self.closed or self.disabled:
            return -1
        h = self._head
        if h - self._tail >= self._cap:
            self.dropped += 1
            return -1
        i = h & self._mask
        if not self._stamp_begin(i, stream):
            return -1
        self._seq[i] = h
        self._state[i] = _BEGUN
        self._tags[i] = tag
        self._head = h + 1
        return h

    def _open(self, slot: Any) -> int:
        if not isinstance(slot, int) or isinstance(slot, bool):
            raise TypeError(f"slot must be the int returned by begin(), not {type(slot).__name__}")
        if slot < self._tail or slot >= self._head:
            return -1
        i = slot & self._mask
        if self._seq[i] != slot or self._state[i] != _BEGUN:
            return -1
        return i

    def end(self, slot: int, stream: Any = None) -> bool:
        """True when the interval will come out of ``poll``; False when nothing was recorded."""
        if isinstance(slot, int) and slot == -1:
            return False
        i = self._open(slot)
        if self.closed or self.disabled or 0 <= slot < self._reset_seq:
            return False
        if i < 0:
            self.bad_end += 1
            return False
        if self._stamp_end(i, stream):
            self._state[i] = _ENDED
            return True
        self._give_up(i)
        return False

    def cancel(self, slot: int) -> bool:
        i = self._open(slot)
        if i < 0 or self.closed:
            return False
        self._give_up(i)
        return True

    def _give_up(self, i: int) -> None:
        self._tags[i] = None
        self._state[i] = _FREE
        self._advance()

    def _advance(self) -> None:
        with self._advance_lock:
            while self._tail != self._head and self._state[self._tail & self._mask] == _FREE:
                self._tail += 1

    def poll(self) -> list[tuple[Any, int, float]]:
        out: list[tuple[Any, int, float]] = []
        if self.closed or self.disabled:
            return out
        for q in range(self._tail, self._head):
            i = q & self._mask
            if self._state[i] != _ENDED:
                continue
            try:
                elapsed = self._resolve(i)
            except Exception:  # a runtime error loses this interval, never the caller's step
                self.errors += 1
                self._tags[i] = None
                self._state[i] = _FREE
                continue
            if elapsed is None:
                continue
            out.append((self._tags[i], q, elapsed))
            self._tags[i] = None
            self._state[i] = _FREE
            self.completed += 1
        self._advance()
        return out

    def region(self, tag: Any, stream: Any = None) -> _Region:
        return _Region(self, tag, stream)

    def stats(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "capacity": self._cap,
            "pending": self.pending,
            "dropped": self.dropped,
            "captured": self.captured,
            "errors": self.errors,
            "completed": self.completed,
            "bad_end": self.bad_end,
            "last_error": 0,
            "closed": self.closed,
        }

    def _clear(self) -> None:
        for q in range(self._tail, self._head):
            i = q & self._mask
            self._tags[i] = None
            self._state[i] = _FREE
        self._tail = self._head

    def close(self) -> None:
        if not self.closed:
            self._clear()
            self.closed = True

    def _after_fork(self) -> None:
        self._advance_lock = threading.Lock()  # another thread may have held it at fork()
        self._clear()
        self._reset_seq = self._head
        self.dropped = self.captured = self.errors = self.completed = self.bad_end = 0

    def __enter__(self) -> "_PyRing":
        return self

    def __exit__(self, *exc: object) -> bool:
        self.close()
        return False


class PyHostRing(_PyRing):
    """Host clock ring: ``perf_counter_ns`` stamps; every ended interval is ready at once."""

    def __init__(self, capacity: int = 1024) -> None:
        super().__init__(capacity)
        self._t0 = [0] * self._cap
        self._t1 = [0] * self._cap

    def _stamp_begin(self, i: int, stream: Any) -> bool:
        self._t0[i] = perf_counter_ns()
        return True

    def _stamp_end(self, i: int, stream: Any) -> bool:
        self._t1[i] = perf_counter_ns()
        return True

    def _resolve(self, i: int) -> float:
        return max(self._t1[i] - self._t0[i], 0) * 1e-9


class TorchEventRing(_PyRing):
    """Device ring on ``torch.cuda.Event`` pairs (CUDA or ROCm torch); never synchronizes."""

    backend = "cuda"

    def __init__(self, capacity: int = 1024, device: int | None = None) -> None:
        import torch

        super().__init__(capacity)
        self._torch = torch
        self.device = torch.cuda.current_device() if device is None else int(device)
        self.backend = "hip" if getattr(torch.version, "hip", None) else "cuda"
        with torch.cuda.device(self.device):
            self._ev0 = [torch.cuda.Event(enable_timing=True) for _ in range(self._cap)]
            self._ev1 = [torch.cuda.Event(enable_timing=True) for _ in range(self._cap)]
        self._streams: dict[int, Any] = {}

    def _stream(self, stream: Any) -> Any:
        if stream is None or isinstance(stream, self._torch.cuda.Stream):
            return stream if stream is not None else self._torch.cuda.current_stream(self.device)
        s = self._streams.get(stream)
        if s is None:
            cuda = self._torch.cuda
            if stream == 0:  # the legacy default stream, torch's default stream's handle
                s = cuda.default_stream(self.device)
            else:  # a raw handle from `.cuda_stream`: wrap once, then reuse
                s = cuda.ExternalStream(int(stream), device=self.device)
            self._streams[stream] = s
        return s

    def _record(self, ev: Any, stream: Any) -> bool:
        cuda = self._torch.cuda
        if cuda.is_current_stream_capturing():
            self.captured += 1
            return False
        try:
            ev.record(self._stream(stream))
        except RuntimeError:
            self.errors += 1
            return False
        return True

    def _stamp_begin(self, i: int, stream: Any) -> bool:
        return self._record(self._ev0[i], stream)

    def _stamp_end(self, i: int, stream: Any) -> bool:
        return self._record(self._ev1[i], stream)

    def _resolve(self, i: int) -> float | None:
        from . import event_done, event_elapsed_s  # the package imports this module first

        if not event_done(self._ev1[i], self.device) or not event_done(self._ev0[i], self.device):
            return None
        return event_elapsed_s(self._ev0[i], self._ev1[i], self.device)

    def _after_fork(self) -> None:
        super()._after_fork()
        self.disabled = (
            "forked child: CUDA/HIP events are not inherited across fork(), device timing is off in "
            "this process (use the 'spawn' start method, or time on the host)"
        )
