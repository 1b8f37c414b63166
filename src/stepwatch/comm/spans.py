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

# Whose time a collective on the training thread is (:func:`step_part`): no step's, the step
# running, the next step's (the step's end is pending), or the step's only if the evaluation span
# open now turns out to be its own work (a frozen teacher's forward) rather than evaluation.
NO_STEP, THIS_STEP, NEXT_STEP, IF_STEP_WORK = 0, 1, 2, 3


def step_part(tr: Any) -> int:
    """Where the step tracker ``tr`` (its state, on the training thread) puts time spent now: not
    before the first step, inside a DataLoader fetch (``data_wait_s``) or a checkpoint save
    (``checkpoint_s``); inside an open evaluation span, held until the span is judged; after the
    step's end is pending (after ``optimizer.step()``), the next step's, as ``step_s`` counts it."""
    if not tr.enabled or tr._prev_end is None or tr.in_data or tr._ckpt_depth:
        return NO_STEP
    if tr._eval_open:
        return IF_STEP_WORK
    return NEXT_STEP if tr._pending_end is not None else THIS_STEP


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
        # Spans issued on the training thread after the step's end (the next step's), and spans
        # and blocked intervals inside an evaluation span not judged yet (``eval_judged``).
        self._buf_next: list[Span] = []
        self._buf_eval: list[Span] = []
        self._blk_eval: list[tuple[int, int]] = []

    def take(self) -> Any:
        buf, blk = self._buf, self._blk
        if not buf and self._fwd_end_ev is None and not blk:
            if self._blk_next:  # blocked after the end of the step ending now: the next one's
                self._blk, self._blk_next = self._blk_next, blk
            if self._buf_next:
                self._buf, self._buf_next = self._buf_next, buf
            return None  # a step without collectives keeps its list: no allocation a step
        # A span issued meanwhile from another thread goes to the next step; so do the training
        # thread's issued after this step's end.
        self._buf, self._buf_next = self._buf_next, []
        ev, self._fwd_end_ev = self._fwd_end_ev, None
        out = {"spans": buf, "fwd_end_ev": ev}
        if self.blocked_on:
            out["blocked"] = blk  # given away: the next step's list is another
            self._blk, self._blk_next = self._blk_next, []
        return out

    def blocked(self, t0: int, t1: int, part: int) -> None:
        """The training thread stood in a collective from ``t0`` to ``t1`` (host ns), in the step
        ``part`` says (:func:`step_part`: this step, the next, or held for an evaluation span's
        judgement). Training thread only."""
        if self._on_first is not None:
            self._first()
        buf = self._blk_next if part == NEXT_STEP else self._blk_eval if part == IF_STEP_WORK else self._blk
        if len(buf) < MAX_SPANS:
            buf.append((t0, t1))
        elif buf[-1][1] < t1:
            # A step of more than MAX_SPANS blocking calls (a per-parameter all_reduce loop):
            # the last interval stretches to this one's end (the gap between counts with it).
            buf[-1] = (buf[-1][0], t1)

    def eval_judged(self, evaluation: bool) -> None:
        """The step tracker closed an evaluation span (training thread): what was held inside it
        is the step's when the span was the step's own work (a teacher's forward under no_grad,
        then a collective), else nobody's (``eval_s``, not communication of a step)."""
        buf, blk = self._buf_eval, self._blk_eval
        if not buf and not blk:
            return
        self._buf_eval, self._blk_eval = [], []
        if evaluation:
            return
        self._buf.extend(buf[: max(MAX_SPANS - len(self._buf), 0)])
        self._blk.extend(blk[: max(MAX_SPANS - len(self._blk), 0)])

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

    def begin(self, op: str, nbytes: int | None, world: int, hook: str, group: str = "default",
              part: int = THIS_STEP) -> Span:
        """A collective starts. ``part``: whose it is (:func:`step_part`; spans issued off the
        training thread are the step's running now). One of no step's is timed for the progress
        board (the hang watchdog) and kept in no record."""
        if self._on_first is not None:
            self._first()
        with self._lock:  # issue can come from the autograd engine's threads as well
            counter = self._seqs.get(group)
            if counter is None:
                counter = self._seqs[group] = itertools.count(1)
            seq = next(counter)
        span = Span(op, nbytes, world, seq, hook, group)
        buf = (self._buf if part == THIS_STEP else self._buf_next if part == NEXT_STEP
               else self._buf_eval if part == IF_STEP_WORK else None)
        if buf is not None:  # None: no step's (NO_STEP)
            if len(buf) < MAX_SPANS:
                buf.append(span)
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
