"""The per-step record and the finding: one schema for the records file, the metrics and the report.

Every field here is documented in the README's "Record schema" table. Fields that a later
feature fills (FLOPs, communication, ...) are ``None`` until something measures them: unknown is
shown as unknown, never as a plausible number.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from math import floor as _floor
from typing import Any, Callable

SCHEMA_VERSION = 1

SEVERITIES = ("info", "warning", "critical")


@dataclass(slots=True)
class StepRecord:
    """One optimizer step on one rank. Times are seconds; ``time`` is unix seconds at step end (whole
    microseconds)."""

    step: int
    rank: int
    time: float
    step_s: float
    data_wait_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    other_s: float = 0.0
    eval_s: float = 0.0
    checkpoint_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    scalars: dict[str, float] = field(default_factory=dict)
    skipped: bool = False
    mem_peak_bytes: int | None = None
    # Filled by later features; None when unknown.
    flops: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    tokens: int | None = None
    grad_norm: float | None = None
    comm_s: float | None = None
    comm_exposed_s: float | None = None
    overlap: float | None = None
    allreduce_s: float | None = None
    # Which clock the phase times came from: "host" or "device".
    clock: str = "host"
    # Checkpoint saves in this record's checkpoint_s: bytes written and GB/s (None when unknown).
    checkpoint_bytes: int | None = None
    checkpoint_gbps: float | None = None
    # MFU's denominator: the step's matmul dtype ("bf16", "fp32", "tf32", "mixed") and the peak
    # TFLOP/s it was divided by (FLOP-weighted over dtypes).
    mfu_dtype: str | None = None
    peak_tflops: float | None = None
    # Samples (sequences) in the step, summed over micro-batches; None when unknowable.
    samples: int | None = None
    # GPU health over the step (telemetry window summary), None without a GPU sample in the step.
    gpu: dict[str, Any] | None = None
    # Communication detail (stepwatch.comm): bandwidth of the step's collectives whose bytes are
    # known (nccl-tests' algbw/busbw, GB/s) and the part of allreduce_s spent waiting for peers.
    algbw_gbps: float | None = None
    busbw_gbps: float | None = None
    comm_wait_s: float | None = None
    # Memory (stepwatch.memory), read every STEPWATCH_MEMORY_EVERY steps (None in between). CUDA
    # caching allocator at the step's end: allocated, reserved, reserved beyond the peak since the
    # previous read (fragmentation), allocation retries and OOMs since the previous read.
    mem_allocated_bytes: int | None = None
    mem_reserved_bytes: int | None = None
    mem_fragmentation_bytes: int | None = None
    mem_alloc_retries: int | None = None
    mem_ooms: int | None = None
    # Device free memory (cudaMemGetInfo: all processes), sampled at most once a second.
    mem_device_free_bytes: int | None = None
    # Host: the trainer's current resident set, and its DataLoader workers' summed USS and PSS
    # (/proc/<pid>/smaps_rollup, sampled at most once a second) and how many there are.
    host_rss_bytes: int | None = None
    workers_uss_bytes: int | None = None
    workers_pss_bytes: int | None = None
    dataloader_workers: int | None = None
    # The run's last record when evaluation or checkpoints ran after the last step: no training
    # step (step_s and the training phases are 0), only eval_s / checkpoint_s, so totals count them.
    tail: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in STEP_FIELDS}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StepRecord":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(slots=True)
class Finding:
    """Something stepwatch noticed, with the diagnosis and the action from the reference tables."""

    time: float
    step: int | None
    rank: int | None  # None: a trace of unknown rank (stepwatch trace on a file without distributedInfo)
    kind: str
    severity: str
    summary: str
    diagnosis: str
    action: str
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Finding":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class RawStep:
    """One step as the training thread hands it over (``hooks/phases.py``): host-clock
    nanoseconds and what the collectors took, nothing converted. Built once per step on the hot
    path, so a slots class with a positional constructor (about what the tuple it replaced cost);
    :meth:`to_record` decodes it on the background thread. hooks/_ctracker.c fills these slots
    itself, without calling ``__init__``, while every one is a plain slot: ``__init__`` must only
    store its arguments (tests/unit/test_tracker_core.py compares the two ways field by field)."""

    __slots__ = (
        "step", "t_end_ns", "step_ns", "data_ns", "forward_ns", "backward_ns", "optimizer_ns",
        "eval_ns", "checkpoint_ns", "phases", "scalars", "skipped", "mem_peak_bytes", "extras", "tail",
    )

    def __init__(
        self,
        step: int,
        t_end_ns: int,
        step_ns: int,
        data_ns: int,
        forward_ns: int,
        backward_ns: int,
        optimizer_ns: int,
        eval_ns: int,
        checkpoint_ns: int,
        phases: dict[str, int] | None,
        scalars: dict[str, Any],
        skipped: bool,
        mem_peak_bytes: int | None,
        extras: dict[str, Any],
        tail: bool = False,
    ) -> None:
        self.step = step
        self.t_end_ns = t_end_ns  # perf_counter_ns at the step's end
        self.step_ns = step_ns
        self.data_ns = data_ns
        self.forward_ns = forward_ns
        self.backward_ns = backward_ns
        self.optimizer_ns = optimizer_ns
        self.eval_ns = eval_ns
        self.checkpoint_ns = checkpoint_ns
        self.phases = phases  # user phases, ns (None: none ran)
        self.scalars = scalars  # as logged (a pending device copy stays as it is)
        self.skipped = skipped
        self.mem_peak_bytes = mem_peak_bytes
        # What the collectors took at the step's end, by collector name (the enrichers read it),
        # plus ``backward_spans`` and, with a checkpoint in the step, ``checkpoint_bytes``.
        self.extras = extras
        self.tail = tail  # evaluation/checkpoints after the last step (see StepTracker.flush)

    def to_record(
        self, rank: int, wall_ref: float, perf_ref_ns: int, scalar: Callable[[str, Any], Any]
    ) -> StepRecord:
        """The record: seconds; ``time`` in unix seconds from the pair (``wall_ref`` = time.time()
        taken at ``perf_ref_ns``); ``other_s`` the step's rest; ``scalar(name, value)`` converts
        each logged value that is not a float already (most are: a CPU tensor is read at log()).

        Built positionally, the fields in StepRecord's order, and the empty dicts not walked: this
        runs once per step on the background thread, and keyword passing was a third of its cost.

        Durations are ``ns / 1e9``, the float nearest the measured nanoseconds (whose shortest repr
        is those digits: ``0.000897729``), not ``ns * 1e-9``, which is often one ulp off it
        (``0.0008977290000000001``: a longer line, and a slower repr). ``time`` likewise is whole
        microseconds / 1e6 (``1796400555.773568``): its repr is those digits, which the records
        line writes without dtoa (a 17-digit repr cost a tenth of a line)."""
        ns = 1e9  # per second
        step_ns, data_ns, fwd_ns = self.step_ns, self.data_ns, self.forward_ns
        bwd_ns, opt_ns = self.backward_ns, self.optimizer_ns
        other = step_ns - data_ns - fwd_ns - bwd_ns - opt_ns
        other = 0 if 0 > other else other  # max(other, 0) without its call (a sixth of this method)
        ckpt_s = self.checkpoint_ns / ns
        phases, scalars = self.phases, self.scalars
        rec = StepRecord(
            self.step,
            rank,
            (_floor(wall_ref * 1e6) + (self.t_end_ns - perf_ref_ns) // 1000) / 1e6,
            step_ns / ns,
            data_ns / ns,
            fwd_ns / ns,
            bwd_ns / ns,
            opt_ns / ns,
            other / ns,
            self.eval_ns / ns,
            ckpt_s,
            {k: v / ns for k, v in phases.items()} if phases else {},
            {k: v if type(v) is float else scalar(k, v) for k, v in scalars.items()} if scalars else {},
            self.skipped,
            self.mem_peak_bytes,
        )
        if self.tail:
            rec.tail = True
        if ckpt_s:
            nbytes = self.extras.get("checkpoint_bytes")
            rec.checkpoint_bytes = nbytes
            rec.checkpoint_gbps = nbytes / ckpt_s / 1e9 if nbytes else None
        return rec


STEP_FIELDS = tuple(f.name for f in dataclasses.fields(StepRecord))
FINDING_FIELDS = tuple(f.name for f in dataclasses.fields(Finding))


def _plain_defaults() -> tuple[Any, ...] | None:
    """StepRecord's defaults past the fields to_record gives, when every one is a plain value a
    record may share (None, a number, a str, a bool); None when one is not (a default_factory)."""
    out = []
    for f in dataclasses.fields(StepRecord)[15:]:
        if type(f.default) not in (type(None), float, int, str, bool):
            return None
        out.append(f.default)
    return tuple(out)


# RawStep.to_record in C (src/stepwatch/_speedups.c), for the background thread: the record's
# slots filled without its dataclass __init__'s frame. Optional, like the step line's filler:
# None where it is not built or declined to bind; it returns None for any step it leaves to the
# method (a checkpoint in the step, an unusual value), and tests/unit/test_records_decode.py compares
# the two field by field.
c_to_record: Callable[..., StepRecord | None] | None = None
try:
    from ._speedups import bind_records, to_record

    _defaults = _plain_defaults()
    if _defaults is not None and bind_records(RawStep, StepRecord, STEP_FIELDS, _defaults):
        c_to_record = to_record
except ImportError:  # not built (no compiler at install): the method, the same records
    pass
