"""Weights & Biases: when this process has an active run (``wandb.run``), step records go into it
as ``stepwatch/<field>`` with ``stepwatch/step`` (the optimizer step) as their x-axis, and
findings as the ``stepwatch/findings`` table. No setting needed; ``STEPWATCH_WANDB=0`` turns it off.

Never ``step=``: W&B drops a row whose ``step=`` does not increase, and every ``wandb.log``
advances the run's own step (``_step``). So each run gets ``define_metric("stepwatch/*",
step_metric="stepwatch/step")`` and rows without ``step=``: stepwatch's rows advance ``_step``
too (see docs/sinks.md for what that means for a script that passes ``step=`` itself).

wandb is never imported here: a script that uses W&B has imported it, and one that has not has no
run to log into. Runs on stepwatch's background thread only (``wandb.log`` costs ~1 ms).

A script that never calls ``wandb.finish()`` lets W&B finish the run in its own atexit hook. atexit
runs the last registered first, and stepwatch registers its exit shutdown at ``init``, before
``wandb.init`` registers W&B's: so once this exporter sees the run, it registers the session's
shutdown again (``Exporter.exit_first``), ahead of W&B's hook. What still comes for a run W&B has
finished (one seen only at exit, a script's own exit hook that finishes it) is dropped and
counted, with one info line, not an error.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from .base import Batch
from .tracking import PREFIX, STEP_KEY, FindingGate, RowLimiter, TrackingExporter, log, record_scalars

if TYPE_CHECKING:
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

    def _active_run(self) -> Any:
        wandb = sys.modules.get("wandb")
        return getattr(wandb, "run", None) if wandb is not None else None

    def _adopt(self, run: Any) -> None:
        if run is self._run:
            return
        # A new run (the first, or one after wandb.finish()): our x-axis for our keys only.
        run.define_metric(STEP_KEY)
        run.define_metric(PREFIX + "*", step_metric=STEP_KEY)
        self._findings.clear()
        self._table_dirty = False
        self._run = run
        if self.exit_first is not None:  # after wandb.init's exit hook: runs before it
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
        run = self._active_run()
        if run is None:
            if self._run is not None and batch.records:
                # The run this sink logged into was finished, and no new one is active (a sweep's
                # last run, or steps trained between two runs): these are counted, not lost unsaid.
                self._drop(None, len(batch.records), None)
                if not self._between_runs_said:
                    self._between_runs_said = True
                    log.info("stepwatch: the W&B run was finished and no new run is active; stepwatch's records for "
                             "that time are not in W&B (counted in run.json's exporter_drops; every step is in "
                             "steps.rank<R>.jsonl)")
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
