"""TensorBoard: step records as ``stepwatch/<field>`` scalars at the optimizer step, findings as a
text summary. ``STEPWATCH_TENSORBOARD=<dir>`` writes ``<dir>/rank<R>/`` (one TensorBoard run per
rank, so every rank's series sits beside the others); ``stepwatch.init(tensorboard=writer)`` writes
into the user's own ``SummaryWriter`` (flushed at shutdown, never closed: it is theirs).

Everything runs on stepwatch's background thread; ``torch.utils.tensorboard`` is imported at the
first batch, not before. The writer's own thread does the file I/O.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from .._files import make_private_dir
from .base import Batch
from .tracking import PREFIX, FindingGate, RowLimiter, TrackingExporter, finding_text, record_scalars

if TYPE_CHECKING:
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
        if self.writer is not None and not self.off:
            self.writer.flush()
        return True

    def shutdown(self) -> None:
        if self.writer is not None and self.own:
            self.writer.close()
