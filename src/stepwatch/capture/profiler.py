"""Anomaly-triggered captures: torch.profiler over the next N steps, on every rank, the same steps.

Who does what:

* Background thread (``on_pass``, each pipeline pass): sees trigger findings
  (``triggers.TRIGGER_KINDS``). Rank 0 decides -- rate limit, cooldown, maximum count, disk
  budget -- and publishes ``stepwatch/<run_id>/capture/<k> = "<first step>:<reason>"`` in
  torch.distributed's store; another rank that sees a trigger asks rank 0 through a counter key
  (``capture/req``, ``store.add``). Every other rank polls for the next key without blocking
  (``store.check``) each pass. The first step is the current step plus a lag long enough for
  every rank to read the key first (two seconds of steps, at least two steps); a rank that
  decides alone (one process, no store) takes the second step after the decision.
* Training thread (a step-end listener, ``hub.add_listener``): starts the profiler at the
  boundary before the first step, marks each step (``stepwatch_step_<n>`` ranges), stops it after
  the N-th. A profiler started from another thread records none of the training thread's ops.
* An export thread writes the Chrome trace JSON to ``<run_dir>/captures/`` (Perfetto opens it).

Warm-up: the first profiler start in a process costs 1-3 s (Kineto's initialisation; 1.1-1.4 s
on the issue's machine, 3 s on a loaded 2-core VM), later ones ~2 ms. ``warm()`` pays it once at
install, on the training thread before the first step (a profiler warmed on another thread works
too, but Kineto then prints an ERROR line into the job's log). The ~2 ms start and the stop run at
step boundaries; the tracker ends a step lazily, when the next step's first phase begins, so they
are counted in that phase (visible, not hidden).

Each trace is then analysed off the job (``traces/worker.py``: a separate process at nice 19,
bounded memory and CPU time, no torch), where it was written; its summary lands beside it as
``<stem>.analysis.json`` and its findings join this rank's findings at the next background pass
(``collect_analyses``), linked to the capture, its steps and the trigger's reason.

On demand: ``stepwatch capture RUN_DIR --steps N`` drops a request in ``RUN_DIR/requests/``;
rank 0 takes it (``traces/rundir.py``) and publishes it like a trigger, with its step count.

Under ``stepwatch run --nsys`` (``STEPWATCH_NSYS=1``) the same steps also open an nsys capture
range (``nsys.py``). Each capture also asks the watchdog sidecar for a py-spy dump.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Iterator

from .. import _dist, _env
from .._files import private_subdir, private_tmp, read_json_private, write_json_private
from .._log import logger, warn_once
from ..record import Finding, StepRecord
from . import nsys as nsys_mod
from .triggers import triggers_capture

if TYPE_CHECKING:
    from .._feature import Hub

# Seconds of steps between the decision and the first captured step: every rank must read the
# store key first (one background pass is flush_interval_s, 0.25 s by default) and warm up.
LAG_S = 2.0
# Ranks look for a decision in the store at most this often: every rank polls the job's one store
# (4 passes a second would be ~16k store operations a second at 4k ranks); well inside LAG_S.
STORE_POLL_S = 1.0
MIN_LAG_STEPS = 2
MAX_LAG_STEPS = 100
# A profiler that starts (the job's, or our next capture's) first waits this long for a capture's
# export still writing: torch 2.13 crashes (a segmentation fault in the export's
# ``kineto_results.save``) when a profiler session runs beside it.
EXPORT_WAIT_S = 120.0
# At the job's end, the last pass waits this long for analyses still running; later ones are read
# by `stepwatch report` from their files.
FINAL_WAIT_S = 10.0
# Why a capture was not taken, as counted in run.json's ``features.capture.captures.skipped``.
BUSY = "busy: the job's own profiler is running"
TAKEN_OVER = "taken over: the job's own profiler started inside a captured step"
LOST = "lost: torch no longer held the capture's profiler session"


class _Scheduled:
    __slots__ = ("k", "first", "reason", "pyspy_req", "t", "steps")

    def __init__(self, k: int, first: int, reason: str, steps: int) -> None:
        self.k, self.first, self.reason, self.steps = k, first, reason, steps
        self.pyspy_req: int | None = None
        self.t = time.time()


def _highest_number(d: str, pattern: str) -> int:
    """The highest number ``pattern``'s group takes among the names in folder ``d`` (0 for none)."""
    import re

    rx = re.compile(pattern)
    try:
        names = os.listdir(d)
    except OSError:
        return 0
    return max((int(m.group(1)) for n in names if (m := rx.match(n))), default=0)


def _results_held(prof: Any) -> bool:
    """Whether a stopped ``torch.profiler.profile`` holds the results of a session. torch 2.13's
    ``_disable_profiler`` without a session of its own (another profiler took it over and ended
    it) warns and returns an empty ``_ProfilerResult``: no trace, start time 0, and its ``save``
    (``export_chrome_trace``) dereferences the missing trace (a segmentation fault). The start
    time is a plain field: reading it calls nothing that can crash."""
    res = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if res is None:
        return True  # torch without Kineto results: exported through its own event list
    start = getattr(res, "trace_start_ns", None)
    try:
        return not callable(start) or start() != 0
    except Exception:
        return False


class CaptureManager:
    name = "captures"

    def __init__(self, hub: "Hub", *, steps: int, cooldown_s: float, max_count: int, budget_mb: int,
                 board: Any = None, nsys: bool = False) -> None:
        self.hub = hub
        self.ctx = hub.ctx
        self.steps = steps
        self.cooldown_s = cooldown_s
        self.max_count = max_count
        self.budget_bytes = budget_mb * 1024 * 1024
        self.board = board
        self.nsys = nsys_mod.Nsys() if nsys else None
        self.dir = os.path.join(self.ctx.run_dir, "captures")
        self.scheduled: _Scheduled | None = None  # written by the background thread, read by training
        self.active: dict[str, Any] | None = None
        self.count = 0
        self._polled = 0.0  # last look at the store (on_pass)
        self.skipped: dict[str, int] = {}
        self.done: list[dict[str, Any]] = []
        self._last_decision = -math.inf
        # Captures are numbered on from the highest this run dir holds (a relaunch into it, a
        # resumed or requeued job with the same run id: its capture 1 was written over the last
        # launch's). Rank 0 numbers them; the other ranks take its first number from the store
        # (``_k_synced``) before they look for its decisions.
        from ..traces import rundir

        self._next_k = rundir.highest_capture(self.dir) + 1
        self._k_synced = self.ctx.rank == 0
        if board is not None:  # the stack dumps' numbers (pyspy-<n>.rank<R>.txt) likewise
            board.number_dumps_after(_highest_number(self.dir, rf"pyspy-(\d+)\.rank{self.ctx.rank}\.txt$"))
        self._req_seen = 0
        self._store: Any = None
        self._store_state = "unresolved"
        self.warm_s: float | None = None
        self._rf: Any = None
        self._step_s: deque[float] = deque(maxlen=50)
        self._exports: list[threading.Thread] = []
        self._analyses: list[tuple[Any, str, dict[str, Any]]] = []  # (process, summary path, meta)
        self._requests_polled = 0.0
        self.analysed: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        # The steps our own profiler slowed, ``[first, last]`` per capture, newest last (the
        # training thread writes, the spike detector reads on the background thread): its start
        # lands in the first captured step, its stop in the one after the last, and its export
        # thread runs beside the steps after that; ``last`` is open (inf) until the export ends.
        self._ours: tuple[list[float], ...] = ()
        # The job's own profiler (follow_job_profilers): prepared and not stopped yet; ``_own``
        # while our profiler starts or stops (training thread), whose calls are not the job's.
        self._job_profiler = False
        self._job_since = 0  # the step the job's profiler was prepared in (``_job_profiling``)
        self._own = False
        self._patched: list[tuple[Any, str, Any, Any]] = []  # (module, name, torch's, ours)

    # -- records (background) -------------------------------------------------------------------

    def observe(self, rec: StepRecord) -> list[Finding]:
        self._step_s.append(rec.step_s)
        return []

    def _lag(self) -> int:
        if not self._step_s:
            return MIN_LAG_STEPS
        med = statistics.median(self._step_s)
        return int(min(max(math.ceil(LAG_S / max(med, 1e-6)), MIN_LAG_STEPS), MAX_LAG_STEPS))

    def profiled(self, step: int) -> bool:
        """Whether ``step``'s time holds our profiler's cost (any thread): the spike detector
        leaves such a step out, as it leaves out evaluation and checkpoints."""
        return any(first <= step <= last for first, last in self._ours)

    # -- coordination (background) ---------------------------------------------------------------

    def _get_store(self) -> Any:
        """torch.distributed's default store once a multi-rank process group exists, else None."""
        if self._store_state == "ok":
            return self._store
        try:
            store = _dist.default_store()
            if store is None:
                return None
            if _dist.world()[1] < 2:
                self._store_state = "single"
                return None
            self._store = store
            self._store_state = "ok"
            return self._store
        except Exception as e:
            if self._store_state != "failed":
                self._store_state = "failed"
                warn_once("capture.store", "captures: no torch.distributed store (%s); each rank decides alone", e)
            return None

    def _key(self, name: str) -> str:
        return _dist.namespace(self.ctx.run_id, "capture", name)

    def on_pass(self, findings: list[Finding]) -> None:
        """Each background pass, with the findings of that pass."""
        reason = next((f.kind for f in findings if triggers_capture(f) and f.rank == self.ctx.rank), None)
        store = self._get_store()
        rank = self.ctx.rank
        if rank == 0 and (store is not None or self.ctx.world_size < 2 or self._store_state in ("single", "failed")):
            try:
                self._take_request(store)
            except OSError as e:  # an unwritable requests folder: on-demand captures only are off
                warn_once("capture.request", "captures: cannot answer an on-demand request (%s)", e)
        if store is None:
            # A multi-rank job decides through the store: wait for the process group.
            if reason and (self.ctx.world_size < 2 or self._store_state in ("single", "failed")):
                self._decide(reason, None)
            return
        now = time.monotonic()
        if not reason and now - self._polled < STORE_POLL_S:
            return
        self._polled = now
        if rank == 0:
            if self._k_synced is True:
                store.set(self._key("first"), str(self._next_k))
                self._k_synced = "published"
            if reason:
                self._decide(reason, store)
            n = int(store.add(self._key("req"), 0))
            if n > self._req_seen:
                self._req_seen = n
                self._decide("requested by another rank", store)
        else:
            if reason and self._allowed(time.monotonic()) is None:
                store.add(self._key("req"), 1)
                self._last_decision = time.monotonic()  # do not ask again within the cooldown
            if not self._k_synced:
                if not store.check([self._key("first")]):
                    return  # rank 0 has not said its first number yet
                self._next_k = int(store.get(self._key("first")).decode())
                self._k_synced = True
            key = self._key(str(self._next_k))
            if store.check([key]):
                first, _, rest = store.get(key).decode().partition(":")
                n, _, why = rest.partition(":")
                steps = int(n) if n.isdigit() else self.steps
                if not n.isdigit():
                    why = rest
                self._next_k += 1
                self._schedule(_Scheduled(self._next_k - 1, int(first), why, steps))

    def _disk_used(self) -> tuple[int, int]:
        """(bytes in the captures folder, bytes of its largest capture so far, all ranks' files).
        The next capture is projected at the largest one's size: on a shared run dir every rank
        writes a trace of its own, so one capture costs ranks x a trace, not one trace."""
        total = 0
        per_capture: dict[str, int] = {}
        try:
            with os.scandir(self.dir) as it:
                for e in it:
                    if e.is_file(follow_symlinks=False):
                        size = e.stat().st_size
                        total += size
                        if e.name.startswith("capture-"):
                            k = e.name.split("-", 2)[1]
                            per_capture[k] = per_capture.get(k, 0) + size
        except OSError:
            pass
        return total, max(per_capture.values(), default=0)

    def _over_budget(self) -> bool:
        used, largest = self._disk_used()
        return used + largest > self.budget_bytes or used >= self.budget_bytes

    def _allowed(self, now: float) -> str | None:
        """None when a capture may be scheduled now, else why not."""
        if self.scheduled is not None or self.active is not None:
            return "busy"
        if self.count >= self.max_count:
            return "max_count"
        if now - self._last_decision < self.cooldown_s:
            return "cooldown"
        if self._over_budget():
            return "disk_budget"
        return None

    def _take_request(self, store: Any) -> None:
        """Rank 0, at most once a second: an on-demand request from `stepwatch capture`. It skips
        the cooldown and the count limit (a person asked), not the disk budget."""
        now = time.monotonic()
        if now - self._requests_polled < STORE_POLL_S:
            return
        self._requests_polled = now
        from ..traces import rundir

        reqs = rundir.pending_requests(self.ctx.run_dir)
        if not reqs:
            return
        if self.scheduled is not None or self.active is not None:
            return  # busy: the request waits for the next pass
        rid, steps = reqs[0]
        if self._job_profiling(across_steps=True):
            # The job's profiler wins (``_start`` would skip the capture at its first step): say so
            # to the one who asked now, not after the command's whole --timeout.
            self._skip(BUSY)
            rundir.answer_request(self.ctx.run_dir, rid, {
                "refused": "the job's own profiler is running (torch.profiler: a capture would take its session "
                           "over, and the job's profiler wins); ask again once it has stopped",
                "skipped": BUSY})
            return
        if self._over_budget():
            rundir.answer_request(self.ctx.run_dir, rid, {"refused": "the captures' disk budget is spent "
                                                          "(STEPWATCH_CAPTURE_BUDGET_MB)"})
            return
        sc = self._decide("on demand (stepwatch capture)", store, steps=steps, forced=True)
        if sc is None:
            rundir.answer_request(self.ctx.run_dir, rid, {"refused": "this rank's capture limits"})
            return
        rundir.answer_request(self.ctx.run_dir, rid, {"capture": sc.k, "first_step": sc.first,
                                                      "last_step": sc.first + sc.steps - 1, "steps": sc.steps})

    def _decide(self, reason: str, store: Any, *, steps: int | None = None, forced: bool = False) -> _Scheduled | None:
        now = time.monotonic()
        why_not = None if forced else self._allowed(now)
        if why_not is not None:
            self._skip(why_not)
            if why_not in ("max_count", "disk_budget"):
                warn_once(f"capture.{why_not}", "captures: no more captures (%s reached)", why_not.replace("_", " "))
            return None
        self._last_decision = now
        k = self._next_k
        self._next_k += 1
        # The lag lets every rank read the decision first; a rank that decides alone (one process,
        # no store) waits for no one, and captures as close to the trigger as it can.
        first = self.hub.step + (self._lag() if store is not None else MIN_LAG_STEPS)
        n = steps or self.steps
        if store is not None:
            store.set(self._key(str(k)), f"{first}:{n}:{reason}")
        sc = _Scheduled(k, first, reason, n)
        self._schedule(sc, forced=forced)
        return sc

    def _skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1

    def _job_profiling(self, *, across_steps: bool = False) -> bool:
        """Whether the job's own profiler is prepared or running (any thread): ours neither
        scheduled nor recording. torch's ``_profiler_enabled()`` answers for the calling thread only
        (False on the background thread while the training thread profiles), so torch's
        process-wide flag, which every torch profiler sets as it starts and clears as it stops,
        is asked too (a profiler the wrapped functions did not see: started before stepwatch).

        ``across_steps`` (a request, answered between two step boundaries): only a profiler of the
        job's that has stayed on since an earlier step counts; one prepared and stopped inside each
        step (a scheduled profiler stepped per micro-batch, a ``with profile():`` around the
        backward) is off at the boundary where the capture starts, which then decides."""
        if self._job_profiler:
            return not across_steps or self.hub.step > self._job_since
        try:
            import torch
            import torch.autograd.profiler as ap

            if bool(getattr(ap, "_is_profiler_enabled", False)):
                return True
            return self.hub.on_training_thread() and bool(torch.autograd._profiler_enabled())
        except Exception:
            return False

    def _note_not_taken(self, sc: _Scheduled, why: str, detail: str | None = None) -> None:
        """``captures/skipped-<k>.rank<R>.json``: capture ``k`` was not taken on this rank,
        and why. `stepwatch capture` waits for each rank's analysis or this note (``rundir``), so
        it says why at once instead of waiting for its whole --timeout."""
        from ..traces import rundir

        try:
            private_subdir(self.dir)
            write_json_private(rundir.skipped_path(self.dir, sc.k, self.ctx.rank),
                               {"capture": sc.k, "rank": self.ctx.rank, "reason": sc.reason, "skipped": why,
                                "detail": detail, "planned_first_step": sc.first,
                                "planned_last_step": sc.first + sc.steps - 1, "time": time.time()})
        except OSError as e:
            warn_once("capture.skipped_note", "captures: cannot write why capture %d was not taken (%s)", sc.k, e)

    def _schedule(self, sc: _Scheduled, *, forced: bool = False) -> None:
        if sc.reason.startswith("on demand"):
            forced = True  # another rank's on-demand request: the same exemption as on rank 0
        if (self.count >= self.max_count and not forced) or self._over_budget():
            # this rank's own limits still hold
            self._note_not_taken(sc, "max_count" if self.count >= self.max_count and not forced else "disk_budget")
            return
        self.count += 1
        self._last_decision = time.monotonic()
        if self.board is not None:
            try:
                sc.pyspy_req = self.board.request_dump()
            except (ValueError, OSError):
                sc.pyspy_req = None
        self.scheduled = sc

    # -- training thread -----------------------------------------------------------------------

    def on_step_end(self, ended: int) -> None:
        """tracker listener: ``ended`` is the step that just ended; the next one is ``ended + 1``."""
        a = self.active
        if a is not None:
            self._close_range()
            if ended >= a["first"]:
                a["ends"][ended] = self._ended_at(a["t0"])
            if ended >= a["last"]:
                self._stop()
            elif not a.get("standing_down"):
                self._open_range(ended + 1)
            return
        if self._rf is not None:  # the range of a capture dropped from another thread (``_drop``)
            try:
                self._close_range()
            except Exception as e:
                self.hub.report_error("capture.drop", e)
        sc = self.scheduled
        if sc is None or ended + 1 < sc.first:
            return
        try:
            self._start(sc, ended + 1)
        except Exception as e:
            self.scheduled = None
            self.hub.report_error("capture.profiler", e)

    def _activities(self) -> list[Any]:
        import torch
        from torch.profiler import ProfilerActivity

        acts = [ProfilerActivity.CPU]
        # Under `stepwatch run --nsys`, nsys holds CUPTI (one subscriber per process): Kineto's
        # CUDA activity would fail beside it, and nsys records the GPU side anyway.
        if self.nsys is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            acts.append(ProfilerActivity.CUDA)
        return acts

    @contextlib.contextmanager
    def _ours_calling(self) -> Iterator[None]:
        """Our own profiler starts or stops inside: its calls through the wrapped functions
        (``follow_job_profilers``) are not the job's."""
        self._own = True
        try:
            yield
        finally:
            self._own = False

    def warm(self) -> float:
        """Start and stop a profiler once (at install, training thread): Kineto's one-off
        initialisation happens here, not inside a captured step. Returns the seconds it took."""
        from torch.profiler import ProfilerActivity, profile

        t = time.perf_counter()
        p = profile(activities=[ProfilerActivity.CPU])
        with self._ours_calling():
            p.start()
            p.stop()
        self.warm_s = time.perf_counter() - t
        return self.warm_s

    def follow_job_profilers(self) -> None:
        """Keep out of the way of the job's own profiler.

        Every torch profiler (``torch.profiler.profile``, ``torch.autograd.profiler.profile``, a
        Trainer's or Lightning's) prepares Kineto's session through
        ``torch.autograd.profiler._prepare_profiler`` (a scheduled one at its warm-up, when torch
        does not yet say a profiler is enabled) and ends it through ``_disable_profiler``. torch
        2.13 lets a second profiler take a prepared or running session over, and its stop ends
        the session: the job's trace came back empty, or the job's own stop crashed the process
        (a segmentation fault in ``_disable_profiler``). Both are wrapped here: a capture recording
        when the job's profiler prepares between steps stops first (``_stand_down``), and none
        starts until the job's profiler has stopped (``_start``). Put back at ``stop``. Where torch has no such
        functions, nothing is wrapped (docs/hang.md)."""
        import torch.autograd.profiler as ap

        prepare, disable = getattr(ap, "_prepare_profiler", None), getattr(ap, "_disable_profiler", None)
        if not callable(prepare) or not callable(disable):
            return

        def _prepare_profiler(*args: Any, **kwargs: Any) -> Any:
            if not self._own:
                if not self._job_profiler:
                    self._job_since = self.hub.step
                self._job_profiler = True
                try:
                    if self.active is not None:
                        self._stand_down()
                    self._wait_exports("the job's own profiler")
                except Exception as e:  # the job's profiler starts whatever happened to ours
                    self.hub.report_error("capture.job_profiler", e)
            return prepare(*args, **kwargs)

        def _disable_profiler(*args: Any, **kwargs: Any) -> Any:
            if not self._own:
                self._job_profiler = False
                a = self.active
                if a is not None:
                    # Someone else ends the session our capture records in: it is not ours to stop
                    # (nor to export) any more.
                    try:
                        self._drop(a, TAKEN_OVER, f"the job's own profiler stopped in step {self.hub.step}")
                    except Exception as e:
                        self.hub.report_error("capture.job_profiler", e)
            return disable(*args, **kwargs)

        self._patched = [(ap, "_prepare_profiler", prepare, _prepare_profiler),
                         (ap, "_disable_profiler", disable, _disable_profiler)]
        for mod, name, _orig, ours in self._patched:
            setattr(mod, name, ours)

    def _wait_exports(self, who: str) -> None:
        """Before a profiler starts: wait (EXPORT_WAIT_S at most) for the captures' exports still
        writing, which crash the process when a profiler session runs beside them."""
        running = [th for th in self._exports if th.is_alive()]
        if not running:
            return
        t0 = time.monotonic()
        deadline = t0 + EXPORT_WAIT_S
        for th in running:
            th.join(max(deadline - time.monotonic(), 0.0))
        waited = time.monotonic() - t0
        if waited >= 1.0:
            logger.info("captures: %s waited %.1f s for a capture's trace to be written (torch crashes when a "
                        "profiler runs beside the write)", who, waited)

    def _stand_down(self) -> None:
        """The job's own profiler is preparing while a capture records: the job's profiler wins,
        as when it was running before the capture's start (``_start``).

        Between steps (on the training thread) the capture stops now, with the steps it recorded
        whole (a step whose end is pending is made final first, so its end is the capture's),
        and says why in ``cut_short``. Inside a step it cannot stop: the job's ``record_function``
        ranges opened in the step are still open, and torch 2.13 crashes (kineto's
        ``processCpuTrace``, or a later op) when a profiler stops with such ranges open. And it
        cannot run on: the job's prepare takes torch's one profiler session over, which ends the
        capture's recording there and then, and a stop of ours later would end the job's session
        (or, with none left, hand back results that crash the export): the capture is dropped
        (``_drop``)."""
        a = self.active
        if a is None:
            return
        if not self.hub.between_steps or not self.hub.on_training_thread():
            self._drop(a, TAKEN_OVER, f"the job's own profiler started inside step {self.hub.step}")
            return
        if self.hub.step_pending:
            a["standing_down"] = True  # no range opens for the step after it
            self.hub.end_pending_step()  # its end runs on_step_end: the capture may end there
            if self.active is not a:
                return  # that step was its last: a whole capture
        a["cut_short"] = f"the job's own profiler started in step {self.hub.step}"
        if a["ends"]:
            a["last"] = max(a["ends"])
        else:
            a["last"] = a["first"]  # not one whole step: the trace holds part of its first
        logger.info("captures: capture %d cut short: %s", a["sc"].k, a["cut_short"])
        self._stop()

    def _drop(self, a: dict[str, Any], why: str, detail: str) -> None:
        """Give capture ``a`` up without a call into torch's profiler: its session is, or is about
        to be, someone else's. Its step range is closed first where the caller is the training
        thread (the job's prepare has not run yet: the range ends in the capture's own session,
        not in the job's); from another thread it is closed at the next step's end, as before.
        Nothing is exported (torch holds no results of it), ``skipped`` counts it, one line says
        so, and `stepwatch capture` is told (``_note_not_taken``)."""
        if self.active is not a:
            return
        self.active = None
        try:
            if self.hub.on_training_thread():
                self._close_range()
            if self.nsys is not None:
                self.nsys.stop()  # nsys's range (cudaProfilerStop), not torch's profiler
        except Exception as e:
            self.hub.report_error("capture.drop", e)
        finally:
            a["span"][1] = max(self.hub.step, a["first"])  # our profiler records no more
            a["prof"] = None  # never stopped nor exported: its session is not ours any more
        self._skip(why)
        self._note_not_taken(a["sc"], why, detail)
        logger.warning("captures: capture %d (steps %d-%d) dropped: %s and took torch's profiler session over, "
                       "ending the capture's recording; nothing is written for it, and the job's profiler keeps "
                       "its trace. Start your profiler between steps (the capture then stops first and keeps its "
                       "steps), or set STEPWATCH_CAPTURE=off.", a["sc"].k, a["first"], a["last"], detail)

    def _start(self, sc: _Scheduled, first: int) -> None:
        import torch
        from torch.profiler import profile

        self.scheduled = None
        if self._job_profiling() or torch.autograd._profiler_enabled():
            # The job profiles itself (torch.profiler, a Trainer's profiler): a second profiler
            # would take its session over and leave the job's trace empty. The job's wins.
            self._skip(BUSY)
            self._note_not_taken(sc, BUSY)
            return
        self._wait_exports("a capture")  # the last one's, where the cooldown is short
        prof = profile(activities=self._activities())
        with self._ours_calling():
            prof.start()
        try:
            if self.nsys is not None:
                self.nsys.start()
            self._open_range(first)
        except BaseException:
            prof.stop()  # never leave a profiler recording for the rest of the run
            raise
        span = [first, math.inf]
        self._ours = self._ours[-7:] + (span,)  # one assignment: the reader sees the old or the new tuple
        self.active = {"sc": sc, "prof": prof, "first": first, "last": first + sc.steps - 1, "t0": time.time(),
                       "span": span, "ends": {}}

    def _ended_at(self, since: float) -> float:
        """Wall-clock time the step that just ended did (the tracker's end, not now: the job's last
        step ends only at its shutdown's flush, after the script's teardown). Now where the
        tracker's clock says nothing later than ``since`` (the capture's start; a test's clock)."""
        t = time.time()
        end = getattr(self.hub.tracker, "_prev_end", None)
        if not isinstance(end, int):
            return t
        at = t - max(time.perf_counter_ns() - end, 0) / 1e9
        return at if at >= since else t

    def _open_range(self, step: int) -> None:
        from torch.autograd.profiler import record_function

        self._rf = record_function(f"stepwatch_step_{step}")
        self._rf.__enter__()

    def _close_range(self) -> None:
        if self._rf is not None:
            rf, self._rf = self._rf, None
            rf.__exit__(None, None, None)

    def _stop(self) -> None:
        a, self.active = self.active, None
        if a is None:
            return
        try:
            self._close_range()
            if self.nsys is not None:
                self.nsys.stop()
        finally:
            with self._ours_calling():
                a["prof"].stop()  # whatever failed above, the profiler stops recording
        if not _results_held(a["prof"]):
            # torch ended our session behind our back (a profiler whose start or stop we did not
            # see): it hands back results without a trace, whose export crashes the process.
            a["span"][1] = a["last"] + 1
            self._skip(LOST)
            self._note_not_taken(a["sc"], LOST)
            logger.warning("captures: capture %d (steps %d-%d) dropped: torch no longer held its profiler session "
                           "(another profiler took it over); nothing is written for it",
                           a["sc"].k, a["first"], a["last"])
            return
        th = threading.Thread(target=self._export, args=(a,), name="stepwatch-capture-export", daemon=True)
        try:
            th.start()
        except BaseException:
            a["span"][1] = a["last"] + 1  # no export runs beside the steps after this one
            raise
        self._exports.append(th)

    # -- export thread -----------------------------------------------------------------------------

    def _export(self, a: dict[str, Any]) -> None:
        try:
            self._write(a)
        finally:
            a["span"][1] = max(a["last"] + 1, self.hub.step)  # the step running now ran beside the export

    def _write(self, a: dict[str, Any]) -> None:
        sc = a["sc"]
        r = self.ctx.rank
        stem = f"capture-{sc.k}-steps{a['first']}-{a['last']}.rank{r}"
        try:
            private_subdir(self.dir)
            # gzip: a few steps of a big model are hundreds of MB of JSON per rank, about a tenth
            # compressed; Perfetto, chrome://tracing and TensorBoard open .json.gz as they are.
            trace = os.path.join(self.dir, f"{stem}.trace.json.gz")
            tmp = private_tmp(trace, ".json.gz")  # a fresh file of ours, not whatever sits at the name
            try:
                a["prof"].export_chrome_trace(tmp)
                os.replace(tmp, trace)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            meta = {
                "capture": sc.k,
                "rank": r,
                "reason": sc.reason,
                "first_step": a["first"],
                "last_step": a["last"],
                "planned_first_step": sc.first,
                "cut_short": a.get("cut_short"),  # why the capture ended before its last planned step
                "started": a["t0"],
                "trace": trace,
                "bytes": os.path.getsize(trace),
                "pyspy": (os.path.join(self.dir, f"pyspy-{sc.pyspy_req}.rank{r}.txt") if sc.pyspy_req else None),
                "nsys": self.nsys is not None,
                # where each step ended (wall clock): the analysis takes the steps as recorded
                "step_ends": {str(n): t for n, t in sorted(a["ends"].items())},
            }
            write_json_private(os.path.join(self.dir, f"{stem}.json"), meta)
            with self._lock:
                self.done.append(meta)
            logger.info("captures: rank %d steps %d-%d (%s) -> %s", r, a["first"], a["last"], sc.reason, trace)
        except Exception as e:
            self.hub.report_error("capture.export", e)
            return
        try:
            self._start_analysis(meta, os.path.join(self.dir, f"{stem}.analysis.json"))
        except Exception as e:
            self.hub.report_error("capture.analysis", e)

    # -- trace analysis (a process of its own) ---------------------------------------------------

    def _start_analysis(self, meta: dict[str, Any], out: str) -> None:
        import subprocess

        exe = sys.executable
        if not exe:
            return
        pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env[_env.ENABLED] = "0"  # the sitecustomize shim must not instrument the analysis
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH", "")) if p)
        ctx = {"capture": meta["capture"], "reason": meta["reason"], "first_step": meta["first_step"],
               "last_step": meta["last_step"], "trace": meta["trace"]}
        cmd = [exe, "-m", "stepwatch.traces.worker", "--trace", meta["trace"], "--out", out, "--rank", str(meta["rank"]),
               "--step", str(meta["first_step"]), "--context", json.dumps(ctx),
               "--step-ends", json.dumps(meta.get("step_ends") or {})]
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, close_fds=True)
        with self._lock:
            self._analyses.append((proc, out, meta))

    def collect_analyses(self, final: bool = False) -> list[Finding]:
        """Background thread: the findings of analyses that finished since the last call. At the
        job's end (``final``) waits up to FINAL_WAIT_S for exports and analyses still running."""
        if final:
            deadline = time.monotonic() + FINAL_WAIT_S
            for th in list(self._exports):
                th.join(max(deadline - time.monotonic(), 0.0))
            for proc, _out, _m in list(self._analyses):
                try:
                    proc.wait(max(deadline - time.monotonic(), 0.01))
                except Exception:
                    break  # TimeoutExpired: it goes on alone; `stepwatch report` reads its file
        out: list[Finding] = []
        with self._lock:
            pending = list(self._analyses)
        for item in pending:
            proc, path, meta = item
            if proc.poll() is None:
                continue
            with self._lock:
                self._analyses.remove(item)
            try:
                summary = read_json_private(path)
            except (OSError, ValueError):
                warn_once("capture.analysis", "captures: the analysis of %s wrote no summary (exit %s)",
                          meta["trace"], proc.returncode)
                continue
            self.analysed.append({"capture": meta["capture"], "analysis": path, "error": summary.get("error")})
            for d in summary.get("findings", []):
                try:
                    out.append(Finding.from_dict(d))
                except TypeError:
                    continue
        return out

    # -- lifecycle -------------------------------------------------------------------------------

    def stop(self, timeout_s: float = 10.0) -> None:
        a = self.active
        if a is not None:
            if a["ends"] and max(a["ends"]) < a["last"]:  # the job ended first: name the steps it ran
                a["last"] = max(a["ends"])
            try:
                self._stop()
            except Exception as e:
                self.hub.report_error("capture.stop", e)
        for th in self._exports:
            th.join(timeout_s)
        patched, self._patched = self._patched, []
        for mod, name, orig, ours in patched:
            if getattr(mod, name, None) is ours:  # not where someone wrapped it after us
                setattr(mod, name, orig)

    def manifest(self) -> dict[str, Any]:
        with self._lock:
            done = [{k: m[k] for k in ("capture", "reason", "first_step", "last_step", "cut_short", "trace")} for m in self.done]
        return {"enabled": True, "dir": self.dir, "steps": self.steps, "cooldown_s": self.cooldown_s, "warm_up_s": self.warm_s,
                "max_count": self.max_count, "captures": done, "skipped": dict(self.skipped),
                "analyses": list(self.analysed)}
