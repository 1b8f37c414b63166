"""``low_mfu``: the median MFU of a window of steps below the reference sheet's 40% (B.10)."""

from __future__ import annotations

from typing import Callable

from ..analysis.kinds import make_finding
from ..record import Finding, StepRecord


# Reference B.10: "Low MFU in training (< 40%) -> nsys --trace=cuda,nvtx,nccl -> Timeline: idle
# gaps between kernels". stepwatch: judged on the median of at least this many steps whose MFU is
# known (one slow step, or a VM whose step time wanders, does not make a verdict).
LOW_MFU_MIN_STEPS = 100
# stepwatch: a part of the step (data wait, exposed comm, time outside the phases) is worth
# looking at first when it takes at least this share of the step time.
FIRST_LOOK_SHARE = 0.10

# Where to look first, per part: (what it is, the sheet's command and first metric).
_FIRST_LOOK = {
    "data": ("data loading",
             "B.10 'Data loading bottleneck -> nsys --trace=cuda,osrt: CPU idle gaps between CUDA "
             "launches'; DataLoader num_workers, pin_memory, prefetch_factor (B.9)"),
    "comm": ("exposed communication",
             "B.10 'AllReduce bottleneck suspected -> NCCL_DEBUG=INFO + nccl-tests: busbw vs. healthy "
             "baseline'; overlap with backward (gradient_as_bucket_view=True, bucket_cap_mb; B.2)"),
    "other": ("host time outside forward/backward/optimizer (logging, .item()/.cpu() syncs, Python "
              "between phases)",
              "an nsys --trace=cuda,nvtx,osrt timeline: idle gaps between kernels while the host works"),
    "compute": ("the compute itself",
                "B.10 'Low MFU -> nsys --trace=cuda,nvtx,nccl: idle gaps between kernels', then SM_ACTIVE "
                "and Tensor Core activity ('GPU utilization looks low', 'GEMM underperforming')"),
}


# The same on a CPU (a peak given with STEPWATCH_PEAK_TFLOPS is how a CPU run gets an MFU,
# docs/mfu.md): no kernels, no SM_ACTIVE, no NCCL there; the sheet's tools are for GPUs.
_FIRST_LOOK_CPU = {
    "data": ("data loading",
             "DataLoader num_workers and prefetch_factor (B.9); `stepwatch dump` shows what the rank "
             "does while it waits for a batch"),
    "comm": ("exposed communication",
             "overlap with backward (bucket_cap_mb; B.2); gloo's collectives run on the host's cores, "
             "beside the compute"),
    "other": ("host time outside forward/backward/optimizer (logging, Python between phases)",
              "`stepwatch dump` (py-spy) on the rank: what the Python between the phases does"),
    "compute": ("the compute itself",
                "a torch.profiler capture (`stepwatch capture`, or the one stepwatch took) for the ops "
                "that take the time; torch's intra-op threads (torch.get_num_threads(), OMP_NUM_THREADS) "
                "against the cores the rank has; whether the peak given is this CPU's for this dtype"),
}


def _median(vals: list[float]) -> float:
    s = sorted(vals)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class LowMfuDetector:
    """``low_mfu`` when the median MFU of a window of steps is below ``threshold`` (B.10: 40%).

    Windows are ``max(window, 100)`` consecutive steps whose MFU is known (steps without an MFU
    are left out, so a job without a known peak never fires). One finding per episode: a window
    at or above the threshold ends it. The finding says where the step time went and which part
    the reference sheet would look at first, and names this rank's latest capture file when
    ``captures_dir`` holds one. Background thread; memory bounded by the window.
    """

    def __init__(self, threshold: float, window: int, captures_dir: str | None = None,
                 device: Callable[[], str | None] = lambda: None) -> None:
        """``device``: the device's name once known (``"cpu"`` on a CPU), for where to look."""
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be within (0, 1], got {threshold!r}")
        if window < 1:
            raise ValueError(f"window must be >= 1 step, got {window!r}")
        self.threshold = threshold
        self.window = max(int(window), LOW_MFU_MIN_STEPS)
        self.captures_dir = captures_dir
        self._device = device
        self._buf: list[StepRecord] = []
        self._in_episode = False

    def observe_many(self, records: list[StepRecord]) -> list[Finding]:
        """``observe`` over a pass's records in one call (most have no MFU: no peak known)."""
        out: list[Finding] = []
        for rec in records:
            if rec.mfu is not None:
                out.extend(self.observe(rec))
        return out

    def observe(self, rec: StepRecord) -> list[Finding]:
        mfu = rec.mfu
        if mfu is None or mfu != mfu or rec.step_s <= 0:
            return []
        self._buf.append(rec)
        if len(self._buf) < self.window:
            return []
        buf, self._buf = self._buf, []
        med = _median([r.mfu for r in buf])  # type: ignore[misc]
        if med >= self.threshold:
            self._in_episode = False
            return []
        if self._in_episode:
            return []
        self._in_episode = True
        return [self._finding(buf, med)]

    def _latest_capture(self, rank: int) -> str | None:
        import os

        d = self.captures_dir
        if not d:
            return None
        try:
            names = [n for n in os.listdir(d) if n.endswith(f".rank{rank}.trace.json.gz")]
            return max((os.path.join(d, n) for n in names), key=os.path.getmtime) if names else None
        except OSError:
            return None

    def _finding(self, buf: list[StepRecord], med: float) -> Finding:
        total = sum(r.step_s for r in buf)
        share = {
            "data_wait": sum(r.data_wait_s for r in buf) / total,
            "forward": sum(r.forward_s for r in buf) / total,
            "backward": sum(r.backward_s for r in buf) / total,
            "optimizer": sum(r.optimizer_s for r in buf) / total,
            "other": sum(r.other_s for r in buf) / total,
        }
        exposed = [r.comm_exposed_s for r in buf if r.comm_exposed_s is not None]
        comm = (sum(exposed) / sum(r.step_s for r in buf if r.comm_exposed_s is not None)) if exposed else None
        parts = {"data": share["data_wait"], "comm": comm or 0.0, "other": share["other"]}
        big = {k: v for k, v in parts.items() if v >= FIRST_LOOK_SHARE}
        first = max(big, key=big.get) if big else "compute"  # type: ignore[arg-type]
        on_cpu = self._device() == "cpu"
        what, where = (_FIRST_LOOK_CPU if on_cpu else _FIRST_LOOK)[first]
        last = buf[-1]
        split = ", ".join(f"{k.replace('_', ' ')} {v:.0%}" for k, v in share.items())
        if comm is not None:
            split += f"; exposed comm {comm:.0%}"
        capture = self._latest_capture(last.rank)
        summary = (
            f"rank {last.rank}: MFU median {med:.1%} over steps {buf[0].step}-{last.step} (< {self.threshold:.0%}); "
            f"step time: {split}. Look first at {what}"
            + (f" ({parts[first]:.0%} of the step)" if first != "compute" else
               f" (forward+backward+optimizer {share['forward'] + share['backward'] + share['optimizer']:.0%} of the step)")
            + f": {where}"
            + (f". Capture of this rank: {capture}" if capture else "")
        )
        return make_finding(
            "low_mfu",
            rank=last.rank,
            step=last.step,
            when=last.time,
            summary=summary,
            data={
                "mfu_median": med,
                "threshold": self.threshold,
                "first_step": buf[0].step,
                "last_step": last.step,
                "steps": len(buf),
                "share": share,
                "exposed_comm_share": comm,
                "look_first": first,
                "capture": capture,
                "peak_tflops": last.peak_tflops,
                "mfu_dtype": last.mfu_dtype,
            },
        )
