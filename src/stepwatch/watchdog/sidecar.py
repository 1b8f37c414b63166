"""The hang watchdog: a sidecar process per rank, outside the trainer's GIL.

A Python thread inside the trainer cannot run while the main thread holds the GIL in C code, so
the watchdog is a separate process (``python -m stepwatch.watchdog.sidecar``, started with
exec, never forked from the trainer). It maps the rank's progress board read-only, and:

* measures step times and derives the timeout (``STEPWATCH_HANG_TIMEOUT`` overrides);
* declares a hang when the board shows no progress (a step end, a phase change, a collective)
  for longer than the timeout -- only after the first step ended, so start-up is not a hang;
* then dumps its rank's stacks (py-spy, two samples; faulthandler through SIGUSR1 when py-spy
  cannot attach) into ``<run_dir>/hang-<n>/stacks.rank<R>.txt`` and publishes its snapshot as
  ``hang-<n>/progress.rank<R>.json``; rank 0's sidecar gathers every rank's snapshot, writes
  ``hang-<n>/report.json``, logs one paragraph and a ``hang`` finding in
  ``findings.watchdog.rank0.jsonl``;
* answers stack-dump requests the trainer posts on the board (capture actions);
* exits when the trainer exits or closes the board.

Ranks on other hosts (run dir not shared) also publish their snapshot to torch.distributed's
store under ``stepwatch/<run_id>/hang/<attempt>/<n>/<rank>`` when the store's address is known.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from collections import deque
from typing import Any

from .._files import open_private, private_subdir, read_json_private, read_private, write_json_private
from . import verdict as hang_mod
from .._os import pyspy
from .._os.ptrace import can_read_memory
from ..hooks import progress

# Default timeout: K x the p99 step time, at least FLOOR_S, at most CAP_S. The cap keeps the
# dump well inside the process-group timeout that destroys the evidence: NCCL's default is
# 10 min and gloo's 30 min (torch.distributed: default_pg_nccl_timeout / default_pg_timeout).
K = 10.0
FLOOR_S = 30.0
CAP_S = 300.0
# Checkpoint saves are one long phase without other progress: the default timeout stretches.
CHECKPOINT_FACTOR = 5.0
PG_TIMEOUT_SHARE = 0.5  # act within half the process group's timeout (torchtitan trains with 100 s)
POLL_S = 0.25
# While stalled past the base timeout, how often a sidecar asks whether other ranks checkpoint
# (a run-dir listing and a store request): every poll would be 4 requests/s per rank on the
# job's store and shared file system, at thousands of ranks, during every long save.
CHECKPOINT_RECHECK_S = 5.0
# Rank 0 waits this long for the other ranks' snapshots before it writes the report anyway.
GATHER_S = 20.0
# How long past GATHER_S a non-zero rank waits for rank 0's report under STEPWATCH_HANG_ACTION=exit.
REPORT_EXTRA_S = 10.0
# Rank 0's sidecar touches its watchdog.rank0.json at most this often while its trainer makes
# progress: a non-zero rank that stalled sees rank 0 working alone (a rank-0-only evaluation).
ALIVE_EVERY_S = 5.0
# Episodes are counted per rank: one that stalled alone before (waiting for a slow peer) counts
# more than rank 0. Rank 0 looks for their snapshots in the store up to this many episodes past
# its own (the run dir is listed whole, but across hosts only the store is shared).
EPISODES_AHEAD = 3


def default_timeout(step_s: list[float]) -> float:
    if not step_s:
        return FLOOR_S
    xs = sorted(step_s)
    p99 = xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]
    return min(max(K * p99, FLOOR_S), CAP_S)


def log(msg: str) -> None:
    try:
        sys.stderr.write(f"[stepwatch] {msg}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _process_start(pid: int) -> float | None:
    """When process ``pid`` started (unix seconds), from /proc; None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for us; /proc says so.
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _write_json(path: str, obj: Any) -> None:
    write_json_private(path, obj)


class Store:
    """torch.distributed's TCPStore as a client, opened on first use (importing torch costs
    seconds, paid only on a hang). None of its failures stop the run-dir path."""

    def __init__(self, addr: str | None, port: int | None, prefix: str) -> None:
        self.addr, self.port, self.prefix = addr, port, prefix
        self._store: Any = None
        self._failed = addr is None or port is None

    def _get(self) -> Any:
        if self._store is None and not self._failed:
            try:
                from datetime import timedelta

                import torch.distributed as dist

                self._store = dist.TCPStore(self.addr, self.port, is_master=False, timeout=timedelta(seconds=10))
            except Exception as e:  # no torch, store gone: the run dir still works
                log(f"watchdog: store {self.addr}:{self.port} unavailable ({type(e).__name__}: {e}); using the run dir only")
                self._failed = True
        return self._store

    def set(self, key: str, value: str) -> None:
        s = self._get()
        if s is not None:
            try:
                s.set(f"{self.prefix}/{key}", value)
            except Exception as e:
                log(f"watchdog: store set failed ({e}); using the run dir only")
                self._failed, self._store = True, None

    def add(self, key: str, n: int) -> int | None:
        """The counter at ``key`` after adding ``n`` (0 reads it); None without a store."""
        s = self._get()
        if s is None:
            return None
        try:
            return int(s.add(f"{self.prefix}/{key}", n))
        except Exception as e:
            log(f"watchdog: store add failed ({e}); using the run dir only")
            self._failed, self._store = True, None
            return None

    def try_get(self, key: str) -> str | None:
        s = self._get()
        if s is None:
            return None
        try:
            full = f"{self.prefix}/{key}"
            if s.check([full]):
                return s.get(full).decode()
        except Exception:
            return None
        return None


class Watchdog:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.rank = a.rank
        self.pid = a.trainer_pid
        self.run_dir = a.run_dir
        self.host = socket.gethostname()
        self.steps: deque[float] = deque(maxlen=500)
        self.episode = 0
        self.in_hang = False
        self.last_done = 0
        self.last_progress = 0
        self.dump_seen = 0
        self.stack_method = "unknown"
        self.store = Store(a.store_addr, a.store_port, f"stepwatch/{a.run_id}")
        self.board: progress.Reader | None = None
        self._open_episode: tuple[int, str, dict[str, Any]] | None = None  # (n, snapshot path, snapshot)
        self.checkpointing = False  # this rank's trainer, as last published
        self._alive_at = 0  # monotonic ns rank 0's sidecar last showed its trainer's progress
        # (stall start, this hang's report path): a non-zero rank left running under action=exit
        # while rank 0 worked alone, ended once rank 0 reports a hang after that start.
        self._awaiting: tuple[float, str] | None = None
        self._others_ckpt: tuple[float, bool] | None = None  # (monotonic s when asked, answer)
        self._launch = self._launch_tag()

    # -- set-up -----------------------------------------------------------------------------------

    def check_permissions(self) -> None:
        """Pick the stack path that works here and say so in ``watchdog.rank<R>.json``."""
        info: dict[str, Any] = {"rank": self.rank, "trainer_pid": self.pid, "sidecar_pid": os.getpid(),
                                "host": self.host, "pyspy": self.a.pyspy}
        if self.a.pyspy:
            ok, why = can_read_memory(self.pid)
            info["ptrace"] = why
            self.stack_method = "py-spy" if ok else "faulthandler"
        else:
            info["ptrace"] = "py-spy not found (pip install py-spy)"
            self.stack_method = "faulthandler"
        info["stack_method"] = self.stack_method
        info["timeout_s"] = self.a.timeout if self.a.timeout else "adaptive"
        info["action"] = self.a.action
        try:
            _write_json(os.path.join(self.run_dir, f"watchdog.rank{self.rank}.json"), info)
        except OSError as e:
            if not self.a.run_dir_said:
                log(f"watchdog: cannot write to {self.run_dir}: {e}")
        # py-spy missing is said by the trainer when it starts this sidecar (capture.start_sidecar).
        if self.a.pyspy and self.stack_method != "py-spy":
            log(f"watchdog rank {self.rank}: py-spy cannot read the trainer ({info['ptrace']}); "
                "hang stacks come from faulthandler (Python frames only). "
                "Fix: CAP_SYS_PTRACE or kernel.yama.ptrace_scope=0 (see docs/hang.md).")

    # -- main loop --------------------------------------------------------------------------------

    def timeout(self, snap: dict[str, Any]) -> float:
        if self.a.timeout:
            return self.a.timeout
        t = default_timeout(list(self.steps))
        return t * CHECKPOINT_FACTOR if snap["phase"] == "checkpoint" else t

    @staticmethod
    def within_pg_timeout(limit: float, snap: dict[str, Any]) -> float:
        """At most half the process group's timeout: past it, the backend's own watchdog ends the
        job (NCCL aborts the process) and the evidence with it. An explicit timeout included."""
        pg = snap.get("pg_timeout_s")
        return min(limit, PG_TIMEOUT_SHARE * pg) if pg else limit

    # While one rank saves (`if rank == 0: torch.save(...)`), the others wait in their next
    # collective: they get the checkpoint allowance too. Each sidecar says when its trainer is in
    # a checkpoint: a marker file in the run dir (same host or a shared run dir) and a counter in
    # the store (other hosts).
    def publish_checkpoint(self, snap: dict[str, Any]) -> None:
        now = snap["phase"] == "checkpoint"
        if now == self.checkpointing:
            return
        self.checkpointing = now
        marker = os.path.join(self.run_dir, f"checkpointing.rank{self.rank}")
        try:
            if now:
                write_json_private(marker, {"pid": self.pid, "attempt": self.a.attempt})
            else:
                os.unlink(marker)
        except OSError:
            pass
        if self.a.world_size > 1:
            self.store.add(f"checkpointing/{self.a.attempt}", 1 if now else -1)

    def others_checkpointing(self) -> bool:
        try:
            names = os.listdir(self.run_dir)
        except OSError:
            names = []
        for n in names:
            if not n.startswith("checkpointing.rank") or n == f"checkpointing.rank{self.rank}":
                continue
            try:
                mark = read_json_private(os.path.join(self.run_dir, n))
                # Not a crashed attempt's, nor a dead trainer's (a relaunch into the same run dir
                # is attempt 0 again): a marker whose trainer is gone says no save is running.
                pid = mark.get("pid")
                if mark.get("attempt") == self.a.attempt and isinstance(pid, int) and pid > 0 and _alive(pid):
                    return True
            except (OSError, ValueError, AttributeError, TypeError):
                continue
        n = self.store.add(f"checkpointing/{self.a.attempt}", 0) if self.a.world_size > 1 else None
        return bool(n and n > 0)

    def others_checkpointing_now(self, now_s: float) -> bool:
        """:meth:`others_checkpointing`, asked at most every CHECKPOINT_RECHECK_S seconds."""
        if self._others_ckpt is None or now_s - self._others_ckpt[0] >= CHECKPOINT_RECHECK_S:
            self._others_ckpt = (now_s, self.others_checkpointing())
        return self._others_ckpt[1]

    def run(self) -> int:
        deadline = time.monotonic() + 30
        while self.board is None:
            try:
                self.board = progress.Reader(self.a.board)
            except OSError:
                if time.monotonic() > deadline or not _alive(self.pid):
                    return 1
                time.sleep(0.1)
        self.check_permissions()
        try:
            return self._watch()
        finally:
            # SIGTERM (shutdown's, when this sidecar had not polled yet; a scheduler's preemption
            # of the process group) ends the loop with SystemExit from the handler: a marker left
            # in the run dir gave the next launch's sidecars the checkpoint allowance (5x the
            # hang timeout) for the whole run. The file only: the store may be gone by now.
            if self.checkpointing:
                self.checkpointing = False
                try:
                    os.unlink(os.path.join(self.run_dir, f"checkpointing.rank{self.rank}"))
                except OSError:
                    pass

    def _watch(self) -> int:
        global _busy
        while _alive(self.pid):
            snap = self.board.read()
            if snap is None or snap["closed"]:
                break
            now = time.monotonic_ns()
            if snap["steps_done"] != self.last_done:
                if snap["last_step_ns"] > 0 and self.last_done > 0:
                    self.steps.append(snap["last_step_ns"] / 1e9)
                self.last_done = snap["steps_done"]
            # A time this poll saw for the first time is progress, not a hang: one read can catch
            # an update half done (hooks/progress.py), so only a time seen unchanged on two polls
            # in a row is judged.
            fresh = snap["last_progress_ns"] != self.last_progress
            if fresh:
                self.last_progress = snap["last_progress_ns"]
                if self.in_hang:
                    self.end_episode(snap)
                self.in_hang = False
                self._awaiting = None
                if self.rank == 0 and now - self._alive_at >= ALIVE_EVERY_S * 1e9:
                    self._alive_at = now
                    self.show_alive()
            elif self._awaiting is not None and self.reported_since(*self._awaiting):
                self._awaiting = None  # rank 0 reports a hang that holds this rank's stall
                if not _term:
                    self.end_trainer()
            if snap["dump_req"] != self.dump_seen:
                self.dump_seen = snap["dump_req"]
                self.on_request(snap["dump_req"])
            stalled = (now - snap["last_progress_ns"]) / 1e9
            self.publish_checkpoint(snap)
            # The clock starts after the first step (steps_done counts step ends).
            if snap["steps_done"] >= 1 and not self.in_hang and not fresh:
                limit = self.timeout(snap)
                if (stalled > limit and not self.a.timeout and snap["phase"] != "checkpoint"
                        and self.others_checkpointing_now(now / 1e9)):
                    limit *= CHECKPOINT_FACTOR
                limit = self.within_pg_timeout(limit, snap)
                if stalled > limit:
                    self.in_hang = True
                    self.episode += 1
                    _busy = True
                    try:
                        self.on_hang(self.episode, snap, stalled, limit)
                    finally:
                        _busy = False
                    if _term:
                        break
            time.sleep(POLL_S)
        if self.checkpointing:  # the trainer ended inside a checkpoint: take our marker back
            self.publish_checkpoint({"phase": "other"})
        return 0

    # -- stacks -----------------------------------------------------------------------------------

    def stacks(self) -> dict[str, Any]:
        if self.stack_method != "py-spy" and self.a.pyspy and can_read_memory(self.pid)[0]:
            # The trainer grants ptrace (PR_SET_PTRACER) just after starting us: the check at
            # start-up can come first. Asked again now, at the hang.
            self.stack_method = "py-spy"
        if self.stack_method == "py-spy":
            res = pyspy.two_samples(self.a.pyspy, self.pid, native_budget_s=self.a.native_budget)
            if res["ok"]:
                res["method"] = "py-spy"
                return res
            log(f"watchdog rank {self.rank}: py-spy failed ({res['error']}); falling back to faulthandler")
        return self.faulthandler_stacks()

    def faulthandler_stacks(self) -> dict[str, Any]:
        """The dump signal (SIGUSR1 when the trainer has no private one) makes the trainer's
        faulthandler append its stacks to the signal file."""
        path = self.a.signal_file
        if not path:
            return {"ok": False, "text": "no stack path available\n", "top_frames": [], "stuck": None, "method": "none"}
        samples = []
        for i in range(2):
            try:
                start = os.path.getsize(path)
            except OSError:
                start = 0
            try:
                os.kill(self.pid, self.a.dump_signal or signal.SIGUSR1)
            except OSError as e:
                return {"ok": False, "text": f"cannot signal {self.pid}: {e}\n", "top_frames": [], "stuck": None,
                        "method": "faulthandler"}
            time.sleep(1.0)
            try:
                samples.append(read_private(path, offset=start, errors="replace"))
            except OSError:
                samples.append("")
            if i == 0:
                time.sleep(1.0)
        f1 = pyspy.main_frames(samples[0])
        f2 = pyspy.main_frames(samples[1])
        text = "".join(f"== sample {i + 1} (faulthandler, SIGUSR1) ==\n{s}\n" for i, s in enumerate(samples))
        return {"ok": bool(f1 or f2), "text": text, "top_frames": (f2 or f1)[:8], "stuck": bool(f1) and f1 == f2,
                "method": "faulthandler"}

    def on_request(self, k: int) -> None:
        """A capture asked for a py-spy dump (request number ``k``)."""
        d = os.path.join(self.run_dir, "captures")
        try:
            private_subdir(d)
            if self.stack_method == "py-spy":
                ok, text = pyspy.dump(self.a.pyspy, self.pid)
            else:
                ok, text = False, "py-spy cannot attach here (see watchdog.rank<R>.json)"
            pyspy.write_private(os.path.join(d, f"pyspy-{k}.rank{self.rank}.txt"), text if ok else f"py-spy failed: {text}\n")
        except OSError as e:
            log(f"watchdog rank {self.rank}: cannot write the capture dump: {e}")

    # -- a hang -----------------------------------------------------------------------------------

    def hang_dir(self, n: int) -> str:
        """``hang-<n>``; after an elastic restart ``hang-<n>.attempt<A>``, and in a later launch
        into the same run dir ``...launch<L>`` (:meth:`_launch_tag`), beside the earlier ones."""
        return self._hang_dir(n, self._launch)

    def _hang_dir(self, n: int, tag: str) -> str:
        name = f"hang-{n}" if not self.a.attempt else f"hang-{n}.attempt{self.a.attempt}"
        return os.path.join(self.run_dir, name + tag)

    def _launch_tag(self) -> str:
        """This launch's suffix of its hang directories: "" for the first launch into the run
        dir, ``.launch<L>`` for the L-th after it, taken at start-up, before this launch can
        have a hang: the first whose episode 1 directory does not exist yet, or was made by this
        launch (written since its trainer started: a rank whose sidecar started late). Every
        rank of a launch takes the same one. A relaunch (a requeued job, the same run id) wrote
        its hangs into the last launch's ``hang-<n>/`` over its dumps, and took that report for
        its own."""
        started = _process_start(self.pid)
        for k in range(10_000):
            tag = f".launch{k}" if k else ""
            try:
                st = os.stat(self._hang_dir(1, tag))
            except OSError:
                return tag
            if started is not None and st.st_mtime >= started:
                return tag
        return f".launch{os.getpid()}"

    def on_hang(self, n: int, snap: dict[str, Any], stalled: float, limit: float) -> None:
        d = private_subdir(self.hang_dir(n))
        mine = dict(snap)
        mine.update({"host": self.host, "stalled_s": round(stalled, 3), "timeout_s": limit, "complete": False,
                     "detected_at": time.time()})
        snap_path = os.path.join(d, f"progress.rank{self.rank}.json")
        _write_json(snap_path, mine)
        st = self.stacks()
        stack_path = os.path.join(d, f"stacks.rank{self.rank}.txt")
        pyspy.write_private(stack_path, st["text"])
        mine.update({"top_frames": st.get("top_frames") or [], "stuck": st.get("stuck"), "stacks": stack_path,
                     "stack_method": st.get("method"), "complete": True})
        _write_json(snap_path, mine)
        self.store.set(f"hang/{self.a.attempt}/{n}/{self.rank}", json.dumps(mine, default=str))
        self._open_episode = (n, snap_path, mine)
        if self.rank == 0:
            self.report(n, mine, limit)
        elif self.a.action == "exit" and not self.wait_for_report(os.path.join(d, "report.json"), snap, mine):
            return  # not a hang after all, or not yet rank 0's: back to watching
        # Not when the trainer told us to stop meanwhile (it shut down, or is being stopped): it
        # may be gone already, and its pid another process's.
        if self.a.action == "exit" and not _term:
            self.end_trainer()

    def wait_for_report(self, report: str, snap: dict[str, Any], mine: dict[str, Any]) -> bool:
        """Ending this rank makes torchrun stop the others: rank 0 must have its report first. The
        board is watched meanwhile: when progress resumes, this rank only stalled (waiting for a
        slow peer), and False says to leave the trainer running and watch on; a later hang is
        this rank's next episode, with a snapshot of its own for rank 0 to find.

        No report by the deadline while rank 0 shows progress since this rank stalled: rank 0
        works alone (``if rank == 0: evaluate()`` before a barrier), this rank only waits for it.
        False then too, and the trainer is ended only once rank 0 reports a hang (``_awaiting``,
        checked at each poll). Where rank 0's progress cannot be seen (another host, no shared
        run dir), the trainer is ended at the deadline, as always."""
        since = mine["detected_at"] - mine["stalled_s"]  # wall time this rank's stall began
        end = time.monotonic() + GATHER_S + REPORT_EXTRA_S
        while not self.reported_since(since, report) and time.monotonic() < end and _alive(self.pid):
            cur = self.board.read() if self.board is not None else None
            if cur is not None and cur["last_progress_ns"] != snap["last_progress_ns"]:
                return False
            time.sleep(POLL_S)
        if self.reported_since(since, report) or not _alive(self.pid):
            return True
        shown = self.rank0_shown()
        if shown is None or shown <= since:
            return True
        self._awaiting = (since, report)
        log(f"watchdog rank {self.rank}: stalled {mine['stalled_s']:.0f} s, but rank 0 reports no hang and made progress "
            f"{max(time.time() - shown, 0.0):.0f} s ago (rank 0 works alone: an evaluation or a save on rank 0 "
            "only?): this rank is left running, and ended (STEPWATCH_HANG_ACTION=exit) once rank 0 reports a hang")
        return False

    def _alive_path(self) -> str:
        return os.path.join(self.run_dir, "watchdog.rank0.json")

    def show_alive(self) -> None:
        """Rank 0: its trainer made progress just now (``watchdog.rank0.json``'s time). Never fatal."""
        try:
            os.utime(self._alive_path())
        except OSError:
            pass

    def rank0_shown(self) -> float | None:
        """When rank 0's sidecar last showed its trainer's progress (wall time), or None unseen."""
        try:
            return os.stat(self._alive_path()).st_mtime
        except OSError:
            return None

    def reported_since(self, since: float, report: str) -> bool:
        """Rank 0 has reported a hang written after ``since`` (wall time): this episode's
        ``report.json``, or any of this attempt's (ranks number their episodes apart), or the
        store's ``hang/<attempt>/report`` (another host's rank 0)."""
        if os.path.exists(report):
            return True
        times = []
        raw = self.store.try_get(f"hang/{self.a.attempt}/report") if self.a.world_size > 1 else None
        if raw:
            try:
                times.append(float(json.loads(raw)["time"]))
            except (ValueError, TypeError, KeyError):
                pass
        suffix = f".attempt{self.a.attempt}" if self.a.attempt else ""
        try:
            names = [n for n in os.listdir(self.run_dir)
                     if n.startswith("hang-") and n.endswith(suffix) and (suffix or ".attempt" not in n)]
        except OSError:
            names = []
        for n in names:
            try:
                rep = read_json_private(os.path.join(self.run_dir, n, "report.json"))
                times.append(float(rep["time"]))
            except (OSError, ValueError, TypeError, KeyError):
                continue
        return any(t >= since for t in times)

    def end_episode(self, snap: dict[str, Any]) -> None:
        """Progress resumed: the open episode's snapshot (file and store key) gets ``ended_at``, so
        rank 0 does not take it for a later hang (see :meth:`gather`). The time is the newest
        progress on the board, not now: this sidecar may notice late (it was dumping), and a
        later time could pass for a stall still open when rank 0 detected its hang. Never fatal."""
        ep, self._open_episode = self._open_episode, None
        if ep is None:
            return
        n, path, mine = ep
        try:
            ago_s = max(time.monotonic_ns() - snap["last_progress_ns"], 0) / 1e9
            mine["ended_at"] = time.time() - ago_s
            _write_json(path, mine)
            self.store.set(f"hang/{self.a.attempt}/{n}/{self.rank}", json.dumps(mine, default=str))
        except Exception as e:
            log(f"watchdog rank {self.rank}: cannot mark hang {n} over ({type(e).__name__}: {e})")

    def gather(self, n: int, mine: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """Every rank's snapshot of this hang (rank 0's episode ``n``). Each rank numbers its own
        episodes, so another rank's snapshot of this hang may lie under any number: a rank that
        stalled alone before (waiting for a slow peer) has an ended episode more. Of a rank's
        snapshots, those of :meth:`_same_episode` count and the one detected nearest to mine wins."""
        snaps = {self.rank: mine}
        deadline = time.monotonic() + GATHER_S
        while True:
            episodes = self._episodes(n)
            for r in range(self.a.world_size):
                if r in snaps and snaps[r].get("complete"):
                    continue
                found = [got for got in (self._snapshot(k, r) for k in episodes)
                         if got is not None and self._same_episode(got, mine)]
                if found:
                    snaps[r] = min(found, key=lambda got: abs(got["detected_at"] - mine["detected_at"]))
            if all(r in snaps and snaps[r].get("complete") for r in range(self.a.world_size)):
                return snaps
            if time.monotonic() > deadline:
                return snaps
            time.sleep(POLL_S)

    def _episodes(self, n: int) -> list[int]:
        """The episode numbers to look under: 1 to n + EPISODES_AHEAD (the store), and every
        ``hang_dir`` of this attempt in the run dir."""
        ks = set(range(1, n + EPISODES_AHEAD + 1))
        try:
            names = os.listdir(self.run_dir)
        except OSError:
            names = []
        for name in names:
            k = name[len("hang-"):].split(".", 1)[0] if name.startswith("hang-") else ""
            if k.isdigit() and os.path.basename(self.hang_dir(int(k))) == name:
                ks.add(int(k))
        return sorted(ks)

    def _snapshot(self, k: int, r: int) -> dict[str, Any] | None:
        """Rank ``r``'s snapshot of its episode ``k``: the run dir's, else the store's (other hosts)."""
        got: Any = None
        try:
            got = read_json_private(os.path.join(self.hang_dir(k), f"progress.rank{r}.json"))
        except (OSError, ValueError):
            raw = self.store.try_get(f"hang/{self.a.attempt}/{k}/{r}") if self.a.world_size > 1 else None
            if raw:
                try:
                    got = json.loads(raw)
                except ValueError:
                    got = None
        return got if isinstance(got, dict) else None

    @staticmethod
    def _same_episode(got: dict[str, Any], mine: dict[str, Any]) -> bool:
        """A rank's snapshot of this hang, not of an earlier one: a reused run directory (same run
        id) can hold an old job's ``hang-<n>``, and a rank's own earlier stall may have ended
        (``ended_at``, progress resumed) before this hang was detected. Ranks detect one hang
        within about a timeout of each other (wall clocks of hosts agree to well under that)."""
        t = got.get("detected_at")
        if not isinstance(t, (int, float)):
            return False
        ended = got.get("ended_at")
        if isinstance(ended, (int, float)) and ended < mine["detected_at"]:
            return False
        return abs(t - mine["detected_at"]) <= max(float(mine.get("timeout_s") or 0), 60.0) + GATHER_S

    def report(self, n: int, mine: dict[str, Any], limit: float) -> None:
        snaps = self.gather(n, mine)
        rep = hang_mod.build_report(n, snaps, self.a.world_size, timeout_s=limit, detected_after_s=mine["stalled_s"],
                                    action=self.a.action, run_dir=self.run_dir, hang_dir=self.hang_dir(n))
        _write_json(os.path.join(self.hang_dir(n), "report.json"), rep)
        if self.a.world_size > 1:  # the ranks of other hosts wait for it (wait_for_report)
            self.store.set(f"hang/{self.a.attempt}/report", json.dumps({"hang": n, "time": rep["time"]}))
        log(rep["summary"])
        self.finding(rep)

    def finding(self, rep: dict[str, Any]) -> None:
        from ..analysis.kinds import make_finding

        lag = rep["laggards"]
        step = min((r["step"] for r in rep["ranks"]), default=None)
        f = make_finding(
            "hang",
            rank=self.rank,
            step=step,
            summary=rep["summary"],
            data={"hang": rep["hang"], "laggards": lag, "verdict": rep["verdict"], "collective": rep["collective"],
                  "detected_after_s": rep["detected_after_s"], "report": os.path.join(self.hang_dir(rep["hang"]), "report.json")},
        )
        path = os.path.join(self.run_dir, f"findings.watchdog.rank{self.rank}.jsonl")
        try:
            with open_private(path, exclusive=False) as out:
                out.write(json.dumps(f.to_dict(), default=str) + "\n")
        except OSError as e:
            log(f"watchdog: cannot write {path}: {e}")

    def end_trainer(self) -> None:
        """STEPWATCH_HANG_ACTION=exit: end the rank so torchrun sees a failure and can restart."""
        log(f"watchdog rank {self.rank}: ending the trainer (pid {self.pid}) after the hang dump "
            "(STEPWATCH_HANG_ACTION=exit)")
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                return
            end = time.monotonic() + wait
            while time.monotonic() < end:
                if not _alive(self.pid):
                    return
                time.sleep(0.1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m stepwatch.watchdog.sidecar", description="stepwatch's hang watchdog sidecar")
    p.add_argument("--trainer-pid", type=int, required=True)
    p.add_argument("--board", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--attempt", type=int, default=0)
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--action", choices=("dump", "exit"), default="dump")
    p.add_argument("--pyspy", default=None)
    p.add_argument("--native-budget", type=float, default=8.0)
    p.add_argument("--signal-file", default=None)
    p.add_argument("--dump-signal", type=int, default=None,
                   help="the trainer's private stack-dump signal (else SIGUSR1, which may also run the job's handler)")
    p.add_argument("--store-addr", default=None)
    p.add_argument("--store-port", type=int, default=None)
    p.add_argument("--run-dir-said", action="store_true",
                   help="the trainer said the run directory cannot be written: its failed writes are not said again")
    return p.parse_args(argv)


_busy = False  # inside a hang dump: finish it first (torchrun may stop the whole process group)
_term = False


def _on_term(*_: Any) -> None:
    global _term
    _term = True
    if not _busy:
        sys.exit(0)


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C reaches the whole process group: the trainer decides; the sidecar follows it out.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SLURM's --signal=USR1@T and `scancel -s` signal every process of the step: the default
    # action would end the watchdog for the rest of the job, unnoticed.
    for name in ("SIGUSR1", "SIGUSR2", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_term)
    a = parse_args(argv)
    try:
        return Watchdog(a).run()
    except SystemExit:
        raise
    except BaseException as e:  # the sidecar must never take the job down; say why it stopped
        log(f"watchdog rank {a.rank} stopped: {type(e).__name__}: {e}")
        return 1
    finally:
        try:
            os.unlink(a.board)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
