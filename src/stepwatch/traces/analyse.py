"""One rank's trace, read as a stream: where the GPU's time went, and why it idled.

Definitions follow HolisticTraceAnalysis 0.5.0 (``hta/common/trace*.py``,
``hta/analyzers/breakdown_analysis.py``, ``communication_analysis.py``), pre-processing included:

* Events: complete events (``ph == "X"``) with a ``cat`` other than ``Trace``. The "GPU row" is
  every event whose ``args.stream`` is an integer other than -1 (kernels, memcpy/memset,
  ``cuda_sync``); ``args.correlation`` links a GPU event to the CPU runtime call that launched it.
* Nanosecond traces (fractional ``ts``): start rounded up, end rounded down, as HTA does
  (pytorch/pytorch#122425: events of one stream overlap by a fraction of a µs otherwise).
* With two or more ``ProfilerStep#`` names in the trace, the last step is dropped: a GPU event is
  kept only when the CPU event of its correlation id starts before the last ``ProfilerStep``
  starts; other events when they start before it.
* Temporal breakdown: the span is the first GPU event's start to the last one's end; idle is the
  span less the union of all GPU events; compute is the union of computation kernels (compute
  overlapping anything counts as compute); non-compute the rest.
* Comm/compute overlap: time both the union of communication kernels and the union of
  computation kernels run, over the union of communication kernels; null without communication.
* Idle time per stream (kernel, memcpy and memset events, in start order): the gap before each
  is *host wait* when its launch came after the previous one ended (the queue was empty), *kernel
  wait* when shorter than 30 µs (HTA's ``consecutive_kernel_delay``), else *other*.
* Host syncs (stepwatch's, not HTA's): a blocking call is one only where the trace shows device
  work it waits on (a GPU row, or CUDA/HIP runtime calls), and only a GPU gap is named by one; a
  CPU job's trace (no GPU row: its gaps are the training thread's time without an op) has none.
* A CPU gap covered at least half by a collective (``gloo:``/``nccl:`` ranges, ``c10d::`` ops), on
  any thread of the process, is a wait on communication (gloo runs the AllReduce on its own
  thread); a collective names at most one gap per thread, the first (``_comm_waits``).

One pass over the file. Memory: per GPU event five numbers in typed arrays (and three per
runtime call with a correlation id), the merged busy intervals of ``aten::`` ops per thread, the
step ranges, and the CPU events that can name a gap: those lasting ``LONG_US`` (0.5 ms, half the
1 ms gap of the sheet) or more, and the blocking calls; never the other events (~1.5% of the CPU
events of the V100 trace are kept). The gaps are known only once every GPU event has been read
(the events of one stream can sit thousands of positions out of time order in the file), so they
are named at the end from what was kept: a gap shorter than 1 ms may be named only by an outer op.
"""

from __future__ import annotations

import heapq
import math
import os
import re
import time
from array import array
from typing import Any

from . import kernels as K
from .reader import EventReader

TOP_GAPS = 5
GAP_MS = 1.0  # B.2: "Gaps > 1 ms between kernels"
TINY_US = 50.0  # B.2: "Many tiny kernels (< 50 µs each)"
KERNEL_WAIT_US = 30.0  # HTA get_idle_time_breakdown's consecutive_kernel_delay default
KERNEL_CATS = frozenset(("kernel", "Kernel", "gpu_memset", "Memset", "gpu_memcpy", "Memcpy", "mtia_ccp_events"))
DEVICE_SYNC_NAMES = frozenset(("Event Sync", "Context Sync"))  # HTA: on stream -1, still GPU events
RUNTIME_CATS = frozenset(("cuda_runtime", "cuda_driver"))  # the host side of device work (CUDA and HIP)
CPU_CATS = frozenset(("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver"))
# The runtime calls whose launch delay HTA measures (``cuda_kernel_launch_stats``: kernel launches
# and the async memcpy/memset), and their HIP names, which HTA 0.5.0 does not list (stepwatch's).
LAUNCH_NAMES = frozenset(("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaMemsetAsync",
                          "hipLaunchKernel", "hipExtLaunchKernel", "hipModuleLaunchKernel",
                          "hipExtModuleLaunchKernel", "hipMemcpyAsync", "hipMemsetAsync"))
# Calls that block the host until the device catches up (CUDA and HIP runtime, and the aten ops
# that copy a device value to the host).
SYNC_NAMES = frozenset((
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
    "hipStreamSynchronize", "hipDeviceSynchronize", "hipEventSynchronize", "hipMemcpy",
    "aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal",
    "aten::tolist", "aten::unique", "aten::_unique2", "aten::masked_select",
))
DATA_RE = re.compile(r"DataLoader|_next_data|__next__|dataloader|collate|fetch", re.I)
# A collective: the backends' ranges (gloo:all_reduce on gloo's thread, nccl:all_reduce, ...), the
# c10d ops (c10d::allreduce_, c10d::barrier) and the profiler's record_param_comms range.
COMM_RE = re.compile(r"^(?:gloo|nccl|rccl|mpi|ucc|xccl):|^c10d::|^record_param_comms$")
STEP_RE = re.compile(r"^(?:ProfilerStep\s*#\s*|stepwatch_step_)(\d+)")
_LIBRARY = re.compile(r"(^|/)(torch|site-packages|dist-packages|threading\.py|<built-in)|^<|^built-in|^torch/")
RANK_NAME_RE = re.compile(r"rank[-_.]?(\d+)")  # a trace's rank in its file name (when the trace has none)
MAX_RANGES = 100_000
LONG_US = 500.0
MAX_CPU_KEPT = 2_000_000  # bound on the CPU events kept to name gaps (16 bytes + ids each)


def _int(v: Any) -> int:
    if v.__class__ is int:
        return v
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


def merge(iv: list[tuple[float, float]]) -> list[list[float]]:
    """Union of intervals sorted by start (HTA: a new group starts only when ts > running end)."""
    out: list[list[float]] = []
    for ts, end in iv:
        if out and ts <= out[-1][1]:
            if end > out[-1][1]:
                out[-1][1] = end
        else:
            out.append([ts, end])
    return out


def _busy(m: list[list[float]]) -> float:
    return sum(e - s for s, e in m)


def _intersection(a: list[list[float]], b: list[list[float]]) -> float:
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            tot += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def _pct(x: float, of: float) -> float | None:
    return round(100.0 * x / of, 2) if of > 0 else None


def _quantile(sorted_xs: list[float], q: float) -> float | None:
    if not sorted_xs:
        return None
    return round(sorted_xs[min(int(q * len(sorted_xs)), len(sorted_xs) - 1)], 2)


class _Pass1:
    """Everything the first pass keeps."""

    def __init__(self) -> None:
        self.floats = False
        # GPU-row events: start, duration, stream, name id, correlation, cat id, HTA's GPU filter.
        self.k_ts, self.k_dur = array("d"), array("d")
        self.k_stream, self.k_name, self.k_corr, self.k_cat = array("q"), array("l"), array("q"), array("l")
        self.k_gf = bytearray()
        self.names: dict[str, int] = {}
        self.cats: dict[str, int] = {}
        # CPU-side events carrying a correlation id (runtime launches): correlation, start, end (NaN
        # unless a call in LAUNCH_NAMES), tid id.
        self.r_corr, self.r_ts, self.r_end, self.r_tid = array("q"), array("d"), array("d"), array("l")
        self.tids: dict[Any, int] = {}
        self.prof_names: set[str] = set()
        self.prof_last: float | None = None
        self.steps: list[tuple[float, float, int, Any, str]] = []  # (ts, end, step, tid, source)
        self.aten: dict[Any, list[list[float]]] = {}
        self.aten_sorted: dict[Any, bool] = {}
        self.syncs: dict[str, list[Any]] = {}  # name -> [count, total_us, longest (ts, dur, tid)]
        self.cpu_seen = False
        self.runtime_seen = False  # a CUDA/HIP runtime or driver call: the process drove a device
        # CPU events that can name a gap (long ones, blocking calls): start, duration, ids.
        self.c_ts, self.c_dur, self.c_name, self.c_tid, self.c_cat = (array("d"), array("d"), array("l"),
                                                                     array("l"), array("l"))
        self.c_dropped = 0
        self.malformed = 0  # complete events skipped: ts/dur not a finite number, dur < 0, args not an object

    def _id(self, table: dict, key: Any) -> int:
        i = table.get(key)
        if i is None:
            i = table[key] = len(table)
        return i

    def feed(self, e: dict[str, Any]) -> None:
        ts = e.get("ts")
        if ts is None or ts.__class__ is float:
            self.floats = True  # HTA rounds when its ts column is float (any float or missing ts)
        if e.get("ph") != "X":
            return
        cat = e.get("cat")
        dur = e.get("dur")
        if cat is None or dur is None or ts is None or cat == "Trace":
            return
        tc, dc = ts.__class__, dur.__class__
        if ((tc is not int and (tc is not float or ts - ts != 0)) or (dc is not int and (dc is not float or dur - dur != 0))
                or dur < 0):
            self.malformed += 1  # a string, NaN or infinite time, a negative duration: not an event HTA could use
            return
        name = e.get("name", "")
        if name.__class__ is not str:
            name = str(name)
        args = e.get("args")
        if args is not None and args.__class__ is not dict:
            self.malformed += 1
            return
        stream = corr = -1
        if args:
            s = args.get("stream")
            if s is not None:
                stream = _int(s)
            c = args.get("correlation")
            if c is not None:
                corr = _int(c)
        gf = (stream >= 0 and corr >= 0) or name in DEVICE_SYNC_NAMES
        if "ProfilerStep" in name:
            self.prof_names.add(name)
            if not gf and (self.prof_last is None or ts > self.prof_last):
                self.prof_last = ts
        if stream != -1:
            self.k_ts.append(ts)
            self.k_dur.append(dur)
            self.k_stream.append(stream)
            self.k_name.append(self._id(self.names, name))
            self.k_corr.append(corr)
            self.k_cat.append(self._id(self.cats, cat))
            self.k_gf.append(1 if gf else 0)
            return
        tid = e.get("tid")
        self.cpu_seen = True
        if cat in RUNTIME_CATS:
            self.runtime_seen = True
        if corr != -1 and not gf:
            self.r_corr.append(corr)
            self.r_ts.append(ts)
            self.r_end.append(ts + dur if name in LAUNCH_NAMES else math.nan)
            self.r_tid.append(self._id(self.tids, tid))
        if name.startswith(("ProfilerStep", "stepwatch_step_")) and len(self.steps) < MAX_RANGES:
            m = STEP_RE.match(name)
            if m:
                self.steps.append((ts, ts + dur, int(m.group(1)), tid, "stepwatch" if name[0] == "s" else "profiler"))
        if name.startswith("aten::"):
            lst = self.aten.get(tid)
            if lst is None:
                lst = self.aten[tid] = []
                self.aten_sorted[tid] = True
            end = ts + dur
            if lst and self.aten_sorted[tid]:
                last = lst[-1]
                if ts < last[0]:
                    self.aten_sorted[tid] = False
                    lst.append([ts, end])
                elif ts <= last[1]:
                    if end > last[1]:
                        last[1] = end
                else:
                    lst.append([ts, end])
            else:
                lst.append([ts, end])
        if cat in CPU_CATS and (dur >= LONG_US or name in SYNC_NAMES):
            if len(self.c_ts) < MAX_CPU_KEPT:
                self.c_ts.append(ts)
                self.c_dur.append(dur)
                self.c_name.append(self._id(self.names, name))
                self.c_tid.append(self._id(self.tids, tid))
                self.c_cat.append(self._id(self.cats, cat))
            else:
                self.c_dropped += 1
        if name in SYNC_NAMES:
            st = self.syncs.get(name)
            if st is None:
                st = self.syncs[name] = [0, 0.0, None]
            st[0] += 1
            st[1] += dur
            if st[2] is None or dur > st[2][1]:
                st[2] = (ts, dur, tid)


class _Namer:
    """For each target interval (a gap, the longest host sync), the kept CPU events around it."""

    def __init__(self, gaps: list[dict[str, Any]], tids: set[Any] | None, sync: tuple[float, float, Any] | None) -> None:
        self.gaps = gaps
        self.tids = tids
        self.cover: list[tuple[float, str, str] | None] = [None] * len(gaps)  # innermost covering >= 50%
        # A CPU gap's collectives on any thread of the process covering >= 50% of it: (ts, dur, name, cat, tid).
        self.comm: list[list[tuple[float, float, str, str, Any]]] = [[] for _ in gaps]
        self.sync: list[tuple[float, str, float, float] | None] = [None] * len(gaps)
        self.stacks: list[list[tuple[float, float, str]]] = [[] for _ in gaps]  # python frames at the gap start
        self.sync_target = sync
        self.sync_stack: list[tuple[float, float, str]] = []

    def add(self, cat: str, name: str, tid: Any, ts: float, dur: float) -> None:
        end = ts + dur
        st = self.sync_target
        if cat == "python_function" and st is not None and st[2] == tid and ts <= st[0] and end >= st[0] + st[1]:
            self.sync_stack.append((ts, dur, name))
        if COMM_RE.match(name):
            # The training thread of a CPU job waits on a collective that runs on another thread
            # (gloo's): the gap is that wait, whichever thread the collective's range is on.
            for i, g in enumerate(self.gaps):
                gs, ge = g["_s"], g["_e"]
                if g["where"] == "cpu" and min(end, ge) - max(ts, gs) >= 0.5 * (ge - gs):
                    self.comm[i].append((ts, dur, name, cat, tid))
        if self.tids is not None and tid not in self.tids:
            return
        for i, g in enumerate(self.gaps):
            gs, ge = g["_s"], g["_e"]
            if ts > ge or end < gs - 5.0:
                continue
            if name in SYNC_NAMES and g["where"] == "gpu" and end >= gs - 5.0:
                # Only a GPU gap has a host sync: the CPU waited on the device, which then idled.
                cur = self.sync[i]
                if cur is None or end > cur[2]:
                    self.sync[i] = (dur, name, end, ts)
            if cat == "python_function" and ts <= gs <= end:
                self.stacks[i].append((ts, dur, name))
            ov = min(end, ge) - max(ts, gs)
            if ov >= 0.5 * (ge - gs) and not name.startswith(("ProfilerStep", "stepwatch_step_")):
                cur = self.cover[i]
                if cur is None or dur < cur[0]:
                    self.cover[i] = (dur, name, cat)


def _comm_waits(gaps: list[dict[str, Any]], cands: list[list[tuple[float, float, str, str, Any]]]) -> list[tuple | None]:
    """Per gap, the collective it waited on, or None. A thread waits on a collective once: after
    the wait it runs on (DDP copies the bucket back), and a collective whose range goes on past
    that (gloo's completion callbacks run on its thread) explains no later gap of that thread. So
    the gaps are taken in time order, each with the shortest candidate no earlier gap of its
    thread took."""
    out: list[tuple | None] = [None] * len(gaps)
    used: set[tuple[Any, tuple]] = set()
    for i in sorted(range(len(gaps)), key=lambda i: gaps[i]["_s"]):
        tid = gaps[i].get("_tid")
        free = [c for c in cands[i] if (tid, c) not in used]
        if free:
            out[i] = min(free, key=lambda c: c[1])
            used.add((tid, out[i]))
    return out


def _call_site(frames: list[tuple[float, float, str]], inside: tuple[float, float] | None = None) -> str | None:
    """The innermost Python frame of the user's code (not torch, not the standard library)."""
    best = None
    for ts, dur, name in frames:
        if inside is not None and not (ts <= inside[0] and ts + dur >= inside[1]):
            continue
        if _LIBRARY.search(name):
            continue
        if best is None or dur < best[1]:
            best = (ts, dur, name)
    return best[2] if best else None


def _step_at(steps: list[tuple[float, float, int, Any, str]], t: float) -> int | None:
    for s, e, n, _tid, _src in steps:
        if s <= t <= e:
            return n
    return None


def _rank_of(meta: dict[str, Any], path: str) -> int | None:
    di = meta.get("distributedInfo")
    if isinstance(di, dict) and isinstance(di.get("rank"), int):
        return di["rank"]
    m = RANK_NAME_RE.search(os.path.basename(path))
    return int(m.group(1)) if m else None


def _steps_as_recorded(steps: list[tuple[float, float, int, Any, str]], ends: dict[int, float],
                       base_us: float) -> list[tuple[float, float, int, Any, str]]:
    """stepwatch's step ranges as its records count the steps, from where each step ended (``ends``:
    step -> wall-clock seconds, the capture's ``step_ends``; ``base_us``: the trace's
    ``baseTimeNanoseconds`` in µs, its ``ts`` being µs after it): step N runs from step N-1's end
    to its own. A range only closes when the next step's first phase begins, which for the job's
    last step is its shutdown: the script's teardown after the loop was a gap "in" that step. A
    range of a step that never ended (opened by the last step's end at shutdown) is no step. Other
    ranges (``ProfilerStep#``) stay as they are."""
    ours = sorted(r for r in steps if r[4] == "stepwatch")
    out = [r for r in steps if r[4] != "stepwatch"]
    prev: float | None = None
    for s, e, n, tid, src in ours:
        end = ends.get(n)
        if end is None:
            continue
        start = s if prev is None else prev
        end = min(max(end * 1e6 - base_us, start), e)  # within its range: a clock step cannot widen it
        out.append((start, end, n, tid, src))
        prev = end
    return out


def analyse(path: str, *, rank: int | None = None, top_gaps: int = TOP_GAPS,
            step_ends: dict[int, float] | None = None) -> dict[str, Any]:
    """The summary of one trace file (the ``--json`` object of docs/traces.md, findings aside).
    ``step_ends``: where each captured step ended (wall-clock seconds), from the capture's
    metadata: the step ranges are then the steps as recorded (:func:`_steps_as_recorded`)."""
    t0 = time.perf_counter()
    p1 = _Pass1()
    reader = EventReader(path)
    for ev in reader:
        p1.feed(ev)
    if step_ends is not None:
        base = reader.meta.get("baseTimeNanoseconds")
        p1.steps = _steps_as_recorded(p1.steps, step_ends, base / 1e3 if isinstance(base, (int, float)) else 0.0)
    out: dict[str, Any] = {"rank": rank if rank is not None else _rank_of(reader.meta, path), "trace": path,
                           "events": reader.events, "passes": 1}
    rnd = p1.floats
    ceil, floor = (math.ceil, math.floor) if rnd else (float, float)
    # Runtime calls by correlation id, only for the GPU events' ids (a dict of all would be large).
    launch: dict[int, float | None] = dict.fromkeys(p1.k_corr)  # None: no launch seen (yet)
    launch.pop(-1, None)
    # HTA's launch delay runs from the end of the launch call (a call that itself blocks, lazy
    # module loading for one, is no delay between launch and start).
    launch_end: dict[int, float] = {}
    launch_tids: set[int] = set()
    for c, ts, end, tid in zip(p1.r_corr, p1.r_ts, p1.r_end, p1.r_tid):
        if c in launch and launch[c] is None:
            launch[c] = ceil(ts)
            launch_tids.add(tid)
            if end == end:  # not NaN: a kernel launch or an async memcpy/memset
                launch_end[c] = floor(end)
    p1.r_corr = p1.r_ts = p1.r_end = p1.r_tid = array("q")  # done with: the memory goes back before the sort
    # A blocking call is a host sync only where the trace shows device work it waits on: a GPU row,
    # or CUDA/HIP runtime calls. In a CPU job's trace aten::item and the like wait on nothing.
    device = len(p1.k_ts) > 0 or p1.runtime_seen
    if not device:
        p1.syncs = {}
    drop = len(p1.prof_names) >= 2 and p1.prof_last is not None
    last_start = ceil(p1.prof_last) if drop else None
    ev: list[tuple[float, float, int, int, int, int]] = []  # ts, end, stream, name, corr, cat
    dropped = 0
    for i in range(len(p1.k_ts)):
        ts = ceil(p1.k_ts[i])
        end = floor(p1.k_ts[i] + p1.k_dur[i])
        c = p1.k_corr[i]
        if drop:
            if p1.k_gf[i]:
                lt = launch.get(c)
                if lt is None or lt >= last_start:
                    dropped += 1
                    continue
            elif ts >= last_start:
                dropped += 1
                continue
        ev.append((ts, end, p1.k_stream[i], p1.k_name[i], c, p1.k_cat[i]))
    p1.k_ts = p1.k_dur = p1.k_stream = p1.k_name = p1.k_corr = p1.k_cat = array("q")
    out["steps"] = {"profiler_steps": len(p1.prof_names), "last_step_dropped": drop, "gpu_events_dropped": dropped,
                    "ns_rounding": rnd, "stepwatch_steps": sorted({s[2] for s in p1.steps if s[4] == "stepwatch"})}
    names = [None] * len(p1.names)
    for n, i in p1.names.items():
        names[i] = n  # type: ignore[call-overload]
    kernel_cat_ids = {i for c, i in p1.cats.items() if c in KERNEL_CATS}
    gaps: list[dict[str, Any]] = []
    origin = min((s[0] for s in p1.steps), default=None)
    if ev:
        ev.sort()
        origin = ev[0][0] if origin is None else min(origin, ev[0][0])
        allm = merge([(e[0], e[1]) for e in ev])
        out.update(_gpu_summary(ev, allm, names, kernel_cat_ids, launch, launch_end))
        cand = [(allm[i + 1][0] - allm[i][1], allm[i][1], allm[i + 1][0]) for i in range(len(allm) - 1)]
        big = [c for c in cand if c[0] > GAP_MS * 1000.0]
        out["gaps_over_1ms"] = {"count": len(big), "total_us": round(sum(c[0] for c in big), 1)}
        for d, s, e in heapq.nlargest(top_gaps, cand):
            if d > 0:
                gaps.append({"_s": s, "_e": e, "dur_us": round(d, 1), "step": _step_at(p1.steps, s), "where": "gpu"})
        # Threads that launched work: the CPU side worth naming.
        tid_names = {i: t for t, i in p1.tids.items()}
        tids = {tid_names[t] for t in launch_tids} or None
    else:
        out.update({"temporal": None, "comm_comp_overlap_pct": None, "idle_breakdown": {}, "kernels": None,
                    "launch": None, "note": "no GPU kernels"})
        tids = None
        gaps = _cpu_gaps(p1, top_gaps)
        big = [g for g in gaps if g["dur_us"] > GAP_MS * 1000.0]
        out["gaps_over_1ms"] = {"count": len(big), "total_us": round(sum(g["dur_us"] for g in big), 1)}
        if gaps:
            tids = {g["_tid"] for g in gaps}
    longest_sync = None
    for name, (n, tot, inst) in p1.syncs.items():
        if longest_sync is None or inst[1] > longest_sync[1][1]:
            longest_sync = (name, inst)
    p2 = None
    if (gaps or longest_sync) and p1.cpu_seen:
        p2 = _Namer(gaps, tids, longest_sync[1] if longest_sync else None)
        tid_of = {i: t for t, i in p1.tids.items()}
        cat_of = {i: c for c, i in p1.cats.items()}
        for ts, dur, nid, tid, cid in zip(p1.c_ts, p1.c_dur, p1.c_name, p1.c_tid, p1.c_cat):
            p2.add(cat_of[cid], names[nid], tid_of[tid], ts, dur)
    if p1.c_dropped:
        out["cpu_events_not_kept"] = p1.c_dropped
    if p1.malformed:
        out["malformed_events"] = p1.malformed
        what = f"{p1.malformed} malformed event(s) skipped"
        out["note"] = f"{out['note']}; {what}" if out.get("note") else what
    comm = _comm_waits(gaps, p2.comm) if p2 else [None] * len(gaps)
    for i, g in enumerate(gaps):
        g["start_us"] = round(g["_s"] - origin, 1) if origin is not None else None
        cover = p2.cover[i] if p2 else None
        sync = p2.sync[i] if p2 else None
        g["cpu_op"] = cover[1] if cover else None
        g["cpu_cat"] = cover[2] if cover else None
        g["host_sync"] = sync[1] if sync else None
        if sync is not None and g["where"] == "gpu":
            g["cause"] = "host_sync"
            g["call_site"] = _call_site(p2.stacks[i], (sync[3], sync[2])) if p2 else None
        elif cover and DATA_RE.search(cover[1]):
            g["cause"] = "data_loading"
            g["call_site"] = _call_site(p2.stacks[i]) if p2 else None
        elif cover and cover[1].startswith(("cudaLaunch", "hipLaunch", "cuLaunch", "hipExtModuleLaunch")):
            g["cause"] = "launch"
            g["call_site"] = None
        elif comm[i] is not None:
            # A CPU gap the thread spent waiting on a collective (on gloo's thread, or its own).
            g["cause"] = "communication"
            g["cpu_op"], g["cpu_cat"] = comm[i][2], comm[i][3]
            g["call_site"] = _call_site(p2.stacks[i]) if p2 else None
        else:
            # No kept op over it: a gap of 1 ms or more is Python between ops (any op covering half
            # of it would have been kept); a shorter one stays unnamed (null).
            g["cause"] = "cpu" if cover else ("python" if g["dur_us"] >= 2 * LONG_US else None)
            g["call_site"] = _call_site(p2.stacks[i]) if p2 else None
        del g["_s"], g["_e"]
        g.pop("_tid", None)
    out["gaps"] = gaps
    syncs = []
    for name, (n, tot, inst) in sorted(p1.syncs.items(), key=lambda kv: -kv[1][1]):
        in_step = any(s <= inst[0] <= e for s, e, *_ in p1.steps) if p1.steps else None
        syncs.append({"op": name, "count": n, "total_us": round(tot, 1), "longest_us": round(inst[1], 1),
                      "in_step": in_step, "step": _step_at(p1.steps, inst[0])})
    for s in syncs:
        s["call_site"] = None
        if p2 is not None and longest_sync is not None and s["op"] == longest_sync[0]:
            s["call_site"] = _call_site(p2.sync_stack)  # the longest instance's, when the trace has stacks
    out["host_syncs"] = syncs
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def _gpu_summary(ev: list[tuple], allm: list[list[float]], names: list, kernel_cat_ids: set[int],
                 launch: dict[int, float | None], launch_end: dict[int, float]) -> dict[str, Any]:
    types: dict[int, int] = {}
    classes: dict[int, str] = {}
    for nid in {e[3] for e in ev}:
        t = K.hta_type(names[nid])
        types[nid] = t
        classes[nid] = K.kernel_class(names[nid], t)
    span = allm[-1][1] - allm[0][0]
    busy = _busy(allm)
    comp = merge([(e[0], e[1]) for e in ev if types[e[3]] == K.COMPUTATION])
    comm = merge([(e[0], e[1]) for e in ev if types[e[3]] == K.COMMUNICATION])
    compute = _busy(comp)
    idle = span - busy
    temporal = {"idle_pct": _pct(idle, span), "compute_pct": _pct(compute, span),
                "non_compute_pct": _pct(span - compute - idle, span), "span_us": round(span, 1)}
    comm_t = _busy(comm)
    overlap = _pct(_intersection(comm, comp), comm_t) if comm else None
    # Idle per stream, and the launch behaviour, over kernel/memcpy/memset events.
    streams: dict[int, list[float]] = {}
    prev_end: dict[int, float] = {}
    delays: list[float] = []
    transitions = empties = 0
    for ts, end, stream, nid, corr, cat in ev:
        if cat not in kernel_cat_ids:
            continue
        lt = launch.get(corr)
        le = launch_end.get(corr)
        if le is not None:
            delays.append(max(ts - le, 0.0))  # HTA clips at 0
        pe = prev_end.get(stream)
        prev_end[stream] = end
        if pe is None:
            streams.setdefault(stream, [0.0, 0.0, 0.0])
            continue
        gap = ts - pe
        acc = streams[stream]
        transitions += 1
        if lt is not None and lt > pe:
            acc[0] += gap
            empties += 1
        elif gap < KERNEL_WAIT_US:
            acc[1] += gap
        else:
            acc[2] += gap
    idle_bd = {}
    for s, (h, k, o) in sorted(streams.items()):
        tot = h + k + o
        idle_bd[str(s)] = {"host_wait_us": round(h, 1), "kernel_wait_us": round(k, 1), "other_us": round(o, 1),
                           "host_wait_pct": _pct(h, tot), "kernel_wait_pct": _pct(k, tot), "other_pct": _pct(o, tot)}
    delays.sort()
    launch_out = {"kernels_with_launch": len(delays), "delay_us": {
        "median": _quantile(delays, 0.5), "p90": _quantile(delays, 0.9), "p99": _quantile(delays, 0.99),
        "max": round(delays[-1], 2) if delays else None},
        "queue_empty_count": empties, "queue_empty_pct": _pct(empties, transitions)}
    by_class: dict[str, list[float]] = {c: [0, 0.0] for c in K.CLASSES}
    by_name: dict[int, list[float]] = {}
    total = tiny_t = 0.0
    tiny_n = n = 0
    for ts, end, stream, nid, corr, cat in ev:
        if cat not in kernel_cat_ids:
            continue
        d = end - ts
        n += 1
        total += d
        if d < TINY_US:
            tiny_n += 1
            tiny_t += d
        c = by_class[classes[nid]]
        c[0] += 1
        c[1] += d
        bn = by_name.setdefault(nid, [0, 0.0])
        bn[0] += 1
        bn[1] += d
    top = heapq.nlargest(5, by_name.items(), key=lambda kv: kv[1][1])
    kern = {"count": n, "time_us": round(total, 1), "tiny_count": tiny_n, "tiny_time_pct": _pct(tiny_t, total),
            "classes": {c: {"count": int(v[0]), "time_us": round(v[1], 1), "time_pct": _pct(v[1], total)}
                        for c, v in by_class.items() if v[0]},
            "top": [{"name": short, "class": classes[nid], "count": int(v[0]), "time_us": round(v[1], 1)}
                    for short, (nid, v) in zip(K.short_names([names[nid] for nid, _ in top]), top)]}
    return {"temporal": temporal, "comm_comp_overlap_pct": overlap, "idle_breakdown": idle_bd, "kernels": kern,
            "launch": launch_out}


def _cpu_gaps(p1: _Pass1, top_gaps: int) -> list[dict[str, Any]]:
    """A CPU capture (no GPU row): time inside a step range on its thread covered by no aten:: op."""
    steps = [s for s in p1.steps if s[4] == "stepwatch"] or p1.steps
    cand: list[tuple[float, float, float, int, Any]] = []
    merged: dict[Any, list[list[float]]] = {}
    first: dict[Any, int] = {}  # per thread: the first merged op that ends after the last step's start
    for s, e, n, tid, _src in sorted(steps, key=lambda st: st[0]):
        m = merged.get(tid)
        if m is None:
            lst = p1.aten.get(tid, [])
            if not p1.aten_sorted.get(tid, True):
                lst.sort()
            m = merged[tid] = merge([(a, b) for a, b in lst])
            first[tid] = 0
        i = first[tid]
        while i < len(m) and m[i][1] <= s:  # steps in start order: ops before this one's start are done with
            i += 1
        first[tid] = i  # (a walk from the first op for every step was quadratic: 16,000 steps took 106 s)
        cur = s
        while i < len(m):
            a, b = m[i]
            if a >= e:
                break
            if a > cur:
                cand.append((a - cur, cur, a, n, tid))
            cur = max(cur, b)
            i += 1
        if e > cur:
            cand.append((e - cur, cur, e, n, tid))
    return [{"_s": s, "_e": e, "_tid": tid, "dur_us": round(d, 1), "step": n, "where": "cpu"}
            for d, s, e, n, tid in heapq.nlargest(top_gaps, cand) if d > 0]
