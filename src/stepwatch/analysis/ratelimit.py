"""One rate limit for every finding kind: a persistent condition is one finding per episode.

Every finding a session (or ``serve-vllm``) emits passes through :class:`FindingLimiter` before
exporters, files, the console and the captures see it, so a new detector gets the limit for free.

Episodes. Findings are grouped by (kind, rank, ``data["subject"]`` when a detector names one,
e.g. the rank a straggler finding is about). The first finding of a group opens an episode and
is emitted at once. Further findings of the group while the episode lasts are counted, and one
of them is emitted again at most every ``repeat_windows`` windows, carrying the count so far. An
episode ends when the group has been quiet for one window; if findings were held back since the
last one emitted, a closing finding says how many (``data["episode"]["final"]``), so the count
is never lost. ``flush()`` (at shutdown) closes every open episode the same way.

How bad. A detector may give a finding ``data["magnitude"]`` (a positive number, bigger is
worse: a step-time spike's multiple of the median). A finding at least ``ESCALATE`` times the
largest one emitted in its episode is emitted at once, as a repeat (a 52 ms burst inside the
episode a 9 ms blip opened was told only if it was the episode's last finding), and the closing
finding is the worst one held back rather than the last when it was worse than every one told.

Positions are steps in a training session (a finding's ``step``, else the last step seen) and
seconds for ``serve-vllm`` (the finding's ``time``); ``window`` is in the same unit. Memory is
bounded: at most ``max_groups`` open episodes (the oldest are closed first).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..record import Finding

ESCALATE = 2.0  # a finding this many times the episode's worst emitted is emitted at once


@dataclasses.dataclass(slots=True)
class _Episode:
    first: float
    last: float  # position of the group's last finding
    emitted_at: float  # position of the last one emitted
    count: int = 1
    held: int = 0  # findings counted since the last one emitted
    latest: Finding | None = None  # the last finding held back (the closing one is built from it)
    peak: float | None = None  # the largest magnitude emitted
    worst: Finding | None = None  # the held-back finding of the largest magnitude (may close instead)


class FindingLimiter:
    def __init__(
        self,
        window: float,
        repeat_windows: int = 20,
        *,
        position: Callable[[Finding], float | None] | None = None,
        unit: str = "step",
        max_groups: int = 256,
    ) -> None:
        if not window > 0:
            raise ValueError(f"window must be > 0, got {window!r}")
        if isinstance(repeat_windows, bool) or not isinstance(repeat_windows, int) or repeat_windows < 1:
            raise ValueError(f"repeat_windows must be an integer >= 1, got {repeat_windows!r}")
        self.window = window
        self.repeat_windows = repeat_windows
        self._position = position or (lambda f: f.step)
        self.max_groups = max_groups
        self.unit = unit
        self._open: dict[tuple[Any, ...], _Episode] = {}
        self.now: float | None = None  # the latest position seen (a record's step, a pass's time)
        self.suppressed = 0  # findings held back over the whole run

    @staticmethod
    def key(f: Finding) -> tuple[Any, ...]:
        subject = f.data.get("subject") if isinstance(f.data, dict) else None
        return (f.kind, f.rank, subject if isinstance(subject, (str, int, float, type(None))) else str(subject))

    def advance(self, position: float | None) -> None:
        """The pipeline moved on (a record of step N, a pass at time T) with or without findings."""
        if position is not None and (self.now is None or position > self.now):
            self.now = position

    def filter(self, findings: list[Finding], now: float | None = None) -> list[Finding]:
        """The findings to pass on now: openings, due repeats, and closings of ended episodes.
        ``now``: how far the pipeline got (the pass's last step, or the time), findings or not."""
        out: list[Finding] = []
        for f in findings:
            pos = self._position(f)
            if pos is None:
                pos = self.now if self.now is not None else 0.0
            self.advance(pos)
            k = self.key(f)
            ep = self._open.get(k)
            if ep is not None and pos - ep.last > self.window:
                out.extend(self._close(k))  # quiet for a window: that episode is over
                ep = None
            m = magnitude(f)
            if ep is None:
                if len(self._open) >= self.max_groups:
                    oldest = min(self._open, key=lambda g: self._open[g].last)
                    out.extend(self._close(oldest))
                self._open[k] = _Episode(first=pos, last=pos, emitted_at=pos, peak=m)
                out.append(self._annotate(f, ep=self._open[k], held=0, final=False))
                continue
            ep.count += 1
            ep.last = max(ep.last, pos)
            worse = m is not None and ep.peak is not None and m >= ESCALATE * ep.peak
            if worse or pos - ep.emitted_at >= self.repeat_windows * self.window:
                ep.emitted_at = pos
                held, ep.held, ep.latest, ep.worst = ep.held, 0, None, None
                if m is not None:
                    ep.peak = m if ep.peak is None else max(ep.peak, m)
                out.append(self._annotate(f, ep=ep, held=held, final=False, worse=worse))
            else:
                ep.held += 1
                ep.latest = f
                if m is not None and (ep.worst is None or m > magnitude(ep.worst)):  # type: ignore[operator]
                    ep.worst = f
                self.suppressed += 1
        self.advance(now)
        out.extend(self._close_quiet())
        return out

    def flush(self) -> list[Finding]:
        """At the end: close every open episode."""
        out: list[Finding] = []
        for k in list(self._open):
            out.extend(self._close(k))
        return out

    def _close_quiet(self) -> list[Finding]:
        if self.now is None:
            return []
        out: list[Finding] = []
        for k in [k for k, ep in self._open.items() if self.now - ep.last > self.window]:
            out.extend(self._close(k))
        return out

    def _close(self, k: tuple[Any, ...]) -> list[Finding]:
        ep = self._open.pop(k)
        if not ep.held or ep.latest is None:
            return []
        # The last held back, unless one held back was worse than every finding told.
        worst = ep.worst is not None and ep.peak is not None and magnitude(ep.worst) > ep.peak  # type: ignore[operator]
        return [self._annotate(ep.worst if worst else ep.latest, ep=ep, held=ep.held, final=True)]

    def _annotate(self, f: Finding, *, ep: _Episode, held: int, final: bool, worse: bool = False) -> Finding:
        data = dict(f.data) if isinstance(f.data, dict) else {"value": f.data}
        data["episode"] = {"count": ep.count, "first": ep.first, "last": ep.last, "held_back": held,
                           "final": final, "unit": self.unit}
        if self.unit == "step":
            span = f"steps {int(ep.first)}-{int(ep.last)}"
        else:
            span = f"{ep.last - ep.first:.0f} s"
        summary = f.summary
        if final:
            summary = f"{summary} [episode over: {ep.count} in all over {span}]"
        elif worse:
            summary = f"{summary} [worse than before: {ep.count} over {span}, {held} held back since the last report]"
        elif ep.count > 1:
            summary = f"{summary} [still going: {ep.count} over {span}, {held} held back since the last report]"
        return dataclasses.replace(f, data=data, summary=summary)


def magnitude(f: Finding) -> float | None:
    """``data["magnitude"]`` of ``f`` when it is a positive finite number, else None."""
    v = f.data.get("magnitude") if isinstance(f.data, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
        return None
    return float(v)
