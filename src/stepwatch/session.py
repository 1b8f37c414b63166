"""The session wires the parts from a :class:`Config`: hooks -> tracker -> bounded queue ->
background pipeline -> detectors -> exporters. It owns the background thread and the run directory's
manifest; it measures nothing itself.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import platform
import resource
import sys
import threading
import time
from typing import Any, Callable

from . import __version__
from ._log import FailureLog, logger
from .analysis.detectors import DataLoadingDetector
from .analysis.kinds import make_finding
from .analysis.ratelimit import FindingLimiter
from .config import Config
from .context import RunContext, from_env
from .exporters.base import Batch, Exporter
from ._files import make_private_dir, write_json_private
from .exporters.records import free_name
from .cuda_ext import copy_to_host, event_done
from .hooks.nvtx import Nvtx
from .hooks.phases import StepTracker
from .record import SCHEMA_VERSION, Finding, StepRecord

# How long a record may wait for its device-side values (CUDA scalars) before they are dropped.
_MAX_HOLD_S = 30.0


class _MemProbe:
    """Peak memory of the step on the training thread: the CUDA allocator's peak (read and reset
    each step, no sync) when CUDA is in use. Without CUDA it returns None and the background
    thread fills in the process's peak resident set, a high-water mark that never resets, so
    reading it later costs the training thread nothing and loses nothing."""

    def __init__(self) -> None:
        self._cuda: Any = None
        self._decided = False

    def __call__(self) -> int | None:
        if not self._decided:
            self._decided = True
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
                self._cuda = torch.cuda
        if self._cuda is not None:
            peak = self._cuda.max_memory_allocated()
            self._cuda.reset_peak_memory_stats()
            return int(peak)
        return None


def _peak_rss_bytes() -> int:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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
        self.failures = FailureLog()
        self.dropped = 0
        self.steps_seen = 0
        self.exporters: list[Exporter] = []
        self._exporter_names: list[str] = []
        self._queue: collections.deque[tuple] = collections.deque()
        self._cap = config.queue_size
        self._held: list[tuple[float, StepRecord]] = []
        self._internal_findings: list[Finding] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._ctx_refreshed = False
        self._opened = False
        self._rss: int | None = None
        self.timing_backend: str | None = None
        self._perf_ref = time.perf_counter_ns()
        self._wall_ref = time.time()
        self._start_wall = self._wall_ref
        self.pid = os.getpid()
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

        self.tracker = StepTracker(
            self._enqueue,
            step_offset=self.config.step_offset,
            nvtx=Nvtx(self.config.nvtx),
            mem_probe=_MemProbe(),
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
        self._started = True
        atexit.register(self.shutdown)

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
            ("training_metrics", cfg.training_metrics, "stepwatch.analysis.training_metrics"),
            ("comm", cfg.comm, "stepwatch.comm"),
            # Hang watchdog, SIGUSR1 stack dumps, anomaly-triggered captures (docs/hang.md).
            ("capture", cfg.watchdog != "off" or cfg.capture != "off", "stepwatch.capture"),
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

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Finish the last step, stop hooks and the pipeline, flush and close every exporter."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if not self._started or os.getpid() != self.pid:
            return
        try:
            atexit.unregister(self.shutdown)
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
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._thread is None or not self._thread.is_alive():
            self._pass(final=True)
        for f in self.features_started:
            try:
                f.stop()
            except Exception as exc:
                self._internal_error(f"feature.{type(f).__name__}.stop", exc)
        for e in self.exporters:
            try:
                e.force_flush(timeout_s)
                e.shutdown()
            except Exception as exc:
                self._internal_error(f"exporter.{getattr(e, 'name', type(e).__name__)}", exc)
        self._write_manifest(final=True)

    def after_fork_in_child(self) -> None:
        """In a forked child (DataLoader worker): no threads, no hooks firing, no files."""
        self._closed = True
        self._started = False
        if self.tracker is not None:
            self.tracker.enabled = False

    # -- training-thread API ---------------------------------------------------------------------

    def _enqueue(self, raw: tuple) -> None:
        if len(self._queue) < self._cap:
            self._queue.append(raw)
        else:
            self.dropped += 1

    def total_dropped(self) -> int:
        """Records dropped on the bounded queue plus what exporters dropped (e.g. OTLP down)."""
        n = self.dropped
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
        while not self._stop.wait(self.config.flush_interval_s):
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
        from .exporters.builtin import build_exporters

        self._refresh_context()
        try:
            exporters = build_exporters(self.config, self.ctx)
        except Exception as e:
            self._internal_error("exporter.start", e)
            exporters = list(self.config.exporters)
        self.exporters = exporters
        self._exporter_names = [getattr(e, "name", type(e).__name__) for e in exporters]
        for e in exporters:
            if hasattr(e, "drops"):
                e.drops = self.total_dropped
        self._write_manifest(final=False)

    def _pass(self, *, final: bool) -> None:
        try:
            while self._new_enrichers:
                self.enrichers.insert(0, self._new_enrichers.pop())
            raws = []
            q = self._queue
            while q:
                raws.append(q.popleft())
            self._rss = _peak_rss_bytes() if raws else None
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
            for e in self.exporters:
                try:
                    e.export(batch)
                except Exception as exc:
                    self._internal_error(f"exporter.{getattr(e, 'name', type(e).__name__)}", exc)
        except Exception as e:  # the pipeline itself must never die silently
            self._internal_error("pipeline", e)

    def _resolve(self, raws: list[tuple], *, final: bool) -> list[StepRecord]:
        now = time.monotonic()
        for raw in raws:
            self._held.append([now, self._build(raw), raw[-1], []])
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

    def _build(self, raw: tuple) -> StepRecord:
        (step, t_end, step_ns, data, fwd, bwd, opt, ev, ckpt, phases, scalars, skipped, mem, extras) = raw
        s = 1e-9
        other = max(step_ns - data - fwd - bwd - opt, 0)
        if mem is None:
            mem = self._rss if self._rss is not None else _peak_rss_bytes()
        return StepRecord(
            step=step,
            rank=self.ctx.rank,
            time=self._wall_ref + (t_end - self._perf_ref) * s,
            step_s=step_ns * s,
            data_wait_s=data * s,
            forward_s=fwd * s,
            backward_s=bwd * s,
            optimizer_s=opt * s,
            other_s=other * s,
            eval_s=ev * s,
            checkpoint_s=ckpt * s,
            phases={k: v * s for k, v in phases.items()},
            scalars={k: (v if isinstance(v, _Pending) else _to_float(v)) for k, v in scalars.items()},
            skipped=skipped,
            mem_peak_bytes=mem,
            **_checkpoint_fields(extras.get("checkpoint_bytes"), ckpt * s),
            tail=bool(extras.get("tail", False)),
        )

    # -- manifest -------------------------------------------------------------------------------

    def _write_manifest(self, *, final: bool) -> None:
        """Every rank writes ``rank<R>.json``; rank 0 writes ``run.json`` (hosts from all rank files)."""
        if not self.config.records:
            return
        ctx = self.ctx
        try:
            make_private_dir(ctx.run_dir)
            me = {
                "rank": ctx.rank,
                "local_rank": ctx.local_rank,
                "host": ctx.host,
                "pid": self.pid,
                "attempt": ctx.attempt,
                "start_time": self._start_wall,
            }
            write_json_private(os.path.join(ctx.run_dir, f"rank{ctx.rank}.json"), me)
            if ctx.rank != 0:
                return
            hosts = sorted({ctx.host} | set(_hosts_in(ctx.run_dir)))
            manifest = {
                "schema_version": SCHEMA_VERSION,
                "run_id": ctx.run_id,
                "argv": list(sys.argv),
                "versions": _versions(),
                "world_size": ctx.world_size,
                "hosts": hosts,
                "attempt": ctx.attempt,
                "start_time": self._start_wall,
                "end_time": time.time() if final else None,
                "config": self.config.as_manifest(),
                "features": self.features(),
                "exporters": self._exporter_names,
                "steps": self.steps_seen,
                "dropped_records": self.dropped,
                "internal_errors": dict(self.failures.counts),
            }
            if not hasattr(self, "_manifest_path"):
                self._manifest_path = free_name(ctx.run_dir, "run", "json")
            write_json_private(self._manifest_path, manifest)
        except OSError as e:
            logger.warning("cannot write the manifest in %s: %s", ctx.run_dir, e)

    def features(self) -> dict[str, Any]:
        inst = self.instrumentation
        return {
            "step_tracking": bool(self.tracker is not None and self.tracker.enabled) or self.steps_seen > 0,
            "nvtx": self.config.nvtx,
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


def _checkpoint_fields(nbytes: int | None, seconds: float) -> dict[str, Any]:
    if not seconds:
        return {}
    gbps = nbytes / seconds / 1e9 if nbytes else None
    return {"checkpoint_bytes": nbytes, "checkpoint_gbps": gbps}


def _to_float(v: Any) -> float | None:
    try:
        if hasattr(v, "numel"):
            if v.numel() != 1:
                return None
            v = v.detach()
        return float(v)
    except (TypeError, ValueError, RuntimeError):
        return None


def _hosts_in(run_dir: str) -> list[str]:
    out = []
    try:
        names = os.listdir(run_dir)
    except OSError:
        return out
    for n in names:
        if n.startswith("rank") and n.endswith(".json"):
            try:
                with open(os.path.join(run_dir, n), encoding="utf-8") as f:
                    out.append(json.load(f)["host"])
            except (OSError, ValueError, KeyError):
                continue
    return out


def _versions() -> dict[str, str]:
    torch = sys.modules.get("torch")
    return {
        "stepwatch": __version__,
        "torch": getattr(torch, "__version__", "not imported"),
        "python": platform.python_version(),
    }
