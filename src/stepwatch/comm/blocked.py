"""The training thread's time blocked in collectives: the job's own, and the waits stepwatch's
spans do not see (docs/comm.md, "Blocked in a collective").

A rank that finished its work first waits for the others in whatever collective comes next. DDP's
bucket AllReduce is timed through its comm hook (hooks.py) and its exposure cut at the end of the
backward's compute (overlap.py), but a job waits in other collectives too: a logging
``dist.all_reduce(loss)``, a ``dist.barrier()`` after rank 0's checkpoint or evaluation, an
object gather, and FSDP2's all-gathers (synchronous on gloo, or ``work.wait()`` in its module
hooks). Time spent there counted as the waiting rank's own work, so the rank that waited was
named the straggler. So, at install:

- each collective function of ``torch.distributed`` (``_FUNCS``, those that exist) is wrapped:
  a call on the training thread that returns no ``Work`` (a synchronous call) was blocked from
  its start to its return. A call returning a ``Work`` (``async_op=True``) only enqueued;
- ``torch.distributed.Work.wait`` is patched on the class (pybind11 allows it; the work objects
  are torch's own, so ``isinstance(work, dist.Work)`` checks such as FSDP2's still hold): a wait
  on the training thread was blocked from call to return.

Only the outermost call counts (``all_gather_object`` calls ``all_gather``, ``barrier`` calls
``wait``): ``depth``, set on the training thread only. Only the training thread counts
(the step tracker's ``_thread``), and only time inside a step that is none of its separately
reported parts: not before the first step, not inside a DataLoader fetch (``data_wait_s``), an
evaluation (``eval_s``: held until the span is judged, since a span of a few grad-disabled calls
can be the step's own work, a teacher's) or a checkpoint save (``checkpoint_s``). A wait after the step's end is
pending (after ``optimizer.step()``, until the next iteration's work) is the next step's time, as
``step_s`` counts it. DDP's own bucket waits run in C++ (the reducer), never through these
functions. On CUDA (NCCL) a synchronous collective returns once enqueued and ``wait()`` makes the
stream wait, so little host time is seen; nothing here synchronizes the device.

Cost: a thread-id compare on every call; on the training thread two clock reads and a tuple
appended per outermost call (see docs/comm.md for the measured figure). Nothing here raises into
the job: a failure of the timer goes to ``on_error`` once and turns it off.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable

from .spans import NO_STEP, CommCollector, step_part

_now = time.perf_counter_ns
_REMAPS = "torch.distributed._functional_collectives"

# The collectives of torch.distributed a job calls itself (those this torch has). FSDP2's four
# (all_gather_single, reduce_scatter_single, all_gather_into_tensor, reduce_scatter_tensor) are
# wrapped again here, above fsdp.py's span-timing wrappers: their synchronous calls block too.
_FUNCS = (
    "all_reduce", "barrier", "monitored_barrier", "broadcast", "reduce", "all_gather", "gather",
    "scatter", "reduce_scatter", "all_to_all", "all_to_all_single", "all_gather_object",
    "broadcast_object_list", "gather_object", "scatter_object_list", "send_object_list",
    "recv_object_list", "send", "recv", "all_reduce_coalesced", "all_gather_coalesced",
    "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single",
)


class BlockedTimer:
    """Installs and removes the wrappers; hands blocked intervals to a :class:`CommCollector`.
    ``tracker`` is the session's step tracker (its state says which thread trains and whether the
    time is a step's)."""

    def __init__(self, collector: CommCollector, tracker: Any, on_error: Callable[[str, BaseException], None]) -> None:
        self.collector = collector
        self.tracker = tracker
        self._on_error = on_error
        self._patches: list[tuple[Any, str, Any, Any]] = []  # (owner, name, original, ours)
        self._remapped: list[Any] = []  # our wrappers added to torch.compile's collective remaps
        self._watch: Any = None  # the import of that table, when the job has not made it yet
        self.active = True
        self.depth = 0  # training thread only: inside a timed call

    # -- install / uninstall ------------------------------------------------------------------

    def install(self) -> None:
        import torch.distributed as dist

        for name in _FUNCS:
            orig = getattr(dist, name, None)
            if orig is None or not callable(orig):
                continue
            ours = self._wrap(orig, dist.Work)
            setattr(dist, name, ours)
            self._patches.append((dist, name, orig, ours))
        work = dist.Work
        orig_wait = work.__dict__.get("wait")
        if orig_wait is not None:
            ours = self._wrap_wait(orig_wait)
            work.wait = ours
            self._patches.append((work, "wait", orig_wait, ours))
        self.collector.blocked_on = True
        # torch.compile's table of collectives it rewrites: now if the job imported it (FSDP2,
        # DTensor do), else as its import finishes (importing it here costs ~30 ms at start).
        import sys

        if _REMAPS in sys.modules:
            self._remap()
        else:
            from .._imports import ImportWatch

            self._watch = ImportWatch([_REMAPS], lambda name: self._remap()).start()

    def uninstall(self) -> None:
        self.active = False
        for owner, name, orig, ours in reversed(self._patches):
            current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
            if current is ours:  # something patched after us keeps its own (ours is inert now)
                setattr(owner, name, orig)
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        self._patches.clear()
        _unmap(self._remapped)

    def _remap(self) -> None:
        """torch.compile rewrites the collectives it knows (``traceable_collective_remaps``, keyed
        by the function) into traceable ones; a wrapper of one would be traced into instead. Ours
        get the entry of the function they wrap (through fsdp.py's wrapper, for FSDP2's four).
        Best effort: the table is torch's private one."""
        if not self.active:
            return
        try:
            from torch.distributed._functional_collectives import traceable_collective_remaps as remaps

            for owner, name, orig, ours in self._patches:
                fn = orig
                while fn is not None and ours not in remaps:
                    if fn in remaps:
                        remaps[ours] = remaps[fn]
                        self._remapped.append(ours)
                    fn = getattr(fn, "__wrapped__", None)
        except Exception:  # noqa: BLE001 - no such table in this torch, or another shape
            pass

    # -- the wrappers -------------------------------------------------------------------------

    def _wrap(self, orig: Callable, work_type: type) -> Callable:
        me = self
        get_ident = threading.get_ident
        now = _now

        @functools.wraps(orig)
        def collective(*args: Any, **kwargs: Any) -> Any:
            if me.depth or not me.active or get_ident() != me.tracker._thread:
                return orig(*args, **kwargs)
            me.depth = 1
            t0 = now()
            try:
                out = orig(*args, **kwargs)
            finally:
                me.depth = 0
            if not isinstance(out, work_type):  # synchronous: it returned when it was done
                me._note(t0, now())
            return out

        return collective

    def _wrap_wait(self, orig_wait: Any) -> Callable:
        me = self
        get_ident = threading.get_ident
        now = _now
        call = getattr(orig_wait, "__func__", orig_wait)  # pybind11's instancemethod: the function

        @functools.wraps(call)
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            if me.depth or not me.active or get_ident() != me.tracker._thread:
                return call(work, *args, **kwargs)
            me.depth = 1
            t0 = now()
            try:
                out = call(work, *args, **kwargs)
            finally:
                me.depth = 0
            me._note(t0, now())
            return out

        return wait

    def _note(self, t0: int, t1: int) -> None:
        """One outermost blocked call on the training thread, ``t0``-``t1`` (host clock, ns), in
        the step :func:`spans.step_part` says. With the step's end pending, the next step's (a
        second optimizer stepping after it would move that end past this wait: rare, and then the
        wait is counted one step late). Inside an evaluation span it is held until the span is
        judged: a frozen teacher's no_grad forward, then a logging all_reduce, is the step's."""
        try:
            part = step_part(self.tracker)
            if part == NO_STEP:
                return  # no step yet, or time the step reports apart (data, checkpoint)
            self.collector.blocked(t0, t1, part)
        except Exception as e:  # never into the job: off, and said once
            if self.active:
                self.active = False
                self._on_error("comm.blocked", e)


def _unmap(added: list[Any]) -> None:
    if not added:
        return
    try:
        from torch.distributed._functional_collectives import traceable_collective_remaps as remaps

        for fn in added:
            remaps.pop(fn, None)
    except Exception:  # noqa: BLE001
        pass
    added.clear()
