"""Per-rank comm findings: AllReduce not overlapped, and bus bandwidth below the baseline."""

from __future__ import annotations

from typing import Any

from ..analysis.detectors import WindowedDetector
from ..analysis.kinds import make_finding
from ..record import Finding, StepRecord

# Exposed comm below this share of the step is not worth a finding, whatever the overlap.
MIN_EXPOSED_SHARE = 0.02

GiB = 1024**3
MiB = 1024**2


def baseline(gpu_name: str | None, world: int, nodes: int) -> dict[str, Any] | None:
    """The reference's healthy AllReduce busbw for this hardware, or None when it has none.

    B.5: 'H100 x 8, NVLink healthy baseline: 256MB busbw >= 160 GB/s, 1GB >= 180, ALERT < 140';
    'H100 x 64, IB NDR 400G: 256MB >= 40, 1GB >= 45, ALERT < 35'. Only H100s have baselines; a
    multi-node job is judged against the IB numbers, a single node against NVLink's. Those are
    SXM nodes (NVSwitch): an H100 PCIe or NVL (names "NVIDIA H100 PCIe", "NVIDIA H100 NVL") has no
    NVSwitch, and no baseline here rather than a false alert.
    """
    name = (gpu_name or "").upper()
    if "H100" not in name or "PCIE" in name or "NVL" in name or world < 2:
        return None
    if nodes > 1:
        return {"name": "H100 IB NDR 400G (B.5, x64)", "256MB": 40.0, "1GB": 45.0, "alert": 35.0}
    return {"name": "H100 NVLink (B.5, x8)", "256MB": 160.0, "1GB": 180.0, "alert": 140.0}


def verdict(busbw: float, nbytes: int, base: dict[str, Any] | None) -> str:
    """'ok', 'low' (under the size's healthy number), 'alert' (under the alert line) or 'n/a'."""
    if base is None or nbytes < 256 * MiB:
        return "n/a"
    if busbw < base["alert"]:
        return "alert"
    want = base["1GB"] if nbytes >= GiB else base["256MB"]
    return "ok" if busbw >= want else "low"


class OverlapDetector(WindowedDetector):
    """B.2: overlap of AllReduce with backward should exceed 80%."""

    def __init__(self, window: int, threshold: float, repeat_windows: int = 20) -> None:
        super().__init__(window, repeat_windows)
        self.threshold = threshold

    def judge(self, window: list[StepRecord]) -> Finding | None:
        recs = [r for r in window if r.overlap is not None and r.comm_exposed_s is not None]
        if len(recs) < max(2, len(window) // 2):
            return None
        ov = sum(r.overlap for r in recs) / len(recs)
        exposed = sum(r.comm_exposed_s for r in recs) / len(recs)
        step = sum(r.step_s for r in recs) / len(recs)
        if ov >= self.threshold or exposed < MIN_EXPOSED_SHARE * step:
            return None
        last = window[-1]
        return make_finding(
            "allreduce_not_overlapped",
            rank=last.rank,
            step=last.step,
            when=last.time,
            summary=(
                f"rank {last.rank}: AllReduce overlapped {ov:.0%} with backward over steps "
                f"{window[0].step}-{last.step} (target > {self.threshold:.0%}); "
                f"{exposed * 1e3:.1f} ms exposed per step ({exposed / step if step else 0:.0%} of step time)"
            ),
            data={
                "overlap": ov,
                "exposed_s": exposed,
                "share_of_step": exposed / step if step else None,
                "threshold": self.threshold,
                "first_step": window[0].step,
                "last_step": last.step,
            },
        )


class LowBusbwDetector:
    """Live busbw of large (>= 256 MB) CUDA collectives against the reference baselines.

    The enricher feeds it (``note``); ``observe`` hands out what it found. DDP buckets are
    usually far smaller than the baselines' message sizes, so most jobs are judged only by
    ``stepwatch bench-comm``; a small message's busbw says nothing about the fabric.
    """

    def __init__(self, base: dict[str, Any] | None, repeat_every: int = 100) -> None:
        self.base = base
        self._out: list[Finding] = []
        self._last_step: int | None = None
        self.repeat_every = repeat_every

    def note(self, rec: StepRecord, span: Any, algbw: float, busbw: float) -> None:
        v = verdict(busbw, span.nbytes, self.base)
        if v not in ("low", "alert"):
            return
        if self._last_step is not None and rec.step - self._last_step < self.repeat_every:
            return
        self._last_step = rec.step
        self._out.append(
            make_finding(
                "low_busbw",
                rank=rec.rank,
                step=rec.step,
                severity="critical" if v == "alert" else None,
                summary=(
                    f"rank {rec.rank}: {span.op} of {span.nbytes / MiB:.0f} MiB ran at busbw {busbw:.1f} GB/s "
                    f"(algbw {algbw:.1f}); {self.base['name']} healthy >= "
                    f"{self.base['1GB'] if span.nbytes >= GiB else self.base['256MB']:.0f}, alert < {self.base['alert']:.0f}"
                ),
                data={"busbw_gbps": busbw, "algbw_gbps": algbw, "bytes": span.nbytes, "baseline": self.base},
            )
        )

    def observe(self, rec: StepRecord) -> list[Finding]:
        out, self._out = self._out, []
        return out
