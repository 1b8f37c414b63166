"""The feature contract: what a feature is, and the one hub it plugs in through.

A feature package (``metrics/``, ``comm/``, ``telemetry/``, ``memory/``, ``capture/``, a sink
such as ``exporters/mlflow.py``) exposes ``install(hub: Hub) -> Feature | None``, called once on
the training thread at init, each in its own guard (one that raises is reported and left off).
It registers what it measures on the hot path and what it does per record off it through the
:class:`Hub`, and returns what the session keeps until shutdown (None: nothing to keep, e.g. off
here). It touches nothing else of the session.

Threads. ``add_collector``, the listeners and the observers run on the training thread (cheap,
never raising: a failure is reported and the hook is dropped); enrichers, detectors and a
feature's ``collect``/``on_findings`` run on the pipeline's thread (:mod:`stepwatch._pipeline`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

from .record import Finding, StepRecord

if TYPE_CHECKING:
    from .config import Config
    from .context import RunContext
    from .hooks.install import Instrumentation
    from .hooks.phases import Collector, StepTracker
    from ._pipeline import Pipeline


@runtime_checkable
class Feature(Protocol):
    """What ``install`` returns.

    * ``name``: the feature's key in run.json's ``features``.
    * ``stop()``: at shutdown, after the final pass, while the exporters flush; undo patches,
      stop threads and processes. Must not block for long.
    * ``status() -> dict | bool``: what run.json's ``features[name]`` says (an omitted ``status``
      reads as ``True``).

    Optional, looked up by name on the pipeline's thread once per pass:

    * ``collect(records) -> (samples, findings)``: every pass, with the records of the pass (maybe
      none): telemetry samples for the exporters and findings of its own.
    * ``on_findings(findings)``: every pass, with every finding of the pass after rate limiting
      (captures act on them).

    A feature that is also an :class:`~stepwatch.exporters.base.Exporter` joins the exporters.
    """

    name: str

    def stop(self) -> None: ...

    def status(self) -> dict[str, Any] | bool: ...


class Collects(Protocol):
    def collect(self, records: list[StepRecord]) -> tuple[list[dict[str, Any]], list[Finding]]: ...


class ActsOnFindings(Protocol):
    def on_findings(self, findings: list[Finding]) -> None: ...


class Hub:
    """Handed to every feature's ``install``: the session's extension points, and nothing more."""

    def __init__(
        self,
        *,
        config: "Config",
        ctx: "RunContext",
        tracker: "StepTracker",
        instrumentation: "Instrumentation",
        pipeline: "Pipeline",
        pid: int,
        files_ok: bool = True,
    ) -> None:
        self._files_ok = files_ok
        self._config = config
        self._ctx = ctx
        self._tracker = tracker
        self._inst = instrumentation
        self._pipeline = pipeline
        self._pid = pid

    # -- what a feature reads ----------------------------------------------------------------------

    @property
    def config(self) -> "Config":
        return self._config

    @property
    def ctx(self) -> "RunContext":
        """Rank, world size, run id and run directory (rank and world size are refreshed from
        torch.distributed when the exporters open)."""
        return self._ctx

    @property
    def files_ok(self) -> bool:
        """False when the run directory cannot be written (said once, at init: a feature's own
        failed writes there need no warning of their own)."""
        return self._files_ok

    @property
    def pid(self) -> int:
        """The process the session started in (a forked child is not it)."""
        return self._pid

    @property
    def step(self) -> int:
        """The training thread's step number now."""
        return self._tracker.step

    @property
    def step_pending(self) -> bool:
        """The step numbered ``step`` has ended (its optimizer step ran) and its record is not
        made yet: it is made when the next step's work begins, or at shutdown."""
        return self._tracker._pending_end is not None

    @property
    def last_step_trained(self) -> int:
        """The newest step whose work has ended: the pending one (its record not made yet), else
        the last one made (``step - 1``; -1 before any)."""
        return self.step if self.step_pending else self.step - 1

    @property
    def between_steps(self) -> bool:
        """No step's work is under way: the last step has ended (its end may be pending) and the
        next one's first fetch, forward or backward has not begun."""
        tr = self._tracker
        return tr._pending_end is not None or not tr._step_open

    def end_pending_step(self) -> None:
        """Training thread: the step whose end is pending (:attr:`step_pending`) is made final now,
        its record queued, rather than at the next step's first work (a sink whose run is about
        to end: W&B's ``Run.finish``). Nothing elsewhere, or with none pending."""
        tr = self._tracker
        if tr.enabled and tr._pending_end is not None and self.on_training_thread():
            tr._finalize(tr._pending_end, tr._pending_skipped)

    def on_training_thread(self) -> bool:
        """Whether the caller is the thread whose steps are tracked."""
        return threading.get_ident() == self._tracker._thread

    def phase_now(self) -> str:
        """The phase the training thread is in (see ``StepTracker.phase_now``)."""
        return self._tracker.phase_now()

    @property
    def final_pass(self) -> bool:
        """True while shutdown's last pipeline pass runs (a feature may wait there, bounded)."""
        return self._pipeline.final_pass

    @property
    def tracker(self) -> "StepTracker":
        """The step tracker itself, for what has no method here; prefer the methods."""
        return self._tracker

    # -- training thread ---------------------------------------------------------------------------

    def add_collector(self, collector: "Collector") -> None:
        """``take()`` at every step end; its value lands in the step's ``extras[collector.name]``."""
        self._tracker.collectors.append(collector)

    def add_listener(self, fn: Callable[[int], None]) -> None:
        """``fn(step)`` at every step end, with the number of the step that ended."""
        self._tracker.listeners.append(fn)

    def remove_listener(self, fn: Callable[[int], None]) -> None:
        """Safe from inside the listener itself (a one-shot listener)."""
        self._tracker.remove_listener(fn)

    def add_forward_observer(self, fn: Callable[[Any, Any, Any], None]) -> None:
        """``fn(module, args, kwargs)`` for each root module's forward, before the phase opens."""
        self._inst.forward_observers.append(fn)

    def remove_forward_observer(self, fn: Callable[[Any, Any, Any], None]) -> None:
        """Safe from inside the observer itself (a one-shot observer)."""
        self._inst.remove_observer("forward", fn)

    def add_optimizer_observer(self, fn: Callable[[Any], None]) -> None:
        """``fn(optimizer)`` for each optimizer step, before the phase opens."""
        self._inst.optimizer_observers.append(fn)

    def add_manual_update_observer(self, fn: Callable[[Any], None]) -> None:
        """In a loop without a torch optimizer (a manual update, ``p.data.add_(p.grad, ...)``):
        ``fn(params)`` at the end of each outermost backward, with the gradients as the update
        will find them; ``params`` stands for the optimizer there is not (its ``param_groups``
        hold the roots' parameters that take a gradient). Never called once an optimizer steps."""
        self._inst.manual_update_observers.append(fn)

    def add_reevaluation_observer(self, fn: Callable[[bool], None]) -> None:
        """``fn(True)`` before, ``fn(False)`` after each call of an optimizer's closure after the
        first in one step (LBFGS evaluates the same batch again): the forwards between are the
        step's work again, not more of its data."""
        self._inst.reevaluation_observers.append(fn)

    def add_recompute_observer(self, fn: Callable[[Any, Any, Any], None]) -> None:
        """``fn(module, args, kwargs)`` for each root call inside a backward: the recompute of a
        root checkpointed from the loop (``checkpoint(model, x)``), the backward's work."""
        self._inst.recompute_observers.append(fn)

    def add_eval_span_listener(self, fn: Callable[[bool], None]) -> None:
        """``fn(evaluation)`` when a span of grad-disabled or eval-mode root calls closes: True
        when it was evaluation (``eval_s``), False when it was the step's own work (a teacher, a
        model trained in eval mode). Training thread; a rare path, never every step."""
        tr = self._tracker
        before = tr._span_judged
        if before is None:
            tr._span_judged = fn
        else:
            def both(evaluation: bool) -> None:
                before(evaluation)
                fn(evaluation)

            tr._span_judged = both

    def add_exception_observer(self, fn: Callable[[str, BaseException], None]) -> None:
        """``fn(phase, exc)`` for an exception passing through a hooked phase, before it goes on."""
        self._inst.exception_observers.append(fn)

    def remove_exception_observer(self, fn: Callable[[str, BaseException], None]) -> None:
        self._inst.remove_observer("exception", fn)

    @property
    def progress(self) -> Any:
        """The progress board, or None (no hang watchdog)."""
        return self._tracker.progress

    def set_progress(self, board: Any) -> None:
        """A progress board (``set_phase(code)``, ``set_step(n)``) the hang watchdog reads."""
        self._tracker.progress = board

    def exclude(self, ns: int) -> None:
        """Time stepwatch itself spent inside the step (a one-off count): kept out of ``step_s``."""
        self._tracker.exclude(ns)

    def set_device(self, name: str | None) -> None:
        """The accelerator's name, once known (``ctx.device``: the console and run.json show it)."""
        self._ctx.device = name

    # -- pipeline thread ---------------------------------------------------------------------------

    def add_enricher(self, enricher: Any, *, first: bool = False) -> None:
        """``enrich(record, extras, *, force) -> bool``; see :meth:`Pipeline.add_enricher`."""
        self._pipeline.add_enricher(enricher, first=first)

    def add_detector(self, detector: Any) -> None:
        """``observe(record) -> list[Finding]``, every record in order (``observe_many(records)``
        too, optionally: a pass's records in one call); see :meth:`Pipeline.add_detector`."""
        self._pipeline.add_detector(detector)

    # -- any thread --------------------------------------------------------------------------------

    def report_error(self, where: str, exc: BaseException) -> None:
        """An internal failure: counted in run.json, logged once, an ``internal_error`` finding.
        The caller disables what failed."""
        self._pipeline.report_error(where, exc)
