"""What triggers a capture: a step-time spike (detected here) and findings of other detectors.

``StepTimeSpikeDetector`` judges each step's ``step_s`` against the rolling median and MAD of the
steps before it. ``step_s`` already excludes evaluation and checkpoint time (hooks/phases.py), so
an eval pass or a save is never a spike -- on the rank that runs it. Its peers run ahead into the
next step and wait in its collective: a spike most of whose excess is that wait is ``info``, and
says so (analysis/detectors.py ``spike_finding``). The first ``min_history`` steps (warm-up,
compilation) only fill the history.

Findings that trigger a capture (``TRIGGER_KINDS``): the spike, the data-loading stall
(``data_loading``, from analysis/detectors.py), ``mfu_drop`` and ``grad_norm_spike``.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from typing import Callable

from ..analysis.detectors import collective_s, spike_finding
from ..record import Finding, StepRecord

TRIGGER_KINDS = ("step_time_spike", "data_loading", "mfu_drop", "grad_norm_spike")


def triggers_capture(f: Finding) -> bool:
    """Whether ``f`` asks for a capture of the next steps. Not a spike that was waiting for
    another rank: this rank's next steps are normal, the peer's are what to look at. Nor the
    rate limit's closing line of an episode ("[episode over: N in all ...]", a copy of its worst
    or last finding held back, written once the condition has been quiet for a window): the
    steps after it are normal ones."""
    if f.kind not in TRIGGER_KINDS or f.data.get("cause") == "collective_wait":
        return False
    if f.kind == "grad_norm_spike" and f.data.get("steady"):
        return False  # a norm high all along: the next steps are like the ones before
    episode = f.data.get("episode")
    return not (isinstance(episode, dict) and episode.get("final"))

# MAD -> standard deviation for normal data (1 / Phi^-1(3/4); Rousseeuw & Croux 1993).
MAD_TO_SIGMA = 1.4826
# A spike is at least this much over the median, whatever the ratio: a 0.4 ms step taking 1 ms
# (cold caches after a CPU-heavy evaluation, a page fault) is nothing anyone can act on, and a
# capture of the steps after it would profile normal steps.
MIN_SPIKE_EXCESS_S = 0.002


class StepTimeSpikeDetector:
    """A step slower than ``median + max(mads x 1.4826 x MAD, (min_ratio - 1) x median,
    MIN_SPIKE_EXCESS_S)``: at least ``min_ratio`` (2) times the median, so the jitter of a busy
    host is no spike, and at least 2 ms over it, so neither is a tiny step's blip.

    The second term keeps a very steady job (MAD near 0) from calling jitter a spike. Every slow
    step is a finding: the one rate limit every finding passes (analysis/ratelimit.py) makes a
    burst one episode and counts it, and a bigger spike right after a small one is still told
    (at once when it is at least twice the worst one told: ``data["magnitude"]``; else in the
    episode's repeat or closing line). A step ``excluded(step)`` says is ours (a
    capture's profiler slowed it) is neither judged nor kept in the history.

    A spike most of whose excess over the median the step spent waiting in a collective (exposed
    AllReduce beyond its own rolling median) is another rank's -- a checkpoint, an evaluation or a
    slow step there -- and is ``info``, its summary saying how much was waiting and to look at the
    other ranks at that step; any other spike (compute, data, optimizer) is this rank's own,
    a ``warning`` (``analysis.detectors.spike_finding`` decides). The two are episodes of their
    own in the rate limit, so a peer's periodic save never holds back the rank's own spike."""

    def __init__(self, window: int = 50, *, mads: float = 6.0, min_ratio: float = 2.0, min_history: int | None = None,
                 excluded: Callable[[int], bool] | None = None) -> None:
        self.hist: deque[float] = deque(maxlen=max(window, 5))
        self._sorted: list[float] = []  # hist, sorted: its median without a sort per record
        self.comm_hist: deque[float] = deque(maxlen=self.hist.maxlen)  # collective_s, where measured
        self.mads = mads
        self.min_ratio = min_ratio
        self.min_history = min_history if min_history is not None else max(5, min(window, 20))
        self.excluded = excluded

    def observe(self, rec: StepRecord) -> list[Finding]:
        if self.excluded is not None and self.excluded(rec.step):
            return []
        x = rec.step_s
        out: list[Finding] = []
        hist, srt = self.hist, self._sorted
        n = len(srt)
        if n >= self.min_history:
            med = srt[n // 2] if n % 2 else (srt[n // 2 - 1] + srt[n // 2]) / 2  # as statistics.median
            floor = med + max((self.min_ratio - 1.0) * med, MIN_SPIKE_EXCESS_S)
            # The MAD (a median of deviations: ~10 us a record) only where it can matter: the limit
            # is never below ``floor``, so a step under it is no spike whatever the MAD.
            mad = statistics.median(abs(v - med) for v in hist) if x > floor else 0.0
            limit = max(med + self.mads * MAD_TO_SIGMA * mad, floor)
            if x > limit:
                out.append(spike_finding(rec, median_s=med, mad_s=mad, limit_s=limit,
                                         collective_median_s=statistics.median(self.comm_hist) if self.comm_hist else None))
        if len(hist) == hist.maxlen:
            del srt[bisect.bisect_left(srt, hist[0])]
        hist.append(x)
        bisect.insort(srt, x)
        c = collective_s(rec)
        if c is not None:
            self.comm_hist.append(c)
        return out
