"""Weights & Biases: when this process has an active run (``wandb.run``), step records go into it
as ``stepwatch/<field>`` with ``stepwatch/step`` (the optimizer step) as their x-axis, and
findings as the ``stepwatch/findings`` table. No setting needed; ``STEPWATCH_WANDB=0`` turns it off.

Never ``step=``: W&B drops a row whose ``step=`` does not increase, and every ``wandb.log``
advances the run's own step (``_step``). So each run gets ``define_metric("stepwatch/*",
step_metric="stepwatch/step")`` and rows without ``step=``: stepwatch's rows advance ``_step``
too (see docs/sinks.md for what that means for a script that passes ``step=`` itself).

wandb is never imported here: a script that uses W&B has imported it, and one that has not has no
run to log into. Runs on stepwatch's background thread only (``wandb.log`` costs ~1 ms).

Each record goes into the run that was active when its step ended (``tracking.RunProbe``, on
the training thread at each step end once the script has imported wandb), and ``Run.finish``
is wrapped: called on the training thread, it first makes the step whose end is pending final
and waits (``FINISH_WAIT_S`` at most) until this sink has logged the run's steps into it. A sweep
that runs several W&B runs in one process (``wandb.agent`` with a function) lost a run's last
pass of steps into the next run until the thirty-eighth session. A record whose run W&B finished
before it came (the wait ran out), or trained with no run active after one, is dropped and
counted in ``exporter_drops``. The exporter is started as a session feature (:func:`install`,
at init on the training thread), as MLflow's is.

A script that never calls ``wandb.finish()`` lets W&B finish the run in its own atexit hook. atexit
runs the last registered first, and stepwatch registers its exit shutdown at ``init``, before
``wandb.init`` registers W&B's: so once this exporter sees the run, it registers the session's
shutdown again (``Exporter.exit_first``), ahead of W&B's hook. What still comes for a run W&B has
finished (one seen only at exit, a script's own exit hook that finishes it) is dropped and
counted, with one info line, not an error.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from .._imports import ImportWatch
from .base import Batch
from .tracking import (PREFIX, STEP_KEY, FindingGate, RowLimiter, RunProbe, TrackingExporter, follow_runs, log,
                       record_scalars, settling, stop_following, wait_for_steps)

if TYPE_CHECKING:
    from .._feature import Hub
    from ..context import RunContext
    from ..record import Finding

FINDINGS_KEY = PREFIX + "findings"
FINDING_COLUMNS = ["step", "rank", "severity", "kind", "summary", "action"]
# Rows a second at most (tracking.RowLimiter): W&B is built for a few logs a second, and each
# costs the background thread ~0.6 ms and a row of the run's history.
ROWS_PER_S = 10.0
ROWS_BURST = 100
# The findings table: the latest findings, re-logged at most once a minute and at shutdown.
TABLE_ROWS = 200
TABLE_EVERY_S = 60.0
# How long ``Run.finish`` on the training thread waits for the run's last steps to be logged
# into it (a pipeline pass, 0.05-0.25 s, and the rows' log calls) before W&B finishes it.
FINISH_WAIT_S = 2.0


def _active_wandb_run() -> Any:
    """``RunProbe``'s look for W&B: ``wandb.run`` itself (0.04 µs; its ``id`` property costs
    1.7 µs, and an address can be a later run's), or None; LookupError while wandb is not
    imported. The probe keeps the last 64 runs it saw."""
    wandb = sys.modules.get("wandb")
    if wandb is None:
        raise LookupError("wandb")
    return getattr(wandb, "run", None)


def _noop(run: Any) -> bool:
    """A run of ``wandb.init(mode="disabled")`` (``WANDB_MODE=disabled``; W&B's ``NoopRun``): no
    run at all to stepwatch, so its steps are neither logged nor counted as dropped."""
    return type(run).__name__ == "NoopRun"


def _real_run(run: Any) -> Any:
    """``RunProbe``'s ``describe``: a disabled run is kept as no run (asked when the run changes)."""
    return None if _noop(run) else run


class WandbExporter(TrackingExporter):
    name = "wandb"

    def __init__(
        self,
        ctx: "RunContext",
        *,
        rows_per_s: float | None = None,
        burst: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.clock = clock
        self.rows = RowLimiter(ROWS_PER_S if rows_per_s is None else rows_per_s, ROWS_BURST if burst is None else burst, clock)
        self._run: Any = None
        self.gate = FindingGate()
        self._findings: deque[list[Any]] = deque(maxlen=TABLE_ROWS)
        self._table_dirty = False
        self._table_at = -TABLE_EVERY_S
        # The run W&B finished before stepwatch was done with it: the rest for it is dropped.
        self._ended: Any = None
        self._between_runs_said = False
        self.probe = RunProbe(_active_wandb_run, _real_run, on_run=self._exit_ahead)
        self._through = -(2**62)  # the last step this sink has handled (logged, sampled out, dropped)
        self._wrapped: list[tuple[Any, str, Any, Any]] = []  # (class, name, W&B's method, ours)
        self.watch: ImportWatch | None = None

    def _active_run(self) -> Any:
        wandb = sys.modules.get("wandb")
        run = getattr(wandb, "run", None) if wandb is not None else None
        return None if _noop(run) else run

    def _adopt(self, run: Any) -> None:
        if run is self._run:
            return
        # A new run (the first, or one after wandb.finish()): our x-axis for our keys only.
        run.define_metric(STEP_KEY)
        run.define_metric(PREFIX + "*", step_metric=STEP_KEY)
        self._findings.clear()
        self._table_dirty = False
        self._run = run
        self._exit_ahead(run)

    def _exit_ahead(self, run: Any) -> None:
        """The session's exit shutdown registered again, after the exit hook W&B registered at
        ``wandb.init``: it runs first. When the probe first sees ``run`` at a step end (training
        thread: a short job may end before any pass logs into it), and when a pass adopts it."""
        if self.exit_first is not None:
            atexit.unregister(self.exit_first)
            atexit.register(self.exit_first)

    def _finished(self, run: Any, exc: Exception) -> bool:
        """Whether ``exc`` from ``run`` says W&B has finished the run: its exit hook closed the
        connection (the main thread has ended: the interpreter is exiting), or the script
        finished it since this pass picked it up (``wandb.run`` is no longer it)."""
        wandb = sys.modules.get("wandb")
        errors = getattr(wandb, "errors", None)
        kinds = (OSError, getattr(errors, "Error", OSError))
        if not isinstance(exc, kinds):
            return False
        return not threading.main_thread().is_alive() or getattr(wandb, "run", None) is not run

    def _drop(self, run: Any, n: int, exc: Exception | None) -> None:
        """``n`` records not logged into ``run``, which W&B has finished: counted; one line."""
        self._dropped += n
        if exc is not None and self._ended is not run:
            self._ended = run
            log.info(
                "stepwatch: the W&B run %s was finished (by W&B at exit, or by the script) before stepwatch's last "
                "records reached it (%s: %s); what comes for it is dropped (every step is in steps.rank<R>.jsonl)",
                getattr(run, "id", "?"), type(exc).__name__, exc,
            )

    def _export(self, batch: Batch) -> None:
        try:
            self._export_to_runs(batch)
        finally:
            if batch.records:
                self._through = max(self._through, max(r.step for r in batch.records))

    def _export_to_runs(self, batch: Batch) -> None:
        run = self._active_run()
        records = batch.records
        if self.probe.seen and records:
            # Each step into the run active when it ended: not a run W&B finished since (it
            # takes nothing more), nor a run started after it.
            runs = [self.probe.run_at(r.step) for r in records]
            own = [r for r, at in zip(records, runs) if at is run]
            elsewhere = sum(1 for at in runs if at is not None and at is not run)
            between = len(records) - len(own) - elsewhere  # trained with no run active
            lost = elsewhere + (between if self._run is not None else 0)  # before any run: not W&B's
            if lost:
                self._drop(None, lost, None)
                self._say_between_runs()
            batch = dataclasses.replace(batch, records=own)
        if run is None:
            if self._run is not None and batch.records:
                # The run this sink logged into was finished, and no new one is active (a sweep's
                # last run, or steps trained between two runs): these are counted, not lost unsaid.
                self._drop(None, len(batch.records), None)
                self._say_between_runs()
            return
        if run is self._ended:
            self._drop(run, len(batch.records), None)
            return
        pending = len(batch.records)  # not logged yet
        try:
            self._adopt(run)
            rows = self.rows.admit(batch.records)
            pending = len(rows)
            for f in self.gate.admit(batch.findings):
                self._add_finding(f)
            last = len(rows) - 1
            for i, r in enumerate(rows):
                row: dict[str, Any] = {STEP_KEY: r.step, **record_scalars(r)}
                if i == last:
                    self._maybe_table(row, final=False)
                run.log(row)
                pending -= 1
            if not rows and self._table_dirty and batch.findings:
                row = {}
                self._maybe_table(row, final=False)
                if row:
                    run.log(row)
        except Exception as e:
            if not self._finished(run, e):
                raise
            self._drop(run, pending, e)

    def _say_between_runs(self) -> None:
        if not self._between_runs_said:
            self._between_runs_said = True
            log.info("stepwatch: steps trained while no W&B run was active after one, or in a run W&B finished "
                     "before their records reached it, are not in W&B (counted in run.json's exporter_drops; "
                     "every step is in steps.rank<R>.jsonl)")

    def _add_finding(self, f: "Finding") -> None:
        self._findings.append([f.step, f.rank, f.severity, f.kind, f.summary, f.action])
        self._table_dirty = True

    def _maybe_table(self, row: dict[str, Any], *, final: bool) -> None:
        """Put the findings table into ``row`` (one row less than logging it alone) when it changed
        and a minute has passed since the last one, or at shutdown."""
        now = self.clock()
        if not self._table_dirty or (not final and now - self._table_at < TABLE_EVERY_S):
            return
        import wandb  # already imported: the run exists

        note = self.gate.note()
        data = list(self._findings)
        if note:
            data.append([None, self.ctx.rank, "info", "suppressed", note, ""])
        row[FINDINGS_KEY] = wandb.Table(columns=FINDING_COLUMNS, data=data)
        self._table_dirty = False
        self._table_at = now

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """At shutdown: the findings table not logged yet goes out now, in its own row."""
        if self.off:
            return True
        run = self._active_run()
        if run is None or run is self._ended:
            return True
        try:
            self._adopt(run)
            if self._table_dirty:
                row: dict[str, Any] = {}
                self._maybe_table(row, final=True)
                run.log(row)
        except Exception as e:
            if not self._finished(run, e):
                raise
            self._drop(run, 0, e)
        return True

    # -- as a session feature (started at init, beside the others; see :func:`install`) --------

    def before_finish(self, run: Any, hub: "Hub") -> None:
        """Training thread, in ``Run.finish`` of the active run, before W&B finishes it: the
        steps trained so far are the run's (``RunProbe.settle``), the pending step's record is
        made now, and this waits until they are logged into it, ``FINISH_WAIT_S`` at most."""
        if self.off or _noop(run) or getattr(sys.modules.get("wandb"), "run", None) is not run:
            return
        self.probe.settle(hub.last_step_trained)
        wait_for_steps(self, hub, FINISH_WAIT_S)

    def wrap_finish(self, hub: "Hub") -> None:
        """``wandb.sdk.wandb_run.Run._finish`` (what ``wandb.finish()``, ``run.finish()``, a
        ``with wandb.init()`` block's exit -- which bypasses ``finish`` -- and the sweep agent's
        end of a run all call; ``Run.finish`` in a W&B without it) calls :meth:`before_finish`
        first, and ``wandb.init`` settles the probe (``tracking.settling``). Another thread's
        call says nothing: its steps are not known there."""
        cls = getattr(sys.modules.get("wandb.sdk.wandb_run"), "Run", None)
        name = "_finish" if callable(getattr(cls, "_finish", None)) else "finish"
        orig = getattr(cls, name, None)
        if orig is None or getattr(orig, "__stepwatch_wrapped__", None) is not None:
            return

        @functools.wraps(orig)
        def finish(run: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                if hub.on_training_thread():
                    self.before_finish(run, hub)
            except Exception as e:  # noqa: BLE001 - never in the way of the user's call
                hub.report_error("wandb.finish", e)
            return orig(run, *args, **kwargs)

        finish.__stepwatch_wrapped__ = orig  # type: ignore[attr-defined]
        self._wrapped.append((cls, name, orig, finish))
        setattr(cls, name, finish)
        # ``wandb.init``: the step whose end is pending was trained before the run (its record,
        # made at the next step's start, went into the run).
        wandb = sys.modules.get("wandb")
        init = getattr(wandb, "init", None)
        if callable(init) and getattr(init, "__stepwatch_wrapped__", None) is None:
            ours = settling(init, self.probe, hub)
            self._wrapped.append((wandb, "init", init, ours))
            wandb.init = ours

    def stop(self) -> None:
        stop_following(self)  # force_flush/shutdown come with the other exporters

    def status(self) -> dict[str, Any]:
        return {"run_seen": self._run is not None or self.probe.run_at(None) is not None, "off": self.off}


def install(hub: "Hub") -> WandbExporter:
    """Training thread, at init: the exporter, its run probe among the step-end listeners from
    the first step on which wandb is imported (now, or when the script imports it), and
    ``Run.finish`` wrapped (:meth:`WandbExporter.wrap_finish`). The session adds it to its
    exporters."""
    e = WandbExporter(hub.ctx)
    follow_runs(hub, e, "wandb", e.wrap_finish)
    return e
