"""Dense-math peak TFLOP/s by device name and dtype, and the MFU arithmetic.

Every number below is a *dense* peak (no 2:4 structured sparsity). Vendor datasheets print the
Tensor Core rows "with sparsity" (an asterisk in a footnote); those are exactly 2x the dense
number, and mixing the two tables is a classic 2x MFU error, so each value here is the
datasheet's sparse figure halved (or the dense figure where the sheet prints one), with the sheet
named next to it. An unknown device gives ``None`` -- never a fallback to some other GPU's peak.

Import is cheap: no torch at module level.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from .._log import warn_once

log = logging.getLogger(__name__)

# The dtype keys used everywhere FLOPs are split by precision (flops.py counts into these).
DTYPE_KEYS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8")


@dataclass(frozen=True, slots=True)
class DevicePeaks:
    """Dense peak TFLOP/s of one device model, by dtype key; ``source`` names the datasheet."""

    model: str
    tflops: Mapping[str, float]
    source: str


def _p(model: str, source: str, **tflops: float) -> DevicePeaks:
    return DevicePeaks(model, dict(tflops), source)


# fp32 is the non-Tensor-Core (CUDA core / vector) rate: what an fp32 matmul runs at when TF32 is
# off. fp16 and bf16 Tensor Core rates are equal on every part listed here.
_H100_SXM = _p(
    "H100 SXM",
    "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): FP32 67; TF32 989, BF16/FP16 1,979, "
    "FP8 3,958 TFLOPS 'with sparsity' -> halved",
    fp64=67.0, fp32=67.0, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9, int8=1978.9,
)
_H100_PCIE = _p(
    "H100 PCIe",
    "NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe column): FP32 51; TF32 756, BF16/FP16 1,513, "
    "FP8 3,026 TFLOPS 'with sparsity' -> halved",
    fp64=51.0, fp32=51.0, tf32=378.0, bf16=756.5, fp16=756.5, fp8=1513.0, int8=1513.0,
)
_H100_NVL = _p(
    "H100 NVL",
    "NVIDIA H100 Tensor Core GPU datasheet (H100 NVL column, per GPU): FP32 60; TF32 835, "
    "BF16/FP16 1,671, FP8 3,341 TFLOPS 'with sparsity' -> halved",
    fp64=60.0, fp32=60.0, tf32=417.5, bf16=835.5, fp16=835.5, fp8=1670.5, int8=1670.5,
)
_H200_SXM = _p(
    "H200 SXM",
    "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column): FP32 67; TF32 989, BF16/FP16 1,979, "
    "FP8 3,958 TFLOPS 'with sparsity' -> halved",
    fp64=67.0, fp32=67.0, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9, int8=1978.9,
)
_H200_NVL = _p(
    "H200 NVL",
    "NVIDIA H200 Tensor Core GPU datasheet (H200 NVL column): FP32 60; TF32 835, BF16/FP16 1,671, "
    "FP8 3,341 TFLOPS 'with sparsity' -> halved",
    fp64=60.0, fp32=60.0, tf32=417.5, bf16=835.5, fp16=835.5, fp8=1670.5, int8=1670.5,
)
_GH200 = _p(
    "GH200",
    "NVIDIA GH200 Grace Hopper Superchip datasheet: FP32 67; TF32 989, BF16/FP16 1,979, FP8 3,958 "
    "TFLOPS 'with sparsity' -> halved",
    fp64=67.0, fp32=67.0, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9, int8=1978.9,
)
_H800 = _p(
    "H800 SXM",
    "NVIDIA H800 SXM5 product brief: same GH100 compute rates as H100 SXM (FP32 67; BF16 1,979 "
    "'with sparsity') -> halved",
    fp32=67.0, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9, int8=1978.9,
)
_A100 = _p(
    "A100",
    "NVIDIA A100 Tensor Core GPU datasheet (40GB/80GB, PCIe and SXM identical): FP32 19.5; "
    "TF32 156, BF16/FP16 312, INT8 624 TOPS (dense; sparse figures 2x)",
    fp64=19.5, fp32=19.5, tf32=156.0, bf16=312.0, fp16=312.0, int8=624.0,
)
_B200 = _p(
    "B200",
    "NVIDIA HGX B200 spec table (8 GPUs, Tensor Core rows 'with sparsity'): FP32 600, TF32 18 P, "
    "FP16/BF16 36 P, FP8 72 PFLOPS -> /8 per GPU, Tensor Core rows halved",
    fp32=75.0, tf32=1125.0, bf16=2250.0, fp16=2250.0, fp8=4500.0, int8=4500.0,
)
_B300 = _p(
    "B300",
    "NVIDIA HGX B300 spec table (8 GPUs, Tensor Core rows 'with sparsity'): FP32 600, TF32 18 P, "
    "FP16/BF16 36 P, FP8 72 PFLOPS -> /8 per GPU, Tensor Core rows halved",
    fp32=75.0, tf32=1125.0, bf16=2250.0, fp16=2250.0, fp8=4500.0,
)
_GB200 = _p(
    "GB200",
    "NVIDIA GB200 NVL72 spec table (72 GPUs, Tensor Core rows 'with sparsity'): FP32 5,760 T, "
    "TF32 180 P, FP16/BF16 360 P, FP8 720 PFLOPS -> /72 per GPU, Tensor Core rows halved",
    fp32=80.0, tf32=1250.0, bf16=2500.0, fp16=2500.0, fp8=5000.0, int8=5000.0,
)
_L40S = _p(
    "L40S",
    "NVIDIA L40S datasheet: FP32 91.6; TF32 183, BF16/FP16 362.05, FP8 733 TFLOPS dense "
    "(366 / 733 / 1,466 with sparsity)",
    fp32=91.6, tf32=183.0, bf16=362.05, fp16=362.05, fp8=733.0, int8=733.0,
)
_L40 = _p(
    "L40",
    "NVIDIA L40 datasheet: FP32 90.5; TF32 90.5, BF16/FP16 181.05, FP8 362 TFLOPS dense "
    "(sparse figures 2x)",
    fp32=90.5, tf32=90.5, bf16=181.05, fp16=181.05, fp8=362.0, int8=362.0,
)
_L4 = _p(
    "L4",
    "NVIDIA L4 datasheet: FP32 30.3; TF32 120, BF16/FP16 242, FP8 485 TFLOPS 'with sparsity' -> halved",
    fp32=30.3, tf32=60.0, bf16=121.0, fp16=121.0, fp8=242.5, int8=242.5,
)
_A10 = _p(
    "A10",
    "NVIDIA A10 datasheet: FP32 31.2; TF32 62.5, BF16/FP16 125, INT8 250 TOPS dense (sparse 2x)",
    fp32=31.2, tf32=62.5, bf16=125.0, fp16=125.0, int8=250.0,
)
_V100_SXM = _p(
    "V100 SXM2",
    "NVIDIA Tesla V100 datasheet (SXM2): FP32 15.7; Tensor (FP16) 125 TFLOPS; no TF32 (Volta), "
    "so an fp32 matmul with TF32 allowed still runs at the FP32 rate",
    fp64=7.8, fp32=15.7, tf32=15.7, fp16=125.0,
)
_V100_PCIE = _p(
    "V100 PCIe",
    "NVIDIA Tesla V100 datasheet (PCIe): FP32 14; Tensor (FP16) 112 TFLOPS; no TF32 (Volta), "
    "so an fp32 matmul with TF32 allowed still runs at the FP32 rate",
    fp64=7.0, fp32=14.0, tf32=14.0, fp16=112.0,
)
_MI300X = _p(
    "MI300X",
    "AMD Instinct MI300X datasheet: FP32 matrix 163.4; TF32 653.7, FP16/BF16 1,307.4, FP8 2,614.9 "
    "TFLOPS dense (with-sparsity figures 2x)",
    fp64=163.4, fp32=163.4, tf32=653.7, bf16=1307.4, fp16=1307.4, fp8=2614.9, int8=2614.9,
)
_MI325X = _p(
    "MI325X",
    "AMD Instinct MI325X datasheet: FP32 matrix 163.4; TF32 653.7, FP16/BF16 1,307.4, FP8 2,614.9 "
    "TFLOPS dense (with-sparsity figures 2x)",
    fp64=163.4, fp32=163.4, tf32=653.7, bf16=1307.4, fp16=1307.4, fp8=2614.9, int8=2614.9,
)
_MI355X = _p(
    "MI355X",
    "AMD Instinct MI355X datasheet: FP32 vector 157.3; FP16/BF16 2,516.6, FP8 5,033.2 TFLOPS dense "
    "(with-sparsity figures 2x); no TF32 row",
    fp32=157.3, bf16=2516.6, fp16=2516.6, fp8=5033.2, int8=5033.2,
)
_MI250X = _p(
    "MI250X",
    "AMD Instinct MI250X datasheet: FP32 matrix 95.7; FP16/BF16 383 TFLOPS; no TF32 on CDNA2, so "
    "an fp32 matmul with TF32 allowed runs at the FP32 matrix rate",
    fp64=95.7, fp32=95.7, tf32=95.7, bf16=383.0, fp16=383.0, int8=383.0,
)

# (pattern on the normalised name, peaks). First match wins, so the specific forms (NVL, PCIe,
# GH200, MI300A...) come before the generic ones. \b keeps A10 from matching A100 or A10G (the
# AWS A10G has different, unpublished Tensor Core rates), and L4 from matching L40.
_PATTERNS: tuple[tuple[str, DevicePeaks | None], ...] = (
    (r"\bGH200\b", _GH200),
    (r"\bGB200\b", _GB200),
    (r"\bH100\b.*\bNVL\b", _H100_NVL),
    (r"\bH100\b.*\bPCIE\b", _H100_PCIE),
    (r"\bH100\b.*\b(SXM\w*|HBM3)\b", _H100_SXM),
    (r"\bH200\b.*\bNVL\b", _H200_NVL),
    (r"\bH200\b", _H200_SXM),
    (r"\bH800\b.*\bPCIE\b", None),
    (r"\bH800\b", _H800),
    (r"\bA100\b", _A100),
    (r"\bB300\b", _B300),
    (r"\bB200\b", _B200),
    (r"\bL40S\b", _L40S),
    (r"\bL40\b", _L40),
    (r"\bL4\b", _L4),
    (r"\bA10\b", _A10),
    (r"\bV100\b.*\bPCIE\b", _V100_PCIE),
    (r"\bV100\b.*\bSXM\w*\b", _V100_SXM),
    (r"\bMI300X\b", _MI300X),
    (r"\bMI325X\b", _MI325X),
    (r"\bMI355X\b", _MI355X),
    (r"\bMI250X\b", _MI250X),
)


@functools.lru_cache(maxsize=1)
def _table() -> tuple[tuple[re.Pattern[str], DevicePeaks | None], ...]:
    return tuple((re.compile(p), peaks) for p, peaks in _PATTERNS)


def _normalise(name: str) -> str:
    return re.sub(r"[\s_\-]+", " ", name.upper()).strip()


def lookup_device(device_name: str | None) -> DevicePeaks | None:
    """Peaks of a device from its name as ``torch.cuda.get_device_name()`` reports it, or None.

    A MIG slice (``... MIG 1g.10gb``) returns None: the slice gets a fraction of the SMs that the
    name does not state exactly.
    """
    if not device_name:
        return None
    n = _normalise(device_name)
    if re.search(r"\bMIG\b", n):
        return None
    for pattern, peaks in _table():
        if pattern.search(n):
            return peaks
    return None


def matmul_dtype_key(tensor_dtype: Any, autocast_dtype: Any = None, allow_tf32: bool = False) -> str:
    """The dtype key a matmul runs in: autocast's dtype if active, else the tensor's; fp32 becomes
    ``tf32`` when TF32 is allowed (``torch.backends.cuda.matmul.allow_tf32`` for matmuls,
    ``torch.backends.cudnn.allow_tf32`` for convolutions; only meaningful on CUDA devices)."""
    dt = autocast_dtype if autocast_dtype is not None else tensor_dtype
    name = str(dt).replace("torch.", "")
    if name in ("float32", "float"):
        return "tf32" if allow_tf32 else "fp32"
    if name in ("bfloat16",):
        return "bf16"
    if name in ("float16", "half"):
        return "fp16"
    if name in ("float64", "double"):
        return "fp64"
    if name.startswith("float8"):
        return "fp8"
    if name in ("int8", "uint8"):
        return "int8"
    raise ValueError(
        f"matmul_dtype_key: tensor_dtype/autocast_dtype {dt!r} is not a matmul dtype; valid: "
        "float64, float32, bfloat16, float16, float8_*, int8, uint8"
    )


class PeakResolver:
    """Resolves the peak table for this rank's device, logging once per unknown device.

    ``override_tflops`` (``STEPWATCH_PEAK_TFLOPS``) is one number used for every dtype.
    """

    def __init__(self, override_tflops: float | None = None) -> None:
        if override_tflops is not None:
            if isinstance(override_tflops, bool) or not isinstance(override_tflops, (int, float)):
                raise TypeError(f"override_tflops must be a number > 0 or None, got {override_tflops!r}")
            if not math.isfinite(override_tflops) or override_tflops <= 0:
                raise ValueError(f"override_tflops must be a finite number > 0, got {override_tflops!r}")
        self.override_tflops = override_tflops

    def peaks(self, device_name: str | None) -> Mapping[str, float] | float | None:
        """What ``compute_mfu`` takes: a float (override), a dtype->TFLOP/s table, or None."""
        if self.override_tflops is not None:
            return float(self.override_tflops)
        p = lookup_device(device_name)
        if p is not None:
            return p.tflops
        key = device_name or "<no accelerator>"
        warn_once(
            f"peaks.unknown.{key}",
            "stepwatch: no dense peak TFLOP/s known for device %r, so MFU is null. "
            "Set STEPWATCH_PEAK_TFLOPS=<dense peak TFLOP/s of this device in your training dtype> "
            "(or stepwatch.init(peak_tflops=...)) to get MFU.",
            key, log=log,
        )
        return None


def compute_mfu(
    flops_by_dtype: Mapping[str, float] | None,
    step_s: float | None,
    peaks: Mapping[str, float] | float | None,
) -> float | None:
    """MFU = sum over dtypes of (flops in that dtype / peak FLOP/s for that dtype) / step_s.

    ``peaks`` is TFLOP/s: a per-dtype table, or one number for every dtype. None when anything
    needed is unknown (no FLOPs, no step time, a dtype with FLOPs but no peak).
    """
    if flops_by_dtype is None or peaks is None:
        return None
    return per_step(busy_seconds(flops_by_dtype, peaks), step_s)


def per_step(busy_s: float | None, step_s: float | None) -> float | None:
    """MFU from the FLOPs' busy seconds (:func:`busy_seconds`) and the step's; None when either
    is unknown or the step took no time."""
    if busy_s is None or step_s is None or not step_s > 0:
        return None
    return busy_s / step_s


def busy_seconds(flops_by_dtype: Mapping[str, float], peaks: Mapping[str, float] | float) -> float | None:
    """The seconds the FLOPs take at the peaks (MFU's numerator over the step time); None when
    a dtype with FLOPs has no peak, or there are none."""
    busy_s = 0.0
    for key, flops in flops_by_dtype.items():
        if not flops:
            continue
        peak = float(peaks) if isinstance(peaks, (int, float)) else peaks.get(key)
        if peak is None or not peak > 0:
            return None
        busy_s += flops / (peak * 1e12)
    return None if busy_s == 0.0 else busy_s


def device_name(device: Any = None) -> str | None:
    """``torch.cuda.get_device_name`` (ROCm reports through the same call), None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


class MfuDropDetector:
    """``mfu_drop`` when MFU is more than ``points`` percentage points below its value
    ``window_s`` seconds earlier (reference B.7: 5 points in 10 minutes, with the sign the
    sheet's PromQL got backwards). One finding per episode; re-armed once MFU recovers.
    Background thread; memory bounded (at most ~600 samples kept).
    """

    def __init__(self, points: float = 5.0, window_s: float = 600.0) -> None:
        if not points > 0 or not window_s > 0:
            raise ValueError(f"points and window_s must be > 0, got points={points!r}, window_s={window_s!r}")
        from collections import deque

        self.drop = points / 100.0
        self.window_s = window_s
        self._min_gap = window_s / 600.0
        self._samples: deque[tuple[float, float]] = deque()
        self._in_drop = False

    def observe(self, rec: Any) -> list[Any]:
        """The session's detector interface: a ``StepRecord`` in, findings out."""
        f = self.observe_value(rec.time, rec.mfu, rank=rec.rank, step=rec.step)
        return [f] if f is not None else []

    def observe_many(self, records: list[Any]) -> list[Any]:
        """``observe`` over a pass's records in one call (most have no MFU: no peak known)."""
        out = []
        for rec in records:
            if rec.mfu is not None:
                f = self.observe_value(rec.time, rec.mfu, rank=rec.rank, step=rec.step)
                if f is not None:
                    out.append(f)
        return out

    def observe_value(self, when: float, mfu: float | None, *, rank: int = 0, step: int | None = None) -> Any:
        """Feed one MFU value (unix seconds); returns a ``Finding`` or None."""
        if mfu is None or not math.isfinite(mfu):
            return None
        s = self._samples
        if not s or when - s[-1][0] >= self._min_gap:
            s.append((when, mfu))
        # Keep exactly one sample at or before `when - window_s`: the reference point.
        while len(s) >= 2 and s[1][0] <= when - self.window_s:
            s.popleft()
        if s[0][0] > when - self.window_s:
            return None  # not yet window_s of history
        before = s[0][1]
        if before - mfu <= self.drop:
            self._in_drop = False
            return None
        if self._in_drop:
            return None
        self._in_drop = True
        from ..analysis.kinds import make_finding

        return make_finding(
            "mfu_drop",
            rank=rank,
            step=step,
            when=when,
            summary=f"MFU {mfu:.1%} is {100 * (before - mfu):.1f} points below its {before:.1%} "
            f"of {self.window_s:.0f} s earlier",
            data={"mfu": mfu, "mfu_before": before, "window_s": self.window_s},
        )


class MfuEnricher:
    """Background thread: fills ``flops``, ``mfu``, ``hfu`` and ``tokens`` of a record from
    ``extras["throughput"]`` (``hooks.tokens.ThroughputCollector``). ``peaks`` is what
    ``PeakResolver.peaks(device_name)`` returned for this rank's device (None: MFU stays null).
    ``last_samples`` holds the step's sample count (the record has no field for it yet).
    """

    def __init__(self, peaks: Mapping[str, float] | float | None) -> None:
        self.peaks = peaks
        self.last_samples: int | None = None
        # The last step's count and what follows from it and the peaks alone: steps of one
        # signature share one FlopCount, so most records reuse it (dtype sums, the busy time).
        self._last: tuple[Any, Any, tuple[Any, ...]] | None = None

    def _facts(self, fc: Any) -> tuple[Any, ...]:
        """(flops, mfu_dtype, busy_s, hfu busy_s, whether it recomputes) for ``fc``."""
        last = self._last
        if last is not None and last[0] is fc and last[1] is self.peaks:
            return last[2]
        peaks = self.peaks
        by_dtype = fc.by_dtype
        by = {k: v for k, v in by_dtype.items() if v}
        mfu_dtype = next(iter(by)) if len(by) == 1 else ("mixed" if by else None)
        busy = busy_seconds(by_dtype, peaks) if peaks is not None else None
        hfu_busy = busy_seconds(fc.hfu_by_dtype, peaks) if peaks is not None and fc.recompute else None
        facts = (float(fc.total), mfu_dtype, busy, hfu_busy, bool(fc.recompute))
        self._last = (fc, peaks, facts)
        return facts

    def enrich(self, rec: Any, extras: dict[str, Any], *, force: bool) -> bool:
        tp = extras.get("throughput")
        if tp is None:
            return True
        if extras.get("compiled_forward"):
            # The step's forward ran in a torch.compile'd function, whose modules no count sees
            # (hooks/install.py's rootless_compiled): what was counted (a loss module's 0 FLOPs,
            # its batch) is not the step's. Null, not MFU 0.
            return True
        got = tp.resolve()
        if got is None:
            if not force:
                return False
            got = (tp.flops, None, None)
        fc, tokens, samples = got
        rec.tokens = tokens
        rec.samples = samples
        self.last_samples = samples
        if fc is None:
            return True
        flops, mfu_dtype, busy, hfu_busy, recompute = self._facts(fc)
        step_s = rec.step_s
        rec.flops = flops
        rec.mfu = per_step(busy, step_s)
        # The denominator, shown beside MFU: the step's matmul dtype and the (FLOP-weighted) peak.
        rec.mfu_dtype = mfu_dtype
        if rec.mfu and step_s:
            rec.peak_tflops = rec.flops / (rec.mfu * step_s) / 1e12
        rec.hfu = per_step(hfu_busy, step_s) if recompute else rec.mfu
        return True
