"""The session: one per process. It holds the config and who this process is (``ctx``), owns the
lifecycle (start; shutdown at exit, on SIGTERM or by hand; a forked child) and the training
thread's API (``step``, ``set_step``, ``log``), and assembles the parts: hooks -> tracker ->
:class:`~stepwatch._pipeline.Pipeline` -> exporters; the features through one
:class:`~stepwatch._feature.Hub`; the run directory's manifests (:mod:`stepwatch._manifest`).
It measures nothing itself.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import os
import signal
import sys
import threading
import time
import weakref
from typing import Any

from ._excepthook import pass_on
from ._feature import Hub
from ._files import cannot_write, private_run_dir, say_unwritable
from ._log import FailureLog, logger
from ._manifest import Manifest, RunFacts
from ._sigterm import FINISH_S, SigtermFinisher, _die
from .analysis.checkpoint import CheckpointWatch
from .analysis.detectors import DataLoadingDetector, UnseenForwardCheck
from .config import Config
from .context import RunContext, from_env, is_lone_run_id, refresh_from_dist
from .exporters.base import Exporter
from .exporters.builtin import ExporterSpec, exporter_specs, otel_wanted, preload
from .exporters.worker import describe_drops
from .hooks.nvtx import Nvtx
from .hooks.phases import StepTracker, cpu_items
from ._pipeline import SHUTDOWN_TIMEOUT_S, Pipeline, loggable

__all__ = ["SHUTDOWN_TIMEOUT_S", "Session"]

# Where a multiprocessing child's shutdown runs among the finalizers of its exit (highest first):
# ahead of multiprocessing's own (a Pool's 15, a Queue's 10, the daemon children's terminate at
# 0), as the session's ``atexit`` shutdown runs ahead of multiprocessing's exit hook elsewhere.
_MP_EXIT_PRIORITY = 100


def _features_wanted(cfg: Config) -> list[tuple[str, bool, str]]:
    """(name, on, module with ``install(hub)``), started in this order; imported by name so that
    the core never imports a feature package."""
    return [
        ("gpu_telemetry", cfg.gpu_telemetry, "stepwatch.telemetry.feature"),
        # FLOPs, MFU, tokens, grad-norm (docs/mfu.md).
        ("training_metrics", cfg.training_metrics, "stepwatch.metrics"),
        ("comm", cfg.comm, "stepwatch.comm"),
        # Memory fields, memory findings, OOM forensics (docs/memory.md).
        ("memory", cfg.memory, "stepwatch.memory"),
        # Hang watchdog, SIGUSR1 stack dumps, anomaly-triggered captures (docs/hang.md). Always
        # started: it registers the step-time spike detector, a finding with those off too, and
        # stops there when both are off.
        ("capture", True, "stepwatch.capture"),
        # MLflow and W&B sinks: their probes of the active run sit on the training thread.
        ("mlflow", cfg.mlflow, "stepwatch.exporters.mlflow"),
        ("wandb", cfg.wandb, "stepwatch.exporters.wandb"),
        # TensorBoard into the user's own SummaryWriter: its close is wrapped at init.
        ("tensorboard", cfg.tensorboard is not None and not isinstance(cfg.tensorboard, str),
         "stepwatch.exporters.tensorboard"),
    ]


class Session:
    def __init__(self, config: Config, *, environ: dict[str, str] | None = None) -> None:
        self.config = config
        env = dict(os.environ if environ is None else environ)
        self.ctx: RunContext = from_env(env, run_dir=config.dir, run_id=config.run_id)
        try:
            # A process group made before the session (a torch.multiprocessing.spawn rank, whose
            # session starts at its first optimizer, has no RANK/WORLD_SIZE in its environment):
            # the features that start now (the watchdog's "auto") see the job's real world size.
            refresh_from_dist(self.ctx)
        except Exception:  # asked again at the first pass (_sinks), which reports it
            pass
        # False once the run directory is refused: no records file and no manifest (each would
        # say the same again), the other exporters as configured.
        self._files_ok = True
        if config.enabled:
            try:
                self.ctx.run_dir = private_run_dir(self.ctx.run_dir, warn=self.ctx.rank == 0)
            except OSError as e:  # every writer refuses that directory: no files, the job goes on
                self._files_ok = False
                logger.warning("cannot use the run directory %s (STEPWATCH_DIR or init(dir=...)): %s: going on "
                               "without files", self.ctx.run_dir, e.strerror or e)
            else:
                why = cannot_write(self.ctx.run_dir)
                if why is not None:  # a read-only disk: the one warning, here; no records file, no manifest
                    self._files_ok = False
                    say_unwritable(self.ctx.run_dir, "files (records, manifest, stack dumps, hang reports)", why)
        self.pid = os.getpid()
        self.tracker: StepTracker | None = None
        self.log_convert = loggable  # stepwatch.log's converter (cpu_items' once the hooks are in)
        self.instrumentation: Any = None
        self.by_run = False  # started by `stepwatch run`'s shim (set by _api.init)
        self.hub: Hub | None = None
        # Features that started with the session (see _feature.py): stop() at shutdown, status()
        # in run.json, collect()/on_findings() every pass.
        self.features_started: list[Any] = []
        self._nvtx: Nvtx | None = None
        self._device_timing: Any = None
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._finishing = False  # a shutdown of the started session is under way (or done)
        self._final = threading.Event()  # the final manifest is written
        self._sigterm = SigtermFinisher(self._shutdown_quietly)
        # How the job ended, for run.json's ``ended_by``: SIGTERM, an uncaught exception (seen by
        # ``_excepthook``), else a shutdown (stepwatch.shutdown(), or the interpreter's exit).
        self.ended_by: str | None = None
        self._printed_before: BaseException | None = None
        self._prev_excepthook: Any = None
        # ``sys.exit`` while the session runs (``_recording_exit``), the one it replaced, and what
        # the main thread last asked for: (status, the tracker's step then).
        self._exit_fn: Any = None
        self._prev_exit: Any = None
        self._exit_asked: tuple[Any, Any] | None = None
        # In a multiprocessing child: its shutdown in multiprocessing's exit (``_at_mp_exit``).
        self._mp_exit: Any = None
        self.pipeline = Pipeline(
            self.ctx,
            queue_size=config.queue_size,
            flush_interval_s=config.flush_interval_s,
            window=config.window,
            repeat_windows=config.finding_repeat_windows,
            detectors=[DataLoadingDetector(config.window, config.data_wait_threshold_ms), UnseenForwardCheck(),
                       CheckpointWatch()],
            features=self.features_started,
            sinks=self._sinks,
            on_open=lambda: self._write_manifest(final=False),
            step_of=lambda: self.tracker.step if self.tracker is not None else None,
        )
        self.manifest = Manifest(config, self.ctx, pid=self.pid, start_time=self.pipeline.wall_ref)
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
            self.pipeline.hot_enqueue(), step_offset=self.config.step_offset, nvtx=self._nvtx, on_error=self.report_error
        )
        if self.config.step_boundary == "explicit":
            self.tracker.boundary = "explicit"  # only stepwatch.step() ends a step
        self.instrumentation = Instrumentation(self.tracker, self.report_error)
        self.instrumentation.on_launch = self._stand_down_if_launcher
        try:
            self.instrumentation.install()
            self.log_convert = cpu_items(loggable)
        except Exception as e:  # e.g. an unexpected torch version: go on without hooks
            self.report_error("hooks.install", e)
            self.tracker.enabled = False
        self.hub = Hub(config=self.config, ctx=self.ctx, tracker=self.tracker, instrumentation=self.instrumentation,
                       pipeline=self.pipeline, pid=self.pid, files_ok=self._files_ok)
        if self.config.device_timing:
            from .hooks.device import DeviceTimingSwitch

            self._device_timing = DeviceTimingSwitch(self.hub)
        # SIGTERM skips atexit: finish the run directory first (see _sigterm.py). Before any
        # feature or excepthook of ours: a thread keeps the sys.excepthook of its creation, and
        # the SIGTERM watcher may outlive this session (retired, after a shutdown off the main
        # thread), so it must hold nothing of it.
        self._sigterm.install()
        self._start_features()
        self.pipeline.start()
        if otel_wanted(self.config):
            threading.Thread(target=preload, args=(self.config,), name="stepwatch-preload", daemon=True).start()
        self._started = True
        self._prev_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        self._prev_exit = sys.exit
        self._exit_fn = sys.exit = _recording_exit(self, sys.exit)
        self._printed_before = _last_printed()  # an earlier one (a REPL's) is not this job's end
        atexit.register(self.shutdown)
        # A multiprocessing child ('fork', 'forkserver': a Pool's worker, a rank of
        # torch.multiprocessing) leaves through os._exit(), without atexit: see _at_mp_exit.
        self._mp_exit = _register_mp_exit(self)

    def _start_features(self) -> None:
        """Optional features, each guarded: one that fails to start is logged and left off."""
        for name, on, module in _features_wanted(self.config):
            if not on:
                continue
            try:
                feat = importlib.import_module(module).install(self.hub)
            except Exception as e:
                self.report_error(f"feature.{name}", e)
                continue
            if feat is not None:
                self.features_started.append(feat)
                if isinstance(feat, Exporter):  # a sink whose library's exit hook may come after init's
                    feat.exit_first = self._exit_first

    def _stop_features(self) -> None:
        for f in self.features_started:
            try:
                f.stop()
            except Exception as exc:
                self.report_error(f"feature.{type(f).__name__}.stop", exc)

    def _excepthook(self, t: Any, v: Any, tb: Any) -> None:
        """The job dies of an uncaught exception (its atexit shutdown comes next): said in
        run.json's ``ended_by``; then the previous hook prints it as before (once: see
        ``_excepthook.pass_on``)."""
        try:
            if self.ended_by is None and os.getpid() == self.pid:
                self.ended_by = _uncaught(t, v)
        except Exception:  # noqa: BLE001 - the user's traceback must still be printed
            pass
        pass_on(self._excepthook, self._prev_excepthook, t, v, tb)

    def _exit_called(self, status: Any) -> None:
        """The script called ``sys.exit(status)`` (the SystemExit it raises reaches no hook):
        kept for ``ended_by`` when the main thread of this process called it. A thread's
        ``sys.exit`` ends that thread alone; a SystemExit the script catches and trains on after
        is let go at the shutdown (the step moved on)."""
        if threading.current_thread() is threading.main_thread() and os.getpid() == self.pid:
            self._exit_asked = (status, self._step_now())

    def _step_now(self) -> Any:
        tr = self.tracker
        return tr.step if tr is not None else None

    def _at_mp_exit(self) -> None:
        """The shutdown of a session started in a multiprocessing child, from the child's exit:
        ``BaseProcess._bootstrap`` runs the process's target, then in its ``finally``
        ``multiprocessing.util._exit_function`` (the finalizers registered with an exit priority),
        then ends the process with ``os._exit()`` under 'fork' and 'forkserver': ``atexit`` never
        runs there, and the run directory was left unfinished (of 200 steps, 1 to 28 records;
        run.json with ``steps: 0`` and no end). An exception that leaves the target (which
        multiprocessing prints itself, not ``sys.excepthook``) is said in ``ended_by`` as
        ``_excepthook`` says it for a script; ``SystemExit`` is an exit.

        A SIGTERM during this shutdown (a Pool's ``terminate()``, as ``with Pool(...)`` ends,
        reaching a worker that got its end-of-work sentinel and is leaving by itself) waits for
        it, as during any shutdown on the main thread (:meth:`_sigterm_waits`)."""
        try:
            t, v, _ = sys.exc_info()  # the exception leaving the target, in that ``finally``
            if v is not None and self.ended_by is None and os.getpid() == self.pid:
                # ``raise SystemExit(3)`` too: here the exit is seen, however it was raised.
                self.ended_by = _exit_said(v.code) if isinstance(v, SystemExit) else _uncaught(t, v)
        except Exception:  # noqa: BLE001 - the shutdown comes first
            pass
        self.shutdown()

    @contextlib.contextmanager
    def _sigterm_waits(self) -> Any:
        """A SIGTERM during a shutdown on the main thread waits for it, at most ``FINISH_S``,
        then ends the process as SIGTERM does. Run there, the handler stopped the shutdown where
        it stood and wrote the manifest as it was: a rank whose peer died (gloo's "Connection
        reset", then the exit's shutdown) got torchrun's SIGTERM 26 ms into its final pass and
        lost its last 1 to 8 records, uncounted (``dropped_records: 0``); a multiprocessing
        worker ended by its Pool's ``terminate()`` kept 1 of 30."""
        termed: list[int] = []

        def later(signum: int, frame: Any) -> None:
            if not termed:
                termed.append(signum)
                if self.ended_by is None:
                    self.ended_by = "SIGTERM"
                threading.Thread(target=_die_after, args=(signum, FINISH_S), name="stepwatch-sigterm-deadline",
                                 daemon=True).start()

        deferred = False
        try:
            if (self._sigterm.installed and threading.current_thread() is threading.main_thread()
                    and signal.getsignal(signal.SIGTERM) == self._sigterm._handler):
                signal.signal(signal.SIGTERM, later)  # the watcher thread leaves a handler not its own
                deferred = True
        except (ValueError, OSError):
            pass
        try:
            yield
        finally:
            if deferred:
                try:
                    if signal.getsignal(signal.SIGTERM) == later:
                        # As the shutdown leaves it; ours again when there was none to make (one
                        # already under way on another thread: the handler then waits for it).
                        signal.signal(signal.SIGTERM, self._sigterm._handler if self._sigterm.installed else signal.SIG_DFL)
                    if termed:
                        os.kill(os.getpid(), termed[0])  # as it would have been handled: dies of it
                except (ValueError, OSError):
                    pass

    def _drop_mp_exit(self) -> None:
        """Out of multiprocessing's exit registry (shut down already, or a fork's copy)."""
        f, self._mp_exit = self._mp_exit, None
        if f is not None:
            f.cancel()

    def _shutdown_quietly(self, timeout_s: float) -> None:
        if self.ended_by is None:
            self.ended_by = "SIGTERM"
        try:
            if self._finishing:
                # SIGTERM during a shutdown under way on another thread (one on the main thread
                # defers the signal: ``_sigterm_waits``): it may finish within ``timeout_s``; else
                # the final manifest now, as it stands. The process then dies of SIGTERM.
                if not self._final.wait(timeout_s):
                    self._write_final_manifest()
                return
            self.shutdown(timeout_s=timeout_s)
        except Exception:  # SIGTERM: dying anyway, nothing left to report to
            pass

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Finish the last step, stop hooks and the pipeline, flush and close every exporter,
        all within ``timeout_s`` (but the features' own stop); what is left is counted."""
        deadline = time.monotonic() + timeout_s
        # On the main thread the SIGTERM handler waits from before this shutdown is marked under
        # way: a signal landing between the two found it under way and wrote the manifest as it
        # stood (a Pool's worker leaving on its end-of-work sentinel as ``terminate()`` signals
        # it lost up to half of its records, none counted as dropped).
        with self._sigterm_waits():
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            if not self._started or os.getpid() != self.pid:
                return
            self._finishing = True
            self._shut_down(timeout_s, deadline)

    def _shut_down(self, timeout_s: float, deadline: float) -> None:
        replaced = sys.excepthook != self._excepthook  # by a hook that may not pass exceptions on
        try:
            # The SIGTERM handler stays until the final manifest is written (at the end): a SIGTERM
            # during this shutdown on another thread still writes it (``_shutdown_quietly``), then
            # ends the process; on the main thread it waits for the end (``_sigterm_waits``).
            atexit.unregister(self.shutdown)
            atexit.unregister(self._exit_first)
            self._drop_mp_exit()
            if sys.excepthook == self._excepthook:
                sys.excepthook = self._prev_excepthook
            if sys.exit is self._exit_fn:
                sys.exit = self._prev_exit
        except Exception:
            pass
        asked = self._exit_asked
        if self.ended_by is None and asked is not None and asked[1] == self._step_now():
            self.ended_by = _exit_said(asked[0])
        if self.tracker is not None:
            self.tracker.flush()
            self.tracker.enabled = False
        if self.instrumentation is not None:
            try:
                self.instrumentation.uninstall()
            except Exception as e:
                self.report_error("hooks.uninstall", e)
        if self.ended_by is None and replaced and os.getpid() == self.pid:
            # A hook that replaced ours and calls no other (rich's, loguru's) kept the exception
            # from ``_excepthook``; the interpreter keeps the one it printed (atexit runs after).
            # Only then: a notebook keeps a cell's exception there too, and goes on.
            v = _last_printed()
            if v is not None and v is not self._printed_before:
                self.ended_by = _uncaught(type(v), v)
        # The exporters flush in parallel while the features stop.
        self.pipeline.shutdown(timeout_s, deadline=deadline, meanwhile=self._stop_features)
        self._write_final_manifest()
        try:
            self._sigterm.uninstall()
        except Exception:
            pass

    def _write_final_manifest(self) -> None:
        """The end of this shutdown, or a SIGTERM that came during it before the manifest was
        written (no lock: the handler may have interrupted the thread that holds one)."""
        self._write_manifest(final=True)
        self._final.set()

    def _stand_down_if_launcher(self) -> None:
        """``torch.multiprocessing.spawn`` (or ``start_processes``) is launching processes, and this
        one has recorded no step: it is the launcher of the ranks, each of which starts its own
        session when it makes its first optimizer (``_api._start_at_first_optimizer``), and no rank
        itself. Its session ends here and removes the files it wrote, which sat beside rank 0's
        as a second attempt of world size 1 (``stepwatch report`` showed the launcher's manifest).
        A launcher that recorded a step, or whose files hold a record or a finding, keeps them."""
        if not self.trained_nothing():
            return
        logger.info("stepwatch: this process launches the ranks (torch.multiprocessing) and has trained nothing: "
                    "its session ends; each rank measures itself")
        self.end_without_trace()

    def trained_nothing(self) -> bool:
        """Open, and no step recorded or begun."""
        tr = self.tracker
        return not (self._closed or self.pipeline.steps_seen or (tr is not None and tr.step != self.config.step_offset))

    def end_without_trace(self) -> None:
        """Shut down, and remove the files this session wrote (its empty steps and findings files,
        its manifests, the run directory if that leaves it empty), unless they hold a record or a
        finding: a session that trained nothing and gives way (to the ranks it launches, to the
        script's own ``init``) leaves no run of its own behind."""
        self.shutdown()
        records = self.pipeline.records_paths()
        if any(_size(p) for p in records):
            return
        paths = [*records, *self.manifest.paths()]
        for f in self.features_started:  # what a feature wrote for this process alone (its SIGUSR1 file)
            try:
                paths.extend(getattr(f, "leftovers", list)())
            except Exception as e:
                self.report_error(f"feature.{type(f).__name__}.leftovers", e)
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        try:
            os.rmdir(self.ctx.run_dir)  # only if empty: the ranks' files stay
        except OSError:
            pass

    def after_fork_in_child(self) -> None:
        """In a forked child (DataLoader worker): no threads, no hooks firing, no files."""
        self._closed = True
        self._started = False
        try:
            # The child's copy of multiprocessing's exit registry (multiprocessing's own children
            # clear it; an os.fork() child keeps it): this session is the parent's.
            self._drop_mp_exit()
        except Exception:
            self._mp_exit = None
        self._sigterm.after_fork_in_child()
        if self.tracker is not None:
            self.tracker.enabled = False

    # -- training-thread API ---------------------------------------------------------------------

    def step(self) -> None:
        if self.tracker is not None:
            self.tracker.end_step()

    def set_step(self, n: int) -> None:
        if self.tracker is not None:
            self.tracker.set_step(n)

    def report_error(self, where: str, exc: BaseException) -> None:
        """An internal failure (any thread): counted in run.json, logged once, an
        ``internal_error`` finding; the caller disables what failed."""
        self.pipeline.report_error(where, exc)

    # -- what the session reports ----------------------------------------------------------------

    @property
    def failures(self) -> FailureLog:
        return self.pipeline.failures

    @property
    def dropped(self) -> int:
        return self.pipeline.dropped

    @property
    def steps_seen(self) -> int:
        return self.pipeline.steps_seen

    @property
    def exporters(self) -> list[Exporter]:
        """The exporters running now (one still starting on its thread is not listed yet)."""
        return self.pipeline.exporters

    def features(self) -> dict[str, Any]:
        inst, tr = self.instrumentation, self.tracker
        backend = self._device_timing.backend if self._device_timing is not None else None
        return {
            "step_tracking": bool(tr is not None and tr.enabled) or self.steps_seen > 0,
            # On only when the ranges really go out (the nvtx package imported, a tool that can listen).
            "nvtx": bool(self._nvtx is not None and self._nvtx.enabled),
            "records": self.config.records and self._files_ok,
            "console": self.config.console,
            "timing_clock": "device" if backend else "host",
            "timing_backend": backend or "host clock",
            "root_modules": list(inst.roots) if inst is not None else [],
            # What ends a step: "optimizer" (optimizer.step()), "backward" (no torch optimizer
            # in the loop: one step per backward) or "explicit" (stepwatch.step()).
            "step_boundary": tr.boundary if tr is not None else None,
            "module_scan_s": inst.scan_s if inst is not None else 0.0,
            **{
                getattr(f, "name", type(f).__name__): f.status() if hasattr(f, "status") else True
                for f in self.features_started
            },
        }

    # -- pipeline thread -------------------------------------------------------------------------

    def _sinks(self) -> list[ExporterSpec]:
        """The exporters to open, at the first pass with anything to export: rank and world size
        are known by then (torch.distributed initialized)."""
        try:
            refresh_from_dist(self.ctx)
        except Exception as e:
            self.report_error("context", e)
        if self.ctx.world_size > 1 and is_lone_run_id(self.ctx.run_id, self.pid) and self.config.run_id is None:
            logger.warning(
                "stepwatch: rank %d of %d chose its run id %r (a timestamp and its pid) before the process group "
                "existed, and its launcher set no TORCHELASTIC_RUN_ID or MASTER_ADDR/MASTER_PORT: every rank writes "
                "a run directory of its own (%s), and the straggler exchange, the hang verdict and captures do not "
                "join the ranks. Fix: set STEPWATCH_RUN_ID (the same on every rank), or MASTER_ADDR/MASTER_PORT "
                "with init_method=\"env://\", or call stepwatch.init() after init_process_group",
                self.ctx.rank, self.ctx.world_size, self.ctx.run_id, self.ctx.run_dir)
        try:
            specs = exporter_specs(self.config, self.ctx)
        except Exception as e:
            self.report_error("exporter.start", e)
            specs = []
        if not self._files_ok:
            specs = [s for s in specs if s.name != "records"]
        # A feature that is also a sink (MLflow: it must see the training thread from init).
        specs = specs + [ExporterSpec(str(getattr(f, "name", type(f).__name__)), (lambda f=f: f))
                         for f in self.features_started if isinstance(f, Exporter)]
        return [ExporterSpec(s.name, functools.partial(self._bind_exit, s.build), s.inline) for s in specs]

    def _bind_exit(self, build: Any) -> Exporter | None:
        """An exporter as built, told the session's shutdown (``Exporter.exit_first``)."""
        e = build()
        if e is not None:
            try:
                e.exit_first = self._exit_first
            except AttributeError:  # a sink of the user's with __slots__: it never asks for it
                pass
        return e

    def _exit_first(self) -> None:
        """``Exporter.exit_first``: the shutdown an exporter re-registers with ``atexit`` to run
        ahead of its library's exit hook. A callable of its own, not ``self.shutdown``: an
        exporter's ``atexit.unregister`` of it must never take out the session's own exit
        shutdown (registered as ``self.shutdown``), as it did when the exporter first saw its
        run while the interpreter was already running its exit hooks -- then no shutdown ran."""
        self.shutdown()

    def _write_manifest(self, *, final: bool) -> None:
        if not self.config.records or not self._files_ok:
            return
        p = self.pipeline
        self.manifest.write(
            RunFacts(
                features=self.features(),
                exporters=p.exporter_names,
                steps=p.steps_seen,
                dropped_records=p.dropped,
                exporter_drops=describe_drops(p.workers, p.exporters),
                null_scalars=p.null_scalars,
                internal_errors=dict(p.failures.counts),
                steps_rotated_out=p.records_rotated_out(),
                ended_by=(self.ended_by or "shutdown") if final else None,
            ),
            final=final,
        )


def _last_printed() -> BaseException | None:
    """The last uncaught exception the interpreter printed (it keeps it before it calls
    ``sys.excepthook``): ``sys.last_exc`` from Python 3.12, ``sys.last_value`` before."""
    v = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return v if isinstance(v, BaseException) else None


def _uncaught(t: Any, v: BaseException) -> str:
    """``ended_by`` of a process that an exception ended."""
    return f"uncaught {getattr(t, '__name__', t)}" + _said(v)


def _said(v: Any, limit: int = 200) -> str:
    """``": <the first line of str(v)>"`` for ``ended_by`` (``…`` where more was cut), or "" when
    it says nothing."""
    first = str(v).strip().splitlines()
    if not first:
        return ""
    line = first[0]
    return ": " + (line if len(line) <= limit and len(first) == 1 else line[:limit] + "…")


def _exit_said(status: Any) -> str | None:
    """``ended_by`` of a process that ``sys.exit(status)`` ended, as the interpreter reads the
    status: None for 0 or None (a finished job's ``shutdown``), ``exit <code>`` for another
    integer, ``exit 1: <message>`` for anything else (printed, then exit status 1)."""
    if status is None:
        return None
    if isinstance(status, int):
        return f"exit {int(status)}" if status else None
    return "exit 1" + _said(status)


def _recording_exit(session: Session, prev: Any) -> Any:
    """``sys.exit`` while ``session`` runs: tells the session, then calls ``prev`` (the one it
    replaced), which raises the SystemExit as before. W&B's ``ExitHooks`` wraps ``sys.exit`` the
    same way, before or after this one. It holds the session weakly: one wrapped over by another
    library outlives it, and then only passes the call on."""
    ref = weakref.ref(session)

    def exit(status: Any = None, /) -> Any:  # noqa: A001 - it is sys.exit
        s = ref()
        if s is not None:
            try:
                s._exit_called(status)
            except Exception:  # noqa: BLE001 - the exit comes first
                pass
        return prev(status)

    exit.__doc__ = getattr(prev, "__doc__", None)
    exit.__wrapped__ = prev  # type: ignore[attr-defined]
    return exit


def _in_mp_child() -> bool:
    """This process is a child started by ``multiprocessing`` (any start method): it imported
    ``multiprocessing.process`` to start, which knows its parent (nothing is imported here)."""
    proc = sys.modules.get("multiprocessing.process")
    try:
        return proc is not None and proc.parent_process() is not None
    except Exception:
        return False


def _register_mp_exit(session: Session) -> Any:
    """In a multiprocessing child, ``session``'s shutdown among the finalizers of the child's exit
    (``Session._at_mp_exit``); None elsewhere. The finalizer holds the session weakly (a session
    dropped without a shutdown is freed), is cancelled by the shutdown, and runs only in the
    process that registered it (``Finalize`` checks the pid: a fork of this child leaves it be)."""
    if not _in_mp_child():
        return None
    try:
        from multiprocessing import util

        return util.Finalize(None, _mp_exit_shutdown, args=(weakref.ref(session),), exitpriority=_MP_EXIT_PRIORITY)
    except Exception as e:
        session.report_error("mp_exit", e)
        return None


def _die_after(signum: int, delay_s: float) -> None:
    """A SIGTERM waits for the exit shutdown under way (``Session._at_mp_exit``) this long at most."""
    time.sleep(delay_s)
    _die(signum)


def _mp_exit_shutdown(ref: "weakref.ref[Session]") -> None:
    s = ref()
    if s is not None:
        s._at_mp_exit()


def _size(path: str) -> int:
    """The bytes of ``path`` and of its rotated segment (``.1``); a missing file is empty."""
    n = 0
    for p in (path, path + ".1"):
        try:
            n += os.path.getsize(p)
        except OSError:
            pass
    return n
