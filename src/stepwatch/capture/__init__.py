"""Hang watchdog, on-demand stack dumps and anomaly-triggered captures (docs/hang.md).

``install(hub)`` wires them in through the session's hub at init (training thread, cheap): a
progress board for the tracker, the watchdog sidecar process, the SIGUSR1 stack dump, the
step-time spike detector and the capture manager. Heavy parts (torch.profiler, py-spy) load only
when used.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from .._env import ENABLED as ENABLED_ENV, RUN as RUN_ENV, SIDECAR as SIDECAR_ENV
from .._files import read_json_private, read_private
from .._log import logger, warn_once
from .._os.ptrace import grant_ptrace

# PyTorch's Flight Recorder keeps the last N collectives per process group for its own dumps
# (TORCH_NCCL_DUMP_ON_TIMEOUT, torch.distributed.flight_recorder). Older torch kept none unless a
# buffer size was set; torch 2.13 defaults to 2000 (c10d/FlightRecorder.hpp), the size set here
# too. Each name pair: the torch >= 2.7 name first, then the older NCCL one (which still works
# there, with a warning on every rank).
FR_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FR_ENTRIES = "2000"
# Where the dumps go (torch appends the rank): by default /tmp/nccl_trace_rank_<R> on each node,
# with the umask's permissions; the private run directory instead, beside stepwatch's evidence.
FR_FILE_ENV = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
FR_FILE = "nccl_flight_recorder.rank"

# How long shutdown waits for the watchdog sidecar (within _pipeline.SHUTDOWN_TIMEOUT_S, which
# it shares with the final pass and the exporters' flush, in parallel): first for it to see the
# board's closed flag (it polls every 0.25 s), then, after SIGCONT + SIGTERM, for it to exit.
SIDECAR_STOP_S = 0.4
SIDECAR_TERM_S = 0.2

if TYPE_CHECKING:
    from .._feature import Hub


def _wanted(setting: str, ctx: Any) -> bool:
    """``auto``: on in a multi-rank job or under ``stepwatch run``; a lone process (a notebook, a
    unit test) would pay for a sidecar and profiler warm-up it rarely needs."""
    if setting == "on":
        return True
    if setting == "off":
        return False
    return ctx.world_size > 1 or os.environ.get(RUN_ENV) == "1"


class Feature:
    """What ``install`` started; ``stop()`` at shutdown, ``status()`` for run.json (key ``capture``),
    ``on_findings`` each background pass."""

    name = "capture"

    def __init__(self, hub: "Hub") -> None:
        self.hub = hub
        self.board: Any = None
        self.sidecar: subprocess.Popen | None = None
        self.ptrace_grant: str | None = None
        self.signal: Any = None
        self.dump_signal: Any = None  # stepwatch's own stack-dump signal (signals.dump_signal)
        self.signal_off: str | None = None  # why SIGUSR1 writes no stacks
        self.captures: Any = None
        self.timeout: float | None = None
        self.action = "dump"
        self.flight_recorder: str | None = None
        # The Flight Recorder variables stepwatch set: name -> (the value before, the value set);
        # put back at stop (restore_env).
        self.env_set: dict[str, tuple[str | None, str]] = {}
        # Where this attempt starts reading the sidecar's findings file: the run dir (and so the
        # file) survives an elastic restart, and the last attempt's hangs are not news.
        self._watch_off: int | None = None
        self._watch_t = 0.0
        self._pg_timeout_told = False
        # A sidecar that dies (OOM killer, a stray kill) is noticed by the background pass, said
        # once, and restarted once; a second death leaves the job without a watchdog, and says so.
        self.sidecar_restarts = 0
        self.sidecar_dead: str | None = None
        # Why the watchdog is off although asked for (no progress board: /dev/shm full, say).
        self.watchdog_off: str | None = None
        # Set when shutdown left a sidecar that is mid-dump to finish on its own (see _stop_sidecar).
        self.sidecar_left: str | None = None
        self._stopping = False

    # -- pieces -------------------------------------------------------------------------------

    def start_board(self) -> None:
        from ..hooks import progress

        ctx = self.hub.ctx
        for path in progress.clean_stale(ctx.run_dir):
            logger.info("removed the progress board %s of a trainer that was killed", path)
        path = progress.default_path(ctx.run_id, ctx.rank, ctx.run_dir)
        try:
            self.board = progress.Board(path, ctx.rank)
        except OSError as e:
            # A full /dev/shm (or disk): no board, so no sidecar; the job goes on, told once.
            self.watchdog_off = f"cannot create the progress board {path}: {e}"
            where = os.path.dirname(path) or "."
            logger.warning("stepwatch: hang watchdog off on rank %d: cannot create its progress board %s (%s%s); "
                           "training continues without the watchdog. Fix: free space in %s.", ctx.rank, path,
                           e, " -- is %s full?" % where if getattr(e, "errno", None) == errno.ENOSPC else "", where)
            return
        self.hub.set_progress(self.board)

    def start_sidecar(self) -> None:
        from .._os.ptrace import find_pyspy

        if self.board is None:  # start_board said why
            return
        ctx, cfg = self.hub.ctx, self.hub.config
        exe = sys.executable
        if not exe or not os.path.basename(exe).startswith("python"):
            logger.warning("hang watchdog off: no Python executable to start the sidecar with (%r)", exe)
            return
        pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env[ENABLED_ENV] = "0"  # the sidecar must not instrument itself (sitecustomize shim)
        env[SIDECAR_ENV] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH", "")) if p)
        cmd = [exe, "-m", "stepwatch.watchdog.sidecar", "--trainer-pid", str(os.getpid()), "--board", self.board.path,
               "--run-dir", ctx.run_dir, "--run-id", ctx.run_id, "--rank", str(ctx.rank),
               "--world-size", str(ctx.world_size), "--attempt", str(ctx.attempt), "--action", cfg.hang_action]
        if cfg.hang_timeout:
            cmd += ["--timeout", repr(cfg.hang_timeout)]
        if not self.hub.files_ok:
            cmd.append("--run-dir-said")  # the session said the run directory cannot be written
        pyspy = find_pyspy()
        if pyspy:
            cmd += ["--pyspy", pyspy]
        else:
            # Said here, not by the sidecar: a short job can end before the sidecar is up.
            warn_once("watchdog.nopyspy", "stepwatch: watchdog rank %d: py-spy not found (next to this Python "
                      "or on PATH); hang stacks come from faulthandler (Python frames only). Fix: pip install "
                      "py-spy.", ctx.rank)
        stacks = self.signal or self.dump_signal  # the same file
        if stacks is not None:
            cmd += ["--signal-file", stacks.path]
        if self.dump_signal is not None:
            cmd += ["--dump-signal", str(self.dump_signal.signum)]
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if addr and port and port.isdigit():
            cmd += ["--store-addr", addr, "--store-port", port]
        self.sidecar = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True)
        self.ptrace_grant = grant_ptrace(self.sidecar.pid)
        self.timeout = cfg.hang_timeout
        self.action = cfg.hang_action

    def start_signal(self) -> None:
        from .signals import StackSignal, dump_signal, supported

        if not supported():
            return
        ctx = self.hub.ctx
        path = os.path.join(ctx.run_dir, f"sigusr1.rank{ctx.rank}.txt")
        sig = StackSignal(path)
        if sig.install():
            self.signal = sig
        else:
            self.signal_off = "the job's own handler, set outside Python's signal module"
            logger.warning("stepwatch: SIGUSR1 has a handler set outside Python's signal module (the job's "
                           "faulthandler.register?): stepwatch leaves it as it is, and kill -USR1 writes no "
                           "stacks to %s (stepwatch dump still does)", path)
        rt = dump_signal()
        if rt is not None:
            private = StackSignal(path, rt, private=True)
            if private.install():
                self.dump_signal = private

    def start_captures(self) -> None:
        from . import nsys
        from .profiler import CaptureManager

        hub, cfg = self.hub, self.hub.config
        self.captures = CaptureManager(
            hub, steps=cfg.capture_steps, cooldown_s=cfg.capture_cooldown_s, max_count=cfg.capture_max,
            budget_mb=cfg.capture_budget_mb, board=self.board if self.sidecar is not None else None,
            nsys=nsys.requested(),
        )
        try:
            took = self.captures.warm()
            logger.debug("captures: profiler warmed up in %.2f s", took)
        except Exception as e:  # no torch.profiler: no captures, the rest goes on
            hub.report_error("capture.warm_up", e)
            self.captures = None
            return
        try:
            self.captures.follow_job_profilers()
        except Exception as e:  # captures still work; a job's own profiler may lose its trace to one
            hub.report_error("capture.job_profiler", e)
        hub.add_detector(self.captures)

    def on_step_end(self, ended: int) -> None:
        """tracker listener (training thread)."""
        try:
            if self.signal is not None:
                self.signal.check()
            if self.captures is not None:
                self.captures.on_step_end(ended)
        except Exception as e:
            self.hub.report_error("capture.step", e)

    # -- lifecycle --------------------------------------------------------------------------------

    def _check_sidecar(self) -> None:
        sc = self.sidecar
        if sc is None or self._stopping or self.sidecar_dead is not None:
            return
        code = sc.poll()
        if code is None:
            return
        if code in (0, -signal.SIGTERM):
            # Asked to end (its SIGTERM handler exits 0): torchrun and scancel signal the rank's
            # whole process group, and the rank's own shutdown pass saw the sidecar gone first.
            # No crash: not restarted (it was, on the way out), not warned about.
            self.sidecar_dead = f"ended with {code}: asked to end (SIGTERM); not restarted"
            logger.debug("hang watchdog sidecar (pid %d) %s", sc.pid, self.sidecar_dead)
            return
        if self.sidecar_restarts >= 1:
            self.sidecar_dead = f"exited with {code} after one restart"
            logger.warning("hang watchdog sidecar (pid %d) exited again (code %s): this rank has no "
                           "hang watchdog any more", sc.pid, code)
            return
        self.sidecar_restarts += 1
        logger.warning("hang watchdog sidecar (pid %d) exited unexpectedly (code %s); restarting it once",
                       sc.pid, code)
        try:
            self.start_sidecar()
        except (OSError, ValueError) as e:
            self.sidecar_dead = f"restart failed: {e}"
            logger.warning("hang watchdog sidecar could not be restarted: %s; this rank has no hang watchdog", e)
            return
        if self.sidecar is sc:  # start_sidecar declined (no Python executable)
            self.sidecar_dead = f"exited with {code}; not restarted"

    def leftovers(self) -> list[str]:
        """The files this process wrote that hold nothing of anyone else's: its SIGUSR1 and
        dump-signal file with no stacks in it (only this pid's own announcement), its sidecar's
        ``watchdog.rank<R>.json``. What a session that gives way removes after its shutdown
        (``Session.end_without_trace``: the launcher of ``torch.multiprocessing.spawn``)."""
        from .signals import _HEADER_RE

        out = []
        for sig in {s.path: s for s in (self.signal, self.dump_signal) if s is not None}.values():
            try:
                lines = [x for x in read_private(sig.path).splitlines() if x.strip()]
            except (OSError, ValueError):
                continue
            if all((m := _HEADER_RE.match(x)) is not None and int(m.group(1)) == os.getpid() for x in lines):
                out.append(sig.path)
        ctx = self.hub.ctx
        path = os.path.join(ctx.run_dir, f"watchdog.rank{ctx.rank}.json")
        try:
            if read_json_private(path).get("trainer_pid") == os.getpid():
                out.append(path)
        except (OSError, ValueError, AttributeError):
            pass
        return out

    def stop(self) -> None:
        self._stopping = True
        self.restore_env()  # first: a step below that fails leaves none behind (the sidecar has its copy)
        if self.captures is not None:
            self.captures.stop()
        if self.board is not None:
            self.board.close()  # sets the closed flag: the sidecar exits on its next poll
        if self.sidecar is not None:
            self._stop_sidecar(self.sidecar)
        if self.sidecar_left:
            # A sidecar finishing a hang dump after us may still ask for our stacks with these
            # signals (its way without py-spy); their default action would end the process. The
            # registrations stay until the process exits (they only write stacks to the run dir).
            return
        if self.signal is not None:
            self.signal.uninstall()
        if self.dump_signal is not None:
            self.dump_signal.uninstall()

    def restore_env(self) -> None:
        """Undo the Flight Recorder variables ``enable_flight_recorder`` set: after shutdown, a
        next session in this process (a notebook) must not take them for the job's, nor a child
        job started now inherit this run dir's dump file. A variable the job set since (its
        value is not ours any more) is the job's, and stays."""
        restore_env(self.env_set)

    def _stop_sidecar(self, sc: subprocess.Popen) -> None:
        """End the sidecar within SIDECAR_STOP_S + SIDECAR_TERM_S (shutdown's bound, README "Never
        breaks the job"). It normally exits by itself at its next poll of the closed board. One
        that does not gets SIGCONT (a stopped process acts on no signal but SIGKILL) and SIGTERM:
        an idle sidecar exits at once. One still there is either held stopped (a debugger, a
        frozen cgroup: SIGKILL) or inside a hang dump, which it finishes before it exits (its
        py-spy runs are bounded, docs/hang.md): it is left to do so, after the trainer, which
        does not wait for it."""
        try:
            sc.wait(SIDECAR_STOP_S)
            return
        except subprocess.TimeoutExpired:
            pass
        try:
            if _stopped(sc.pid):
                os.kill(sc.pid, signal.SIGCONT)
            sc.terminate()
            sc.wait(SIDECAR_TERM_S)
            return
        except subprocess.TimeoutExpired:
            pass
        except OSError:  # it is gone
            return
        if _stopped(sc.pid) or sc.poll() is not None:
            try:
                sc.kill()
            except OSError:
                pass
            return
        self.sidecar_left = "finishing a hang dump after the trainer's shutdown"
        logger.info("stepwatch: the hang watchdog sidecar (pid %d) is finishing a stack dump; it exits when done, "
                    "on its own", sc.pid)

    def collect(self, records: list[Any]) -> tuple[list[Any], list[Any]]:
        """Each background pass: the sidecar's ``hang`` findings and the findings of finished
        capture analyses join this rank's finding stream (exporters, ``findings.rank<R>.jsonl``)
        when the trainer's pipeline still runs."""
        extra: list[Any] = []
        if self.captures is not None:
            # The job's last pass (shutdown runs it once the pipeline's thread stopped): wait,
            # bounded, for analyses still running.
            extra = self.captures.collect_analyses(self.hub.final_pass)
        samples, found = self._collect_watchdog()
        return samples, found + extra

    def _collect_watchdog(self) -> tuple[list[Any], list[Any]]:
        if not self._pg_timeout_told and self.board is not None and self.sidecar is not None:
            t = pg_timeout_s()
            if t is not None:
                self._pg_timeout_told = True
                self.board.set_pg_timeout(t)
        now = time.monotonic()
        if now - self._watch_t < 1.0 and not self.hub.final_pass:  # the last pass reads it whatever the time
            return [], []
        self._watch_t = now
        self._check_sidecar()
        path = os.path.join(self.hub.ctx.run_dir, f"findings.watchdog.rank{self.hub.ctx.rank}.jsonl")
        try:
            if self._watch_off is None:
                self._watch_off = os.path.getsize(path) if os.path.exists(path) else 0
            if os.path.getsize(path) <= self._watch_off:
                return [], []
            # Split on "\n" only, as the sidecar writes lines; a half-written character at the
            # end is replaced (its line has no "\n" yet and is read again next pass).
            parts = read_private(path, offset=self._watch_off, errors="replace").split("\n")
            lines = [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
        except OSError:
            return [], []
        from ..record import Finding

        out = []
        for line in lines:
            if not line.endswith("\n"):
                break  # half written: read it next pass
            self._watch_off += len(line.encode("utf-8"))
            try:
                out.append(Finding(**json.loads(line)))
            except (ValueError, TypeError):
                continue
        return [], out

    def on_findings(self, findings: list[Any]) -> None:
        """Each background pass, with every finding of the pass (the pipeline calls it)."""
        if self.captures is not None:
            self.captures.on_pass(findings)

    def status(self) -> dict[str, Any]:
        run_dir = self.hub.ctx.run_dir
        methods: dict[str, Any] = {}
        try:
            names = sorted(n for n in os.listdir(run_dir) if n.startswith("watchdog.rank") and n.endswith(".json"))
        except OSError:
            names = []
        for n in names:
            try:
                info = read_json_private(os.path.join(run_dir, n))
                methods[str(info["rank"])] = info["stack_method"]
            except (OSError, ValueError, KeyError):
                continue
        out: dict[str, Any] = {
            "hang_watchdog": {
                "enabled": self.sidecar is not None and self.sidecar_dead is None,
                **({"off": self.watchdog_off} if self.watchdog_off else {}),
                **({"left_running": self.sidecar_left} if self.sidecar_left else {}),
                "restarts": self.sidecar_restarts,
                **({"died": self.sidecar_dead} if self.sidecar_dead else {}),
                "timeout_s": self.timeout if self.timeout else "adaptive",
                "action": self.action,
                "stack_dump": methods,
                "ptrace": self.ptrace_grant,
                "sigusr1": (self.signal.manifest() if self.signal is not None
                            else {"off": self.signal_off} if self.signal_off else None),
                "dump_signal": self.dump_signal.manifest() if self.dump_signal is not None else None,
                "flight_recorder": self.flight_recorder,
            }
        }
        if self.captures is not None:
            out["captures"] = self.captures.manifest()
        return out


def _stopped(pid: int) -> bool:
    """``pid`` is stopped (SIGSTOP, a job-control stop, a tracer)."""
    from .._os import procs

    st = procs.read_stat(pid)
    return st is not None and st.state in procs.STOPPED_STATES


def pg_timeout_s() -> float | None:
    """The default process group's timeout in seconds, once one exists (None before, or when this
    torch does not say): ``init_process_group(timeout=...)`` as the backend holds it."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        import torch

        pg = dist.distributed_c10d._get_default_group()
        for dev in ("cuda", "cpu"):
            try:
                t = pg._get_backend(torch.device(dev)).options._timeout
            except (RuntimeError, AttributeError, ValueError):
                continue
            return t.total_seconds()
    except (RuntimeError, AttributeError, ValueError):
        return None
    return None


def enable_flight_recorder(run_dir: str, undo: dict[str, tuple[str | None, str]] | None = None) -> str:
    """Keep PyTorch's Flight Recorder on with a bounded buffer, dumping into the run directory,
    unless the job chose the size or the file. Takes effect for process groups created after this
    (``import stepwatch.auto`` comes first). Each variable set goes into ``undo`` (name -> the
    value before, None when unset; the value set), for ``restore_env`` at shutdown."""
    import torch

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    new = (major, minor) >= (2, 7)
    said = []
    for names, value in ((FR_ENV, FR_ENTRIES), (FR_FILE_ENV, os.path.join(run_dir, FR_FILE))):
        mine = next((v for v in names if os.environ.get(v)), None)
        if mine is not None:
            said.append(f"{mine}={os.environ[mine]} (set by the job)")
            continue
        var = names[0] if new else names[1]
        if undo is not None and var not in undo:
            undo[var] = (os.environ.get(var), value)  # "" (set, empty) counts as unset above
        os.environ[var] = value
        said.append(f"{var}={value} (set by stepwatch)")
    return "; ".join(said)


def restore_env(undo: dict[str, tuple[str | None, str]]) -> None:
    """Put back what ``enable_flight_recorder`` changed (and empty ``undo``): each variable to
    its value before, unset if it was, but only while it still holds the value stepwatch set."""
    while undo:
        var, (before, value) = undo.popitem()
        if os.environ.get(var) != value:
            continue
        if before is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = before


def install(hub: "Hub") -> Feature | None:
    """Wire the watchdog, SIGUSR1 dumps and captures in through ``hub`` (training thread, at init)."""
    if os.environ.get(SIDECAR_ENV) == "1":
        return None
    cfg, ctx = hub.config, hub.ctx
    from .triggers import StepTimeSpikeDetector

    # The spike is a finding with captures or without (a one-process job has none by default);
    # added before the captures, which take the findings of the same pass as triggers.
    spikes = StepTimeSpikeDetector(cfg.window, mads=cfg.spike_mads)
    hub.add_detector(spikes)
    watchdog = _wanted(cfg.watchdog, ctx)
    capture = _wanted(cfg.capture, ctx)
    if not (watchdog or capture):
        return None
    from .._files import make_private_dir

    if hub.files_ok:  # else said at init: the watchdog still watches (its board is in /dev/shm) and logs
        make_private_dir(ctx.run_dir)
    feat = Feature(hub)
    try:
        if watchdog:
            feat.flight_recorder = enable_flight_recorder(ctx.run_dir, feat.env_set)
            feat.start_board()
            try:
                feat.start_signal()
            except OSError as e:  # its file: the run directory's fault, not stepwatch's (no internal error)
                from .._files import say_unwritable

                say_unwritable(ctx.run_dir, "the SIGUSR1 stack-dump file (kill -USR1 dumps nothing)", e)
            except Exception as e:
                hub.report_error("capture.sigusr1", e)
            try:
                feat.start_sidecar()
            except Exception as e:
                hub.report_error("capture.watchdog", e)
        if capture and hub.files_ok:  # a capture's trace and stack dump go in the run directory
            feat.start_captures()
            if feat.captures is not None:
                spikes.excluded = feat.captures.profiled  # the steps our profiler slowed are no spike
        hub.add_listener(feat.on_step_end)
    except BaseException:  # no feature for the session to stop: the variables it set go now
        feat.restore_env()
        raise
    return feat  # the session keeps it: stop() at shutdown, status() in run.json
