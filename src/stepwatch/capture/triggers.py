"""What triggers a capture: a step-time spike (detected here) and findings of other detectors.

``StepTimeSpikeDetector`` judges each step's ``step_s`` against the rolling median and MAD of the
steps before it. ``step_s`` already excludes evaluation and checkpoint time (hooks/phases.py), so
an eval pass or a save is never a spike. The first ``min_history`` steps (warm-up, compilation)
only fill the history.

Findings that trigger a capture (``TRIGGER_KINDS``): the spike, the data-loading stall
(``data_loading``, from analysis/detectors.py), ``mfu_drop`` and ``grad_norm_spike``.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Callable

from ..analysis.kinds import make_finding
from ..record import Finding, StepRecord

TRIGGER_KINDS = ("step_time_spike", "data_loading", "mfu_drop", "grad_norm_spike")

# MAD -> standard deviation for normal data (1 / Phi^-1(3/4); Rousseeuw & Croux 1993).
MAD_TO_SIGMA = 1.4826


class StepTimeSpikeDetector:
    """A step slower than ``median + max(mads x 1.4826 x MAD, (min_ratio - 1) x median)``: at least
    ``min_ratio`` (2) times the median, so the jitter of a busy host is no spike.

    The second term keeps a very steady job (MAD near 0) from calling jitter a spike. At most one
    finding per ``hold`` steps: a burst of slow steps is one event. A step ``excluded(step)`` says
    is ours (a capture's profiler slowed it) is neither judged nor kept in the history."""

    def __init__(self, window: int = 50, *, mads: float = 6.0, min_ratio: float = 2.0, min_history: int | None = None,
                 hold: int | None = None, excluded: Callable[[int], bool] | None = None) -> None:
        self.hist: deque[float] = deque(maxlen=max(window, 5))
        self.mads = mads
        self.min_ratio = min_ratio
        self.min_history = min_history if min_history is not None else max(5, min(window, 20))
        self.hold = hold if hold is not None else max(window, 5)
        self._last_fire: int | None = None
        self.excluded = excluded

    def observe(self, rec: StepRecord) -> list[Finding]:
        if self.excluded is not None and self.excluded(rec.step):
            return []
        x = rec.step_s
        out: list[Finding] = []
        if len(self.hist) >= self.min_history:
            med = statistics.median(self.hist)
            mad = statistics.median(abs(v - med) for v in self.hist)
            limit = med + max(self.mads * MAD_TO_SIGMA * mad, (self.min_ratio - 1.0) * med)
            if x > limit and (self._last_fire is None or rec.step - self._last_fire >= self.hold):
                self._last_fire = rec.step
                out.append(
                    make_finding(
                        "step_time_spike",
                        rank=rec.rank,
                        step=rec.step,
                        when=rec.time,
                        summary=(f"rank {rec.rank} step {rec.step} took {x * 1e3:.1f} ms, {x / med:.1f}x the rolling "
                                 f"median of {med * 1e3:.1f} ms (limit {limit * 1e3:.1f} ms)"),
                        data={"step_s": x, "median_s": med, "mad_s": mad, "limit_s": limit,
                              "data_wait_s": rec.data_wait_s, "forward_s": rec.forward_s,
                              "backward_s": rec.backward_s, "optimizer_s": rec.optimizer_s},
                    )
                )
        self.hist.append(x)
        return out
