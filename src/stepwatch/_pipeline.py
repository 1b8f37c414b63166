"""The background pipeline: raw steps in, batches out, on one thread ("stepwatch-pipeline").

Each pass (every ``flush_interval_s``, at once for the first step, and a final one at shutdown):

  queue (bounded; the training thread's :meth:`Pipeline.enqueue`) -> decode each
  :class:`~stepwatch.record.RawStep` -> hold records in order until their device-side values are in
  (logged CUDA scalars, enrichers waiting on events or on other ranks, each of which may look ahead
  at every held record once a pass; at most ``_MAX_HOLD_S``) -> enrich -> detect
  -> features' ``collect`` -> rate-limit (:mod:`stepwatch.analysis.ratelimit`) -> features'
  ``on_findings`` -> export: the records file on this thread, every other exporter through its own
  :class:`~stepwatch.exporters.worker.ExporterWorker`.

It knows nothing of the session or of any feature: it is given its stages, the features to call
and how to make its sinks, and runs without a Session (``tests/unit/test_pipeline.py``). A stage
that raises is reported (counted, logged once, an ``internal_error`` finding), left out from then
on where it is a stage of its own, and costs no other stage.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from typing import Any, Callable, Iterable

from ._log import FailureLog, logger, retried_note
from .analysis.kinds import make_finding
from .analysis.ratelimit import FindingLimiter
from .context import RunContext
from .cuda_ext import Pending, copy_to_host, event_done
from .exporters.base import Batch, Exporter
from .exporters.builtin import ExporterSpec
from .exporters.worker import ExporterWorker
from .record import Finding, RawStep, StepRecord, c_to_record

try:  # enqueue in C for the training thread (src/stepwatch/_speedups.c); optional
    from ._speedups import Enqueue as _CEnqueue
except ImportError:
    _CEnqueue = None

# How long a record may wait for its device-side values (CUDA scalars) or an enricher (a sharded
# grad norm's other ranks) before it leaves without them: a bound for a rank or device that never
# answers, not a wait in the common case (a fast FSDP2 loop's norms come back within a pass or two).
_MAX_HOLD_S = 30.0
# Shutdown's time for the final pass and every exporter's flush (in parallel): a collector that is
# down or a slow sink delays the job's exit by at most this (2 s with the rest of shutdown); what
# is left is counted in run.json.
SHUTDOWN_TIMEOUT_S = 1.5
# Distinct scalar names counted in run.json's ``null_scalars`` (the rest under "<other>").
_MAX_NULL_NAMES = 64


def _step_order(f: Finding) -> float:
    """A detector finding's place among a pass's: its step (one without a step, first)."""
    return f.step if f.step is not None else -1.0


def to_float(v: Any) -> float | None:
    """A float, or None for what is not one number that fits (``10**400``, a tensor of several
    values, a string, a user's object whose ``__float__`` raises anything). A one-value tensor is
    read with one call (``float``); no graph is kept."""
    if type(v) is float:
        return v
    if isinstance(v, (str, bytes, bytearray)):  # float("0.25") would take a string for a number, silently
        return None
    try:
        if getattr(v, "requires_grad", False):
            v = v.detach()  # float() of a tensor in a graph warns in the user's job
        elif _is_ndarray(v):
            v = v.item()  # one value, as a one-value tensor (more: ValueError, null); numpy 2 refuses float()
        return float(v)
    except Exception:  # noqa: BLE001 - OverflowError (10**400), TypeError, or whatever a user's value raises
        return None


def _is_ndarray(v: Any) -> bool:
    """A numpy array (numpy is never imported for it)."""
    t = type(v)
    return t.__name__ == "ndarray" and t.__module__ == "numpy"


_TENSOR: list[Any] = [None]  # torch.Tensor, once a tensor was logged (torch is never imported for it)


class _NotOneNumber:
    """A logged tensor that is not one number (several values, or none), read on the training
    thread: null in the record, counted in run.json's ``null_scalars`` like any value that is not
    a number (it was None there, which counts as nothing logged)."""

    __slots__ = ("what",)

    def __init__(self, t: Any) -> None:
        # a meta tensor holds no data, however many values it has (the "log one value a name"
        # advice was wrong for it)
        self.what = "meta tensor (no data)" if getattr(t, "is_meta", False) else f"tensor of {t.numel()} values"

    def __eq__(self, other: object) -> bool:
        return type(other) is _NotOneNumber and other.what == self.what

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<not one number: {self.what}>"


def loggable(v: Any) -> Any:
    """Training thread: a value given to ``stepwatch.log`` as the pipeline takes it. A CUDA tensor
    is copied to host without blocking and read once its event completes (:class:`Pending`); a
    CPU tensor is plain memory, read now (a later in-place update cannot change what was logged,
    and no graph is kept); anything else as it is (converted, or counted as null, off the hot path)."""
    if type(v) is _TENSOR[0] and v.is_cpu:  # the common case: one call, no detach (item() keeps no graph)
        try:
            x = v.item()
        except (RuntimeError, ValueError, TypeError):  # several values: not one number
            return _NotOneNumber(v)
        if type(x) is float:
            return x
        f = to_float(x)
        return x if f is None else f  # a complex: as it is, counted as null off the hot path
    if hasattr(v, "detach") and hasattr(v, "is_cuda"):
        if _TENSOR[0] is None:
            import torch

            _TENSOR[0] = torch.Tensor
        if not v.is_cuda:
            f = to_float(v)
            if f is None and v.numel() == 1:  # a complex: as it is, counted as null off the hot path
                try:
                    return v.detach().item()
                except (RuntimeError, ValueError, TypeError):  # no value to read (a meta tensor)
                    return _NotOneNumber(v)
            return _NotOneNumber(v) if f is None else f
        import torch

        if torch.cuda.is_current_stream_capturing():
            # inside a CUDA graph capture the copy would be a graph node and the host value the
            # capture's, not a replay's: unknown instead
            return None
        return Pending(*copy_to_host(v.detach()))
    return v


class Pipeline:
    """``ctx`` gives each record its rank (read when the record is decoded). ``sinks()`` makes the
    exporters' specs, called once, on the pipeline's thread, at the first pass with anything to
    export; ``on_open()`` runs right after (the session writes its manifest there). ``features``
    is a list the caller may keep appending to: each item's optional ``collect(records) ->
    (samples, findings)`` and ``on_findings(findings)`` run every pass. ``step_of()`` says the
    training thread's step for an internal-error finding. The defaults are :class:`Config`'s."""

    def __init__(
        self,
        ctx: RunContext,
        *,
        queue_size: int = 4096,
        flush_interval_s: float = 0.25,
        window: int = 50,
        repeat_windows: int = 20,
        detectors: Iterable[Any] = (),
        features: list[Any] | None = None,
        sinks: Callable[[], list[ExporterSpec]] | None = None,
        on_open: Callable[[], None] | None = None,
        step_of: Callable[[], int | None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.failures = FailureLog()
        self.dropped = 0  # records lost on the bounded queue, or that could not be decoded
        self.steps_seen = 0
        # Logged values that became null (not a number, or too big for a float), per name.
        self.null_scalars: dict[str, int] = {}
        self.enrichers: list[Any] = []
        self.detectors: list[Any] = list(detectors)
        self.features: list[Any] = features if features is not None else []
        # Every finding of every kind passes here before anything acts on it (analysis/ratelimit.py).
        self.limiter = FindingLimiter(window, repeat_windows)
        self.exporter_names: list[str] = []
        self.workers: list[ExporterWorker] = []
        self.final_pass = False  # True while shutdown's last pass runs (a feature may wait, bounded)
        self.perf_ref_ns = time.perf_counter_ns()
        self.wall_ref = time.time()
        self._records: Exporter | None = None
        self._sinks = sinks
        self._on_open = on_open
        self._step_of = step_of
        self._queue: collections.deque[RawStep] = collections.deque()
        # Records the running pass has taken (off the queue, or out of ``_held``) and not yet
        # handed out or held: what a pass stuck at shutdown loses besides the queue and ``_held``.
        self._in_pass = 0
        self._cap = queue_size
        self._interval = flush_interval_s
        # [since, record, extras, enrichers done with it (None: none has run yet)], oldest first
        self._held: collections.deque[list[Any]] = collections.deque()
        self._new_enrichers: list[tuple[Any, bool]] = []  # from any thread; taken in by the pass
        self._internal_findings: list[Finding] = []
        self._opened = False
        self._stop = threading.Event()
        self._wake = threading.Event()  # the first record: open the exporters now, not at a pass
        # The next record wakes the thread (set until the exporters are open, and again by a pass
        # that found none): one Event.set(), not one a step until the thread gets the GIL.
        self._wake_first = True
        self._thread: threading.Thread | None = None

    # -- stages ---------------------------------------------------------------------------------

    def add_enricher(self, enricher: Any, *, first: bool = False) -> None:
        """``enrich(record, extras, *, force) -> bool`` fills fields from the step's extras and
        returns False while it still waits on the device (``force``: give up, use None). Safe from
        any thread: taken in at the next pass; ``first`` puts it before the others (device times
        replace the host phases before anything reads them). An optional ``look_ahead(items, *,
        final)`` sees the held records once a pass (:meth:`_look_ahead`)."""
        self._new_enrichers.append((enricher, first))

    def add_detector(self, detector: Any) -> None:
        """``observe(record) -> list[Finding]``, every record in order; or ``observe_many(records)
        -> list[Finding]`` too, the same over a pass's records in one call."""
        self.detectors.append(detector)

    def report_error(self, where: str, exc: BaseException, *, retried: bool = False) -> None:
        """Count, log once, and (the first time for ``where``) an ``internal_error`` finding in
        the next pass. ``retried``: the part goes on (an exporter gets the next batch). Never
        raises."""
        try:
            if not self.failures.record(where, exc, retried=retried):
                return
            step = self._step_of() if self._step_of is not None else None
            fate = f"is {retried_note()}" if retried else "was disabled"
            self._internal_findings.append(
                make_finding(
                    "internal_error",
                    rank=self.ctx.rank,
                    step=step,
                    summary=f"{where} failed ({type(exc).__name__}: {exc}) and {fate}",
                    data={"where": where, "error": f"{type(exc).__name__}: {exc}", "subject": where},
                )
            )
        except Exception:  # noqa: BLE001 - already counted and logged above; reporting must not raise
            pass

    # -- training thread ------------------------------------------------------------------------

    def enqueue(self, raw: RawStep) -> None:
        if len(self._queue) < self._cap:
            self._queue.append(raw)
            if self._wake_first:
                self._wake_first = False
                self._wake.set()
        else:
            self.dropped += 1

    def hot_enqueue(self) -> Callable[[RawStep], None]:
        """What the training thread calls with each step: :meth:`enqueue`, in C where
        ``_speedups`` was built (the same steps, no Python frame a step)."""
        if _CEnqueue is None:
            return self.enqueue
        e = _CEnqueue()
        e.pipeline, e.queue, e.cap = self, self._queue, self._cap
        return e

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stepwatch-pipeline", daemon=True)
        self._thread.start()

    def stop_thread(self, timeout_s: float | None = None) -> bool:
        """Stop the background thread (passes are then driven by :meth:`run_pass` or shutdown);
        True once it has ended."""
        self._stop.set()
        self._wake.set()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def shutdown(
        self, timeout_s: float = SHUTDOWN_TIMEOUT_S, *, deadline: float | None = None,
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        """The final pass, then every exporter flushed and shut down, all within ``timeout_s``
        (by ``deadline``, ``time.monotonic()``, when the caller's shutdown began earlier).
        ``meanwhile`` runs while the exporters' threads flush (the features' stop). A pass stuck
        past the deadline leaves its records counted as dropped."""
        if deadline is None:
            deadline = time.monotonic() + timeout_s
        if self.stop_thread(max(deadline - time.monotonic(), 0.0)):
            self.final_pass = True
            try:
                self.run_pass(final=True)
            finally:
                self.final_pass = False
        else:  # the pipeline is stuck in a pass: what it has not taken is lost, and counted
            lost = len(self._queue) + len(self._held) + self._in_pass
            self.dropped += lost
            logger.warning("stepwatch: the background pass did not end in %.1f s; %d records not written", timeout_s, lost)
        # The exporters that say the totals (the console's closing line) close after the others,
        # with the final count of what was dropped: the others' last pass included.
        last = [w for w in self.workers if getattr(w.exporter, "says_totals", False) is True]
        first = [w for w in self.workers if w not in last]
        for w in first:  # they flush in parallel while ``meanwhile`` runs
            w.close(deadline)
        if meanwhile is not None:
            meanwhile()
        for w in [*first, *last]:
            if w in last:
                w.close(deadline, dropped=self.total_dropped())
            if not w.join(deadline):
                if w.left_at_deadline:
                    logger.warning(
                        "stepwatch: exporter %s did not finish within the %.1f s of shutdown; the %d records, "
                        "findings and samples it still held are counted in run.json's exporter_drops",
                        w.name, timeout_s, w.left_at_deadline,
                    )
                else:
                    logger.warning(
                        "stepwatch: exporter %s did not finish within the %.1f s of shutdown: it had sent every "
                        "batch, and was still flushing or shutting down (its destination may lack the last "
                        "values it was sending)", w.name, timeout_s,
                    )
        if self._records is not None:
            # What failed after the final pass was handed out (a sink on its thread, a feature's
            # stop) left its internal_error finding for a pass that will not come: the records
            # file takes it now.
            late, self._internal_findings = self._internal_findings, []
            try:
                if late:
                    self._records.export(Batch(records=[], findings=late))
            except Exception as exc:
                self.report_error("exporter.records", exc)
            try:
                self._records.shutdown()
            except Exception as exc:
                self.report_error("exporter.records", exc)

    # -- exporters ------------------------------------------------------------------------------

    @property
    def exporters(self) -> list[Exporter]:
        """The exporters running now (one still starting on its thread is not listed yet)."""
        out = [self._records] if self._records is not None else []
        return out + [w.exporter for w in self.workers if w.exporter is not None]

    def records_rotated_out(self) -> int | None:
        """Step records the records file's disk budget rotated out; None while it is not open."""
        fn = getattr(self._records, "rotated_out", None)
        return int(fn()) if callable(fn) else None

    def records_paths(self) -> list[str]:
        """The records exporter's files (steps, findings); none while it is not open."""
        paths = getattr(self._records, "paths", None)
        return list(paths()) if callable(paths) else []

    def total_dropped(self) -> int:
        """Records dropped on the bounded queue or by an exporter's queue, plus what exporters
        dropped themselves (e.g. OTLP down)."""
        n = self.dropped + sum(w.total_dropped() for w in self.workers)
        for e in self.exporters:
            fn = getattr(e, "dropped", None)
            if callable(fn):
                try:
                    n += int(fn())
                except Exception:  # an exporter's counter must not break the batch
                    continue
        return n

    def drain(self, timeout_s: float) -> bool:
        """Wait until every exporter has taken what it was given (tests drive passes by hand)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if all(w.idle() for w in self.workers):
                return True
            time.sleep(0.005)
        return False

    def _open_exporters(self) -> None:
        """Each exporter starts on its own: the records file here (a file to open), every other
        on its own thread (see exporters/worker.py). One that fails is counted under its name."""
        try:
            specs = self._sinks() if self._sinks is not None else []
        except Exception as e:
            self.report_error("exporter.start", e)
            specs = []
        for spec in specs:
            self.exporter_names.append(spec.name)
            if spec.inline:
                try:
                    self._records = spec.build()
                except Exception as e:
                    self.report_error(f"exporter.{spec.name}.start", e)
                continue
            self.workers.append(ExporterWorker(spec.name, spec.build, capacity=self._cap, on_error=self.report_error,
                                               on_retry=functools.partial(self.report_error, retried=True)))
        if self._on_open is not None:
            self._on_open()

    # -- the pass -------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            self.run_pass(final=False)

    def run_pass(self, *, final: bool = False) -> None:
        try:
            self._take_enrichers()
            if not self._opened:
                self._wake_first = True  # a record that comes while the exporters are closed wakes the thread
            raws = []
            q = self._queue
            while q:
                raws.append(q.popleft())
            self._in_pass = len(raws)
            # Internal-error findings too: taken from the list below, they would be lost with no exporter open.
            if not self._opened and (raws or final or self._held or self._internal_findings):
                self._opened = True
                self._wake_first = False
                self._open_exporters()
            records = self._resolve(raws, final=final)
            findings = self._internal_findings
            self._internal_findings = []
            if records:
                findings.extend(self._detect(records))
            if final:
                findings.extend(self._finish_detectors())
            samples: list[dict[str, Any]] = []
            for f in self.features:
                collect = getattr(f, "collect", None)
                if collect is None:
                    continue
                try:
                    got_samples, got_findings = collect(records)
                except Exception as e:
                    self.report_error(f"feature.{type(f).__name__}", e)
                    continue
                samples.extend(got_samples)
                findings.extend(got_findings)
            findings = self.limiter.filter(findings, now=records[-1].step if records else None)
            if final:
                findings.extend(self.limiter.flush())
            for f in self.features:
                # A feature that acts on findings (captures) sees every finding of the pass.
                on_findings = getattr(f, "on_findings", None)
                if on_findings is not None:
                    try:
                        on_findings(findings)
                    except Exception as e:
                        self.report_error(f"feature.{type(f).__name__}", e)
            self.steps_seen += sum(1 for r in records if not r.tail)  # a tail record is no step
            batch = Batch(records=records, findings=findings, samples=samples)
            if not batch:
                return
            batch.dropped = self.total_dropped()
            if self._records is not None:
                try:
                    self._records.export(batch)
                except Exception as exc:
                    self.report_error("exporter.records", exc)
            # Each exporter its own lists (shallow copies: the records, findings and samples
            # themselves are shared): one that consumes its batch in place costs no other.
            for w in self.workers:
                w.submit(Batch(records=list(records), findings=list(findings), samples=list(samples),
                               dropped=batch.dropped))
        except Exception as e:  # the pipeline itself must never die silently
            self.report_error("pipeline", e)
        finally:
            self._in_pass = 0

    def _detect(self, records: list[StepRecord]) -> list[Finding]:
        """Every detector over the pass's records: ``observe_many(records)`` where it has one
        (one call a pass), else ``observe`` a record at a time (a failure costs that record
        only). Findings in the order of their steps, each step's in the detectors' order: as
        calling every detector on each record in turn gives them."""
        got: list[list[Finding]] = []
        for d in self.detectors:
            many = getattr(d, "observe_many", None)
            if many is not None:
                try:
                    mine = many(records)
                except Exception as e:
                    self.report_error(f"detector.{type(d).__name__}", e)
                    continue
            else:
                mine = []
                for rec in records:
                    try:
                        found = d.observe(rec)
                        if found:  # nearly always empty
                            mine.extend(found)
                    except Exception as e:
                        self.report_error(f"detector.{type(d).__name__}", e)
            if mine:
                got.append(mine)
        if len(got) < 2:
            return got[0] if got else []
        merged = [f for mine in got for f in mine]
        merged.sort(key=_step_order)  # stable: each step's findings stay in the detectors' order
        return merged

    def _finish_detectors(self) -> list[Finding]:
        """The last pass: each detector that judges what a run left unjudged (``finish``: a run
        shorter than one window), once."""
        out: list[Finding] = []
        for d in self.detectors:
            finish = getattr(d, "finish", None)
            if finish is None:
                continue
            try:
                out.extend(finish())
            except Exception as e:
                self.report_error(f"detector.{type(d).__name__}", e)
        return out

    def _take_enrichers(self) -> None:
        new = self._new_enrichers
        if not new:
            return
        taken = []
        while new:
            taken.append(new.pop(0))
        # "first" ones before every enricher there is (in the order they came), the rest after
        self.enrichers = [e for e, f in taken if f] + self.enrichers + [e for e, f in taken if not f]

    def _resolve(self, raws: list[RawStep], *, final: bool) -> list[StepRecord]:
        """The pass's records that wait on nothing (any more), in order. Each raw step is let go
        as soon as it is decoded, its dicts with it, not with ``raws`` at the pass's end: the
        records' allocations then no longer outnumber the frees in the pass, which ran the cyclic
        GC's young collection (a walk over the whole young generation) three times per 500 records."""
        now = time.monotonic()
        rank = self.ctx.rank
        wall_ref, perf_ref, scalar, c_build = self.wall_ref, self.perf_ref_ns, self._scalar, c_to_record
        out: list[StepRecord] = []
        held = self._held
        # Records leave in order: the first one still waiting on the device holds the rest. While
        # none waits from an earlier pass (nearly always), each record is enriched as it is built,
        # and held (with its entry: what _enrich needs to resume it) only when it must wait.
        # Shutdown's final pass holds its new records too: an enricher's look-ahead (below) sees
        # them before each is forced.
        drain = bool(held) or final
        for i, raw in enumerate(raws):
            raws[i] = None  # type: ignore[call-overload]  # see above
            try:
                rec = None if c_build is None else c_build(raw, rank, wall_ref, perf_ref, scalar)
                if rec is None:
                    rec = raw.to_record(rank, wall_ref, perf_ref, scalar)
            except Exception as e:  # one bad record never costs the others of the pass
                self.dropped += 1
                self._in_pass -= 1
                self.report_error("pipeline.build", e)
                continue
            if held or final or (Pending.made and not self._ready(rec, force=final)):
                held.append([now, rec, raw.extras, None])
                self._in_pass -= 1  # counted in ``_held`` now
                continue
            done = self._enrich_new(rec, raw.extras, force=final)
            if done is None:
                out.append(rec)
            else:
                held.append([now, rec, raw.extras, done])
                self._in_pass -= 1
        if held or final:
            self._look_ahead(final)
        while drain and held:
            entry = held[0]
            since, rec, extras, _ = entry
            force = final or now - since > _MAX_HOLD_S
            if (Pending.made and not self._ready(rec, force=force)) or not self._enrich(entry, force=force):
                break
            held.popleft()
            self._in_pass += 1
            out.append(rec)
        return out

    def _look_ahead(self, final: bool) -> None:
        """Each enricher with a ``look_ahead(items, *, final)`` gets, once a pass, every held
        record it has not finished, oldest first, as ``(record, extras)``: what it can start for
        records behind the one that waits (the grad-norm exchange publishes them all, and a
        pass then releases every record whose norm came back, not one). It fills nothing that
        ``enrich`` would not; ``enrich`` still runs on each record, in order."""
        for e in list(self.enrichers):
            la = getattr(e, "look_ahead", None)
            if la is None:
                continue
            items = [(rec, extras) for _, rec, extras, done in self._held if done is None or e not in done]
            if not items and not final:
                continue
            try:
                la(items, final=final)
            except Exception as exc:
                self.report_error(f"enricher.{type(e).__name__}", exc)
                self.enrichers = [x for x in self.enrichers if x is not e]

    def _enrich(self, entry: list[Any], *, force: bool) -> bool:
        """Run the enrichers in order; an enricher that waits on the device holds the record.
        ``entry[3]`` holds the enrichers done with it (by identity: the list can change while
        records wait, and an enricher must run once per record). A record no enricher has run on
        yet (``None``: nearly every one) runs them all without that bookkeeping, and gets its list
        only if one makes it wait."""
        _, rec, extras, done = entry
        if done is None:
            done = self._enrich_new(rec, extras, force=force)
            if done is None:
                return True
            entry[3] = done
            return False
        for e in list(self.enrichers):
            if e in done:
                continue
            try:
                if not e.enrich(rec, extras, force=force):
                    return False
            except Exception as exc:
                self.report_error(f"enricher.{type(e).__name__}", exc)
                self.enrichers = [x for x in self.enrichers if x is not e]
            done.append(e)
        return True

    def _enrich_new(self, rec: StepRecord, extras: dict[str, Any], *, force: bool) -> list[Any] | None:
        """Every enricher on a record none has run on yet: None when all are done with it, else
        the list of those that are (the one that makes it wait is not among them)."""
        enrichers = self.enrichers  # replaced, never changed in place, when one fails below
        for i, e in enumerate(enrichers):
            try:
                if not e.enrich(rec, extras, force=force):
                    return enrichers[:i]  # those before it: done (returned True, or failed)
            except Exception as exc:
                self.report_error(f"enricher.{type(e).__name__}", exc)
                self.enrichers = [x for x in self.enrichers if x is not e]
        return None

    def _ready(self, rec: StepRecord, *, force: bool) -> bool:
        sk = rec.skipped
        if type(sk) is Pending:  # a fused optimizer's found_inf under GradScaler (hooks/install.py)
            if event_done(sk.event, sk.device):
                rec.skipped = bool(to_float(sk.host))
            elif force:
                rec.skipped = False  # unread: as the step ran
            else:
                return False
        scalars = rec.scalars
        if not scalars or Pending not in map(type, scalars.values()):  # nearly every record: no CUDA scalar
            return True
        pending = [k for k, v in scalars.items() if isinstance(v, Pending)]
        for k in pending:
            p = scalars[k]
            if event_done(p.event, p.device):
                scalars[k] = to_float(p.host)
            elif force:
                scalars[k] = None
            else:
                return False
        return True

    def _scalar(self, name: str, v: Any) -> Any:
        """A logged value as a float (a pending device copy waits in :meth:`_ready`); one that is
        not a number or does not fit (``10**400``) is None, counted per name in run.json's
        ``null_scalars`` and logged once."""
        if isinstance(v, Pending):
            return v
        f = to_float(v)
        if f is None and v is not None:
            key = name if name in self.null_scalars or len(self.null_scalars) < _MAX_NULL_NAMES else "<other>"
            self.null_scalars[key] = self.null_scalars.get(key, 0) + 1
            if self.null_scalars[key] == 1:
                what = v.what if isinstance(v, _NotOneNumber) else type(v).__name__
                several = (isinstance(v, (list, tuple)) or (isinstance(v, _NotOneNumber) and v.what.startswith("tensor of ")
                                                             and not v.what.startswith("tensor of 0"))
                           or (_is_ndarray(v) and getattr(v, "size", 0) > 1))
                logger.warning(
                    "stepwatch.log(%s=...): %s %s is not a number that fits a float; recorded as null "
                    "(counted in run.json's null_scalars)%s", name, "an" if what[:1] in "aeiou" or what.startswith("nd") else "a", what,
                    # scheduler.get_last_lr() is a list, one value per parameter group
                    f"; log one value a name: {name}=values[0], or {name}_0=..., {name}_1=..." if several else "",
                )
        return f
