"""Per step: communication time, how much of it hid behind backward, and bandwidth.

Definitions (per step, per rank):

- ``comm_s``: length of the union of the step's collective spans (overlapping buckets count once)
  and of the training thread's blocked intervals (``extras["comm"]["blocked"]``, blocked.py: the
  job's own collectives, ``Work.wait()``). Host clock: a DDP bucket issued inside a backward ends
  by that backward's return at the latest (DDP waits for it there; gloo's completion callback can
  run later): ``clip_to_backward``. Device-timed spans (CUDA): their union plus the blocked time.
- ``allreduce_s``: sum of the DDP AllReduce spans' durations (buckets in flight together count
  each time).
- ``comm_exposed_s``: the part of the AllReduce union that lies outside this rank's backward
  *compute*: each backward interval from the tracker (``extras["backward_spans"]``), cut at the
  moment the last bucket issued inside it was handed to the hook (its gradients are all computed). ``loss.backward()`` returns only after DDP waited
  for every bucket, so the tracker's interval alone would hide the wait; the last bucket being
  ready is when gradient computation ended. On CUDA the same cut is made on the device clock:
  compute = [end of the DDP forward, last bucket ready], both CUDA events on the compute stream.
  Together with (union, host clock; sum beside device time) the blocked intervals: the time the
  training thread stood in any other collective or wait (FSDP's all-gathers included), which is
  no rank's compute. With the blocked time measured, a step of host-timed FSDP spans has its
  exposure (its blocked intervals); one of device-timed FSDP spans has none (None).
- ``overlap = 1 - (DDP's part of comm_exposed_s) / (AllReduce union)`` (Holistic Trace Analysis'
  comm/compute overlap, per step); only for steps whose spans are all DDP's.
- ``algbw_gbps``: bytes reduced / time in collective, over the step's spans whose bytes are known
  (nccl-tests' algbw, GB = 1e9 bytes). ``busbw_gbps``: algbw times the ring factor, 2(n-1)/n for
  AllReduce and (n-1)/n for all-gather / reduce-scatter (nccl-tests doc/PERFORMANCE.md).
- ``comm_wait_s``: the share of ``allreduce_s`` spent waiting for peers, estimated as the excess
  over the transfer floor: the smallest of the ranks' median per-step ``allreduce_s`` in the last
  exchange window (the last rank to arrive does not wait, so its time is transfer only). None
  until the first window's verdict arrived (and in a single-rank job).
"""

from __future__ import annotations

import sys

from typing import Any

from ..cuda_ext import event_elapsed_s
from ..record import StepRecord
from .findings import MIN_JUDGED_BYTES
from .spans import ALLREDUCE

GB = 1e9  # nccl-tests reports GB/s with GB = 1e9 bytes (doc/PERFORMANCE.md)
# Live bandwidth is judged on messages large enough for a size-scaled baseline (comm/findings.py).
LARGE_BYTES = MIN_JUDGED_BYTES
# Steps whose DDP-only exposure is kept for the overlap finding (read within a pass or two).
DDP_EXPOSED_KEEP = 4096


def bus_factor(op: str, n: int) -> float:
    """nccl-tests doc/PERFORMANCE.md: AllReduce 2(n-1)/n; AllGather and ReduceScatter (n-1)/n."""
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n if op == ALLREDUCE else (n - 1) / n


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of union(a) minus union(b)."""
    ua, ub = union(a), union(b)
    inter = 0.0
    j = 0
    for x0, x1 in ua:
        while j < len(ub) and ub[j][1] <= x0:
            j += 1
        k = j
        while k < len(ub) and ub[k][0] < x1:
            inter += max(0.0, min(x1, ub[k][1]) - max(x0, ub[k][0]))
            k += 1
    return length(ua) - inter


def outside(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of union(a) outside union(b), as intervals (``minus`` is their length)."""
    ub = union(b)
    out: list[tuple[float, float]] = []
    j = 0
    for x0, x1 in union(a):
        while j < len(ub) and ub[j][1] <= x0:
            j += 1
        cur = x0
        k = j
        while k < len(ub) and ub[k][0] < x1:
            if ub[k][0] > cur:
                out.append((cur, ub[k][0]))
            cur = max(cur, ub[k][1])
            k += 1
        if cur < x1:
            out.append((cur, x1))
    return out


def compute_intervals(backward: list[tuple[int, int]], issues: list[float]) -> list[tuple[float, float]]:
    """Each backward interval, cut at the last bucket issued inside it (host clock, ns)."""
    out = []
    for b0, b1 in backward:
        inside = [t for t in issues if b0 <= t <= b1]
        out.append((float(b0), max(inside) if inside else float(b1)))
    return out


def clip_to_backward(iv: list[tuple[float, float]], spans: list, backward: list[tuple[int, int]]) -> list[tuple[float, float]]:
    """Host clock: a DDP bucket's span (``ALLREDUCE``, issued by DDP's comm hook) that was issued
    inside a backward ends, at the latest, when that backward returned: DDP waits for every
    bucket's future before ``loss.backward()`` returns (reducer ``finalize_backward``). The
    completion callback that closes the span runs on gloo's worker after the waiter was woken, and
    needs the GIL, which the training thread holds as it runs on: it can run milliseconds late.
    Such an end is cut at the end of the step's last backward interval (an optimizer step run
    inside the backward splits it in two; the last end is the backward's return or later, so the
    cut never shortens a span that really ran on). Spans issued outside a backward (a joined rank's
    shadow AllReduce), and the other ops (FSDP's, waited for later), are left as they are."""
    if not backward:
        return iv
    last = float(max(b1 for _, b1 in backward))
    out = []
    for (a, b), s in zip(iv, spans):
        if s.op == ALLREDUCE and b > last and any(b0 <= a <= b1 for b0, b1 in backward):
            b = max(a, last)
        out.append((a, b))
    return out


def _cuda_in_use() -> bool:
    """CUDA is initialized in this process: a host-timed span may be NCCL's, whose backward does
    not wait on the host for it (``clip_to_backward`` holds for host waits: gloo's)."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - unknown: do not cut
        return True


class CommEnricher:
    """Background thread: fills the comm fields of a record from ``extras["comm"]``."""

    def __init__(self, window: int = 50, large_sink: Any = None, timeline: Any = None) -> None:
        self.timeline = timeline  # a TimelineWriter: one step's intervals every window
        # Smallest per-step allreduce time reported by any rank (set by the straggler exchange).
        self.global_floor_s: float | None = None
        self._large_sink = large_sink
        # step -> the DDP AllReduce part of its comm_exposed_s where blocked time joined it (the
        # rest is no overlap problem): the overlap finding reads it, on this background thread.
        self._ddp_exposed: dict[int, float] = {}

    def enrich(self, rec: StepRecord, extras: dict, *, force: bool) -> bool:
        c = extras.get("comm")
        if not c:
            return True
        spans = c["spans"]
        # The training thread's blocked intervals (blocked.py), host clock; None: not measured.
        blocked = c.get("blocked")
        if not force and not all(s.done() for s in spans):
            return False
        spans = [s for s in spans if not s.failed and s.done() and (s.t1 is not None or s.ev1 is not None)]
        if not spans and not blocked:
            return True
        blk = [(float(a), float(b)) for a, b in blocked] if blocked else []
        timed = [s for s in spans if s.ev0 is not None and s.ev1 is not None]
        device = bool(timed)
        if device:
            # Device and host clocks do not share an axis: in a job with both (a CPU-side gloo
            # collective beside NCCL ones), the device-timed spans are the step's comm.
            spans = timed
            iv, compute = self._device_intervals(spans, c.get("fwd_end_ev"))
        elif spans:
            bwd = extras.get("backward_spans") or []
            iv = [(float(s.t0), float(s.t1)) for s in spans]
            if not _cuda_in_use():  # NCCL's wait is the stream's: its backward returns before the end
                iv = clip_to_backward(iv, spans, bwd)
            issues = [float(s.t0) for s in spans if s.op == ALLREDUCE]
            compute = compute_intervals(bwd, issues) if issues else None
        else:
            iv, compute = [], None
        ns = 1e-9
        if device:  # the host's blocked time has no place on the device axis: added beside it
            rec.comm_s = (length(union(iv)) + length(union(blk))) * ns
        else:  # one clock: a wait inside a span (FSDP's synchronous all-gather) counts once
            rec.comm_s = length(union(iv + blk)) * ns
        ar = [x for x, s in zip(iv, spans) if s.op == ALLREDUCE]
        only_ddp = len(ar) == len(iv)
        ddp_exposed = None
        if ar:
            rec.allreduce_s = sum(b - a for a, b in ar) * ns
            if compute is not None and only_ddp:
                ddp_exposed = minus(ar, compute) * ns
                comm = length(union(ar)) * ns
                rec.comm_exposed_s = ddp_exposed
                rec.overlap = 1.0 - ddp_exposed / comm if comm > 0 else None
            self._wait(rec)
        if blocked is not None:
            rec.comm_exposed_s = self._exposed(ar, compute, only_ddp, blk, device, ddp_exposed)
            if ddp_exposed is not None:
                self._ddp_exposed[rec.step] = ddp_exposed
                if len(self._ddp_exposed) > DDP_EXPOSED_KEEP:
                    del self._ddp_exposed[next(iter(self._ddp_exposed))]
        if spans:
            self._bandwidth(rec, spans, iv)
            if self.timeline is not None and self.timeline.want(rec.step):
                from .timeline import snapshot

                self.timeline.write(snapshot(rec.step, rec.rank, compute or [], spans, iv))
        return True

    @staticmethod
    def _exposed(ar: list[tuple[float, float]], compute: Any, only_ddp: bool, blk: list[tuple[float, float]],
                 device: bool, ddp_exposed: float | None) -> float | None:
        """The step's exposed communication, with the training thread's blocked time measured:
        DDP's AllReduce outside backward compute together with the blocked intervals.

        Host clock: the union of the two (a wait in a DDP comm hook's own synchronous collective,
        or anything else in both, counts once); a host-timed span that is not DDP's (FSDP's) was
        exposed exactly where the thread stood in it or in its wait, which the blocked intervals
        are. Device clock (CUDA): DDP's device-timed exposure plus the host's blocked time (no
        common axis); with device-timed spans of other collectives (FSDP's on NCCL, waited for by
        the streams, not the host) the exposure is unknown: None, as before."""
        ns = 1e-9
        if device:
            if not only_ddp or ddp_exposed is None:
                return None
            return ddp_exposed + length(union(blk)) * ns
        pieces = outside(ar, compute) if ar and compute is not None else []
        return length(union(pieces + blk)) * ns

    def ddp_exposed_s(self, rec: StepRecord) -> float | None:
        """The DDP AllReduce part of ``rec``'s ``comm_exposed_s`` (the part its ``overlap`` is
        about; the rest is time blocked in other collectives), for the overlap finding. The
        record's own figure where none was kept."""
        got = self._ddp_exposed.pop(rec.step, None)
        return got if got is not None else rec.comm_exposed_s

    def _wait(self, rec: StepRecord) -> None:
        g = self.global_floor_s
        if g is not None:  # unknown until the first exchange window: None, not a guess
            rec.comm_wait_s = max(rec.allreduce_s - g, 0.0)

    def _bandwidth(self, rec: StepRecord, spans: list, iv: list[tuple[float, float]]) -> None:
        nbytes = 0.0
        bus_bytes = 0.0
        dur = 0.0
        for s, (a, b) in zip(spans, iv):
            if s.nbytes is None or b <= a:
                continue
            d = (b - a) * 1e-9
            nbytes += s.nbytes
            bus_bytes += s.nbytes * bus_factor(s.op, s.world)
            dur += d
            if self._large_sink is not None and s.nbytes >= LARGE_BYTES and s.ev0 is not None:
                self._large_sink(rec, s, s.nbytes / d / GB, s.nbytes * bus_factor(s.op, s.world) / d / GB)
        if dur > 0 and hasattr(rec, "algbw_gbps"):
            rec.algbw_gbps = nbytes / dur / GB
            rec.busbw_gbps = bus_bytes / dur / GB

    @staticmethod
    def _device_intervals(spans: list, fwd_end: Any) -> tuple[list[tuple[float, float]], Any]:
        """Device events -> ns on one axis (relative to the forward end, or the first span)."""
        anchor = fwd_end if fwd_end is not None else spans[0].ev0
        ns = 1e9
        iv = []
        for s in spans:
            a = event_elapsed_s(anchor, s.ev0, s.device) * ns if s.ev0 is not anchor else 0.0
            b = event_elapsed_s(anchor, s.ev1, s.device) * ns
            iv.append((a, b))
        if fwd_end is None:
            return iv, None
        issues = [a for (a, _), s in zip(iv, spans) if s.op == ALLREDUCE]
        return iv, ([(0.0, max(issues))] if issues else None)
