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

from ..analysis.checkpoint import CheckpointWatch, checkpoint_fields  # noqa: F401 - re-exported (once here)
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
_SW_POWER_CAP = BY_NAME["SwPowerCap"].bit

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
# Reference B.4 field table rows judged over a window of samples (ratios, as DCGM exports them):
# "GR_ENGINE_ACTIVE < 60% -> overhead-bound"; "SM_OCCUPANCY < 25% -> occupancy limiter";
# "DRAM_ACTIVE constant 100% -> BW bottleneck"; "MEM_MAX_OP_TEMP > 90 C -> HBM thermal limit";
# "POWER_USAGE near TDP limit consistently"; "NVLINK_TX/RX_BYTES < 350 GB/s (H100x8) -> degradation";
# XID table "80 Correctable SBE: alert if > 1,000/hr".
GR_ENGINE_LOW = 0.60
SM_OCCUPANCY_LOW = 0.25
HBM_TEMP_C = 90.0
ECC_SBE_PER_HOUR = 1000.0
NVLINK_BASELINE_BPS = 350e9
# stepwatch: "near 100%" is a window mean of at least 95%.
DRAM_SATURATED = 0.95
# stepwatch: "at the limit" is power >= 97% of the enforced limit (NVML's 1 s power average sits
# just under a cap it is held at) or the SwPowerCap reason, on at least 80% of the window's samples.
POWER_AT_LIMIT = 0.97
POWER_WINDOW_SHARE = 0.80
# stepwatch: NVLink bytes/s are judged only while collectives take at least half of the step time
# (divided by that share: bytes per second of communication); a compute-bound job's average link
# rate says nothing about the links.
NVLINK_MIN_COMM_SHARE = 0.5
# stepwatch: an SBE rate needs at least this much time between the window's first and last counts.
ECC_MIN_SPAN_S = 30.0
# stepwatch: the rows are judged once per minute over the last minute of samples (as the matrix).
ROWS_WINDOW_S = 60.0
ROWS_MIN_SAMPLES = 5


def nvlink_baseline(gpu_name: str | None) -> float | None:
    """Healthy NVLink TX/RX bytes/s for this GPU, or None where the reference gives no number.

    Reference B.4: H100 x8 (SXM, NVSwitch) near 450 GB/s, degraded below 350 GB/s. An H100 PCIe or
    NVL has no NVSwitch, so no baseline (as comm/findings.baseline for busbw).
    """
    name = (gpu_name or "").upper()
    if "H100" not in name or "PCIE" in name or "NVL" in name.replace("NVLINK", ""):
        return None
    return NVLINK_BASELINE_BPS


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
        self._records: collections.deque[tuple[float, float, float, float | None]] = collections.deque(maxlen=4096)
        self._last_matrix_t: float | None = None
        self._last_rows_t: float | None = None
        self._episodes: set[str] = set()  # B.4 rows currently bad (one finding per episode)
        self._reported: dict[str, float] = {}
        self._last_step: int | None = None

    def analyze(self, samples: Sequence[dict[str, Any]], records: Sequence[StepRecord] = ()) -> list[Finding]:
        for r in records:
            self._records.append((r.time, r.step_s, r.data_wait_s, r.comm_s))
            self._last_step = r.step
        out: list[Finding] = []
        for s in samples:
            self._recent.append(s)
            out.extend(self._health(s))
        out.extend(self._matrix())
        out.extend(self._rows())
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
        recs = [(st, dw) for (rt, st, dw, _) in self._records if t0 <= rt <= now]
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


    # -- B.4 field-table rows over the last minute, one finding per episode --
    def _rows(self) -> list[Finding]:
        if not self._recent:
            return []
        now = self._recent[-1].get("time", 0.0)
        if self._last_rows_t is not None and now - self._last_rows_t < ROWS_WINDOW_S:
            return []
        window = [s for s in self._recent if s.get("time", 0.0) >= now - ROWS_WINDOW_S]
        if len(window) < ROWS_MIN_SAMPLES:
            return []
        self._last_rows_t = now
        t0 = window[0].get("time", now)
        gpu = window[-1].get("gpu")
        where = f"GPU {gpu} ({window[-1].get('uuid') or 'uuid unknown'})"
        span = f"over {now - t0:.0f} s"

        def vals(field: str) -> list[float]:
            return [s[field] for s in window if s.get(field) is not None]

        # kind -> (bad?, summary, data); None = not enough data to say (the episode stays as it was)
        verdicts: dict[str, tuple[bool, str, dict[str, Any]] | None] = {}
        gr = _mean(vals("DCGM_FI_PROF_GR_ENGINE_ACTIVE"))
        verdicts["gpu_overhead_bound"] = None if gr is None else (
            gr < GR_ENGINE_LOW,
            f"{where}: graphics engine active {gr:.0%} {span} (< {GR_ENGINE_LOW:.0%}: overhead-bound)",
            {"gr_engine_active": gr, "threshold": GR_ENGINE_LOW})
        # Occupancy is judged over the samples whose SMs were busy (SM active >= SM_LOW): with idle
        # SMs it is low by itself (the overhead/launch rows' story), and idle seconds in the window
        # would dilute it. With the tensor cores busy (the matrix's "high") low occupancy is the GEMM
        # kernels' design, not a limiter: Hopper's run one block of 2-3 warpgroups per SM (an H200's
        # healthy bf16 GEMM load read 13% occupancy at 84% tensor active, scripts/gpu_check.sh,
        # 2026-12-04).
        busy = [s for s in window if (s.get("DCGM_FI_PROF_SM_ACTIVE") or 0.0) >= SM_LOW]
        occ = _mean([s["DCGM_FI_PROF_SM_OCCUPANCY"] for s in busy if s.get("DCGM_FI_PROF_SM_OCCUPANCY") is not None])
        sm = _mean([s["DCGM_FI_PROF_SM_ACTIVE"] for s in busy])
        tensor = _mean([s["DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"] for s in busy
                        if s.get("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE") is not None])
        verdicts["low_sm_occupancy"] = None if (occ is None or len(busy) < ROWS_MIN_SAMPLES
                                                or (tensor is not None and tensor >= TENSOR_HIGH)) else (
            occ < SM_OCCUPANCY_LOW,
            f"{where}: SM occupancy {occ:.0%} with SM active {sm:.0%} in {len(busy)} busy samples {span} "
            f"(< {SM_OCCUPANCY_LOW:.0%}: occupancy limiter)",
            {"sm_occupancy": occ, "sm_active": sm, "tensor_active": tensor, "busy_samples": len(busy),
             "threshold": SM_OCCUPANCY_LOW})
        dram = _mean(vals("DCGM_FI_PROF_DRAM_ACTIVE"))
        verdicts["dram_bandwidth_bound"] = None if dram is None else (
            dram >= DRAM_SATURATED,
            f"{where}: DRAM active {dram:.0%} {span} (>= {DRAM_SATURATED:.0%}: bandwidth bottleneck)",
            {"dram_active": dram, "threshold": DRAM_SATURATED})
        mem_t = vals("DCGM_FI_DEV_MEMORY_TEMP")
        verdicts["hbm_thermal"] = None if not mem_t else (
            max(mem_t) > HBM_TEMP_C,
            f"{where}: memory temperature up to {max(mem_t):.0f} C {span} (> {HBM_TEMP_C:.0f} C: HBM thermal limit"
            + (f"; the device's max operating memory temperature is {window[-1]['DCGM_FI_DEV_MEM_MAX_OP_TEMP']} C)"
               if window[-1].get("DCGM_FI_DEV_MEM_MAX_OP_TEMP") is not None else ")"),
            {"mem_temp_max_c": max(mem_t), "threshold_c": HBM_TEMP_C,
             "mem_max_op_temp_c": window[-1].get("DCGM_FI_DEV_MEM_MAX_OP_TEMP")})
        verdicts["power_limited"] = self._power(window, where, span)
        verdicts["nvlink_low_bandwidth"] = self._nvlink(window, where, span, t0, now)
        verdicts["ecc_sbe_rate"] = self._sbe(window, where)
        out: list[Finding] = []
        for kind, v in verdicts.items():
            if v is None:
                continue
            bad, summary, data = v
            if not bad:
                self._episodes.discard(kind)
                continue
            if kind in self._episodes:
                continue
            self._episodes.add(kind)
            out.append(make_finding(kind, rank=self.rank, step=self._last_step, when=now, summary=summary,
                                    data={"gpu": gpu, "uuid": window[-1].get("uuid"), "window_s": now - t0,
                                          "samples": len(window), **data}))
        return out

    def _power(self, window: list[dict[str, Any]], where: str, span: str) -> tuple[bool, str, dict[str, Any]] | None:
        judged = at = 0
        for s in window:
            p, lim = s.get("DCGM_FI_DEV_POWER_USAGE"), s.get("DCGM_FI_DEV_ENFORCED_POWER_LIMIT")
            mask = s.get("DCGM_FI_DEV_CLOCKS_EVENT_REASONS")
            capped = mask is not None and bool(mask & _SW_POWER_CAP)
            if (p is None or not lim) and mask is None:
                continue
            judged += 1
            if capped or (p is not None and lim and p >= POWER_AT_LIMIT * lim):
                at += 1
        if judged < ROWS_MIN_SAMPLES:
            return None
        share = at / judged
        power = _mean([s["DCGM_FI_DEV_POWER_USAGE"] for s in window if s.get("DCGM_FI_DEV_POWER_USAGE") is not None])
        lims = [s["DCGM_FI_DEV_ENFORCED_POWER_LIMIT"] for s in window if s.get("DCGM_FI_DEV_ENFORCED_POWER_LIMIT")]
        lim = min(lims) if lims else None
        return (share >= POWER_WINDOW_SHARE,
                f"{where}: at the power limit on {share:.0%} of samples {span} (mean "
                + ("unknown" if power is None else f"{power:.0f} W") + " vs enforced limit "
                + ("unknown" if lim is None else f"{lim:.0f} W") + ")",
                {"share_at_limit": share, "power_mean_w": power, "enforced_limit_w": lim,
                 "threshold_share": POWER_WINDOW_SHARE, "at_limit_ratio": POWER_AT_LIMIT})

    def _nvlink(self, window: list[dict[str, Any]], where: str, span: str, t0: float,
                now: float) -> tuple[bool, str, dict[str, Any]] | None:
        base = nvlink_baseline(window[-1].get("name"))
        tx = _mean([s["DCGM_FI_PROF_NVLINK_TX_BYTES"] for s in window if s.get("DCGM_FI_PROF_NVLINK_TX_BYTES") is not None])
        rx = _mean([s["DCGM_FI_PROF_NVLINK_RX_BYTES"] for s in window if s.get("DCGM_FI_PROF_NVLINK_RX_BYTES") is not None])
        recs = [(st, c) for (rt, st, _, c) in self._records if t0 <= rt <= now and c is not None]
        total = sum(st for st, _ in recs)
        if base is None or tx is None or rx is None or total <= 0:
            return None  # no baseline for this GPU, no NVLink counters, or no comm timing
        share = sum(c for _, c in recs) / total
        if share < NVLINK_MIN_COMM_SHARE:
            return None  # not communication-bound: the average link rate says nothing
        eff_tx, eff_rx = tx / share, rx / share
        low = min(eff_tx, eff_rx)
        return (low < base,
                f"{where}: NVLink TX {eff_tx / 1e9:.0f} GB/s, RX {eff_rx / 1e9:.0f} GB/s per second of "
                f"collectives ({share:.0%} of step time) {span} (< {base / 1e9:.0f} GB/s: degradation)",
                {"nvlink_tx_bytes_per_s": eff_tx, "nvlink_rx_bytes_per_s": eff_rx, "comm_share": share,
                 "baseline_bytes_per_s": base})

    def _sbe(self, window: list[dict[str, Any]], where: str) -> tuple[bool, str, dict[str, Any]] | None:
        pts = [(s["time"], s["DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"]) for s in window
               if s.get("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL") is not None and "time" in s]
        if len(pts) < 2 or pts[-1][0] - pts[0][0] < ECC_MIN_SPAN_S:
            return None
        dt = pts[-1][0] - pts[0][0]
        new = max(pts[-1][1] - pts[0][1], 0)
        rate = new / dt * 3600.0
        return (rate > ECC_SBE_PER_HOUR,
                f"{where}: {new} correctable ECC error(s) in {dt:.0f} s = {rate:,.0f}/h (> {ECC_SBE_PER_HOUR:,.0f}/h), "
                f"{pts[-1][1]} since driver load",
                {"sbe_per_hour": rate, "sbe_new": new, "sbe_total": pts[-1][1], "threshold_per_hour": ECC_SBE_PER_HOUR})


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
