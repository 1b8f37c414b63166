"""Memory detectors (background thread): steady growth, allocator fragmentation, near the limit.

Growth. A leak (tensors kept in a list, a growing cache, a loss kept with its graph) makes memory
rise *steadily* with steps; warm-up (optimizer state, the allocator's cache, cuDNN workspaces)
rises and then stops. Over the last ``window`` steps of one series (device allocated, trainer RSS,
workers' PSS) the detector fits a line and calls it growth only when all of these hold, so a
plateau, a one-off jump or a saturating warm-up curve never does:

- the rise over the window (slope x span) is at least ``min_rise`` bytes;
- the medians of the window's four quarters increase strictly, quarter after quarter;
- the line explains the points (R^2 >= 0.8);
- the second half rises at least half as fast as the first (not decelerating into a plateau).

It is judged every eighth of a window, the first ``warmup`` steps left out, and a series that
keeps growing is named again at most every 20 windows.
"""

from __future__ import annotations

import collections
import statistics
from typing import Any, Callable

from ..analysis.detectors import WindowedDetector
from ..analysis.kinds import make_finding
from ..record import Finding, StepRecord

MiB = 1 << 20
# Reference B.7: `DCGM_FI_DEV_FB_FREE < 5000` (MiB) -- low free GPU memory, risk of OOM.
DEVICE_FREE_MIN_MIB = 5000
# Host: in use above this share of the limit (the 90%).
HOST_USED_MAX = 0.9
# Fragmentation: reserved but unused at the step's peak, at least this much and this share.
FRAG_MIN_BYTES = 1 << 30
FRAG_MIN_SHARE = 0.3

# (record field, series name, what it is) -- the series the growth detector watches.
GROWTH_SERIES = (
    ("mem_allocated_bytes", "device", "CUDA memory allocated"),
    ("host_rss_bytes", "host", "trainer resident memory (RSS)"),
    ("workers_pss_bytes", "workers", "DataLoader workers' memory (PSS)"),
)

# The ``memory_growth`` action for the memory that grew: a CPU job's RSS has no CUDA snapshot to
# read, and tracemalloc does not see torch's CPU tensors (torch allocates them outside Python's
# allocator), so the host's tool is memray, which follows native allocations too.
_KEPT = ("Find what is kept across steps: accumulate metrics with loss.item() or loss.detach(), "
         "clear or bound caches, del per-step outputs")
GROWTH_ACTION = {
    "device": _KEPT + "; read oom-<n>/memory_snapshot.pickle (CUDA allocation history, switched on by "
              "this finding), or one written now with torch.cuda.memory._dump_snapshot(path), in "
              "https://pytorch.org/memory_viz.",
    "host": _KEPT + " and batches. To see who holds it: memray run --native train.py (or memray attach "
            "<pid> on the running job), then memray flamegraph --leaks on its output -- it sees torch's "
            "CPU tensors, which tracemalloc does not; for Python objects piling up (lists, dicts), "
            "tracemalloc snapshots some hundred steps apart, compared with snapshot.compare_to(old, "
            "'traceback').",
    "workers": "Keep the Dataset's state in numpy arrays or tensors, not Python lists or dicts of objects "
               "(each worker's reads touch their reference counts and copy the pages it shares with the "
               "trainer), and bound per-worker caches; memray run --follow-fork train.py records the "
               "workers' allocations too.",
}


def _fit(pts: list[tuple[int, int]]) -> tuple[float, float]:
    """Least-squares slope (bytes per step) and R^2."""
    n = len(pts)
    mx = sum(p[0] for p in pts) / n
    my = sum(p[1] for p in pts) / n
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    syy = sum((p[1] - my) ** 2 for p in pts)
    sxy = sum((p[0] - mx) * (p[1] - my) for p in pts)
    if sxx <= 0:
        return 0.0, 0.0
    b = sxy / sxx
    r2 = (sxy * sxy) / (sxx * syy) if syy > 0 else 0.0
    return b, r2


def growth_of(pts: list[tuple[int, int]], min_rise: float) -> float | None:
    """Bytes per step if ``pts`` (step, bytes) is steady growth by the rules above, else None."""
    if len(pts) < 8:
        return None
    span = pts[-1][0] - pts[0][0]
    b, r2 = _fit(pts)
    if b <= 0 or b * span < min_rise or r2 < 0.8:
        return None
    q = len(pts) // 4
    meds = [statistics.median(v for _, v in pts[i * q : (i + 1) * q if i < 3 else len(pts)]) for i in range(4)]
    if any(meds[i + 1] <= meds[i] for i in range(3)):
        return None
    h = len(pts) // 2
    b1, _ = _fit(pts[: h + 1])
    b2, _ = _fit(pts[h:])
    if b1 <= 0 or b2 < 0.5 * b1:
        return None
    return b


class MemoryGrowthDetector:
    """``headroom(series) -> (limit_bytes, free_bytes, limit_kind) | None`` says how far the limit is."""

    def __init__(self, window: int, min_rise_bytes: float, *, warmup: int = 20, repeat_windows: int = 20,
                 headroom: Callable[[str], Any] | None = None) -> None:
        self.window = window
        self.min_rise = min_rise_bytes
        self.warmup = warmup
        self.repeat_windows = repeat_windows
        self.headroom = headroom
        self._pts: dict[str, collections.deque] = {s: collections.deque(maxlen=window + 1) for _, s, _ in GROWTH_SERIES}
        self._first: int | None = None
        self._next_eval: dict[str, int] = {}
        self._fired_at: dict[str, int] = {}

    def observe(self, rec: StepRecord) -> list[Finding]:
        if self._first is None:
            self._first = rec.step
        if rec.step < self._first + self.warmup:
            return []
        out = []
        for field, series, what in GROWTH_SERIES:
            v = getattr(rec, field, None)
            if v is None:
                continue
            pts = self._pts[series]
            pts.append((rec.step, v))
            while pts and pts[0][0] < rec.step - self.window:
                pts.popleft()
            if rec.step < self._next_eval.get(series, 0) or pts[-1][0] - pts[0][0] < 0.9 * self.window:
                continue
            self._next_eval[series] = rec.step + max(self.window // 8, 1)
            rate = growth_of(list(pts), self.min_rise)
            if rate is None:
                # Judged anew only once the series stopped rising over a whole window: a steady
                # leak's RSS pauses while malloc reuses freed memory, and a check in the pause
                # must not make the same leak news again 300 steps later.
                if _fit(list(pts))[0] * (pts[-1][0] - pts[0][0]) < self.min_rise:
                    self._fired_at.pop(series, None)
                continue
            last = self._fired_at.get(series)
            if last is not None and rec.step - last < self.repeat_windows * self.window:
                continue
            self._fired_at[series] = rec.step
            out.append(self._finding(rec, series, what, rate, list(pts)))
        return out

    def _finding(self, rec: StepRecord, series: str, what: str, rate: float, pts: list) -> Finding:
        mib = rate / MiB
        data: dict[str, Any] = {
            "series": series,
            "growth_mib_per_step": mib,
            "first_step": pts[0][0],
            "last_step": pts[-1][0],
            "current_bytes": pts[-1][1],
            "limit_bytes": None,
            "limit_kind": None,
            "limit_step": None,
        }
        room = self.headroom(series) if self.headroom is not None else None
        tail = ""
        if room is not None:
            limit, free, kind = room
            data.update(limit_bytes=limit, limit_kind=kind)
            if free is not None:
                data["limit_step"] = rec.step + int(max(free, 0) / rate)
                tail = f"; at this rate it reaches the {kind} limit ({limit / 2**30:.1f} GiB) at step {data['limit_step']}"
        f = make_finding(
            "memory_growth", rank=rec.rank, step=rec.step, when=rec.time,
            summary=(f"rank {rec.rank}: {what} grows {mib:.3g} MiB per step over steps "
                     f"{pts[0][0]}-{pts[-1][0]} (now {pts[-1][1] / MiB:.0f} MiB){tail}"),
            data=data,
        )
        f.action = GROWTH_ACTION[series]
        return f


class FragmentationDetector(WindowedDetector):
    """Allocator retries in the window (cudaMalloc failed, the cache was freed and the allocation
    retried: each one is a synchronizing stall), or reserved memory far above the step's peak."""

    def judge(self, window: list[StepRecord]) -> Finding | None:
        seen = [r for r in window if r.mem_reserved_bytes is not None]
        if not seen:
            return None
        retries = sum(r.mem_alloc_retries or 0 for r in seen)
        gaps = [r.mem_fragmentation_bytes for r in seen if r.mem_fragmentation_bytes is not None]
        gap = statistics.median(gaps) if gaps else 0
        reserved = statistics.median(r.mem_reserved_bytes for r in seen)
        big_gap = gap >= FRAG_MIN_BYTES and reserved > 0 and gap / reserved >= FRAG_MIN_SHARE
        if not retries and not big_gap:
            return None
        last = window[-1]
        why = []
        if retries:
            why.append(f"{retries} allocator retries")
        if big_gap:
            why.append(f"{gap / 2**30:.1f} GiB of {reserved / 2**30:.1f} GiB reserved unused at the step's peak")
        return make_finding(
            "memory_fragmentation", rank=last.rank, step=last.step, when=last.time,
            summary=f"rank {last.rank}: {' and '.join(why)} over steps {window[0].step}-{last.step}",
            data={"alloc_retries": retries, "gap_bytes": gap, "reserved_bytes": reserved,
                  "first_step": window[0].step, "last_step": last.step},
        )


class NearLimitDetector(WindowedDetector):
    """Device free memory under 5000 MiB (B.7), or host memory in use above 90% of the limit.
    ``host()`` returns the latest ``(used_bytes, limit_bytes, limit_kind)`` sample or None."""

    def __init__(self, window: int, host: Callable[[], Any] | None = None) -> None:
        super().__init__(window)
        self.host = host

    def judge(self, window: list[StepRecord]) -> Finding | None:
        last = window[-1]
        frees = [r.mem_device_free_bytes for r in window if r.mem_device_free_bytes is not None]
        why, data = [], {"first_step": window[0].step, "last_step": last.step}
        if frees and min(frees) < DEVICE_FREE_MIN_MIB * MiB:
            why.append(f"device free memory down to {min(frees) / MiB:.0f} MiB (< {DEVICE_FREE_MIN_MIB} MiB)")
            data["device_free_bytes"] = min(frees)
        h = self.host() if self.host is not None else None
        if h is not None:
            used, limit, kind = h
            if used is not None and limit and used > HOST_USED_MAX * limit:
                why.append(f"host memory in use {used / 2**30:.1f} GiB, {used / limit:.0%} of the {kind} limit "
                           f"({limit / 2**30:.1f} GiB)")
                data.update(host_used_bytes=used, host_limit_bytes=limit, host_limit_kind=kind)
        if not why:
            return None
        data["host_rss_bytes"] = last.host_rss_bytes
        data["workers_pss_bytes"] = last.workers_pss_bytes
        return make_finding(
            "memory_near_limit", rank=last.rank, step=last.step, when=last.time,
            summary=f"rank {last.rank}: {'; '.join(why)} at step {last.step}",
            data=data,
        )
