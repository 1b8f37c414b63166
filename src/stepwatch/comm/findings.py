"""Per-rank comm findings: AllReduce not overlapped, and bus bandwidth below the baseline."""

from __future__ import annotations

from typing import Any, Callable

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


# Messages smaller than this are not judged: there NCCL's latency (protocol, launch, version)
# rules busbw, and the baselines' two large-message points say nothing about it.
MIN_JUDGED_BYTES = 16 * MiB


def _curve(base: dict[str, Any]) -> tuple[float, float]:
    """(asymptotic busbw, half-bandwidth size in bytes) through the baseline's 256 MB and 1 GB points.

    nccl-tests' busbw-vs-size sweeps rise like the latency-bandwidth (Hockney) model,
    ``busbw(s) = B * s / (s + s_half)``; both B.5 baselines (160/180, 40/45) give s_half ~ 44.5 MiB.
    """
    s1, s2, a, b = 256 * MiB, GiB, base["256MB"], base["1GB"]
    half = (b - a) / (a / s1 - b / s2)
    return a * (s1 + half) / s1, half


def expected(nbytes: int, base: dict[str, Any] | None) -> tuple[float, float] | None:
    """(healthy busbw, alert line) in GB/s for one message size, or None when not judged.

    From 256 MB up: the sheet's numbers as written. From ``MIN_JUDGED_BYTES`` to 256 MB: both
    scaled down along the curve of :func:`_curve` (a lower bound: real curves rise sooner, so a
    healthy fabric is not called degraded).
    """
    if base is None or nbytes < MIN_JUDGED_BYTES:
        return None
    if nbytes >= GiB:
        return base["1GB"], base["alert"]
    if nbytes >= 256 * MiB:
        return base["256MB"], base["alert"]
    big, half = _curve(base)
    f = big * nbytes / (nbytes + half) / base["256MB"]
    return base["256MB"] * f, base["alert"] * f


def verdict(busbw: float, nbytes: int, base: dict[str, Any] | None) -> str:
    """'ok', 'low' (under the size's healthy number), 'alert' (under the alert line) or 'n/a'."""
    want = expected(nbytes, base)
    if want is None:
        return "n/a"
    healthy, alert = want
    if busbw < alert:
        return "alert"
    return "ok" if busbw >= healthy else "low"


class OverlapDetector(WindowedDetector):
    """B.2: overlap of AllReduce with backward should exceed 80%."""

    def __init__(self, window: int, threshold: float,
                 exposed_of: Callable[[StepRecord], float | None] | None = None) -> None:
        super().__init__(window)
        self.threshold = threshold
        # The AllReduce part of a record's comm_exposed_s (the enricher's ``ddp_exposed_s``): the
        # time blocked in the job's other collectives (a logging all_reduce, a barrier) is in
        # comm_exposed_s too, and no bucket setting hides it. Default: comm_exposed_s itself.
        self._exposed_of = exposed_of or (lambda r: r.comm_exposed_s)
        self._unknown_waits = 0  # windows judged with no comm_wait_s yet (see judge)

    def judge(self, window: list[StepRecord]) -> Finding | None:
        # The time waiting for peers (comm_wait_s) is known from the first straggler-exchange
        # verdict on: a window before it is not judged (its exposed time may all be a slow peer's),
        # unless none comes (two windows without: a job whose ranks share no c10d store).
        n = len(window)
        if any(r.comm_wait_s is not None for r in window):
            window = [r for r in window if r.comm_wait_s is not None]  # at least half of them, below
        elif any(r.overlap is not None for r in window):
            self._unknown_waits += 1
            if self._unknown_waits <= 2:
                return None
        recs, ex, waits = [], [], []
        for r in window:
            if r.overlap is None or r.comm_exposed_s is None:
                continue
            e = self._exposed_of(r)
            if e is not None:
                recs.append(r)
                ex.append(e)
                waits.append(min(r.comm_wait_s or 0.0, e))
        if len(recs) < max(2, n // 2):
            return None
        ov = sum(r.overlap for r in recs) / len(recs)
        exposed = sum(ex) / len(recs)
        # The exposed time spent waiting for a slower peer (comm_wait_s): no bucket setting hides
        # it (a rank 30 ms ahead of a slow-data peer read "31 ms exposed -> gradient_as_bucket_view");
        # the straggler and data findings name the cause. Judged on what is left.
        waiting = sum(waits) / len(recs)
        step = sum(r.step_s for r in recs) / len(recs)
        if ov >= self.threshold or exposed - waiting < MIN_EXPOSED_SHARE * step:
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
                f"{(exposed - waiting) * 1e3:.1f} ms exposed per step ({(exposed - waiting) / step if step else 0:.0%} "
                "of step time" + (f"; another {waiting * 1e3:.1f} ms waiting for other ranks, which no bucket "
                                  "setting changes)" if waiting >= 0.0005 else ")")
            ),
            data={
                "overlap": ov,
                "exposed_s": exposed,
                "waiting_s": waiting,
                "share_of_step": exposed / step if step else None,
                "threshold": self.threshold,
                "first_step": window[0].step,
                "last_step": last.step,
            },
        )


class LowBusbwDetector:
    """Live busbw of CUDA collectives of at least ``MIN_JUDGED_BYTES`` against the reference
    baselines, scaled to each message's size (:func:`expected`).

    The enricher feeds it (``note``); ``observe`` hands out what it found. Every ``spans`` spans
    it judges the 90th percentile of busbw / healthy(size): a span that waited for a slower peer
    or shared the device with backward reads slow, so the best spans are what the fabric can do.
    One finding per episode (a healthy batch of spans ends it). ``why_not`` says in words why
    nothing is judged (no baseline for this hardware, no message large enough yet).
    """

    def __init__(self, base: dict[str, Any] | None, spans: int = 20) -> None:
        self.base = base
        self.spans = spans
        self._out: list[Finding] = []
        self._ratios: list[tuple[float, float, int, float, float, str]] = []
        self._in_episode = False
        self.judged = 0
        self.why_not: str | None = f"no collective of >= {MIN_JUDGED_BYTES // MiB} MiB timed on a CUDA device yet"

    def note(self, rec: StepRecord, span: Any, algbw: float, busbw: float) -> None:
        want = expected(span.nbytes, self.base)
        if want is None:
            if self.judged == 0:
                self.why_not = (f"no healthy busbw baseline for this hardware (the reference has H100 SXM numbers only)"
                                if self.base is None else
                                f"collectives below {MIN_JUDGED_BYTES // MiB} MiB only (latency-bound: no baseline applies)")
            return
        healthy, alert = want
        self._ratios.append((busbw / healthy, alert / healthy, span.nbytes, busbw, healthy, span.op))
        if len(self._ratios) < self.spans:
            return
        batch, self._ratios = self._ratios, []
        self.judged += 1
        self.why_not = None
        batch.sort(key=lambda x: x[0])
        best = batch[min(len(batch) - 1, int(0.9 * len(batch)))]
        ratio, alert_ratio, nbytes, bw, want_bw, op = best
        if ratio >= 1.0:
            self._in_episode = False
            return
        if self._in_episode:
            return
        self._in_episode = True
        critical = ratio < alert_ratio
        self._out.append(
            make_finding(
                "low_busbw",
                rank=rec.rank,
                step=rec.step,
                severity="critical" if critical else None,
                summary=(
                    f"rank {rec.rank}: the 90th-percentile {op} of the last {len(batch)} ran at {ratio:.0%} of the healthy "
                    f"busbw for its size ({bw:.1f} GB/s for {nbytes / MiB:.0f} MiB; {self.base['name']} healthy >= "
                    f"{want_bw:.0f}, alert < {want_bw * alert_ratio:.0f}, scaled by message size)"
                ),
                data={"busbw_gbps": bw, "healthy_gbps": want_bw, "alert_gbps": want_bw * alert_ratio, "bytes": nbytes,
                      "ratio": ratio, "spans": len(batch), "baseline": self.base},
            )
        )

    def observe(self, rec: StepRecord) -> list[Finding]:
        out, self._out = self._out, []
        return out
