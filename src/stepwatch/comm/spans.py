"""One collective as stepwatch saw it, and the collector that hands a step's collectives over.

A span is created on the thread that issues the collective (the training thread, or the autograd
engine's device thread for CUDA backward) and closed by the collective's completion callback,
which may run on another thread (a gloo worker). Closing only writes the span's own slots, so a
span handed to the background thread already is still completed in place; the enricher waits
for it.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from ..cuda_ext import event_done
from ..hooks.phases import Collector

_now = time.perf_counter_ns

# Spans kept per step at most: bounds memory if steps stop ending (a tracker that disabled
# itself never calls take()); a DDP step has one span per bucket, FSDP two per wrapped module.
MAX_SPANS = 4096

# Collective kinds stepwatch times. ``allreduce`` is DDP's gradient reduction (one per bucket).
ALLREDUCE, ALL_GATHER, REDUCE_SCATTER = "allreduce", "all_gather", "reduce_scatter"


def group_key(pg: Any) -> str:
    """The name a process group has on the progress board: "default" for the world group (as a
    collective called without ``group=`` is named), else torch's ``group_name``."""
    if pg is None:
        return "default"
    try:
        import torch.distributed as dist

        if pg is dist.distributed_c10d._get_default_group():
            return "default"
    except (ImportError, RuntimeError, ValueError):
        pass
    return getattr(pg, "group_name", None) or "default"


class Span:
    """One collective. Host clock (``perf_counter_ns``) in ``t0``/``t1``; on CUDA, device events
    in ``ev0``/``ev1`` (resolved by the enricher without blocking)."""

    __slots__ = ("op", "nbytes", "world", "seq", "hook", "group", "t0", "t_ret", "t1", "ev0", "ev1", "device",
                 "failed")

    def __init__(self, op: str, nbytes: int | None, world: int, seq: int, hook: str, group: str = "default") -> None:
        self.op = op
        self.nbytes = nbytes
        self.world = world
        self.seq = seq
        self.hook = hook
        self.group = group
        self.t0 = _now()
        self.t_ret: int | None = None  # when the issuing call returned (the hook, on the issuing thread)
        self.t1: int | None = None
        self.ev0: Any = None
        self.ev1: Any = None
        self.device = -1  # CUDA device of ev0/ev1 (-1: the querying thread's current one)
        self.failed = False

    def done(self) -> bool:
        if self.failed:
            return True
        if self.ev1 is not None:
            return event_done(self.ev1, self.device)
        return self.t1 is not None


class CommCollector(Collector):
    """Collects the spans issued during a step; ``take()`` (training thread, step end) swaps the list.
    ``on_first()`` runs once, at the first span or forward-end event (from whichever thread): the
    feature adds the collector to the tracker's then, so that a job that never communicates (one
    process) has no call a step for it."""

    name = "comm"

    def __init__(self, progress_getter: Any = None, on_first: Any = None) -> None:
        self._on_first = on_first
        self._buf: list[Span] = []
        # Per process group: the hang verdict compares a group's sequence numbers across ranks, and
        # ranks issue different numbers of collectives on other groups (pipeline/tensor parallel).
        self._seqs: dict[str, Any] = {}
        self._progress_getter = progress_getter
        self._lock = threading.Lock()
        self.enabled = True
        self.dropped = 0  # spans not kept because a step already held MAX_SPANS
        # Forward-end device event of the step (CUDA only): start of backward compute on the device.
        self._fwd_end_ev: Any = None
        # The training thread's blocked intervals (host ns) in collectives (blocked.py), of this
        # step and of the next one (blocked after this step's end was pending: the next step's
        # time); handed over as extras["comm"]["blocked"] once ``blocked_on`` (the timer is in).
        self.blocked_on = False
        self._blk: list[tuple[int, int]] = []
        self._blk_next: list[tuple[int, int]] = []

    def take(self) -> Any:
        buf, blk = self._buf, self._blk
        if not buf and self._fwd_end_ev is None and not blk:
            if self._blk_next:  # blocked after the end of the step ending now: the next one's
                self._blk, self._blk_next = self._blk_next, blk
            return None  # a step without collectives keeps its list: no allocation a step
        self._buf = []  # a span issued meanwhile from another thread goes to the next step
        ev, self._fwd_end_ev = self._fwd_end_ev, None
        out = {"spans": buf, "fwd_end_ev": ev}
        if self.blocked_on:
            out["blocked"] = blk  # given away: the next step's list is another
            self._blk, self._blk_next = self._blk_next, []
        return out

    def blocked(self, t0: int, t1: int, next_step: bool) -> None:
        """The training thread stood in a collective from ``t0`` to ``t1`` (host ns), in this
        step, or (``next_step``: the step's end was pending) in the next. Training thread only."""
        if self._on_first is not None:
            self._first()
        buf = self._blk_next if next_step else self._blk
        if len(buf) < MAX_SPANS:
            buf.append((t0, t1))
        elif buf[-1][1] < t1:
            # A step of more than MAX_SPANS blocking calls (a per-parameter all_reduce loop):
            # the last interval stretches to this one's end (the gap between counts with it).
            buf[-1] = (buf[-1][0], t1)

    def set_forward_end_event(self, ev: Any) -> None:
        if self._on_first is not None:
            self._first()
        self._fwd_end_ev = ev

    def _first(self) -> None:
        with self._lock:
            first, self._on_first = self._on_first, None
        if first is not None:
            first()

    # -- issuing side ---------------------------------------------------------------------------

    def begin(self, op: str, nbytes: int | None, world: int, hook: str, group: str = "default") -> Span:
        if self._on_first is not None:
            self._first()
        with self._lock:  # issue can come from the autograd engine's threads as well
            counter = self._seqs.get(group)
            if counter is None:
                counter = self._seqs[group] = itertools.count(1)
            seq = next(counter)
        span = Span(op, nbytes, world, seq, hook, group)
        if len(self._buf) < MAX_SPANS:
            self._buf.append(span)
        else:
            self.dropped += 1
        progress = self._progress()
        if progress is not None:
            try:
                progress.coll_enter(op, group, seq, int(nbytes or 0))
            except Exception:
                pass  # the watchdog's board is best effort; never let it break a collective
        return span

    def end(self, span: Span) -> None:
        span.t1 = _now()
        progress = self._progress()
        if progress is not None:
            try:
                progress.coll_exit(span.seq, span.group)
            except Exception:
                pass

    def _progress(self) -> Any:
        if self._progress_getter is None:
            return None
        p = self._progress_getter()
        if p is None or not hasattr(p, "coll_enter") or not hasattr(p, "coll_exit"):
            return None
        return p
