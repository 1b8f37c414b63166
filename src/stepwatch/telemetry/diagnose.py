"""GPU health findings: telemetry samples, joined with the step records where the diagnosis needs them.

Thresholds come from the reference sheet (B.4 field table and SM Activity Diagnostic Matrix, B.9,
B.10), corrected where the issue says it is wrong (DCGM profiling fields are ratios 0-1). Where
the reference gives no number (what "a clock drop" or "varying" means), the constant is
stepwatch's own and says so.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ..analysis.kinds import make_finding
from ..record import Finding, StepRecord
from .fields import REASONS_KEY, XIDS_KEY
from .throttle import BY_NAME, THERMAL_BITS
from .xid import describe

# Reference B.4 field table: "GPU_TEMP > 83 C -> throttle risk".
THROTTLE_TEMP_C = 83.0
# stepwatch: a "clock drop" is the SM clock 10% or more under the highest clock seen while no
# thermal reason was set (the boost clock a loaded GPU actually holds, not the datasheet maximum).
CLOCK_DROP = 0.10
# HwSlowdown (0x8) covers heat, power brake and over-current (nvml.h); it counts as thermal only
# above the temperature threshold.
_HW_SLOWDOWN = BY_NAME["HwSlowdown"].bit

# Reference B.4 field table (percent there; DCGM exports ratios).
SM_HIGH, SM_LOW = 0.85, 0.50
TENSOR_HIGH, TENSOR_LOW = 0.60, 0.20
FP64_BUG = 0.05
# stepwatch: the matrix says only "High/Low" for DRAM; half of peak bandwidth splits them.
DRAM_HIGH = 0.50
# Reference B.9: "avg_wait_ms > 10ms -> data loading is bottlenecking GPU". stepwatch adds that the
# wait must also be 10% of step time, so a 10 ms wait on a 5 s step is not blamed.
DATA_WAIT_S = 0.010
DATA_WAIT_SHARE = 0.10
# stepwatch: judge the matrix over a minute of samples, repeat a row at most every 10 minutes
# (the reference's SM-underutilised alert waits 10m).
MATRIX_WINDOW_S = 60.0
MATRIX_MIN_SAMPLES = 5
MATRIX_REPEAT_S = 600.0
# Reference B.9: "a healthy training job loses 2-8% MFU to checkpoint overhead"; storage checklist
# "> 10 GB/s healthy; < 2 GB/s -> storage degraded".
CHECKPOINT_SHARE_MAX = 0.08
CHECKPOINT_GBPS_DEGRADED = 2.0
# stepwatch: a save smaller than this says nothing about storage bandwidth (its time is open,
# pickling and metadata latency; a 2 KB save "writes" 0.00 GB/s): only larger saves are judged.
CHECKPOINT_MIN_BYTES = 100_000_000
# stepwatch: straggler = a rank whose SM activity std-dev is >= 0.10 while the others' median is
# <= 0.05 (ratio units), over at least 5 samples each.
STRAGGLER_STD = 0.10
STEADY_STD = 0.05
STRAGGLER_MIN_SAMPLES = 5


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    severity: str
    diagnosis: str
    action: str


# Reference B.4 "SM Activity Diagnostic Matrix" rows that are not healthy, plus the data-loader
# split of the low row (joined with the records) and the FP64 line of the field table.
ROWS = {
    "tensor_unused": Row(
        "tensor_unused", "warning",
        "SM busy but Tensor Cores unused (SM high, tensor low, DRAM low): wrong dtype or misaligned dims.",
        "Train in BF16/FP16 (autocast) or enable TF32; make matmul dims multiples of 8 (BF16) or 16 (INT8).",
    ),
    "memory_bound": Row(
        "memory_bound", "warning",
        "Memory-bound with no Tensor Core work (SM high, tensor low, DRAM high): elementwise-dominated.",
        "Fuse elementwise ops (torch.compile, fused optimizers/norms); check for accidental FP32 copies.",
    ),
    "data_stall": Row(
        "data_stall", "warning",
        "GPU mostly idle (SM, tensor, DRAM low) while the step records show the loop waiting on the "
        "DataLoader: the data loader, not the GPU, is the bottleneck.",
        "Increase DataLoader num_workers, pin_memory=True, prefetch_factor; move decoding off the "
        "critical path; check storage (`stepwatch doctor --storage`).",
    ),
    "launch_overhead": Row(
        "launch_overhead", "warning",
        "GPU mostly idle (SM, tensor, DRAM low) with no data wait: launch overhead or a host-side stall.",
        "Open an nsys timeline (`nsys profile --trace=cuda,nvtx,osrt`) and look for gaps between "
        "kernels; use CUDA graphs or torch.compile, larger batches, fewer host syncs.",
    ),
    "fp64": Row(
        "fp64", "warning",
        "FP64 pipe active above 5%: an FP64 fallback (a float64 tensor or op) in an AI workload.",
        "Find the float64 tensors (torch.get_default_dtype(), numpy float64 inputs) and cast them.",
    ),
}


def classify(sm: float | None, tensor: float | None, dram: float | None, fp64: float | None = None,
             data_wait_s: float | None = None, data_share: float | None = None) -> str | None:
    """The unhealthy matrix row for window means (ratios), or None (healthy, unknown, in between)."""
    if fp64 is not None and fp64 > FP64_BUG:
        return "fp64"
    if sm is None or tensor is None:
        return None
    if sm > SM_HIGH and tensor < TENSOR_LOW:
        if dram is None:
            return None
        return "memory_bound" if dram >= DRAM_HIGH else "tensor_unused"
    if sm < SM_LOW and tensor < TENSOR_LOW and (dram is None or dram < DRAM_HIGH):
        stalled = (data_wait_s is not None and data_share is not None
                   and data_wait_s > DATA_WAIT_S and data_share >= DATA_WAIT_SHARE)
        return "data_stall" if stalled else "launch_overhead"
    return None


def _mean(vals: list[float]) -> float | None:
    return sum(vals) / len(vals) if vals else None


class Analyzer:
    """Turns samples (and records) into findings, remembering what it already reported.

    One per rank; called from the session's background thread only. Memory is bounded: a minute
    of samples and the records of the same span.
    """

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self._baseline_clock: float | None = None
        self._throttling = False
        self._dbe: int | None = None
        self._crc: int | None = None
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=1200)
        self._records: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=4096)
        self._last_matrix_t: float | None = None
        self._reported: dict[str, float] = {}
        self._last_step: int | None = None

    def analyze(self, samples: Sequence[dict[str, Any]], records: Sequence[StepRecord] = ()) -> list[Finding]:
        for r in records:
            self._records.append((r.time, r.step_s, r.data_wait_s))
            self._last_step = r.step
        out: list[Finding] = []
        for s in samples:
            self._recent.append(s)
            out.extend(self._health(s))
        out.extend(self._matrix())
        return out

    # -- per-sample health: throttle episodes, XIDs, ECC, NVLink --
    def _health(self, s: dict[str, Any]) -> list[Finding]:
        out: list[Finding] = []
        t = s.get("time")
        where = f"GPU {s.get('gpu')} ({s.get('uuid') or 'uuid unknown'})"
        temp = s.get("DCGM_FI_DEV_GPU_TEMP")
        mask = s.get("DCGM_FI_DEV_CLOCKS_EVENT_REASONS")
        clock = s.get("DCGM_FI_DEV_SM_CLOCK")
        hot = temp is not None and temp > THROTTLE_TEMP_C
        thermal_bit = mask is not None and (mask & THERMAL_BITS or (hot and mask & _HW_SLOWDOWN))
        if mask is not None and not thermal_bit and clock is not None:
            if self._baseline_clock is None or clock > self._baseline_clock:
                self._baseline_clock = float(clock)
        dropped = (clock is not None and self._baseline_clock is not None
                   and clock <= self._baseline_clock * (1.0 - CLOCK_DROP))
        throttling = bool(hot and thermal_bit and dropped)
        if throttling and not self._throttling:
            reasons = [r for r in s.get(REASONS_KEY, []) if r != "GpuIdle"]
            out.append(make_finding(
                "thermal_throttle", rank=self.rank, step=self._last_step, when=t,
                summary=(f"{where} throttling: {temp} C, SM clock {clock} MHz vs {self._baseline_clock:.0f} "
                         f"MHz healthy, reasons {', '.join(reasons)}"),
                data={"gpu": s.get("gpu"), "uuid": s.get("uuid"), "temp_c": temp, "sm_clock_mhz": clock,
                      "baseline_clock_mhz": self._baseline_clock, "reasons": reasons, "mask": mask},
            ))
        # An episode ends when a sample shows the condition gone (a sample lacking fields says nothing).
        if temp is not None and mask is not None:
            self._throttling = throttling
        for ev in s.get(XIDS_KEY) or ():
            name, sev, action = describe(ev["xid"])
            out.append(make_finding(
                "xid", rank=self.rank, step=self._last_step, when=ev.get("time", t), severity=sev,
                summary=f"{where}: XID {ev['xid']} {name}. Action: {action}",
                data={"gpu": s.get("gpu"), "uuid": s.get("uuid"), "xid": ev["xid"], "name": name, "action": action},
            ))
        dbe = s.get("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL")
        if dbe is not None:
            if (self._dbe is None and dbe > 0) or (self._dbe is not None and dbe > self._dbe):
                new = dbe - (self._dbe or 0)
                out.append(make_finding(
                    "ecc_uncorrectable", rank=self.rank, step=self._last_step, when=t,
                    summary=f"{where}: {new} new uncorrectable ECC error(s), {dbe} since driver load",
                    data={"gpu": s.get("gpu"), "uuid": s.get("uuid"), "dbe_total": dbe, "dbe_new": new},
                ))
            self._dbe = dbe
        crc = s.get("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL")
        if crc is not None:
            if self._crc is not None and crc > self._crc:
                out.append(make_finding(
                    "nvlink_degraded", rank=self.rank, step=self._last_step, when=t,
                    summary=f"{where}: {crc - self._crc:.0f} new NVLink CRC flit error(s), {crc:.0f} total",
                    data={"gpu": s.get("gpu"), "uuid": s.get("uuid"), "crc_total": crc, "crc_new": crc - self._crc},
                ))
            self._crc = crc
        return out

    # -- the SM activity matrix over the last minute, joined with the records --
    def _matrix(self) -> list[Finding]:
        if not self._recent:
            return []
        now = self._recent[-1].get("time", 0.0)
        while self._recent and self._recent[0].get("time", 0.0) < now - MATRIX_WINDOW_S:
            self._recent.popleft()
        if self._last_matrix_t is not None and now - self._last_matrix_t < MATRIX_WINDOW_S:
            return []
        window = [s for s in self._recent if s.get("DCGM_FI_PROF_SM_ACTIVE") is not None]
        if len(window) < MATRIX_MIN_SAMPLES:
            return []
        self._last_matrix_t = now
        t0 = window[0]["time"]
        sm = _mean([s["DCGM_FI_PROF_SM_ACTIVE"] for s in window])
        tensor = _mean([s["DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"] for s in window
                        if s.get("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE") is not None])
        dram = _mean([s["DCGM_FI_PROF_DRAM_ACTIVE"] for s in window if s.get("DCGM_FI_PROF_DRAM_ACTIVE") is not None])
        fp64 = _mean([s["DCGM_FI_PROF_PIPE_FP64_ACTIVE"] for s in window
                      if s.get("DCGM_FI_PROF_PIPE_FP64_ACTIVE") is not None])
        recs = [(st, dw) for (rt, st, dw) in self._records if t0 <= rt <= now]
        wait = share = None
        if recs:
            wait = sum(dw for _, dw in recs) / len(recs)
            total = sum(st for st, _ in recs)
            share = (sum(dw for _, dw in recs) / total) if total > 0 else None
        row = classify(sm, tensor, dram, fp64, wait, share)
        if row is None:
            return []
        last = self._reported.get(row)
        if last is not None and now - last < MATRIX_REPEAT_S:
            return []
        self._reported[row] = now
        r = ROWS[row]
        fmt = lambda v: "unknown" if v is None else f"{v:.2f}"  # noqa: E731
        summary = (f"GPU {window[-1].get('gpu')}: SM active {fmt(sm)}, tensor {fmt(tensor)}, DRAM {fmt(dram)}"
                   + (f", FP64 {fmt(fp64)}" if fp64 is not None else "")
                   + (f"; data wait {wait * 1000:.1f} ms/step ({share:.0%} of step time)"
                      if wait is not None and share is not None else "")
                   + f" over {now - t0:.0f} s -> {r.name}")
        f = make_finding("sm_activity", rank=self.rank, step=self._last_step, when=now, severity=r.severity,
                         summary=summary,
                         data={"row": r.name, "sm_active": sm, "tensor_active": tensor, "dram_active": dram,
                               "fp64_active": fp64, "data_wait_s": wait, "data_wait_share": share,
                               "samples": len(window), "records": len(recs)})
        # The kind names the matrix; the row carries its own diagnosis and action.
        f.diagnosis, f.action = r.diagnosis, r.action
        return [f]


def sm_series(samples: Iterable[dict[str, Any]]) -> list[float]:
    """A rank's SM activity series (ratios), for :func:`find_gpu_stragglers`."""
    return [s["DCGM_FI_PROF_SM_ACTIVE"] for s in samples if s.get("DCGM_FI_PROF_SM_ACTIVE") is not None]


def find_gpu_stragglers(series: dict[int, Sequence[float]], *, rank: int = 0, step: int | None = None,
                        when: float | None = None) -> list[Finding]:
    """Ranks whose SM activity varies while the others hold (B.4 matrix, last row).

    ``series`` maps rank -> SM activity samples over the same period. ``rank`` is the reporting
    rank (the one that gathered the series).
    """
    stds = {r: statistics.pstdev(v) for r, v in series.items() if len(v) >= STRAGGLER_MIN_SAMPLES}
    if len(stds) < 2:
        return []
    out = []
    for r, sd in sorted(stds.items()):
        others = [s for q, s in stds.items() if q != r]
        med = statistics.median(others)
        if sd >= STRAGGLER_STD and med <= STEADY_STD:
            vals = series[r]
            out.append(make_finding(
                "gpu_straggler", rank=rank, step=step, when=when,
                summary=(f"rank {r}: SM activity varies (std {sd:.2f}, mean {sum(vals) / len(vals):.2f}) "
                         f"while the other {len(others)} rank(s) hold (median std {med:.2f})"),
                data={"straggler_rank": r, "std": sd, "others_median_std": med,
                      "mean": sum(vals) / len(vals), "ranks": len(stds)},
            ))
    return out


def checkpoint_fields(nbytes: int | None, seconds: float) -> dict[str, float | int | None]:
    """The record fields for one checkpoint save: bytes and GB/s (None when unknown)."""
    gbps = (nbytes / seconds / 1e9) if (nbytes and seconds > 0) else None
    return {"checkpoint_bytes": nbytes, "checkpoint_gbps": gbps}


def _ck_bytes(r: StepRecord) -> float | None:
    v = getattr(r, "checkpoint_bytes", None)
    if v is None:
        v = r.scalars.get("checkpoint_bytes") if r.scalars else None
    return v


class CheckpointWatch:
    """Checkpoint share of run time since the start, judged each time a record carries a save.

    O(1) memory (running sums). Reports at most once per ``repeat_s`` of record time.
    """

    def __init__(self, rank: int = 0, repeat_s: float = 1800.0) -> None:
        self.rank = rank
        self.repeat_s = repeat_s
        self.run_s = 0.0
        self.ck_s = 0.0
        self.ck_bytes = 0.0
        self.ck_bytes_s = 0.0  # checkpoint seconds of the saves whose bytes are known
        self.saves = 0
        self._last: float | None = None

    def update(self, records: Sequence[StepRecord]) -> list[Finding]:
        out: list[Finding] = []
        for r in records:
            self.run_s += r.step_s + r.eval_s + r.checkpoint_s
            if r.checkpoint_s <= 0:
                continue
            self.saves += 1
            self.ck_s += r.checkpoint_s
            b = _ck_bytes(r)
            if b and b >= CHECKPOINT_MIN_BYTES:
                self.ck_bytes += b
                self.ck_bytes_s += r.checkpoint_s
            share = self.ck_s / self.run_s if self.run_s > 0 else 0.0
            gbps = self.ck_bytes / self.ck_bytes_s / 1e9 if self.ck_bytes_s > 0 else None
            slow = share > CHECKPOINT_SHARE_MAX or (gbps is not None and gbps < CHECKPOINT_GBPS_DEGRADED)
            if not slow or (self._last is not None and r.time - self._last < self.repeat_s):
                continue
            self._last = r.time
            parts = [f"checkpointing took {share:.1%} of run time over {self.saves} save(s) "
                     f"({self.ck_s:.1f} s of {self.run_s:.1f} s; 2-8% is normal)"]
            if gbps is not None:
                parts.append(f"saves wrote {gbps:.2f} GB/s"
                             + (" (< 2 GB/s: storage degraded)" if gbps < CHECKPOINT_GBPS_DEGRADED else ""))
            out.append(make_finding(
                "slow_checkpoint", rank=self.rank, step=r.step, when=r.time, summary="; ".join(parts),
                data={"checkpoint_s": self.ck_s, "run_s": self.run_s, "share": share, "gb_per_s": gbps,
                      "saves": self.saves},
            ))
        return out
