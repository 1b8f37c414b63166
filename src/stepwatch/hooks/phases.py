"""The step tracker: the training thread's side of stepwatch.

Hooks call the tracker's ``*_begin``/``*_end`` methods; the tracker keeps a handful of integer
accumulators (nanoseconds, host clock) and, when a step ends, hands one :class:`~stepwatch.record.RawStep`
to ``emit`` (the bounded queue). It knows nothing of files, metrics or analysis.

Step boundaries. A step ends at the *last* ``optimizer.step()`` of an iteration: the end is only
*pending* after an optimizer step, and becomes final when the next iteration's work starts (a
data fetch, a forward, a backward, a checkpoint, a user phase) or on ``stepwatch.step()`` or at
shutdown. A second optimizer stepping before that extends the same step. A GradScaler step that
skips the optimizer still ends a step, marked ``skipped``. So does an optimizer step that raised
(torch runs no post-hook; the loop caught it): the next work that finds its phase open, with no
step running, ends that step where the failed call began (``_Methods._opt_raised``), on the cold
paths that already looked at an open phase (no hot method reads anything more for it).

Loops without a torch optimizer (``p.data.add_(p.grad, alpha=-lr)``). ``boundary`` says what
ends a step: ``"optimizer"`` (the default), ``"backward"`` (set by the hooks when no
``torch.optim.Optimizer`` exists at the first backward: each outermost backward then makes a
pending end, like an optimizer step; the first optimizer step seen switches back to
``"optimizer"``), or ``"explicit"`` (the user calls ``stepwatch.step()``: from the first call
on only that call ends a step, whatever optimizers step in between).

Data fetches. Root modules called *inside* a DataLoader fetch (an ``nn.Module`` transform in
``Dataset.__getitem__``) are data loading, not forward: ``in_data`` tells the hooks to leave them.

Evaluation. A forward of a hooked root module with grad disabled (or in eval mode: the root call
passes ``grad_enabled`` False for it) opens an *eval span*, and so does
a DataLoader fetch made with grad disabled (a training fetch runs with grad enabled; an evaluation
through a child module, ``model.module(x)``, calls no root); the data fetch right before it and
every fetch inside the span belong to it, the one that ends an iterator (StopIteration) too. The
span closes at the next training work and runs to where that work starts: a training fetch (which
is the step's data wait: the span ends at its start), a forward with grad, a backward, an optimizer
step, a checkpoint; or to the step's end (``stepwatch.step()``), or to shutdown after the last
step. So what an evaluation does after its last model call (a metric over the collected
predictions) is evaluation too. Its length goes to ``eval_s``, never to ``step_s``; it starts at
the creation of the DataLoader iterator its first fetch came from when nothing else ran between
(``iterator_made``: a loader's workers start there). Checkpoint saves go to ``checkpoint_s``
likewise.

The training thread. The tracker belongs to the thread that made it (``stepwatch.init()``'s),
and from the first backward on to that backward's thread (hooks/install.py): ``_thread``. The hooks of what another thread may run alongside the steps (a DataLoader fetch on a
prefetch thread, a ``torch.save`` on a checkpoint thread) pass through there without touching it.

Two cores. The hot methods (the hooks' begin/end calls, ``log``, the step's hand-over) are
``_PyCore``'s here and, where it was built, hooks/_ctracker.c's ``Core``: the same code in C over
the same attributes (``_STATE``). ``StepTracker`` takes the C one when it imports, ``PyStepTracker``
is always the Python; every other method (``_Methods``) is shared. Change a hot method in both.

Compiled functions. A ``torch.compile``'d function (``@torch.compile def train_step(x, y)``)
that calls the model: dynamo inlines the model's call, which no root call sees. Its call at the
top of the loop is told to the tracker (``compiled_begin``/``compiled_end``, from hooks/install.py's
``_CompiledCall``): it is training work (a pending step end is final at its start, as at a
root's forward), and its time up to the first phase timed inside it (a backward: a compiled
step's ``loss.backward()`` runs eagerly) is the step's ``forward_s``; without grad it is an
evaluation call, as a root's. No hot method reads anything of it: while its forward runs, the
span stands in for the device timer (``device``), whose ``begin`` every forward, backward and
optimizer phase calls, and so learns where the first of them begins.

Closures. ``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS) runs forward and
backward *inside* the optimizer phase. The optimizer phase is paused while the closure runs
(``pause_optimizer``, from the hooks' closure wrapper) and while an outermost forward or backward
runs inside it, so that time lands in ``forward_s``/``backward_s`` (the closure's other work in
``other_s``) and ``optimizer_s`` is the optimizer's own work; on the device clock too, the
optimizer's event pair is closed and reopened around them.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable

from ..record import RawStep
from .nvtx import Nvtx

_now = time.perf_counter_ns

# Phase codes published to a progress board (the hang watchdog reads them from another process).
PHASE_OTHER, PHASE_DATA, PHASE_FORWARD, PHASE_BACKWARD, PHASE_OPTIMIZER, PHASE_EVAL, PHASE_CHECKPOINT = range(7)
PHASE_NAMES = ("other", "data", "forward", "backward", "optimizer", "eval", "checkpoint")
# What a fetch's wrapper tells ``data_end`` (bits): grad was disabled; the fetch ended the
# iteration (StopIteration).
FETCH_NO_GRAD, FETCH_END = 1, 2
# A span of grad-disabled root calls with no batch of its own and at most this many calls, closed
# by training work, is the step's own work (a teacher, a reference and a reward model), not
# evaluation: _PyCore._close_eval_for_work. An evaluation loop makes more calls, or fetches.
IN_STEP_NO_GRAD_CALLS = 4


class Collector:
    """Something measured on the training thread during a step (comm spans, FLOPs, grad-norm
    tensors). ``take()`` runs at the end of each step, on the training thread: swap a buffer and
    return it, nothing more. The value lands in the raw record's ``extras[name]``."""

    name = "collector"

    def take(self) -> Any:  # pragma: no cover - interface
        return None


# The tracker's state: every attribute its hot methods read or write. ``_PyCore`` holds them as
# slots; hooks/_ctracker.c's ``Core`` holds the same names in C (a test compares the two lists).
_STATE = (
    "enabled", "_emit", "_nvtx", "_mem_probe", "_on_error", "collectors", "listeners", "progress",
    "device", "_dslot_fwd", "_dslot_bwd", "_dslot_opt", "step", "boundary", "in_data", "_t_start",
    "_prev_end", "_pending_end", "_pending_skipped", "_step_open", "_fwd_depth", "_fwd_t0",
    "_fwd_grad", "_bwd_depth", "_bwd_t0", "_opt_depth", "_opt_t0", "_opt_paused", "_fwd_paused_opt",
    "_bwd_paused_opt", "_ckpt_depth", "_ckpt_t0", "_eval_open", "_eval_t0", "_eval_end",
    "_eval_calls", "_eval_pulls", "_eval_pulled", "_eval_fwd", "_eval_bwd", "_eval_judged", "_bwd_eval", "_eval_last",
    "_span_judged", "_last_fetch_t0", "_last_fetch_ns",
    "_iter_t0", "_iter_t1", "_thread", "_in_scaler", "_scaler_fired", "_data", "_fwd", "_bwd",
    "_opt", "_eval", "_ckpt", "_own", "_ckpt_bytes", "_bwd_spans", "_phases", "_scalars",
)


class _PyCore:
    """The tracker's state and its hot methods (what the hooks call every step, and the step's
    hand-over) in Python: the reference that hooks/_ctracker.c translates line for line, and the
    tracker's core wherever that extension is missing (no C compiler at install). The methods
    that call back into Python from C (``_pause_opt``, ``_resume_opt``, ``_fail``) and every
    colder one live in :class:`_Methods`, over the same attributes, for both cores."""

    __slots__ = _STATE

    def _reset_step(self) -> None:
        self._data = self._fwd = self._bwd = self._opt = self._eval = self._ckpt = 0
        self._own = 0  # stepwatch's own one-off work inside the step (module discovery)
        self._ckpt_bytes: int | None = None
        self._bwd_spans: list[tuple[int, int]] = []  # outermost backward intervals (ns)
        self._phases: dict[str, int] | None = None  # user phases (ns): made by the first one to end
        self._scalars: dict[str, Any] = {}

    def _close_eval(self, t: int) -> None:
        """The open eval span ends where the training fetch after it started (``_eval_end``),
        else at ``t``: where the work that closes it starts (a forward with grad, a backward, an
        optimizer step, a checkpoint), the step's end, or shutdown. Not at its last call or
        fetch: what an evaluation does after its last model call (its metric over the collected
        predictions, ``on_validation_epoch_end``) is evaluation too (it was the next step's
        ``other_s``, a slow step)."""
        if self._eval_open:
            self._eval += max((self._eval_end or t) - self._eval_t0, 0)
            self._eval_open = False
            if self._eval_bwd:  # its backwards (input gradients) are in its time: none is the step's
                spans, t0 = self._bwd_spans, self._eval_t0
                while spans and spans[-1][0] >= t0:
                    spans.pop()
            if self._span_judged is not None:
                self._span_judged(True)

    def _open_eval(self, t0: int) -> None:
        """An eval span is open (from ``t0``, if none was), and the fetch right before it is the
        span's, as for a forward. The span goes on: no training fetch has ended it. One that had
        ended it (an evaluation's next batch, fetched with grad; the next step's, of a model
        trained in eval mode) is judged again (``eval_span_is_evaluation``): the next step's
        backward was the judged span's."""
        if self._eval_end:
            self._eval_judged = False
        self._eval_end = 0
        if not self._eval_open:
            self._eval_open = True
            self._eval_t0 = t0
            self._eval_calls = self._eval_pulls = self._eval_pulled = self._eval_fwd = self._eval_bwd = 0
            self._eval_judged = False
            self._eval_last = t0
        if self._last_fetch_t0 is not None:
            if self._last_fetch_t0 < self._eval_t0:
                self._eval_t0 = self._last_fetch_t0
            self._data -= self._last_fetch_ns
            self._eval_pulls += 1
            self._eval_pulled += self._last_fetch_ns
            self._last_fetch_t0 = None

    def _span_is_work(self) -> bool:
        """The open span, closed by training work now, is the step's own work. Judged evaluation
        (``eval_span_is_evaluation``): never. With backwards in it (input gradients: a model
        trained in eval mode, micro-batch by micro-batch; an adversarial batch searched on the
        step's own): always. Else when it fetched no batch of its own (at most the one fetched
        right before it, and none since its last forward) and made at most
        ``IN_STEP_NO_GRAD_CALLS`` calls: a teacher or reference model (distillation, RLHF) on the
        step's batch."""
        if self._eval_judged:
            return False
        return bool(self._eval_bwd) or (self._eval_calls <= IN_STEP_NO_GRAD_CALLS and self._eval_pulls <= 1
                                        and self._last_fetch_t0 is None)

    def _close_eval_for_work(self, t: int) -> None:
        """Training work begins at ``t`` (a forward with grad, a backward, an optimizer step) while a
        span of eval forwards is open. The step's own work (``_span_is_work``): its forwards are
        forward time, its backwards backward time and its fetch data time, inside ``step_s``. Any
        other span is evaluation (``eval_s``)."""
        if not self._eval_open:
            return
        if self._span_is_work():
            self._fwd += self._eval_fwd
            self._data += self._eval_pulled
            self._bwd += self._eval_bwd
            self._eval_open = False
            if self._span_judged is not None:
                self._span_judged(False)
        else:
            self._close_eval(t)

    def _finalize(self, t_end: int, skipped: bool) -> None:
        if self._eval_open:
            self._close_eval(t_end)
        self._pending_end = None
        self._pending_skipped = False
        prev = self._prev_end if self._prev_end is not None else t_end
        step_ns = max(t_end - prev - self._eval - self._ckpt - self._own, 0)
        mem = self._mem_probe() if self._mem_probe is not None else None
        if self._step_open:
            if self._nvtx is not None:
                self._nvtx.pop_range()
            self._step_open = False
        extras: dict[str, Any] = {"backward_spans": self._bwd_spans}
        if self._ckpt:
            extras["checkpoint_bytes"] = self._ckpt_bytes
        for c in self.collectors:
            extras[c.name] = c.take()
        self._emit(
            RawStep(
                self.step,
                t_end,
                step_ns,
                self._data,
                self._fwd,
                self._bwd,
                self._opt,
                self._eval,
                self._ckpt,
                self._phases,
                self._scalars,
                skipped,
                mem,
                extras,
            )
        )
        ended = self.step
        self.step += 1
        self._prev_end = t_end
        self._reset_step()
        if self.progress is not None:
            self.progress.set_step(self.step)
        for fn in self.listeners:
            fn(ended)

    def _start_work(self, t: int) -> None:
        """Training work begins at ``t``: finalize a pending step, open the next one."""
        if self._pending_end is not None:
            self._finalize(self._pending_end, self._pending_skipped)
        if self._prev_end is None:
            self._prev_end = t
        if not self._step_open:
            self._step_open = True
            if self._nvtx is not None:
                self._nvtx.push_step(self.step)

    def _begin_work(self) -> int:
        """The start of a fetch, forward or backward: now, with a pending step finalized first.
        When one was, the clock is read again after it: the step's end ran its listeners (a scan
        for a copied model, a peak lookup), whose time is not this phase's (a scan of 0.2 s was
        this fetch's data wait, and the step's parts came to more than ``step_s``)."""
        t = _now()
        if self._pending_end is not None:
            self._start_work(t)
            return _now()
        if self._prev_end is None:
            self._start_work(t)
        return t

    # -- data loading -------------------------------------------------------------------------

    def data_begin(self) -> int:
        """The fetch's start, or 0 where it is not timed: a fetch inside a fetch (a DataLoader
        iterated inside another's: sequence packing over a document loader) is the outer one's
        time, which counted it twice (data_wait_s twice the wait, more than step_s)."""
        if not self.enabled or self.in_data:
            return 0
        try:
            t = self._begin_work()
            self.in_data += 1
            if self.progress is not None:
                self.progress.set_phase(PHASE_DATA)
            return t
        except Exception as e:  # never raise into the training loop
            self._fail("data_begin", e)
            return 0

    def data_end(self, t0: int, how: int = 0) -> None:
        """``how``: ``FETCH_NO_GRAD`` | ``FETCH_END`` bits (0: a batch fetched with grad enabled,
        the training loop's fetch). A fetch with grad disabled is evaluation: it opens or extends
        the eval span (a batch of its own; a span of at most one and few calls, closed by training
        work, is still the step's own work: ``_close_eval_for_work``); so is the fetch that ends an
        iterator while a span is open (its workers' shutdown)."""
        if not self.enabled or not t0:
            return
        try:
            self.in_data = max(self.in_data - 1, 0)
            t = _now()
            d = t - t0
            made = -1  # iter()'s own time, when the span starts at the iterator
            if self._iter_t0 is not None:  # the iterator's first fetch: where a span of it starts
                it0, it1 = self._iter_t0, self._iter_t1
                self._iter_t0 = self._iter_t1 = None
                if self._no_work_since(it0):
                    made = it1 - it0 if it1 is not None and it1 >= it0 else -1
                    fetch_t0, t0 = t0, it0
            if how and (how & FETCH_NO_GRAD or self._eval_open):
                self._open_eval(t0)
                if not how & FETCH_END:
                    self._eval_pulls += 1
                self._eval_pulled += d
                self._eval_last = t
            else:  # from the iterator's start, for its first fetch: the loop waited for its workers
                if made >= 0 and t0 < fetch_t0:
                    # iter()'s own time (where non-persistent workers start) and this fetch's; the
                    # loop's work between them (an epoch's bookkeeping) is not the loader's: it
                    # was data wait, and raised a data_loading finding
                    t0 = fetch_t0 - made
                if self._eval_open and not self._eval_end:
                    # training work after an open span: where the span ends (a forward that closes
                    # it comes after this fetch, which is data wait), unless the span takes this
                    # fetch as its own (an evaluation's forward next: _open_eval)
                    self._eval_end = t0
                self._data += t - t0
                # a batch an evaluation may take (_open_eval); a training loader's end (no batch,
                # its workers' shutdown) is the training's, whatever comes next
                self._last_fetch_t0 = None if how & FETCH_END else t0
                self._last_fetch_ns = t - t0
            if self.progress is not None:
                self.progress.set_phase(PHASE_OTHER)
        except Exception as e:
            self._fail("data_end", e)

    # -- forward of the root modules ---------------------------------------------------------

    def forward_begin(self, grad_enabled: bool) -> None:
        if not self.enabled:
            return
        try:
            self._fwd_depth += 1
            if self._fwd_depth > 1 or self._bwd_depth:
                # inside a backward: the recompute of a checkpointed root (checkpoint(model, x)),
                # the backward's own time (timed as forward too, it was counted twice)
                return
            t = self._begin_work()
            self._fwd_paused_opt = self._pause_opt(t) if self._opt_depth else False
            self._fwd_grad = grad_enabled
            self._fwd_t0 = t
            nv = self._nvtx
            if nv is not None:
                nv.push_range(nv.forward if grad_enabled else nv.eval)
            if self.progress is not None:
                self.progress.set_phase(PHASE_FORWARD if grad_enabled else PHASE_EVAL)
            if grad_enabled:
                if self._eval_open:
                    self._close_eval_for_work(t)
                self._last_fetch_t0 = None
                if self.device is not None:
                    self._dslot_fwd = self.device.begin(PHASE_FORWARD)
                return
            # Evaluation: the fetch right before this forward, and fetches inside the span, are eval.
            self._open_eval(t)
            self._eval_calls += 1
        except Exception as e:
            self._fail("forward_begin", e)

    def forward_end(self) -> None:
        if not self.enabled or self._fwd_depth == 0:
            return
        try:
            self._fwd_depth -= 1
            if self._fwd_depth or self._bwd_depth:  # a recompute inside a backward (forward_begin)
                return
            t = _now()
            if self._nvtx is not None:
                self._nvtx.pop_range()
            if self.progress is not None:
                self.progress.set_phase(PHASE_OTHER)
            if self._fwd_grad:
                if self.device is not None:
                    self.device.end(self._dslot_fwd)
                self._fwd += t - self._fwd_t0
            else:
                self._eval_fwd += t - self._fwd_t0
                self._eval_last = t
            if self._fwd_paused_opt:
                self._fwd_paused_opt = False
                self._resume_opt(t)
        except Exception as e:
            self._fail("forward_end", e)

    # -- backward ------------------------------------------------------------------------------

    def backward_begin(self) -> None:
        if not self.enabled:
            return
        try:
            self._bwd_depth += 1
            if self._bwd_depth > 1:
                return
            t = self._begin_work()
            # Inside an open span (the model in eval mode, grad enabled), a backward that is not
            # the step's end (an optimizer loop, none open) is the span's until training work
            # closes it (``_span_is_work``): input gradients of an evaluation (FGSM's robust
            # accuracy), or of the step's own (a model trained in eval mode, TRADES' search).
            self._bwd_eval = False
            if self._eval_open:
                if self.boundary == "optimizer" and not self._opt_depth and (
                        self._eval_judged or self._span_is_work()):
                    self._bwd_eval = True
                else:
                    self._close_eval_for_work(t)
            self._last_fetch_t0 = None
            self._bwd_paused_opt = self._pause_opt(t) if self._opt_depth else False
            self._bwd_t0 = t
            if self.device is not None:
                self._dslot_bwd = self.device.begin(PHASE_BACKWARD)
            if self._nvtx is not None:
                self._nvtx.push_range(self._nvtx.backward)
            if self.progress is not None:
                self.progress.set_phase(PHASE_BACKWARD)
        except Exception as e:
            self._fail("backward_begin", e)

    def backward_end(self) -> None:
        if not self.enabled or self._bwd_depth == 0:
            return
        try:
            self._bwd_depth -= 1
            if self._bwd_depth:
                return
            t = _now()
            if self.device is not None:
                self.device.end(self._dslot_bwd)
            if self._bwd_eval and self._eval_open:
                self._eval_bwd += t - self._bwd_t0
                self._eval_last = t
            else:
                self._bwd += t - self._bwd_t0
            self._bwd_eval = False
            self._bwd_spans.append((self._bwd_t0, t))
            if self._nvtx is not None:
                self._nvtx.pop_range()
            if self.progress is not None:
                self.progress.set_phase(PHASE_OTHER)
            if self._bwd_paused_opt:
                self._bwd_paused_opt = False
                self._resume_opt(t)
            elif self._opt_depth:
                self._drop_opt()  # a step that began inside it raised out of it
            elif self.boundary == "backward":
                self._pending_end = t  # no optimizer in this loop: the backward ends the step
                self._pending_skipped = False
            elif self._pending_end is not None and self.boundary != "explicit":
                self._pending_end = t  # its optimizer steps ran inside it (_pause_bwd): it ends the step
        except Exception as e:
            self._fail("backward_end", e)

    # -- optimizer -----------------------------------------------------------------------------

    def optimizer_begin(self) -> None:
        if not self.enabled:
            return
        try:
            self._opt_depth += 1
            if self._opt_depth > 1 and not self._opt_stale():
                return
            t = _now()
            if self.boundary == "backward":
                self.boundary = "optimizer"  # an optimizer after all: it ends steps from now on
            if self._prev_end is None:
                self._start_work(t)
            elif not self._step_open:
                self._step_open = True
                if self._nvtx is not None:
                    self._nvtx.push_step(self.step)
            # A pending end stays pending: a second optimizer in the same iteration extends it.
            self._pending_end = None
            if self._eval_open:
                self._close_eval_for_work(t)
            self._last_fetch_t0 = None
            self._opt_t0 = t
            self._opt_paused = 0
            if self._bwd_depth:
                self._pause_bwd(t)
            if self.device is not None:
                self._dslot_opt = self.device.begin(PHASE_OPTIMIZER)
            if self._nvtx is not None:
                self._nvtx.push_range(self._nvtx.optimizer)
            if self.progress is not None:
                self.progress.set_phase(PHASE_OPTIMIZER)
        except Exception as e:
            self._fail("optimizer_begin", e)

    def optimizer_end(self, *_hook_args: Any) -> None:
        """Also torch's global optimizer step post-hook as it is: ``(optimizer, args, kwargs)``
        are ignored."""
        if not self.enabled or self._opt_depth == 0:
            return
        try:
            self._opt_depth -= 1
            if self._opt_depth:
                return
            t = _now()
            if not self._opt_paused:  # paused: the closure's forward/backward never ended (it raised)
                if self.device is not None:
                    self.device.end(self._dslot_opt)
                self._opt += t - self._opt_t0
            if self._nvtx is not None:
                self._nvtx.pop_range()
            if self.progress is not None:
                self.progress.set_phase(PHASE_OTHER)
            if self._bwd_depth:
                self._resume_bwd(t)
            if self.boundary != "explicit":  # explicit: only stepwatch.step() ends a step
                self._pending_end = t
                self._pending_skipped = False
            if self._in_scaler:
                self._scaler_fired = True
        except Exception as e:
            self._fail("optimizer_end", e)

    def log(self, scalars: dict[str, Any]) -> None:
        """Attach scalars to the step in progress (or to the one that just ended)."""
        if not self.enabled:
            return
        try:
            self._scalars.update(scalars)
        except Exception as e:
            self._fail("log", e)

    def log_values(self, scalars: dict[str, Any], convert: Callable[[Any], Any]) -> None:
        """``stepwatch.log``'s values as the pipeline takes them: a float or int as it is (no
        call), anything else through ``convert``, then :meth:`log`. An error from ``convert``
        passes to the caller."""
        if not self.enabled:
            return
        out = {}
        for k, v in scalars.items():
            out[k] = v if type(v) is float or type(v) is int else convert(v)
        self.log(out)

    def work_begins(self) -> None:
        """Training work is about to start and a hook wants to attribute something to its step
        before timing it (FLOPs/tokens of a forward): a pending step end becomes final now."""
        if not self.enabled or self._pending_end is None:
            return
        try:
            self._start_work(_now())
        except Exception as e:
            self._fail("work_begins", e)


_STEP_WRAPPER: Any = None


def _step_wrapper_code() -> Any:
    """The code of torch's ``Optimizer.step`` wrapper (``profile_hook_step``'s), which runs the
    step hooks around every optimizer's ``step``."""
    global _STEP_WRAPPER
    if _STEP_WRAPPER is None:
        from torch.optim.optimizer import Optimizer

        _STEP_WRAPPER = Optimizer.profile_hook_step(lambda *a, **k: None).__code__
    return _STEP_WRAPPER


def nested_optimizer_step() -> bool:
    """An optimizer's ``step`` runs inside another's on this thread (Lookahead, SAM, ZeRO's shard
    optimizer): two of torch's step wrappers are on the stack."""
    code = _step_wrapper_code()
    f = sys._getframe(1)
    n = 0
    while f is not None:
        if f.f_code is code:
            n += 1
            if n > 1:
                return True
        f = f.f_back
    return False


def _other_threads_phase(name: str) -> None:
    """``stepwatch.phase()`` on a thread other than the training thread: not timed, said once. It
    ended the training thread's pending step from that thread (a value logged after
    ``optimizer.step()`` went to the next step), put its time in the training step's ``phases``,
    and, racing the step's end, turned the tracker off for the rest of the run."""
    from .._log import warn_once

    warn_once("phase.other_thread",
              "stepwatch: stepwatch.phase(%r) on a thread other than the training thread is not timed: a phase "
              "times the training loop's own work (its time is in the step's phases). Time another thread's work "
              "yourself and log it with stepwatch.log(name=seconds)", name)


def optimizer_step_running() -> bool:
    """An optimizer's ``step`` runs on this thread: torch's step wrapper is on the stack. Asked
    only where an optimizer phase is open with nothing pausing it (``_pause_opt``): no closure's
    forward, no step of a loop whose optimizer steps end, ever walks the stack for it."""
    code = _step_wrapper_code()
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is code:
            return True
        f = f.f_back
    return False


def _tracked(obj: Any) -> Any:
    return obj


# ``untracked(obj) -> obj``: a step's payload (a collector's ``take()`` result, which waits in the
# queue with its record) kept out of the cyclic GC's view where the C module is built, the object
# itself otherwise; see "The cyclic GC" in hooks/_ctracker.c. Only for objects that can never be
# part of a reference cycle.
try:  # the hot methods in C (hooks/_ctracker.c): the same behaviour, less time a step
    from ._ctracker import Core as _Core
    from ._ctracker import _bind
    from ._ctracker import untracked

    _bind(RawStep)
except ImportError:
    _Core = _PyCore
    untracked = _tracked


def cpu_items(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``convert`` (``_pipeline.loggable``) for :meth:`StepTracker.log_values`, with its first
    branch (a CPU ``torch.Tensor``: ``item()`` when that is a float) in C where hooks/_ctracker.c
    was built: no Python frame a logged value. ``convert`` itself otherwise, and for every other
    value. Imports torch."""
    try:
        from ._ctracker import CpuItem
    except ImportError:
        return convert
    import torch

    c = CpuItem()
    c.tensor, c.full = torch.Tensor, convert
    return c


class _Methods:
    """The tracker's methods that are not hot, the same over either core."""

    __slots__ = ()

    def __init__(
        self,
        emit: Callable[[RawStep], None],
        *,
        step_offset: int = 0,
        nvtx: Nvtx | None = None,
        mem_probe: Callable[[], int | None] | None = None,
        on_error: Callable[[str, BaseException], None] | None = None,
        progress: Any = None,
    ) -> None:
        self.enabled = True
        self._emit = emit
        # None unless NVTX is on: a disabled range is a method call per phase for nothing.
        self._nvtx = nvtx if nvtx is not None and nvtx.enabled else None
        self._mem_probe = mem_probe
        self._on_error = on_error
        # Extension points (training thread, cheap): collectors feed ``extras``; listeners run at
        # every step end with the number of the step that ended (captures start/stop there).
        self.collectors: list[Collector] = []
        self.listeners: list[Callable[[int], None]] = [self._first_end]
        # A progress board (``set_phase(code)``, ``set_step(n)``) read by the hang watchdog.
        self.progress = progress
        # Device-clock timing (hooks/device.py), attached once CUDA is in use; None on CPU.
        self.device: Any = None
        self._dslot_fwd = self._dslot_bwd = self._dslot_opt = -1
        self.step = step_offset
        self.boundary = "optimizer"
        self.in_data = 0  # depth of DataLoader fetches in progress
        self._t_start = _now()
        self._reset_step()
        self._prev_end: int | None = None  # end of the previous step (ns); None before any work
        self._pending_end: int | None = None
        self._pending_skipped = False
        self._step_open = False  # NVTX step range pushed
        # Nesting depths: only the outermost call of each kind is timed.
        self._fwd_depth = 0
        self._fwd_t0 = 0
        self._fwd_grad = True
        self._bwd_depth = 0
        self._bwd_t0 = 0
        self._opt_depth = 0
        self._opt_t0 = 0
        # Forward/backward run *inside* ``optimizer.step(closure)`` (Lightning, LBFGS): the
        # optimizer phase is paused around them so their time is not counted twice.
        self._opt_paused = 0
        self._fwd_paused_opt = False
        self._bwd_paused_opt = False
        self._ckpt_depth = 0
        self._ckpt_t0 = 0
        self._phase_depth: dict[str, int] = {}
        self._phase_t0: dict[str, int] = {}
        # Eval span bookkeeping.
        self._eval_open = False
        self._eval_t0 = 0
        # Where the training fetch after the open span started, its end (0: none yet, the span
        # runs to the work that closes it).
        self._eval_end = 0
        self._eval_calls = 0  # the open span's grad-disabled root calls
        self._eval_pulls = 0  # DataLoader fetches it took in (the one right before it, then its own)
        self._eval_pulled = 0  # their ns
        self._eval_fwd = 0  # its forwards' ns
        self._eval_bwd = 0  # its backwards' ns (_bwd_eval: the outermost backward now is one)
        self._bwd_eval = False
        # A no-grad call in eval mode of the model being trained judged it evaluation.
        self._eval_judged = False
        # Where its last call or fetch ended (its start, before one): an evaluation after the last
        # step ends there at shutdown (flush).
        self._eval_last = 0
        # Told how each span closed: True evaluation, False the step's own work (``on_eval_span``).
        self._span_judged: Callable[[bool], None] | None = None
        self._last_fetch_t0: int | None = None
        self._last_fetch_ns = 0
        self._iter_t0: int | None = None  # a DataLoader iterator made, its first fetch not yet ended
        self._iter_t1: int | None = None  # ... and when its iter() returned
        self._thread = threading.get_ident()  # the training thread (see the module's docstring)
        # GradScaler: did an optimizer step run inside scaler.step()?
        self._in_scaler = 0
        self._scaler_fired = False

    # -- internal ---------------------------------------------------------------------------

    def _fail(self, where: str, exc: BaseException) -> None:
        # State may be half-updated: stop tracking rather than emit wrong numbers.
        self.enabled = False
        if self._on_error is not None:
            self._on_error(f"tracker.{where}", exc)

    def _opt_stale(self) -> bool:
        """An optimizer step begins while one is open (``_opt_depth`` > 1 now). Nested (an
        optimizer that steps another, as Lookahead does): two of torch's step wrappers are on the
        stack. Else the open one is stale: its ``step()`` raised (an OOM the loop caught and
        skipped), and torch runs no post-hook then (:meth:`_opt_raised`); this step's phase opens
        in its place. It used to stay open for good, and no later step ended."""
        if nested_optimizer_step():
            return False
        self._opt_raised(_now(), False)
        self._opt_depth = 1
        return True

    def _opt_raised(self, t: int, reopen: bool) -> None:
        """The open optimizer phase is stale: its ``step()`` raised and the loop went on (an OOM
        it caught and skipped, a step pre-hook of the job's that refused the step); torch runs no
        post-hook then, and no hook of stepwatch's sees the exception. The first work that finds
        the phase open and no optimizer step running (:func:`optimizer_step_running`) tells, at
        ``t``: a forward or backward (``_pause_opt``), the next optimizer step (``_opt_stale``),
        a checkpoint. (The phase used to stay open until then: the loop's work after the failed
        step was ``optimizer_s``, and the failed iteration and the next were one record.)

        The phase is dropped: when the step raised is not known, so none of its time is
        ``optimizer_s`` (it is ``other_s``). Under the optimizer boundary the step the failed call
        was to end ends where that call began (``_opt_t0``; where a closure raised, for
        ``step(closure)``), marked ``skipped`` (no update was made, or not all of it): the loop's
        work after it is the next step's, as after any step, and so is the batch fetched since
        (the next step's data wait). When more was fetched since than that batch (an epoch's
        end: its loader's last fetch, the next ``iter()``), that time is in no known place: the
        step ends where that batch's fetch began, or at ``t``, rather than count a fetch after
        its end. A step that already ended (``GradScaler.step``'s end, seeing no optimizer step
        finish; ``stepwatch.step()``), and any under the explicit boundary: the phase is dropped,
        nothing more. ``reopen``: the work at ``t`` is inside a step (a forward, a backward),
        whose NVTX range opens again. Never in a loop whose optimizer steps end."""
        t_end = self._opt_t0
        self._drop_opt(True)
        prev = self._prev_end
        if self.boundary == "explicit" or prev is None or t_end < prev or self._pending_end is not None:
            return
        lf = self._last_fetch_t0
        moved = self._last_fetch_ns if lf is not None and lf >= t_end else 0
        if self._data - moved + self._fwd + self._bwd + self._opt > t_end - prev - self._eval - self._ckpt - self._own:
            t_end = lf if moved else t  # type: ignore[assignment]
        # An eval span open now opened after the failed call (the optimizer step closed any before
        # it): it goes on into the next step.
        span = self._eval_open
        self._eval_open = False
        self._data -= moved
        self._finalize(t_end, True)
        self._data += moved
        self._eval_open = span
        if reopen:
            self._start_work(t)

    def _drop_opt(self, cancel: bool = False) -> None:
        """The open optimizer phase is stale (see :meth:`_opt_stale`), or began inside the
        backward ending now and raised out of it (torch runs no post-hook): it is dropped; in a
        backward, its time is the backward's (:meth:`_pause_bwd`). ``cancel``: its device
        interval is given up (``_opt_raised``: it would run to now, past the raise)."""
        if not self._opt_paused:
            if self.device is not None:
                give_up = getattr(self.device, "cancel", None) if cancel else None
                if give_up is not None:
                    give_up(self._dslot_opt)
                else:
                    self.device.end(self._dslot_opt)
            if self._nvtx is not None:
                self._nvtx.pop_range()
        self._opt_depth = 0

    def _pause_bwd(self, t: int) -> None:
        """An optimizer step begins inside an open backward (PyTorch's "optimizer step in backward":
        one optimizer per parameter, stepped from ``register_post_accumulate_grad_hook``): the
        backward's segment so far is backward time, the step optimizer time (it was both: the
        phases came to more than ``step_s``). The backward that ran it ends the step."""
        self._bwd += t - self._bwd_t0
        self._bwd_spans.append((self._bwd_t0, t))
        self._bwd_t0 = t  # a step that raises never resumes the backward: its time is then the backward's, once
        if self.device is not None:
            self.device.end(self._dslot_bwd)

    def _resume_bwd(self, t: int) -> None:
        self._bwd_t0 = t
        if self.device is not None:
            self._dslot_bwd = self.device.begin(PHASE_BACKWARD)
        if self.progress is not None:
            self.progress.set_phase(PHASE_BACKWARD)

    def _pause_opt(self, t: int) -> bool:
        """A forward/backward starts inside the optimizer phase: close the optimizer's segment.
        One on the training thread that finds the phase open with nothing pausing it (no
        closure's) and no optimizer step running comes after a step that raised: the phase is stale
        (:meth:`_opt_raised`), nothing to pause. (A closure's forward finds it paused already:
        no look at the stack.)"""
        if not self._opt_depth:
            return False
        self._opt_paused += 1
        if self._opt_paused == 1:
            if threading.get_ident() == self._thread and not optimizer_step_running():
                self._opt_paused = 0
                self._opt_raised(t, True)
                return False
            self._opt += t - self._opt_t0
            if self.device is not None:
                self.device.end(self._dslot_opt)
        return True

    def _resume_opt(self, t: int) -> None:
        self._opt_paused = max(self._opt_paused - 1, 0)
        if self._opt_paused == 0 and self._opt_depth:
            self._opt_t0 = t
            if self.device is not None:
                self._dslot_opt = self.device.begin(PHASE_OPTIMIZER)
            if self.progress is not None:
                self.progress.set_phase(PHASE_OPTIMIZER)

    def pause_optimizer(self) -> bool:
        """``optimizer.step(closure)`` enters its closure: the closure is not the optimizer's own
        work. Returns whether the phase was paused (call :meth:`resume_optimizer` then)."""
        if not self.enabled:
            return False
        try:
            # _pause_opt's, without its look for a stale phase: a closure runs inside the step
            t = _now()
            if not self._opt_depth:
                return False
            self._opt_paused += 1
            if self._opt_paused == 1:
                self._opt += t - self._opt_t0
                if self.device is not None:
                    self.device.end(self._dslot_opt)
            return True
        except Exception as e:
            self._fail("pause_optimizer", e)
            return False

    def resume_optimizer(self) -> None:
        if not self.enabled:
            return
        try:
            self._resume_opt(_now())
        except Exception as e:
            self._fail("resume_optimizer", e)

    def mark_skipped(self, skipped: Any) -> None:
        """After ``GradScaler.step`` of an optimizer that skips its own update (fused or
        capturable Adam/AdamW/SGD: the scaler hands it ``found_inf`` and calls its step, so an
        optimizer step ran whatever the gradients): whether it skipped, as a bool, or as a
        device copy the pipeline reads (``cuda_ext.Pending``). It marks the step that optimizer
        step ends (pending) or, under the explicit boundary, the one ``stepwatch.step()`` ends."""
        if not self.enabled or skipped is None or skipped is False:
            return
        try:
            if self._pending_end is not None or self.boundary == "explicit":
                self._pending_skipped = skipped
        except Exception as e:
            self._fail("mark_skipped", e)

    def scaler_begin(self) -> int:
        if not self.enabled:
            return 0
        self._in_scaler += 1
        self._scaler_fired = False
        return _now()

    def scaler_end(self, t0: int) -> None:
        """After ``GradScaler.step``: no optimizer step inside means the step was skipped."""
        if not self.enabled or not t0:
            return
        try:
            self._in_scaler = max(self._in_scaler - 1, 0)
            if self._in_scaler or self._scaler_fired:
                return
            t = _now()
            if self._prev_end is None:
                self._start_work(t0)
            self._opt += t - t0
            if self.boundary != "explicit":
                # Another optimizer of this step updated (one scaler, two optimizers, the NaN in
                # one's gradients): the step is not skipped, half the model moved.
                updated = self._pending_end is not None and not self._pending_skipped
                self._pending_end = t
                if updated:
                    return
            self._pending_skipped = True  # explicit: the step stepwatch.step() ends is marked skipped
        except Exception as e:
            self._fail("scaler_end", e)

    # -- checkpoints ---------------------------------------------------------------------------

    def checkpoint_begin(self) -> int:
        if not self.enabled:
            return 0
        try:
            self._ckpt_depth += 1
            if self._ckpt_depth > 1:
                return 0
            t = _now()
            if self._opt_depth and not self._opt_paused and not optimizer_step_running():
                self._opt_raised(t, False)  # a save after an optimizer step that raised
                t = _now()
            if self._pending_end is not None:
                self._finalize(self._pending_end, self._pending_skipped)
                t = _now()  # after the step end's listeners (see _begin_work)
            if self._prev_end is None:
                # A save before any work (the initial weights): it opens step 0, as an evaluation
                # does; its time is taken out of that step, so it must lie inside it.
                self._start_work(t)
            if self._eval_open:
                self._close_eval(t)
            # A save between iter(loader) and its first fetch: that fetch is timed from its own
            # start, not from the iterator's (the save's time was checkpoint_s and data_wait_s
            # both, and the step's parts came to more than step_s).
            self._iter_t0 = None
            self._ckpt_t0 = t
            if self.progress is not None:
                self.progress.set_phase(PHASE_CHECKPOINT)
            return t
        except Exception as e:
            self._fail("checkpoint_begin", e)
            return 0

    def checkpoint_end(self, t0: int, nbytes: int | None = None) -> None:
        """``nbytes``: what the save wrote, when known; one unknown save makes the step's total unknown."""
        if not self.enabled:
            return
        try:
            self._ckpt_depth = max(self._ckpt_depth - 1, 0)
            if t0:
                first = self._ckpt == 0
                self._ckpt += _now() - t0
                if first:
                    self._ckpt_bytes = nbytes
                elif self._ckpt_bytes is not None:
                    self._ckpt_bytes = None if nbytes is None else self._ckpt_bytes + nbytes
                if self.progress is not None:
                    self.progress.set_phase(PHASE_OTHER)
        except Exception as e:
            self._fail("checkpoint_end", e)

    # -- user API --------------------------------------------------------------------------------

    def phase_begin(self, name: str) -> None:
        if not self.enabled:
            return
        if threading.get_ident() != self._thread:
            _other_threads_phase(name)
            return
        try:
            depth = self._phase_depth.get(name, 0) + 1
            self._phase_depth[name] = depth
            if depth > 1:
                return
            t = self._begin_work()
            self._phase_t0[name] = t
            if self._nvtx is not None:
                self._nvtx.push(name)
        except Exception as e:
            self._fail("phase_begin", e)

    def phase_end(self, name: str) -> None:
        if not self.enabled or threading.get_ident() != self._thread:
            return
        try:
            depth = self._phase_depth.get(name, 0) - 1
            if depth < 0:
                return
            if depth:
                self._phase_depth[name] = depth
                return
            # closed: its name goes (one entry per name ever used grew without bound with
            # phase(f"p{i}"), 18.7 MB over 200k steps)
            del self._phase_depth[name]
            d = _now() - self._phase_t0.pop(name)
            if self._phases is None:
                self._phases = {}
            self._phases[name] = self._phases.get(name, 0) + d
            if self._nvtx is not None:
                self._nvtx.pop_range()
        except Exception as e:
            self._fail("phase_end", e)

    def end_step(self) -> None:
        """Explicit boundary: finalize the pending step, or end one now. From the first call on,
        only this ends steps (``boundary = "explicit"``): optimizer steps and backwards no longer
        do, so a loop whose iteration steps two optimizers in turn, each after its own forward
        (a GAN), gets one step an iteration by calling ``stepwatch.step()`` at its end."""
        if not self.enabled:
            return
        try:
            first = self.boundary != "explicit"
            self.boundary = "explicit"
            if self._pending_end is not None:
                self._finalize(self._pending_end, self._pending_skipped)
            elif first and self.__dict__.get("_auto_ended") and self._fwd and not self._bwd and not self._opt:
                # The first call, after an optimizer step ended the iteration's last step: the
                # forward-only work since (DCGAN's sample images) is no step of its own; it goes
                # on into the next. (An evaluation alone there stays a record, as before.)
                pass
            else:
                if self._prev_end is None:
                    # Nothing hooked ran yet: the first explicit step counts from the session start.
                    self._prev_end = self._t_start
                self._finalize(_now(), self._pending_skipped)
        except Exception as e:
            self._fail("end_step", e)

    def _first_end(self, ended: int) -> None:
        """One-shot listener: a step ended by the automatic boundary (``end_step`` reads it)."""
        self.__dict__["_auto_ended"] = True
        self.remove_listener(self._first_end)

    def flush(self) -> None:
        """At shutdown: a pending step is complete; a step with no optimizer yet is dropped, but
        evaluation, checkpoints, user phases and logged values after the last step are kept in one
        *tail* record (no training step: every training phase and ``step_s`` are 0) so that the
        run's totals count them.
        A save still open (a SIGTERM, a preemption, whose shutdown runs while the training thread
        is inside ``torch.save``) is cut short here: its time so far is the tail's
        ``checkpoint_s``, its bytes unknown, and the tail's extras say ``checkpoint_interrupted``
        (it was in no record: a job killed mid-save showed no save at all, while an interrupt,
        whose exception ends the save first, showed it)."""
        if not self.enabled:
            return
        try:
            if self._pending_end is not None:
                self._finalize(self._pending_end, self._pending_skipped)
            t = _now()
            if self._eval_open:
                # An evaluation after the last step ends at its last call or fetch: what the script
                # does after it until shutdown (plots, uploads, wandb.finish(), the DataLoader
                # workers' exit) is no evaluation (it was, up to the thirty-ninth session).
                self._close_eval(min(max(self._eval_last, self._eval_t0), t))
            cut = False
            if self._ckpt_depth > 0 and self._ckpt_t0:
                cut = True
                self._ckpt_depth = 0
                self._ckpt += max(t - self._ckpt_t0, 0)
                self._ckpt_bytes = None  # what it wrote before it was cut short: unknown
            # A user phase or a logged value after the last step (an export, a final metric,
            # whose start ended that step) is kept too: they went with the dropped step, silently.
            if self._eval or self._ckpt or self._phases or self._scalars:
                self._emit_tail(t, cut)
            if self._step_open:
                self._step_open = False
                if self._nvtx is not None:
                    self._nvtx.pop_range()
        except Exception as e:
            self._fail("flush", e)

    def _emit_tail(self, t_end: int, cut: bool = False) -> None:
        extras: dict[str, Any] = {}
        if self._ckpt:
            extras["checkpoint_bytes"] = self._ckpt_bytes
        if cut:
            extras["checkpoint_interrupted"] = True
        self._emit(RawStep(self.step, t_end, 0, 0, 0, 0, 0, self._eval, self._ckpt, self._phases or {}, self._scalars,
                           False, None, extras, True))
        self._reset_step()

    def remove_listener(self, fn: Callable[[int], None]) -> None:
        """Take ``fn`` off ``listeners``, safe from inside a listener (a one-shot one): the list
        is replaced, not changed in place, so the step's end walking the old one calls every
        listener after it (an in-place removal skipped the next one)."""
        self.listeners = [f for f in self.listeners if f != fn]  # a bound method is made anew each time

    def exclude(self, ns: int) -> None:
        """Time stepwatch itself spent inside the step (one-off discovery): kept out of step_s.
        An iterator made before it does not start an eval span (that would count it twice). A
        step whose end is pending ended before this time began: it is final now, and the time is
        kept out of the next step (an optimizer made between two models' loops scans). The user's
        open phases (``stepwatch.phase``) leave it out too.

        The clock of an open eval span (that no training fetch has ended yet), and of the fetch a
        span opening next would start at, pauses for it (their times move on by ``ns``): an
        evaluation forward's FLOP count, between its fetch and its call, was kept out of ``eval_s``
        and out of ``step_s`` both, and the step's parts came to more than ``step_s``."""
        self._iter_t0 = None
        if self._pending_end is not None and not self._eval_open and self.enabled:
            try:
                self._finalize(self._pending_end, self._pending_skipped)
            except Exception as e:  # never raise into the training loop
                self._fail("exclude", e)
                return
        if self._eval_open and not self._eval_end:  # after a training fetch ended it: not the span's
            self._eval_t0 += ns
        if self._last_fetch_t0 is not None:
            self._last_fetch_t0 += ns
        if self._phase_t0:  # the user's open phases (a FLOP count inside "fwd")
            # Never past the work's end: a phase opened while it ran (another thread's) was moved
            # into the future, and its time came out negative.
            now = _now()
            for name, t0 in list(self._phase_t0.items()):
                self._phase_t0[name] = min(t0 + ns, now)
        # The phase whose clock runs leaves it out too: a FLOP count of a root's first call made
        # inside a backward (a checkpointed model's recompute) was kept out of step_s but stayed
        # in backward_s. The innermost clock runs: an optimizer's unless a closure paused it, a
        # backward's unless an optimizer inside it paused it, a forward's (timed outside a backward).
        if self._fwd_depth and not self._bwd_depth:
            self._fwd_t0 += ns
        elif self.__dict__.get("_compiled") is not None and not self.__dict__["_compiled"].closed:
            self.__dict__["_compiled"].t0 += ns  # a compiled function's forward (the first backward's scan)
        elif self._opt_depth and not self._opt_paused:
            self._opt_t0 += ns
        elif self._bwd_depth:
            self._bwd_t0 += ns
        if self._prev_end is not None:
            self._own += ns

    def _no_work_since(self, t: int) -> bool:
        """No training work (a step's end, a forward, a backward, an optimizer step) began after
        ``t``, and a step began before it: an iterator made at ``t`` is the next fetch's."""
        return (self._prev_end is not None and t >= self._prev_end and t >= self._fwd_t0
                and t >= self._bwd_t0 and t >= self._opt_t0)

    def iterator_made(self, t0: int, t1: int | None = None) -> None:
        """A DataLoader iterator was made (``iter(loader)``, from ``t0`` to ``t1``; its workers
        start there): an eval span that its first fetch opens or joins starts at ``t0``, and a
        training fetch's wait counts ``t1 - t0`` too, if no training work ran in between
        (``data_end``). Another thread's iterator is none of the tracker's."""
        if self.enabled and threading.get_ident() == self._thread:
            p0, p1 = self._iter_t0, self._iter_t1
            if p0 is not None and p1 is not None and t1 is not None and self._no_work_since(p0):
                # Another iterator made since the last training work, its first fetch still to
                # come: ``zip(labeled, unlabeled)``. Both iter() times are the first fetch's wait
                # (the first loader's start, its workers, was other_s): from the first's start,
                # with the second's own time added to the first's.
                self._iter_t1 = p1 + (t1 - t0)
                return
            self._iter_t0 = t0
            self._iter_t1 = t1

    def set_step(self, n: int) -> None:
        """The next step is numbered ``n``. With a step's end pending (``set_step`` right after
        ``optimizer.step()``, as a loop that counts its own steps calls it), that step keeps its
        number and the renumbering waits for its end to be final (it numbered the step that had
        just ended: every record one off)."""
        n = int(n)
        if self._pending_end is None or not self.enabled:
            self.step = n
            return
        first = self.__dict__.get("_next_number") is None
        self.__dict__["_next_number"] = n  # the last call wins
        if first:
            self.listeners = [self._renumber, *self.listeners]  # before the others see the next step

    def _renumber(self, ended: int) -> None:
        """One-shot listener of :meth:`set_step`."""
        n = self.__dict__.pop("_next_number", None)
        self.remove_listener(self._renumber)
        if n is not None:
            self.step = n
            if self.progress is not None:
                self.progress.set_step(n)

    def eval_span_is_evaluation(self) -> None:
        """The open eval span is evaluation whatever its number of calls and its backwards: it
        called a model an optimizer steps, in eval mode, without grad (the root call's
        judgement). Not a teacher's few calls, nor a search of the step's input gradients
        (``_span_is_work``)."""
        if self.enabled and self._eval_open:
            self._eval_judged = True

    # -- torch.compile'd functions (hooks/install.py ``_CompiledCall``) -------------------------

    def compiled_begin(self, grad: bool, judged: bool = False) -> "_CompiledSpan | None":
        """A ``torch.compile``'d function is called at the top of the loop (hooks/install.py's
        ``_CompiledCall`` calls this before the function runs, outside dynamo's tracing). dynamo
        inlines the model's call inside it, which no root call sees: the call is the step's
        training work, as a root's forward. A pending step end is final now (a value logged
        after the call is this step's, not the one before's), and the call's time up to the
        first phase timed inside it is ``forward_s``: the first backward (a compiled step's
        ``loss.backward()``, which runs eagerly), or the call's end (see :meth:`_compiled_part`).
        ``grad`` False (grad disabled, or the trained model in eval mode): an evaluation call, as
        a root's (``judged``: evaluation however few its calls, ``eval_span_is_evaluation``).

        Not the tracker's (None): a call inside a root's forward (a compiled attention function
        in the model), a backward, a fetch, a checkpoint, another compiled call, or the
        optimizer's own step (a compiled Newton-Schulz in Muon's ``step``): that work's own time.
        Inside ``optimizer.step(closure)``'s closure it pauses the optimizer phase, as a forward
        does. Runs once per call, never in a loop without compiled functions."""
        if (not self.enabled or self.in_data or self._fwd_depth or self._bwd_depth or self._ckpt_depth
                or (self._opt_depth and not self._opt_paused) or self.__dict__.get("_compiled") is not None):
            return None
        try:
            t = self._begin_work()
            span = _CompiledSpan(self, t, grad)
            span.paused_opt = self._pause_opt(t) if self._opt_depth else False
            if grad:
                if self._eval_open:
                    self._close_eval_for_work(t)
                self._last_fetch_t0 = None
                real = span.real = self.device
                if real is not None:
                    span.slot = real.begin(PHASE_FORWARD)
                self.device = span  # until the first phase inside the call begins (_CompiledSpan.begin)
            else:
                self._open_eval(t)
                self._eval_calls += 1
                span.calls = self._eval_calls
                if judged:
                    self.eval_span_is_evaluation()
            span.data0, span.ckpt0 = self._data, self._ckpt
            self.__dict__["_compiled"] = span
            if self.progress is not None:
                self.progress.set_phase(PHASE_FORWARD if grad else PHASE_EVAL)
            return span
        except Exception as e:
            self._fail("compiled_begin", e)
            return None

    def compiled_end(self, span: "_CompiledSpan") -> None:
        """The compiled function's call returned (or raised): the span of :meth:`compiled_begin`
        closes; its forward, if no phase inside it closed that first, ends here."""
        if self.__dict__.get("_compiled") is span:
            del self.__dict__["_compiled"]
        if self.device is span:
            self.device = span.real
        if not self.enabled:
            return
        try:
            t = _now()
            if span.grad:
                self._compiled_part(span, t, True)
            elif (self._eval_open and self._eval_calls == span.calls and self.step == span.step
                  and not span.closed):
                span.closed = True
                self._eval_fwd += max(t - span.t0, 0)
                self._eval_last = t
            if span.paused_opt:
                self._resume_opt(t)
            elif self.progress is not None:
                self.progress.set_phase(PHASE_OTHER)
        except Exception as e:
            self._fail("compiled_end", e)

    def _compiled_part(self, span: "_CompiledSpan", t: int, counts: bool) -> None:
        """A grad-enabled compiled call's forward ends at ``t``: where the first phase inside it
        begins, or where the call returns. ``counts``: its time is ``forward_s``, when that phase
        is a backward or there was none. Not when it is a root's forward (the call ran eagerly,
        ``set_stance("force_eager")``, a fallback: the model's call is timed as ever) nor an
        optimizer step (PyTorch's compiled optimizer step recipe: dynamo's entry before the
        step's hooks, no forward). The fetches and checkpoints inside it are their own time, and a
        step that ended inside it (several steps in one compiled call) is not given it."""
        if span.closed:
            return
        span.closed = True
        if span.real is not None:
            span.real.end(span.slot)
        if not counts or self.step != span.step:
            return
        ns = max(t - span.t0 - (self._data - span.data0) - (self._ckpt - span.ckpt0), 0)
        done = self.__dict__.get("_compiled_fwd")
        before = done[1] if done is not None and done[0] == self.step else 0
        span.rootless = self._fwd == before  # no root's forward timed in this step so far
        self._fwd += ns
        self.__dict__["_compiled_fwd"] = (self.step, before + ns)
        span.counted = ns

    def compiled_forward_ns(self) -> int:
        """The part of this step's ``forward_s`` (ns, so far) that compiled functions' calls make."""
        done = self.__dict__.get("_compiled_fwd")
        return done[1] if done is not None and done[0] == self.step else 0

    def phase_now(self) -> str:
        """The phase the training thread is in, by name (for a report of what was running when an
        exception escaped: a phase the exception left never ended)."""
        if self._bwd_depth:
            return "backward"
        if self._fwd_depth:
            return "forward" if self._fwd_grad else "eval"
        span = self.__dict__.get("_compiled")
        if span is not None:
            return "forward" if span.grad else "eval"
        if self._opt_depth:
            return "optimizer"
        if self._ckpt_depth:
            return "checkpoint"
        return "other"



class _CompiledSpan:
    """One top-level call of a ``torch.compile``'d function (:meth:`_Methods.compiled_begin`).

    While its forward runs (grad enabled, no phase inside it begun yet) it is the tracker's
    ``device``: the forward, backward and optimizer phases all call ``device.begin(code)`` as they
    begin (hooks/_ctracker.c as the Python core), so the first phase inside the compiled call
    tells it where the call's forward ends, with no check added to those hot methods. It then
    hands the real device timer (or None, on CPU) back and begins that phase's interval there."""

    __slots__ = ("tr", "t0", "step", "grad", "real", "slot", "closed", "paused_opt", "data0", "ckpt0",
                 "calls", "counted", "rootless")

    def __init__(self, tr: Any, t0: int, grad: bool) -> None:
        self.tr = tr
        self.t0 = t0
        self.step = tr.step
        self.grad = grad
        self.real: Any = None  # the device timer the span stands in for
        self.slot: Any = -1  # its interval of the call's forward
        self.closed = False  # its forward has ended (the first phase inside it began)
        self.paused_opt = False
        self.data0 = self.ckpt0 = 0
        self.calls = 0  # the eval span's calls with this one (no grad)
        self.counted = 0  # ns it added to forward_s
        self.rootless = False  # ... in a step with no root's forward timed before it

    def begin(self, code: int) -> Any:
        """``device.begin``: the first phase inside the compiled call begins."""
        tr = self.tr
        real = self.real
        try:
            if tr.device is self:
                tr.device = real
            tr._compiled_part(self, _now(), code == PHASE_BACKWARD)
        except Exception as e:  # inside a hot method: never raise there
            tr._fail("compiled_part", e)
        return real.begin(code) if real is not None else -1

    def end(self, slot: Any) -> None:
        """``device.end``: handed on (no interval ends while the span stands in for the timer)."""
        if self.real is not None:
            self.real.end(slot)


class StepTracker(_Methods, _Core):  # type: ignore[misc,valid-type]
    """Lives on the training thread. Every public method is cheap and never raises. Its hot
    methods are ``_Core``'s: C where hooks/_ctracker.c was built, else :class:`_PyCore`."""


class PyStepTracker(_Methods, _PyCore):
    """The tracker on the Python core whatever was built: what a job without the C extension
    runs (tests run both and compare them)."""
