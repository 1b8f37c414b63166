"""Detectors: consume step records on the background thread, emit findings.

A detector has ``observe(record) -> list[Finding]``, and may have ``observe_many(records) ->
list[Finding]``: the same over a pass's records in one call (the pipeline calls it instead;
one Python call a record per detector was a tenth of the background's cost). A windowed one
judges non-overlapping windows of ``window`` steps and makes a finding of every bad window: the
one rate limit every finding passes (analysis/ratelimit.py) writes a run of them as an episode,
its first window, a repeat every ``STEPWATCH_FINDING_REPEAT_WINDOWS`` and a closing count, so a
persistent problem is not log spam and its length is not lost.

``spike_finding`` builds the step-time spike's finding (the detector, with its rolling median, is
capture/triggers.py's): it says whose time the spike was, this rank's or a peer's it waited for.
"""

from __future__ import annotations

from .._log import warn_once
from ..record import Finding, StepRecord
from .kinds import make_finding

# A spike is another rank's, seen from here, when at least this share of its excess over the
# median was spent standing in a collective ("most of it").
WAIT_SHARE = 0.5


class WindowedDetector:
    # A run that ends before its first window fills is judged at its end (``finish``) on at least
    # this many steps after its first; 0: never (a partial window is too little for the rule).
    final_min_steps = 0

    def __init__(self, window: int) -> None:
        self.window = window
        self._buf: list[StepRecord] = []
        self._judged = False  # a full window was judged

    def finish(self) -> list[Finding]:
        """The run's end (the pipeline's last pass): a run shorter than one window, never judged,
        is judged on its steps but the first (step 0 waits for workers to start and caches to
        fill, in any run) and the tail record, when there are ``final_min_steps`` of them."""
        buf, self._buf = self._buf, []
        if not self.final_min_steps or self._judged:
            return []
        steps = [r for r in buf[1:] if not r.tail]
        if len(steps) < self.final_min_steps:
            return []
        self._judged = True
        finding = self.judge(steps)
        return [finding] if finding is not None else []

    def observe(self, rec: StepRecord) -> list[Finding]:
        self._buf.append(rec)
        if len(self._buf) < self.window:
            return []
        buf, self._buf = self._buf, []
        return self._close(buf)

    def observe_many(self, records: list[StepRecord]) -> list[Finding]:
        """``observe`` over ``records`` in one call: the same windows and findings."""
        if type(self).observe is not WindowedDetector.observe:  # a subclass that picks its records
            return [f for rec in records for f in self.observe(rec)]
        out: list[Finding] = []
        i, n = 0, len(records)
        while True:
            need = max(self.window - len(self._buf), 1)  # observe closes a window at >= window records
            if n - i < need:
                self._buf.extend(records[i:])
                return out
            buf, self._buf = self._buf, []
            buf.extend(records[i : i + need])
            i += need
            out.extend(self._close(buf))

    def _close(self, buf: list[StepRecord]) -> list[Finding]:
        """A full window judged: its finding, if it was bad."""
        self._judged = True
        finding = self.judge(buf)
        return [finding] if finding is not None else []

    def judge(self, window: list[StepRecord]) -> Finding | None:  # pragma: no cover - interface
        return None


class DataLoadingDetector(WindowedDetector):
    """Reference B.9: mean DataLoader wait per step above 10 ms means data loading is the bottleneck.
    A run shorter than one window (a first try of 30 steps) is judged at its end."""

    final_min_steps = 10

    def __init__(self, window: int, threshold_ms: float) -> None:
        super().__init__(window)
        self.threshold_s = threshold_ms / 1000.0

    def judge(self, window: list[StepRecord]) -> Finding | None:
        waits = [r.data_wait_s for r in window]
        mean = sum(waits) / len(waits)
        if mean <= self.threshold_s:
            return None
        steps = [r.step_s for r in window]
        share = sum(waits) / max(sum(steps), 1e-12)
        last = window[-1]
        return make_finding(
            "data_loading",
            rank=last.rank,
            step=last.step,
            when=last.time,
            summary=(
                f"rank {last.rank} waited {mean * 1e3:.1f} ms per step on data over steps "
                f"{window[0].step}-{last.step} ({share:.0%} of step time; threshold "
                f"{self.threshold_s * 1e3:g} ms)"
            ),
            data={
                "mean_wait_ms": mean * 1e3,
                "max_wait_ms": max(waits) * 1e3,
                "share_of_step": share,
                "first_step": window[0].step,
                "last_step": last.step,
                "threshold_ms": self.threshold_s * 1e3,
            },
        )


class UnseenForwardCheck:
    """A line in the log (no finding) when training steps run backward but no forward is ever
    timed: the forward is tensor code with no module, or a module's own ``forward`` called
    directly (``model.forward(x)``) that calls no submodule: forward time lands in ``other_s``
    and FLOPs, MFU and samples stay null. (A model called through its methods has its submodules
    hooked a level at a time, each level judged two steps later: hooks/install.py
    ``_UnseenForward``, up to 3 levels, so the check waits 8 steps.) Judged on the first
    ``steps`` records with a backward, past the run's first record (whose forward may run before
    the model is found); then it stops looking."""

    def __init__(self, steps: int = 8) -> None:
        self.steps = steps
        self._seen = 0
        self._first = True
        self.done = False

    def observe(self, rec: StepRecord) -> list[Finding]:
        return self.observe_many([rec])

    def observe_many(self, records: list[StepRecord]) -> list[Finding]:
        if self.done:
            return []
        for r in records:
            if self._first:  # the run's first record
                self._first = False
                continue
            if r.backward_s <= 0 or r.tail:
                continue
            if r.forward_s > 0:
                self.done = True
                return []
            self._seen += 1
            if self._seen >= self.steps:
                self.done = True
                warn_once(
                    "unseen-forward",
                    "stepwatch: rank %d: steps up to %d ran backward but no module call was timed as forward, "
                    "of the model or of its submodules 3 levels down. A forward written as plain tensor code, "
                    "with no nn.Module, has nothing to hook; nor has a module's forward called as "
                    "module.forward(x) that calls no submodule (call the module itself: module(x)), nor a model "
                    "called inside a torch.compile'd function, which inlines the call (compile the model "
                    "instead: model.compile() or torch.compile(model)). Its time is in other_s, and FLOPs, MFU "
                    "and samples are null.",
                    r.rank,
                    r.step,
                )
                return []
        return []


def collective_s(rec: StepRecord) -> float | None:
    """Time the step stood in collectives outside its own compute: the exposed communication
    (``comm_exposed_s``: DDP's buckets outside backward compute, with the training thread's time
    blocked in the job's own collectives and in ``Work.wait()``: a barrier, a logging all_reduce,
    FSDP2's all-gathers; comm/blocked.py), else the union of the step's collectives (``comm_s``:
    FSDP's on a GPU, whose waits are the streams'); None when no collective was measured."""
    return rec.comm_exposed_s if rec.comm_exposed_s is not None else rec.comm_s


def spike_finding(rec: StepRecord, *, median_s: float, mad_s: float, limit_s: float,
                  collective_median_s: float | None) -> Finding:
    """The ``step_time_spike`` of ``rec``, judged a spike against ``median_s`` (``limit_s``).

    Whose time it was: the spike's excess over the median that the step spent standing in a
    collective is ``collective_s(rec)`` minus its own rolling median (``collective_median_s``;
    None, when no step before had one measured: ``median_s``, the most a normal step can hold,
    so the wait is never overstated). When that is at least ``WAIT_SHARE`` of the excess, this
    rank was not slow: it ran ahead and waited in the step's collective for a rank that arrived
    late (rank 0 saving a checkpoint or running an evaluation that its peers do not, or a slow
    step of its own there). That rank's own record shows it (checkpoint_s, eval_s, a straggler
    finding, its own spike), and the time is not this rank's to fix, so the finding is ``info``,
    and its summary says how much was waiting and where to look: the other ranks at this step
    (every rank waiting at the same step points at the collective itself: the network). Its
    ``data["subject"]`` keeps it in an episode of its own (analysis/ratelimit.py), so a peer's
    periodic save never holds back this rank's own spike. Otherwise -- compute, data wait, the
    optimizer, or the wait unmeasured -- it is the rank's own spike, a ``warning`` as ever.
    ``data`` always carries the split: ``collective_wait_s`` (None when unmeasured), its
    ``collective_wait_share`` of the excess, and ``cause`` (``"collective_wait"`` or
    ``"this_rank"``)."""
    x = rec.step_s
    excess = x - median_s
    stood = collective_s(rec)
    wait = None
    if stood is not None:
        base = collective_median_s if collective_median_s is not None else median_s
        wait = min(max(stood - base, 0.0), max(excess, 0.0))
    share = wait / excess if wait is not None and excess > 0 else None
    waited = share is not None and share >= WAIT_SHARE
    summary = (f"rank {rec.rank} step {rec.step} took {x * 1e3:.1f} ms, {x / median_s:.1f}x the rolling "
               f"median of {median_s * 1e3:.1f} ms (limit {limit_s * 1e3:.1f} ms)")
    if waited:
        summary += (f", {wait * 1e3:.1f} ms of it ({share:.0%} of the excess) waiting in a collective for "
                    f"another rank: rank {rec.rank}'s own work was not slow -- look at the other ranks at step "
                    f"{rec.step} (a checkpoint, an evaluation or a slow step there: their checkpoint_s, eval_s "
                    "and step_s)")
    return make_finding(
        "step_time_spike",
        rank=rec.rank,
        step=rec.step,
        when=rec.time,
        severity="info" if waited else None,
        summary=summary,
        # magnitude: how bad, for the rate limit (analysis/ratelimit.py): a spike twice the
        # episode's worst told is told at once.
        data={"step_s": x, "median_s": median_s, "mad_s": mad_s, "limit_s": limit_s,
              "magnitude": x / median_s if median_s > 0 else None,
              "data_wait_s": rec.data_wait_s, "forward_s": rec.forward_s,
              "backward_s": rec.backward_s, "optimizer_s": rec.optimizer_s, "other_s": rec.other_s,
              "collective_wait_s": wait, "collective_wait_share": share,
              "cause": "collective_wait" if waited else "this_rank",
              **({"subject": "collective_wait"} if waited else {})},
    )
