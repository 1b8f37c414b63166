"""The live console: one compact line on the console rank.

On a terminal, a line every ``console_interval_s``; when stderr is not a terminal (a log file,
a batch system), one line a minute, so logs are not flooded. Findings print when they happen,
and a summary line at shutdown.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import IO, Callable

from ..config import Config
from ..context import RunContext
from ..record import StepRecord
from .base import Batch, Exporter

NON_TTY_INTERVAL_S = 60.0


def _pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return float("nan")
    i = min(len(sorted_vals) - 1, max(0, int(round(q * (len(sorted_vals) - 1)))))
    return sorted_vals[i]


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}ms" if s < 10 else f"{s:.1f}s"


def format_line(
    window: list[StepRecord], device: str | None = None, grad_norm: tuple[int, float] | None = None
) -> str:
    """The console line for a window of records (also used by tests and the report).
    ``grad_norm``: (step, value) of the last known grad norm, for when no record of the window
    has one (``STEPWATCH_GRAD_NORM_EVERY`` > the window)."""
    window = [r for r in window if not r.tail]  # evaluation/checkpoints after the last step: no step
    if not window:
        return "stepwatch | waiting for the first step"
    live = [r for r in window if not r.skipped] or window
    steps = sorted(r.step_s for r in live)
    total = sum(steps) or 1e-12
    share = {
        name: sum(getattr(r, f"{name}_s") for r in live) / total
        for name in ("data_wait", "forward", "backward", "optimizer", "other")
    }
    last = window[-1]
    parts = [
        f"stepwatch | step {last.step}",
        f"step p50 {_ms(_pct(steps, 0.5))} p99 {_ms(_pct(steps, 0.99))}",
        "data {data_wait:.0%} fwd {forward:.0%} bwd {backward:.0%} opt {optimizer:.0%} other {other:.0%}".format(
            **share
        ),
        f"data wait {_ms(sum(r.data_wait_s for r in live) / len(live))}",
        f"{len(live) / total:.1f} steps/s",
    ]
    tokens = [r.tokens for r in live if r.tokens is not None]
    if len(tokens) == len(live):
        parts.append(f"{sum(tokens) / total:,.0f} tok/s")
    mfu = [r.mfu for r in live if r.mfu is not None]
    if mfu:
        basis = [x for x in (device, last.mfu_dtype) if x]
        if last.peak_tflops:
            basis.append(f"peak {last.peak_tflops:,.4g} TFLOP/s")
        parts.append(f"MFU {sum(mfu) / len(mfu):.1%}" + (f" ({', '.join(basis)})" if basis else ""))
    # The latest known: with STEPWATCH_GRAD_NORM_EVERY > 1 most records have none.
    known = next(((r.step, r.grad_norm) for r in reversed(window) if r.grad_norm is not None), grad_norm)
    if known is not None:
        parts.append(f"grad-norm {known[1]:.3g}" + (f" (step {known[0]})" if known[0] != last.step else ""))
    ov = [r.overlap for r in live if r.overlap is not None]
    if ov:
        parts.append(f"overlap {sum(ov) / len(ov):.0%}")
    skipped = sum(1 for r in window if r.skipped)
    if skipped:
        parts.append(f"{skipped} skipped")
    return " | ".join(parts)


class ConsoleExporter(Exporter):
    name = "console"
    says_totals = True  # its closing line counts what every other exporter dropped

    def __init__(
        self,
        config: Config,
        ctx: RunContext,
        *,
        stream: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream: IO[str] | None = stream or sys.stderr
        self.clock = clock
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        if config.console == "on" or tty:
            self.interval = config.console_interval_s
        else:
            self.interval = max(NON_TTY_INTERVAL_S, config.console_interval_s)
        self.ctx = ctx
        self.window: deque[StepRecord] = deque(maxlen=config.window)
        self._last_print = clock()
        self.total_steps = 0
        # Records and metric points dropped anywhere (bounded queues, a collector that is down),
        # as the latest batch said; shown on the line when not zero.
        self._drops = 0
        # (step, value) of the newest record with a grad norm: it may have left the window.
        self._grad_norm: tuple[int, float] | None = None

    def _line(self) -> str:
        line = format_line(list(self.window), self.ctx.device, self._grad_norm)
        n = self._drops
        return line + (f" | {n:,} dropped" if n else "")

    def _write(self, line: str) -> None:
        stream = self.stream
        if stream is None:  # started with stderr closed (``2>&-``, a daemon): nowhere to show it
            return
        try:
            stream.write(line + "\n")
            flush = getattr(stream, "flush", None)  # a user's stand-in for sys.stderr may have none
            if flush is not None:
                flush()
        except (OSError, ValueError):  # a closed stream at interpreter exit
            pass

    def export(self, batch: Batch) -> None:
        self._drops = max(self._drops, batch.dropped)
        self.window.extend(batch.records)
        for r in batch.records:
            if r.grad_norm is not None:
                self._grad_norm = (r.step, r.grad_norm)
        self.total_steps += sum(1 for r in batch.records if not r.tail)
        for f in batch.findings:
            self._write(f"stepwatch | {f.severity.upper()} {f.kind}: {f.summary} -> {f.action}")
        now = self.clock()
        if batch.records and now - self._last_print >= self.interval:
            self._last_print = now
            self._write(self._line())

    def shutdown(self) -> None:
        if self.window:
            self._write(self._line() + f" | done: {self.total_steps} steps")
