"""``slow_checkpoint``: the checkpoint rules of reference B.9, judged on the step records.

They need nothing but the records (``checkpoint_s``, ``checkpoint_bytes``), so the detector is one
of the session's defaults, whatever else is on: it ran inside the GPU sampler's analysis until the
thirty-fifth session, and a job with ``gpu_telemetry=False`` (most CPU jobs) never got it.
"""

from __future__ import annotations

from typing import Sequence

from ..record import Finding, StepRecord
from .kinds import make_finding

# Reference B.9: "a healthy training job loses 2-8% MFU to checkpoint overhead"; storage checklist
# "> 10 GB/s healthy; < 2 GB/s -> storage degraded".
CHECKPOINT_SHARE_MAX = 0.08
CHECKPOINT_GBPS_DEGRADED = 2.0
# The summary says "may be": a save's speed is the serializer's too (torch.save writes one zip
# entry at a time with its CRC, 0.5-1.1 GB/s on a disk that takes 1.3-1.6 GB/s of raw writes),
# so below 2 GB/s the disk is not known to be the slow part.
# stepwatch: the share of run time is judged once this much run time is behind it (a save of the
# initial weights at step 0, or in a run of seconds, is most of the run so far and says nothing).
CHECKPOINT_SHARE_MIN_RUN_S = 60.0
# stepwatch: a save smaller than this says nothing about storage bandwidth (its time is open,
# pickling and metadata latency; a 2 KB save "writes" 0.00 GB/s): only larger saves are judged.
CHECKPOINT_MIN_BYTES = 100_000_000


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
    """Checkpoint share of run time since the start, judged each time a record carries a save,
    once ``CHECKPOINT_SHARE_MIN_RUN_S`` of run time is behind it; the saves' write speed at once.
    The summary leads with the rule that fired.

    A detector (``observe``/``observe_many``); its findings are ``rank``'s, else each record's
    own rank (the session's: its rank is known only once the process group is). O(1) memory
    (running sums). Reports at most once per ``repeat_s`` of record time.
    """

    def __init__(self, rank: int | None = None, repeat_s: float = 1800.0) -> None:
        self.rank = rank
        self.repeat_s = repeat_s
        self.run_s = 0.0
        self.ck_s = 0.0
        self.ck_bytes = 0.0
        self.ck_bytes_s = 0.0  # checkpoint seconds of the saves whose bytes are known
        self.saves = 0
        self._last: float | None = None

    def observe(self, rec: StepRecord) -> list[Finding]:
        return self.update((rec,))

    def observe_many(self, records: Sequence[StepRecord]) -> list[Finding]:
        return self.update(records)

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
            long_share = share > CHECKPOINT_SHARE_MAX and self.run_s >= CHECKPOINT_SHARE_MIN_RUN_S
            slow_write = gbps is not None and gbps < CHECKPOINT_GBPS_DEGRADED
            if not (long_share or slow_write) or (self._last is not None and r.time - self._last < self.repeat_s):
                continue
            self._last = r.time
            saves = f"{self.saves} step{'s' * (self.saves != 1)} with a save"
            parts = []
            if long_share:
                parts.append(f"checkpointing took {share:.1%} of run time in {saves} ({self.ck_s:.1f} s of "
                             f"{self.run_s:.1f} s; 2-8% is normal)")
            if gbps is not None:
                parts.append(f"saves wrote {gbps:.2f} GB/s"
                             + (" (< 2 GB/s: the storage may be degraded (B.9), or the save itself is slow: "
                                "`stepwatch doctor --storage DIR` measures the disk alone)" if slow_write else ""))
            if not long_share:  # the share is judged only after a minute of run: what it is so far
                parts.append(f"{self.ck_s:.1f} s of checkpointing in {saves} so far")
            rank = r.rank if self.rank is None else self.rank
            out.append(make_finding(
                "slow_checkpoint", rank=rank, step=r.step, when=r.time, summary="; ".join(parts),
                data={"checkpoint_s": self.ck_s, "run_s": self.run_s, "share": share, "gb_per_s": gbps,
                      "saves": self.saves},
            ))
        return out
