"""TensorBoard: step records as ``stepwatch/<field>`` scalars at the optimizer step, findings as a
text summary. ``STEPWATCH_TENSORBOARD=<dir>`` writes ``<dir>/rank<R>/`` (one TensorBoard run per
rank, so every rank's series sits beside the others); ``stepwatch.init(tensorboard=writer)`` writes
into the user's own ``SummaryWriter`` (flushed at shutdown, never closed: it is theirs).

Everything runs on stepwatch's background thread; ``torch.utils.tensorboard`` is imported at the
first batch, not before. The writer's own thread does the file I/O.

The user's writer is the user's to close, and scripts close it at their end, before stepwatch's
shutdown: its ``close`` is wrapped at init (:func:`install`, a session feature; on the instance,
not the class). Called on the training thread, it first makes the pending step's record and
waits (``CLOSE_WAIT_S`` at most) until this sink has written the steps into the writer; what
comes after the close is counted as dropped, with one info line (until the forty-first session
the last pass of steps was lost and the closed writer turned the sink off as an internal error).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

from .._files import make_private_dir
from .base import Batch
from .tracking import (PREFIX, FindingGate, RowLimiter, TrackingExporter, finding_text, log, record_scalars,
                       wait_for_steps)

if TYPE_CHECKING:
    from .._feature import Hub
    from ..context import RunContext
    from ..record import Finding

FINDINGS_TAG = PREFIX + "findings"
# Seconds between the writer's own flushes to disk (torch's default is 120 s: a crash would lose
# two minutes of curves, and TensorBoard would show them late).
FLUSH_SECS = 5
# The largest float32 (TensorBoard's scalar type).
FLOAT32_MAX = 3.4028234663852886e38
# Rows (steps) a second at most (tracking.RowLimiter): without TensorFlow, TensorBoard checksums
# each event record in pure Python, ~0.7 ms for a step's ~25 scalars on the writer's thread.
ROWS_PER_S = 20.0
ROWS_BURST = 200
# How long the user's ``writer.close()`` on the training thread waits for the steps trained so far
# to be written into the writer (a pipeline pass, 0.05-1 s, and the rows) before it closes it.
CLOSE_WAIT_S = 2.0


def rank_dir(base: str, rank: int) -> str:
    return os.path.join(os.path.abspath(base), f"rank{rank}")


class TensorBoardExporter(TrackingExporter):
    name = "tensorboard"

    def __init__(self, ctx: "RunContext", target: Any) -> None:
        """``target``: a directory (str) or an object with ``add_scalar``/``add_text`` (a
        ``torch.utils.tensorboard.SummaryWriter``, or tensorboardX's)."""
        super().__init__()
        self.ctx = ctx
        self.own = isinstance(target, str)
        self.dir = rank_dir(target, ctx.rank) if self.own else None
        self.writer: Any = None if self.own else target
        self.gate = FindingGate()
        self.rows = RowLimiter(ROWS_PER_S, ROWS_BURST)
        self._last_step = 0
        self._fast: Any = None  # (file writer, Summary class) for torch's SummaryWriter
        self._through = -(2**62)  # the last step this sink has handled (written, sampled out, dropped)
        self.closed = False  # the user closed their writer (wrap_close): nothing more goes into it
        self._closed_said = False
        self._lock = threading.Lock()  # a batch's writes, against the user's close
        self._wrapped: Any = None  # (writer, our close) while the user's close is wrapped

    def _open(self) -> Any:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            make_private_dir(self.dir)
            self.writer = SummaryWriter(log_dir=self.dir, flush_secs=FLUSH_SECS)
        if self._fast is None:
            self._fast = False
            SummaryWriter = getattr(sys.modules.get("torch.utils.tensorboard"), "SummaryWriter", None)
            if SummaryWriter is not None and isinstance(self.writer, SummaryWriter):
                from tensorboard.compat.proto.summary_pb2 import Summary

                # One event per step with every value in it, as add_scalars' single-run
                # equivalent: ~10x less than an add_scalar (and an event) per value.
                self._fast = (self.writer._get_file_writer(), Summary)
        return self.writer

    def _export(self, batch: Batch) -> None:
        try:
            with self._lock:
                if self.closed:
                    self._drop_after_close(len(batch.records))
                    return
                self._write(batch)
        finally:
            if batch.records:
                self._through = max(self._through, max(r.step for r in batch.records))

    def _drop_after_close(self, n: int) -> None:
        self._dropped += n
        if n and not self._closed_said:
            self._closed_said = True
            log.info("stepwatch: your SummaryWriter was closed; the steps trained after it are not in TensorBoard "
                     "(counted in run.json's exporter_drops; every step is in steps.rank<R>.jsonl)")

    def _write(self, batch: Batch) -> None:
        w = self._open()
        for r in self.rows.admit(batch.records):
            # TensorBoard keeps float32: a finite value beyond it (1e300) would read inf there.
            values = {k: v for k, v in record_scalars(r).items() if abs(v) <= FLOAT32_MAX}
            if self._fast:
                fw, Summary = self._fast
                summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
                fw.add_summary(summary, r.step, r.time)
            else:
                for key, value in values.items():
                    w.add_scalar(key, value, global_step=r.step, walltime=r.time)
            self._last_step = r.step
        shown = self.gate.admit(batch.findings)
        if not shown:
            return
        # One text entry per step, at the findings' own step (one with none: the latest step
        # written); a pass's findings span its steps.
        by_step: dict[int, list[Finding]] = {}
        for f in shown:
            by_step.setdefault(f.step if f.step is not None else self._last_step, []).append(f)
        note = self.gate.note()
        steps = sorted(by_step)
        for step in steps:
            found = by_step[step]
            text = "\n\n".join(finding_text(f) for f in found)
            if note and step == steps[-1]:
                text += "\n\n" + note
            w.add_text(FINDINGS_TAG, text, global_step=step, walltime=found[-1].time)

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        if self.writer is not None and not self.off and not self.closed:
            self.writer.flush()
        return True

    def shutdown(self) -> None:
        if self.writer is not None and self.own:
            self.writer.close()

    # -- the user's writer, as a session feature (started at init; see :func:`install`) ----------

    def before_close(self, hub: "Hub") -> None:
        """Training thread, in the user's ``writer.close()``: the pending step's record is made
        now, and this waits until the steps trained so far are written, ``CLOSE_WAIT_S`` at most."""
        wait_for_steps(self, hub, CLOSE_WAIT_S)

    def wrap_close(self, hub: "Hub") -> None:
        """The user's writer's ``close`` (also what its ``with`` block's exit calls), wrapped on the
        instance: :meth:`before_close` on the training thread (another thread's call waits for
        nothing: its steps are not known there), then no more writes, then the writer's own close."""
        w = self.writer
        orig = getattr(w, "close", None)
        if not callable(orig):
            return

        @functools.wraps(orig)
        def close(*args: Any, **kwargs: Any) -> Any:
            try:
                if not self.closed and not self.off and hub.on_training_thread():
                    self.before_close(hub)
            except Exception as e:  # noqa: BLE001 - never in the way of the user's call
                hub.report_error("tensorboard.close", e)
            with self._lock:
                self.closed = True
                return orig(*args, **kwargs)

        try:
            w.close = close
        except (AttributeError, TypeError):  # a writer with __slots__: its close stays as it is
            return
        self._wrapped = (w, close)

    def stop(self) -> None:
        """The session's shutdown: the user's writer gets its own ``close`` back."""
        if self._wrapped is not None:
            w, ours = self._wrapped
            self._wrapped = None
            if getattr(w, "__dict__", {}).get("close") is ours:
                del w.close

    def status(self) -> dict[str, Any]:
        return {"writer": "yours", "closed_by_you": self.closed, "off": self.off}


def install(hub: "Hub") -> TensorBoardExporter | None:
    """Training thread, at init, when ``tensorboard=`` is the user's own writer: the exporter,
    with the writer's ``close`` wrapped (:meth:`TensorBoardExporter.wrap_close`). The session adds
    it to its exporters. A directory (``STEPWATCH_TENSORBOARD``) needs nothing at init: its
    exporter is built with the others (exporters/builtin.py)."""
    target = hub.config.tensorboard
    if target is None or isinstance(target, str):
        return None
    e = TensorBoardExporter(hub.ctx, target)
    e.wrap_close(hub)
    return e
