"""TensorBoard: step records as ``stepwatch/<field>`` scalars at the optimizer step, findings as a
text summary. ``STEPWATCH_TENSORBOARD=<dir>`` writes ``<dir>/rank<R>/`` (one TensorBoard run per
rank, so every rank's series sits beside the others); ``stepwatch.init(tensorboard=writer)`` writes
into the user's own ``SummaryWriter`` (flushed at shutdown, never closed: it is theirs).

Everything runs on stepwatch's background thread; ``torch.utils.tensorboard`` is imported at the
first batch, not before. The writer's own thread does the file I/O.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .._files import make_private_dir
from .base import Batch
from .tracking import PREFIX, FindingGate, TrackingExporter, finding_text, record_scalars

if TYPE_CHECKING:
    from ..context import RunContext

FINDINGS_TAG = PREFIX + "findings"
# Seconds between the writer's own flushes to disk (torch's default is 120 s: a crash would lose
# two minutes of curves, and TensorBoard would show them late).
FLUSH_SECS = 5


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
        self._last_step = 0

    def _open(self) -> Any:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            make_private_dir(self.dir)
            self.writer = SummaryWriter(log_dir=self.dir, flush_secs=FLUSH_SECS)
        return self.writer

    def _export(self, batch: Batch) -> None:
        w = self._open()
        for r in batch.records:
            for key, value in record_scalars(r).items():
                w.add_scalar(key, value, global_step=r.step, walltime=r.time)
            self._last_step = r.step
        shown = self.gate.admit(batch.findings)
        if shown:
            text = "\n\n".join(finding_text(f) for f in shown)
            note = self.gate.note()
            if note:
                text += "\n\n" + note
            step = shown[-1].step if shown[-1].step is not None else self._last_step
            w.add_text(FINDINGS_TAG, text, global_step=step, walltime=shown[-1].time)

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        if self.writer is not None and not self.off:
            self.writer.flush()
        return True

    def shutdown(self) -> None:
        if self.writer is not None and self.own:
            self.writer.close()
