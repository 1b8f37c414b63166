"""The session wires the parts from a :class:`Config`: hooks -> tracker -> bounded queue ->
background pipeline -> detectors -> exporters. It owns the background thread and the run directory's
manifest; it measures nothing itself.
"""

from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
import time
from typing import Any, Callable

from ._log import FailureLog, logger
from ._sigterm import SigtermFinisher
from .analysis.detectors import DataLoadingDetector
from .analysis.kinds import make_finding
from .analysis.ratelimit import FindingLimiter
from .config import Config
from .context import RunContext, from_env
from .exporters.base import Batch, Exporter
from .exporters.worker import ExporterWorker, describe_drops
from ._files import private_run_dir
from ._manifest import Manifest, RunFacts
from .cuda_ext import copy_to_host, event_done
from .hooks.nvtx import Nvtx
from .hooks.phases import StepTracker
from .record import Finding, RawStep, StepRecord

# How long a record may wait for its device-side values (CUDA scalars) before they are dropped.
_MAX_HOLD_S = 30.0
# Shutdown's time for the final pass and every exporter's flush (in parallel): a collector that is
# down or a slow sink delays the job's exit by at most this (2 s with the rest of shutdown); what
# is left is counted in run.json.
SHUTDOWN_TIMEOUT_S = 1.5
# Distinct scalar names counted in run.json's ``null_scalars`` (the rest under "<other>").
_MAX_NULL_NAMES = 64


class _Pending:
    """A scalar the training thread logged as a CUDA tensor: copied to host without blocking,
    read by the background thread once its event says the copy is done."""

    __slots__ = ("host", "event", "device")

    def __init__(self, host: Any, event: Any, device: int) -> None:
        self.host = host
        self.event = event
        self.device = device


class Session:
    def __init__(self, config: Config, *, environ: dict[str, str] | None = None) -> None:
        self.config = config
        env = dict(os.environ if environ is None else environ)
        self.ctx: RunContext = from_env(env, run_dir=config.dir, run_id=config.run_id)
        if config.enabled:
            try:
                self.ctx.run_dir = private_run_dir(self.ctx.run_dir, warn=self.ctx.rank == 0)
            except OSError as e:  # every writer refuses that directory: no files, the job goes on
                logger.warning("cannot use the run directory %s (%s): going on without files", self.ctx.run_dir, e)
        self.failures = FailureLog()
        self.dropped = 0
        self.steps_seen = 0
        # Logged values that became null (not a number, or too big for a float), per name.
        self.null_scalars: dict[str, int] = {}
        # The records file, written on the background thread; every other exporter on its own.
        self._records: Exporter | None = None
        self._workers: list[ExporterWorker] = []
        self._exporter_names: list[str] = []
        self._queue: collections.deque[RawStep] = collections.deque()
        self._cap = config.queue_size
        self._held: list[tuple[float, StepRecord]] = []
        self._internal_findings: list[Finding] = []
        self._stop = threading.Event()
        self._wake = threading.Event()  # the first record: open the exporters now, not at a pass
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._ctx_refreshed = False
        self._opened = False
        self.timing_backend: str | None = None
        self._perf_ref = time.perf_counter_ns()
        self._wall_ref = time.time()
        self._start_wall = self._wall_ref
        self.pid = os.getpid()
        self._sigterm = SigtermFinisher(self._shutdown_quietly)
        self.tracker: StepTracker | None = None
        self.instrumentation: Any = None
        self.detectors: list[Any] = [DataLoadingDetector(config.window, config.data_wait_threshold_ms)]
        # Every finding of every kind passes here before anything acts on it (analysis/ratelimit.py).
        self.limiter = FindingLimiter(config.window, config.finding_repeat_windows)
        # Background-thread stages between building a record and the detectors:
        # ``enrich(record, extras, *, force) -> bool`` fills fields from the step's extras and
        # returns False while it still waits on the device (``force`` means: give up, use None).
        self.enrichers: list[Any] = []
        self._new_enrichers: list[Any] = []  # from the training thread; first in the list
        # Features that started with the session; each has ``stop()``, called at shutdown. A
        # feature with ``collect(records) -> (samples, findings)`` is also called once per pass.
        self.features_started: list[Any] = []
        if config.enabled:
            self._start()

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.config.enabled and not self._closed

    def _start(self) -> None:
        from .hooks.install import Instrumentation

        self._nvtx = Nvtx(self.config.nvtx)
        self.tracker = StepTracker(
            self._enqueue,
            step_offset=self.config.step_offset,
            nvtx=self._nvtx,
            on_error=self._internal_error,
        )
        self.instrumentation = Instrumentation(self.tracker, self._internal_error)
        try:
            self.instrumentation.install()
        except Exception as e:  # e.g. an unexpected torch version: go on without hooks
            self._internal_error("hooks.install", e)
            self.tracker.enabled = False
        if self.config.device_timing:
            self.tracker.listeners.append(self._maybe_device_timing)
        self._start_features()
        self._thread = threading.Thread(target=self._run, name="stepwatch-pipeline", daemon=True)
        self._thread.start()
        from .exporters.builtin import otel_wanted, preload

        if otel_wanted(self.config):
            threading.Thread(target=preload, args=(self.config,), name="stepwatch-preload", daemon=True).start()
        self._started = True
        atexit.register(self.shutdown)
        # SIGTERM skips atexit: finish the run directory first (see _sigterm.py)
        self._sigterm.install()

    def _shutdown_quietly(self, timeout_s: float) -> None:
        try:
            self.shutdown(timeout_s=timeout_s)
        except Exception:  # SIGTERM: dying anyway, nothing left to report to
            pass

    def _maybe_device_timing(self, step: int) -> None:
        """First step end, training thread: if CUDA is in use, time phases on the device from now on."""
        tr = self.tracker
        try:
            tr.listeners.remove(self._maybe_device_timing)
            torch = sys.modules.get("torch")
            if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
                return
            from .cuda_ext import get_timer
            from .hooks.device import install

            timer = get_timer("cuda", capacity=4096)
            _, enricher = install(tr, timer, torch.cuda.current_stream().cuda_stream)
            # Taken in by the pipeline thread, which alone touches the list (see _pass).
            self._new_enrichers.append(enricher)
            self.timing_backend = getattr(timer, "name", "python")
        except Exception as e:
            self._internal_error("device_timing", e)

    def _start_features(self) -> None:
        """Optional features, each guarded: one that fails to start is logged and left off."""
        cfg = self.config
        wanted = [
            ("gpu_telemetry", cfg.gpu_telemetry, "stepwatch.telemetry.feature"),
            # FLOPs, MFU, tokens, grad-norm (docs/mfu.md).
            ("training_metrics", cfg.training_metrics, "stepwatch.metrics"),
            ("comm", cfg.comm, "stepwatch.comm"),
            # Memory fields, memory findings, OOM forensics (docs/memory.md).
            ("memory", cfg.memory, "stepwatch.memory"),
            # Hang watchdog, SIGUSR1 stack dumps, anomaly-triggered captures (docs/hang.md).
            ("capture", cfg.watchdog != "off" or cfg.capture != "off", "stepwatch.capture"),
            # MLflow sink: its probe of the thread-local active run sits on the training thread.
            ("mlflow", cfg.mlflow, "stepwatch.exporters.mlflow"),
        ]
        import importlib

        for name, on, module in wanted:
            if not on:
                continue
            try:
                feat = importlib.import_module(module).install(self)
            except Exception as e:
                self._internal_error(f"feature.{name}", e)
                continue
            if feat is not None:
                self.features_started.append(feat)

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Finish the last step, stop hooks and the pipeline, flush and close every exporter,
        all within ``timeout_s`` (but the features' own stop); what is left is counted."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if not self._started or os.getpid() != self.pid:
            return
        try:
            atexit.unregister(self.shutdown)
            self._sigterm.uninstall()
        except Exception:
            pass
        if self.tracker is not None:
            self.tracker.flush()
            self.tracker.enabled = False
        if self.instrumentation is not None:
            try:
                self.instrumentation.uninstall()
            except Exception as e:
                self._internal_error("hooks.uninstall", e)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(max(deadline - time.monotonic(), 0.0))
        if self._thread is None or not self._thread.is_alive():
            self._pass(final=True)
        else:  # the pipeline is stuck in a pass: what it has not taken is lost, and counted
            lost = len(self._queue) + len(self._held)
            self.dropped += lost
            logger.warning("stepwatch: the background pass did not end in %.1f s; %d records not written", timeout_s, lost)
        for w in self._workers:  # they flush in parallel while the features stop
            w.close(deadline)
        for f in self.features_started:
            try:
                f.stop()
            except Exception as exc:
                self._internal_error(f"feature.{type(f).__name__}.stop", exc)
        if self._records is not None:
            try:
                self._records.shutdown()
            except Exception as exc:
                self._internal_error("exporter.records", exc)
        for w in self._workers:
            if not w.join(deadline):
                logger.warning(
                    "stepwatch: exporter %s did not finish within the %.1f s of shutdown; what it still held is "
                    "counted in run.json's exporter_drops", w.name, timeout_s,
                )
        self._write_manifest(final=True)

    def after_fork_in_child(self) -> None:
        """In a forked child (DataLoader worker): no threads, no hooks firing, no files."""
        self._closed = True
        self._started = False
        self._sigterm.after_fork_in_child()
        if self.tracker is not None:
            self.tracker.enabled = False

    # -- training-thread API ---------------------------------------------------------------------

    def _enqueue(self, raw: RawStep) -> None:
        if len(self._queue) < self._cap:
            self._queue.append(raw)
            if not self._opened:
                self._wake.set()
        else:
            self.dropped += 1

    @property
    def exporters(self) -> list[Exporter]:
        """The exporters running now (one still starting on its thread is not listed yet)."""
        out = [self._records] if self._records is not None else []
        return out + [w.exporter for w in self._workers if w.exporter is not None]

    def total_dropped(self) -> int:
        """Records dropped on the bounded queue or by an exporter's queue, plus what exporters
        dropped themselves (e.g. OTLP down)."""
        n = self.dropped + sum(w.total_dropped() for w in self._workers)
        for e in self.exporters:
            fn = getattr(e, "dropped", None)
            if callable(fn):
                try:
                    n += int(fn())
                except Exception:  # an exporter's counter must not break the console
                    continue
        return n

    def step(self) -> None:
        if self.tracker is not None:
            self.tracker.end_step()

    def set_step(self, n: int) -> None:
        if self.tracker is not None:
            self.tracker.set_step(n)

    def log(self, scalars: dict[str, Any]) -> None:
        tr = self.tracker
        if tr is None or not tr.enabled:
            return
        try:
            out = {}
            for k, v in scalars.items():
                if hasattr(v, "detach") and hasattr(v, "is_cuda"):
                    if v.is_cuda:
                        # Copied to host without blocking; read once its event completes.
                        import torch

                        if torch.cuda.is_current_stream_capturing():
                            # inside a CUDA graph capture the copy would be a graph node and
                            # the host value the capture's, not a replay's: unknown instead
                            out[k] = None
                            continue
                        v = _Pending(*copy_to_host(v.detach()))
                    else:
                        # A CPU tensor is plain memory: read it now (no device to wait for), so a
                        # later in-place update cannot change what was logged and no graph is kept.
                        v = _to_float(v)
                out[k] = v
            tr.log(out)
        except Exception as e:
            self._internal_error("log", e)

    # -- failures --------------------------------------------------------------------------------

    def _internal_error(self, where: str, exc: BaseException) -> None:
        if self.failures.record(where, exc):
            rank = self.ctx.rank
            self._internal_findings.append(
                make_finding(
                    "internal_error",
                    rank=rank,
                    step=self.tracker.step if self.tracker is not None else None,
                    summary=f"{where} failed ({type(exc).__name__}: {exc}) and was disabled",
                    data={"where": where, "error": f"{type(exc).__name__}: {exc}", "subject": where},
                )
            )

    # -- background pipeline ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(self.config.flush_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            self._pass(final=False)

    def _refresh_context(self) -> None:
        """Learn rank and world size from torch.distributed once it is initialized."""
        if self._ctx_refreshed:
            return
        dist = sys.modules.get("torch.distributed")
        try:
            if dist is not None and dist.is_available() and dist.is_initialized():
                self.ctx.rank = dist.get_rank()
                self.ctx.world_size = dist.get_world_size()
                self._ctx_refreshed = True
        except Exception as e:
            self._internal_error("context", e)

    def _open_exporters(self) -> None:
        """Each exporter starts on its own: the records file here (a file to open), every other
        on its own thread (see exporters/worker.py). One that fails is counted under its name."""
        from .exporters.builtin import exporter_specs

        self._refresh_context()
        try:
            specs = exporter_specs(self.config, self.ctx)
        except Exception as e:
            self._internal_error("exporter.start", e)
            specs = []
        from .exporters.builtin import ExporterSpec

        # A feature that is also a sink (MLflow: it must see the training thread from init).
        specs += [ExporterSpec(str(getattr(f, "name", type(f).__name__)), (lambda f=f: f))
                  for f in self.features_started if isinstance(f, Exporter)]
        for spec in specs:
            self._exporter_names.append(spec.name)
            if spec.inline:
                try:
                    self._records = spec.build()
                except Exception as e:
                    self._internal_error(f"exporter.{spec.name}.start", e)
                continue
            self._workers.append(
                ExporterWorker(spec.name, spec.build, capacity=self._cap, on_error=self._internal_error)
            )
        self._write_manifest(final=False)

    def _drain_exporters(self, timeout_s: float) -> bool:
        """Wait until every exporter has taken what it was given (tests drive passes by hand)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if all(w.idle() for w in self._workers):
                return True
            time.sleep(0.005)
        return False

    def _pass(self, *, final: bool) -> None:
        try:
            while self._new_enrichers:
                self.enrichers.insert(0, self._new_enrichers.pop())
            raws = []
            q = self._queue
            while q:
                raws.append(q.popleft())
            # Internal-error findings too: taken from the list below, they would be lost with no exporter open.
            if not self._opened and (raws or final or self._held or self._internal_findings):
                self._opened = True
                self._open_exporters()
            records = self._resolve(raws, final=final)
            findings = self._internal_findings
            self._internal_findings = []
            for rec in records:
                for d in self.detectors:
                    try:
                        findings.extend(d.observe(rec))
                    except Exception as e:
                        self._internal_error(f"detector.{type(d).__name__}", e)
            samples: list[dict[str, Any]] = []
            for f in self.features_started:
                collect = getattr(f, "collect", None)
                if collect is None:
                    continue
                try:
                    got_samples, got_findings = collect(records)
                except Exception as e:
                    self._internal_error(f"feature.{type(f).__name__}", e)
                    continue
                samples.extend(got_samples)
                findings.extend(got_findings)
            findings = self.limiter.filter(findings, now=records[-1].step if records else None)
            if final:
                findings.extend(self.limiter.flush())
            for f in self.features_started:
                # A feature that acts on findings (captures) sees every finding of the pass.
                on_findings = getattr(f, "on_findings", None)
                if on_findings is not None:
                    try:
                        on_findings(findings)
                    except Exception as e:
                        self._internal_error(f"feature.{type(f).__name__}", e)
            self.steps_seen += len(records)
            batch = Batch(records=records, findings=findings, samples=samples)
            if not batch:
                return
            batch.dropped = self.total_dropped()
            if self._records is not None:
                try:
                    self._records.export(batch)
                except Exception as exc:
                    self._internal_error("exporter.records", exc)
            for w in self._workers:
                w.submit(batch)
        except Exception as e:  # the pipeline itself must never die silently
            self._internal_error("pipeline", e)

    def _resolve(self, raws: list[RawStep], *, final: bool) -> list[StepRecord]:
        now = time.monotonic()
        for raw in raws:
            try:
                rec = self._build(raw)
            except Exception as e:  # one bad record never costs the others of the pass
                self.dropped += 1
                self._internal_error("pipeline.build", e)
                continue
            self._held.append([now, rec, raw.extras, []])
        out: list[StepRecord] = []
        # Records leave in order: the first one still waiting on the device holds the rest.
        while self._held:
            entry = self._held[0]
            since, rec, extras, _ = entry
            force = final or now - since > _MAX_HOLD_S
            if not self._ready(rec, force=force) or not self._enrich(entry, force=force):
                break
            self._held.pop(0)
            out.append(rec)
        return out

    def _enrich(self, entry: list, *, force: bool) -> bool:
        """Run the enrichers in order; an enricher that waits on the device holds the record.
        ``entry[3]`` holds the enrichers done with it (by identity: the list can change while
        records wait, and an enricher must run once per record)."""
        _, rec, extras, done = entry
        for e in list(self.enrichers):
            if e in done:
                continue
            try:
                if not e.enrich(rec, extras, force=force):
                    return False
            except Exception as exc:
                self._internal_error(f"enricher.{type(e).__name__}", exc)
                self.enrichers = [x for x in self.enrichers if x is not e]
            done.append(e)
        return True

    def _ready(self, rec: StepRecord, *, force: bool) -> bool:
        pending = [k for k, v in rec.scalars.items() if isinstance(v, _Pending)]
        for k in pending:
            p = rec.scalars[k]
            if event_done(p.event, p.device):
                rec.scalars[k] = _to_float(p.host)
            elif force:
                rec.scalars[k] = None
            else:
                return False
        return True

    def _build(self, raw: RawStep) -> StepRecord:
        return raw.to_record(self.ctx.rank, self._wall_ref, self._perf_ref, self._scalar_or_pending)

    def _scalar_or_pending(self, name: str, v: Any) -> Any:
        return v if isinstance(v, _Pending) else self._scalar(name, v)

    def _scalar(self, name: str, v: Any) -> float | None:
        """A logged value as a float; one that is not a number or does not fit (``10**400``)
        is None, counted per name in run.json's ``null_scalars`` and logged once."""
        f = _to_float(v)
        if f is None and v is not None:
            key = name if name in self.null_scalars or len(self.null_scalars) < _MAX_NULL_NAMES else "<other>"
            self.null_scalars[key] = self.null_scalars.get(key, 0) + 1
            if self.null_scalars[key] == 1:
                logger.warning(
                    "stepwatch.log(%s=...): a %s is not a number that fits a float; recorded as null "
                    "(counted in run.json's null_scalars)", name, type(v).__name__,
                )
        return f

    # -- manifest -------------------------------------------------------------------------------

    def _write_manifest(self, *, final: bool) -> None:
        if not self.config.records:
            return
        if not hasattr(self, "_manifest"):
            self._manifest = Manifest(self.config, self.ctx, pid=self.pid, start_time=self._start_wall)
        self._manifest.write(
            RunFacts(
                features=self.features(),
                exporters=self._exporter_names,
                steps=self.steps_seen,
                dropped_records=self.dropped,
                exporter_drops=describe_drops(self._workers),
                null_scalars=self.null_scalars,
                internal_errors=dict(self.failures.counts),
            ),
            final=final,
        )

    def features(self) -> dict[str, Any]:
        inst = self.instrumentation
        return {
            "step_tracking": bool(self.tracker is not None and self.tracker.enabled) or self.steps_seen > 0,
            # On only when the ranges really go out (the ``nvtx`` package imported).
            "nvtx": bool(getattr(self, "_nvtx", None) is not None and self._nvtx.enabled),
            "records": self.config.records,
            "console": self.config.console,
            "timing_clock": "device" if self.timing_backend else "host",
            "timing_backend": self.timing_backend or "host clock",
            "root_modules": list(inst.roots) if inst is not None else [],
            # What ends a step: "optimizer" (optimizer.step()), "backward" (no torch optimizer
            # in the loop: one step per backward) or "explicit" (stepwatch.step()).
            "step_boundary": self.tracker.boundary if self.tracker is not None else None,
            "module_scan_s": inst.scan_s if inst is not None else 0.0,
            **{
                getattr(f, "name", type(f).__name__): f.status() if hasattr(f, "status") else True
                for f in self.features_started
            },
        }


def _to_float(v: Any) -> float | None:
    try:
        if hasattr(v, "numel"):
            if v.numel() != 1:
                return None
            v = v.detach()
        return float(v)
    except (TypeError, ValueError, RuntimeError, OverflowError):  # OverflowError: 10**400
        return None
