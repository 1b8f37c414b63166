"""Which rank is the straggler: a cross-rank exchange of compact per-window summaries.

The DDP trap: a slow rank makes every other rank wait inside AllReduce, so all ranks show the
same step time, and the fast ranks show the *most* communication time. Naming the rank with the
most comm time names a victim. stepwatch compares *compute* instead: step time minus data wait
minus exposed communication (the time this rank sat in collectives after its own compute ended:
DDP's exposed AllReduce, and its time blocked in any other collective or wait, comm/blocked.py).

Exchange (background thread only; never a collective, never a blocking wait):

- every ``every`` steps (a *window*, numbered by step // every so all ranks agree on it), each rank
  appends one line (~60 bytes: rank, medians of compute / step / data wait / allreduce, host) to
  the store key ``<ns>/w<W>/d`` and increments ``<ns>/w<W>/n``: 2 store operations;
- the leader (rank 0) polls the counter (one non-blocking ``add(key, 0)`` per pending window, at
  most every ``POLL_S``); when every rank is in, or when it has itself moved ``LATE_WINDOWS`` windows past W, it
  reads the one key, judges, writes a small verdict ``<ns>/v<W>`` and deletes the window's keys;
- every rank reads the verdict with a non-blocking ``check`` then ``get`` (2 operations) to learn
  the transfer floor used for ``comm_wait_s``.

Adaptive windows (``every=0``, the default). A fixed 20-step window and 3 windows in a row
needed 80 steps to name a straggler: 13 minutes at 10 s a step. Instead the leader measures the
step time over a warm-up (20 steps, or as soon as 3 steps span 10 s) and writes a *plan* to the
store once (``<ns>/plan``: first step, window steps ``e``, windows in a row ``K``), chosen so that
``K`` windows cover ``EVIDENCE_S`` (1 s) at the warm-up's pace, at most 20 steps when a step takes
50 ms or more, and at most ``EVIDENCE_MAX_S`` (50 s) when steps are long. Later steps need not keep
the warm-up's pace (a machine under load), so the verdict does not count windows: a rank is named
once it has been slow for at least 1 s of wall time, summed from the windows' own spans, and at
least ``EVIDENCE_MIN_STEPS`` steps. Never sooner than 1 s; about one window past it otherwise; a
persistent straggler is named within 20 steps of the warm-up where 20 steps last 1 s or more, and
within 60 s. Every rank buffers its records (bounded) until it reads the plan, then numbers windows
from the plan's first step, so all ranks still agree on them. A window is still at least ~1/4 s,
so the store traffic stays bounded by time, not by step rate.

Ranks that disagree on the step only delay a window's verdict; nothing waits for them. Keys are
namespaced by run id and attempt, so a restarted job never reads an old attempt's summaries.

The last window (:meth:`StragglerDetector.finish`, at shutdown's final pass). A job's last steps
rarely end a window where an exchange follows: the last window is partial (never published), or
published while the leader's last look at the store came before the other ranks' parts (never
judged), and a rank slow through it went unnamed. No collective runs at shutdown: ranks shut
down at different times (one crashed, one left its loop early), and a collective there can
hang. Instead every rank publishes its last window through the store as it does any window (a
partial one if it holds at least half a window's steps; less is too few steps for a median),
and the leader judges every window still pending, waiting for the others' parts at most until
``FINISH_S`` (0.5 s) less ``FINISH_JUDGE_S``; what has not arrived then is judged without
(a missing rank is not compared). The store operations run on a helper thread that shutdown
joins for at most ``FINISH_S``: a store that does not answer (its host gone, a partitioned
network) costs the job's exit 0.5 s at most, never a hang. The other ranks do not wait at all.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .._os.threads import start
from ..analysis.kinds import make_finding
from ..record import Finding, StepRecord

# The leader judges a window with whatever arrived once it is this many windows further and
# this many seconds passed since it published its own part (ranks' background passes drift).
LATE_WINDOWS = 2
LATE_S = 5.0
# Verdicts stay this many windows: a rank reads one between a check() and a get(), and a get() of
# a key deleted meanwhile would wait for the store's whole timeout. Synchronous ranks are at most a
# step or two apart, so a rank never looks this far back; the keys are ~100 bytes each.
VERDICT_KEEP = 16
# The store is polled (counter reads, verdict checks) at most this often, however many records
# a background pass brings: the cost per rank is bounded by time, not by step rate.
POLL_S = 0.25
# A persistent straggler is repeated at most every this many windows (like the windowed detectors).
REPEAT_WINDOWS = 20
# Compute below this difference is noise, whatever the ratio (host timer granularity and jitter).
MIN_EXCESS_S = 2e-4
# Adaptive windows (every=0): the warm-up, and how much evidence names a straggler.
WARMUP_STEPS = 20
WARMUP_MIN_STEPS = 3
WARMUP_S = 10.0
EVIDENCE_S = 1.0
EVIDENCE_MIN_STEPS = 3
EVIDENCE_MAX_S = 50.0  # + the exchange's latency (a pass or two) stays within 60 s
PRE_PLAN_RECORDS = 512  # records a rank keeps while it waits for the plan
# Shutdown (finish): the most the final pass spends on the exchange (session shutdown has 1.5 s
# in all, the exporters' flush included), of which the last FINISH_JUDGE_S are left to read the
# windows and judge them; and how often the leader looks for the other ranks' last parts meanwhile.
FINISH_S = 0.5
FINISH_JUDGE_S = 0.1
FINISH_POLL_S = 0.02


def plan_windows(step_s: float, windows: int) -> tuple[int, int]:
    """(steps per window, windows in a row) for a job whose steps take ``step_s``."""
    import math

    t = max(step_s, 1e-6)
    n = max(EVIDENCE_MIN_STEPS, math.ceil(EVIDENCE_S / t))  # >= 1 s; <= 20 steps when t >= 50 ms
    # K windows of e steps, e*K >= n with as little overshoot as possible (20 steps of 50 ms:
    # 4 x 5, not 3 x 7), K from `windows` up to `windows` + 2.
    k = min((max(1, min(kk, n)) for kk in range(windows, windows + 3)),
            key=lambda kk: (math.ceil(n / kk) * kk, kk))
    e = max(1, math.ceil(n / k))
    if k * e * t > EVIDENCE_MAX_S:  # long steps: fewer windows in a row, to name within 60 s
        e = 1
        k = max(1, min(k, int(EVIDENCE_MAX_S // t)))
    return e, k


@dataclass(slots=True)
class Summary:
    rank: int
    compute_s: float
    step_s: float
    data_wait_s: float
    allreduce_s: float | None
    host: str
    # Mean SM activity (DCGM ratio) over the window from GPU telemetry; None without a GPU.
    sm_active: float | None = None
    # The window's wall time (its first step's start to its last step's end): the evidence a
    # window adds. None from a rank that does not send it (then ``step_s`` x the window's steps).
    span_s: float | None = None

    def encode(self) -> bytes:
        ar = "-" if self.allreduce_s is None else f"{self.allreduce_s:.6g}"
        sm = "-" if self.sm_active is None else f"{self.sm_active:.4g}"
        span = "-" if self.span_s is None else f"{self.span_s:.6g}"
        host = (self.host or "?").replace(" ", "_")
        return (f"{self.rank} {self.compute_s:.6g} {self.step_s:.6g} {self.data_wait_s:.6g} {ar} {host} {sm} "
                f"{span}\n").encode()

    @staticmethod
    def decode_all(blob: bytes) -> dict[int, "Summary"]:
        out: dict[int, Summary] = {}
        for line in blob.decode(errors="replace").splitlines():
            p = line.split()
            if len(p) not in (6, 7, 8):
                continue  # a torn or foreign line: skip it, never fail the pass
            try:
                sm = None if len(p) == 6 or p[6] == "-" else float(p[6])
                span = None if len(p) < 8 or p[7] == "-" else float(p[7])
                out[int(p[0])] = Summary(
                    int(p[0]), float(p[1]), float(p[2]), float(p[3]), None if p[4] == "-" else float(p[4]), p[5], sm,
                    span,
                )
            except ValueError:
                continue
        return out


def summarize(records: list[StepRecord], rank: int, host: str) -> Summary:
    """Medians over the window: robust to one slow step (a checkpoint, a GC pause)."""

    def compute(r: StepRecord) -> float:
        return max(r.step_s - r.data_wait_s - (r.comm_exposed_s or 0.0), 0.0)

    ars = [r.allreduce_s for r in records if r.allreduce_s is not None]
    sms = [r.gpu["sm_active"] for r in records if r.gpu and r.gpu.get("sm_active") is not None]
    return Summary(
        rank=rank,
        compute_s=statistics.median(compute(r) for r in records),
        step_s=statistics.median(r.step_s for r in records),
        data_wait_s=statistics.median(r.data_wait_s for r in records),
        allreduce_s=statistics.median(ars) if ars else None,
        host=host,
        sm_active=sum(sms) / len(sms) if sms else None,
        span_s=max(records[-1].time - records[0].time + records[0].step_s, 0.0),
    )


def slow_ranks(summaries: dict[int, Summary], margin: float) -> dict[int, float]:
    """Ranks whose compute exceeds the median of the *others* by ``margin``: rank -> that median."""
    out = {}
    for r, s in summaries.items():
        others = [o.compute_s for q, o in summaries.items() if q != r]
        if not others:
            continue
        med = statistics.median(others)
        if s.compute_s > med * (1.0 + margin) and s.compute_s - med > MIN_EXCESS_S:
            out[r] = med
    return out


class StragglerExchange:
    """One rank's side of the exchange. ``store`` is any c10d store (TCPStore, PrefixStore...)."""

    def __init__(self, store: Any, namespace: str, rank: int, world: int, host: str, leader: int = 0) -> None:
        self.store = store
        self.ns = namespace
        self.rank = rank
        self.world = world
        self.host = host
        self.leader = leader
        self.pending: dict[int, float] = {}  # windows published, not yet judged (leader only) -> when
        self._to_delete: dict[int, list[str]] = {}
        self.last_verdict: dict[str, Any] | None = None
        self._verdict_seen = -1

    def _k(self, w: int, part: str) -> str:
        return f"{self.ns}/w{w}/{part}"

    def publish(self, w: int, s: Summary) -> None:
        self.store.append(self._k(w, "d"), s.encode())
        self.store.add(self._k(w, "n"), 1)
        if self.rank == self.leader:
            self.pending[w] = time.monotonic()

    def all_in(self) -> bool:
        """Leader: every rank's part of every pending window has arrived."""
        return all(self.store.add(self._k(w, "n"), 0) >= self.world for w in self.pending)

    def collect(self, latest: int, *, force: bool = False) -> list[tuple[int, dict[int, Summary]]]:
        """Leader: windows that are complete (or late enough to judge with what arrived; every
        pending one with ``force``, at shutdown)."""
        ready = []
        now = time.monotonic()
        for w, since in sorted(self.pending.items()):
            n = self.world if force else self.store.add(self._k(w, "n"), 0)
            if n < self.world and (latest - w < LATE_WINDOWS or now - since < LATE_S):
                continue
            blob = self.store.get(self._k(w, "d"))  # exists: the leader appended to it itself
            del self.pending[w]
            ready.append((w, Summary.decode_all(blob)))
            self._cleanup(w)
        return ready

    def post_verdict(self, w: int, verdict: dict[str, Any]) -> None:
        self.store.set(f"{self.ns}/v{w}", json.dumps(verdict, separators=(",", ":")).encode())
        self._to_delete.setdefault(w + VERDICT_KEEP, []).append(f"{self.ns}/v{w}")

    def read_verdict(self, w: int) -> dict[str, Any] | None:
        """Any rank: the verdict of window ``w`` if the leader wrote it (never waits)."""
        if w <= self._verdict_seen:
            return None
        key = f"{self.ns}/v{w}"
        if not self.store.check([key]):
            return None
        try:
            v = json.loads(self.store.get(key))
        except ValueError:
            return None
        self._verdict_seen = w
        self.last_verdict = v
        return v

    def _cleanup(self, w: int) -> None:
        # The window's keys now, and again a few windows later: a rank that appended late
        # re-created them after the first delete.
        keys = [self._k(w, "d"), self._k(w, "n")]
        for k in keys:
            self.store.delete_key(k)
        self._to_delete.setdefault(w + LATE_WINDOWS + 1, []).extend(keys)
        for old in [x for x in self._to_delete if x <= w]:
            for k in self._to_delete.pop(old):
                self.store.delete_key(k)


class StragglerDetector:
    """Background thread: windows of this rank's records -> exchange -> (leader) findings."""

    def __init__(
        self,
        *,
        every: int,
        margin: float,
        windows: int,
        rank: int,
        host: str,
        store_factory: Callable[[], Any],
        namespace: str,
        on_floor: Callable[[float], None] | None = None,
        world_factory: Callable[[], int] | None = None,
    ) -> None:
        self.adaptive = every <= 0
        self.every = every if every > 0 else 1
        self.margin = margin
        self.windows = windows
        self.rank = rank
        self.host = host
        self._store_factory = store_factory
        self._world_factory = world_factory
        self.namespace = namespace
        self._on_floor = on_floor
        self._buf: list[StepRecord] = []
        self._win: int | None = None
        self.exchange: StragglerExchange | None = None
        self._disabled = False
        self._streak: dict[int, int] = {}  # rank -> slow windows in a row
        self._streak_s: dict[int, float] = {}  # rank -> their wall time
        self._reported_at: int | None = None
        self._reported_set: frozenset[int] = frozenset()
        self.latest = -1
        self.verdicts: list[dict[str, Any]] = []
        # The first window is warm-up (DDP's bucket rebuild, allocator, lazy init, ranks starting
        # at different times): not published, not judged.
        self.skip_windows = 1
        self._last_poll = -1e9
        # Adaptive windows: records wait here until the plan is known; windows count from _start.
        self._start = 0
        self.plan: tuple[int, int, int] | None = None
        self._pre: list[StepRecord] = []
        if self.adaptive:
            self.skip_windows = 0
        # Leader: each rank's SM activity per window (GPU telemetry), for the B.4 straggler-GPU row.
        self._sm: dict[int, Any] = {}
        self._gpu_reported: frozenset[int] = frozenset()
        self._finished = False
        self._last_step = -1  # this rank's newest record: a partial last window ends there

    def _ensure(self) -> StragglerExchange | None:
        if self.exchange is None and not self._disabled:
            store = self._store_factory()
            if store is None:
                return None  # not distributed (yet)
            world = self._world_factory() if self._world_factory else 1
            if world < 2:
                self._disabled = True
                return None
            self.exchange = StragglerExchange(store, self.namespace, self.rank, world, self.host)
        return self.exchange

    def finish(self, timeout_s: float = FINISH_S) -> list[Finding]:
        """Shutdown's final pass, after the last record: publish this rank's last window and (the
        leader) judge every window still pending; within ``timeout_s`` whatever the store does
        (see the module's docstring). Once; the detector observes nothing after it."""
        if self._finished:
            return []
        self._finished = True
        if self.exchange is None and not self._buf:
            return []  # never published: no exchange to finish (one rank, or no plan yet)
        deadline = time.monotonic() + timeout_s
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["found"] = self._finish(deadline - min(FINISH_JUDGE_S, timeout_s / 2))
            except BaseException as e:  # noqa: BLE001 - handed to the caller, who reports it
                box["error"] = e

        t = threading.Thread(target=work, name="stepwatch-straggler-finish", daemon=True)
        if start(t):
            t.join(max(deadline - time.monotonic(), 0.0))
        else:  # the interpreter refuses a thread at its exit (_os/threads.py): here, within the store's timeouts
            work()
        if "error" in box:
            raise box["error"]
        if "found" not in box:
            from .._log import logger

            logger.warning("stepwatch: the straggler exchange's last window did not finish within %.1f s at "
                           "shutdown (the store did not answer); it is not judged", timeout_s)
            return []
        return box["found"]

    def _finish(self, wait_until: float) -> list[Finding]:
        if self._buf and len(self._buf) >= (self.every + 1) // 2:
            self._close()
        self._buf, self._win = [], None
        ex = self.exchange
        if ex is None or ex.rank != ex.leader or not ex.pending:
            return []
        while time.monotonic() < wait_until and not ex.all_in():
            time.sleep(FINISH_POLL_S)
        out: list[Finding] = []
        for w, sums in ex.collect(self.latest, force=True):
            out += self._judge(w, sums)
        return out

    def observe(self, rec: StepRecord) -> list[Finding]:
        if self._finished:
            return []
        if self.adaptive and self.plan is None:
            self._pre.append(rec)
            del self._pre[:-PRE_PLAN_RECORDS]
            if not self._try_plan(rec):
                return []
            pre, self._pre = self._pre, []
            out: list[Finding] = []
            for r in pre:
                if r.step >= self._start:
                    out += self._observe(r)
            return out
        return self._observe(rec)

    def _plan_key(self) -> str:
        return f"{self.namespace}/plan"

    def _try_plan(self, rec: StepRecord) -> bool:
        """Adaptive windows: the leader writes the plan after its warm-up; the others read it."""
        ex = self._ensure()
        if ex is None:
            if self._disabled:
                self._pre = []
            return False
        if rec.rank == ex.leader:
            warm = self._pre
            if not (len(warm) >= WARMUP_STEPS
                    or (len(warm) >= WARMUP_MIN_STEPS and warm[-1].time - warm[0].time >= WARMUP_S)):
                return False
            t = statistics.median(r.step_s for r in warm[1:])
            e, k = plan_windows(t, self.windows)
            start = rec.step + 1
            ex.store.set(self._plan_key(), f"{start} {e} {k}".encode())
        else:
            now = time.monotonic()
            if now - self._last_poll < POLL_S:
                return False
            self._last_poll = now
            if not ex.store.check([self._plan_key()]):
                return False
            try:
                start, e, k = (int(x) for x in ex.store.get(self._plan_key()).decode().split())
            except ValueError:
                return False
        self.plan = (start, e, k)
        self._start, self.every, self.windows = start, e, k
        return True

    def _observe(self, rec: StepRecord) -> list[Finding]:
        if rec.step < self._start:
            return []
        self._last_step = max(self._last_step, rec.step)
        w = (rec.step - self._start) // self.every
        out: list[Finding] = []
        if self._win is not None and w != self._win and self._buf:
            out += self._close()
        self._win = w
        self._buf.append(rec)
        if len(self._buf) >= self.every:
            out += self._close()
        out += self.poll()
        return out

    def _close(self) -> list[Finding]:
        buf, self._buf = self._buf, []
        w = self._win if self._win is not None else (buf[-1].step - self._start) // self.every
        self._win = None
        if w < self.skip_windows:
            return []
        ex = self._ensure()
        if ex is None:
            return []
        ex.rank = self.rank = buf[-1].rank
        ex.publish(w, summarize(buf, self.rank, self.host))
        self.latest = max(self.latest, w)
        return []

    def poll(self) -> list[Finding]:
        ex = self.exchange
        if ex is None:
            return []
        now = time.monotonic()
        if now - self._last_poll < POLL_S:
            return []
        self._last_poll = now
        out: list[Finding] = []
        if ex.rank == ex.leader:
            for w, sums in ex.collect(self.latest):
                out += self._judge(w, sums)
        else:
            for w in range(max(ex._verdict_seen + 1, self.latest - LATE_WINDOWS - 1), self.latest + 1):
                v = ex.read_verdict(w)
                if v is not None and v.get("floor_s") is not None and self._on_floor is not None:
                    self._on_floor(v["floor_s"])
        return out

    def _judge(self, w: int, sums: dict[int, Summary]) -> list[Finding]:
        return self._judge_gpus(w, sums) + self._judge_compute(w, sums)

    def _judge_gpus(self, w: int, sums: dict[int, Summary]) -> list[Finding]:
        """One rank's SM activity varying while the others hold (reference B.4): judged on the
        per-window means the ranks publish, once per episode."""
        import collections

        from ..telemetry.diagnose import find_gpu_stragglers

        for r, su in sums.items():
            if su.sm_active is not None:
                self._sm.setdefault(r, collections.deque(maxlen=30)).append(su.sm_active)
        if len(self._sm) < 2:
            return []
        found = find_gpu_stragglers({r: list(d) for r, d in self._sm.items()}, rank=self.rank,
                                    step=self._window_end(w))
        named = frozenset(f.data["straggler_rank"] for f in found)
        if named == self._gpu_reported:
            return []
        self._gpu_reported = named
        return found

    def _judge_compute(self, w: int, sums: dict[int, Summary]) -> list[Finding]:
        slow = slow_ranks(sums, self.margin)
        for r in set(self._streak) | set(sums):
            if r in slow:
                self._streak[r] = self._streak.get(r, 0) + 1
                su = sums[r]
                span = su.span_s if su.span_s is not None else su.step_s * self.every
                self._streak_s[r] = self._streak_s.get(r, 0.0) + span
            else:
                self._streak[r], self._streak_s[r] = 0, 0.0
        named = sorted(r for r in self._streak if self._persistent(r))
        floors = [s.allreduce_s for s in sums.values() if s.allreduce_s is not None]
        floor = min(floors) if floors else None
        verdict = {"w": w, "slow": sorted(slow), "named": named, "floor_s": floor, "ranks": len(sums)}
        self.verdicts.append(verdict)
        del self.verdicts[:-8]
        self.exchange.post_verdict(w, verdict)
        if floor is not None and self._on_floor is not None:
            self._on_floor(floor)
        if not named:
            self._reported_set = frozenset()
            return []
        key = frozenset(named)
        if key == self._reported_set and self._reported_at is not None and w - self._reported_at < REPEAT_WINDOWS:
            return []
        self._reported_set, self._reported_at = key, w
        return [self._finding(w, sums, named, slow)]

    def _window_end(self, w: int) -> int:
        """The last step of window ``w``; of a partial last window (at shutdown), the last step."""
        end = self._start + (w + 1) * self.every - 1
        return min(end, self._last_step) if self._last_step >= self._start + w * self.every else end

    def _persistent(self, r: int) -> bool:
        """Fixed windows: ``windows`` slow windows in a row. Adaptive: slow for at least
        ``EVIDENCE_S`` of wall time (the windows' own spans, not the warm-up's step time, which
        later steps need not keep) and at least ``EVIDENCE_MIN_STEPS`` steps (as the plan allows)."""
        n = self._streak.get(r, 0)
        if not self.adaptive:
            return n >= self.windows
        steps = n * self.every
        enough_steps = steps >= min(EVIDENCE_MIN_STEPS, self.every * self.windows)
        return n > 0 and enough_steps and self._streak_s.get(r, 0.0) >= EVIDENCE_S * (1 - 1e-6)

    def _finding(self, w: int, sums: dict[int, Summary], named: list[int], slow: dict[int, float]) -> Finding:
        hosts = {str(r): sums[r].host for r in named if r in sums}
        compute = {str(r): s.compute_s for r, s in sorted(sums.items())}
        wait = {str(r): s.allreduce_s for r, s in sorted(sums.items())}
        most_comm = max((r for r in sums if sums[r].allreduce_s is not None), key=lambda r: sums[r].allreduce_s, default=None)
        parts = []
        for r in named:
            med = slow.get(r)
            s = sums.get(r)
            if s is None or med is None:
                parts.append(f"rank {r}")
                continue
            parts.append(
                f"rank {r} ({s.host}) computes {s.compute_s * 1e3:.1f} ms per step vs "
                f"{med * 1e3:.1f} ms median of the others (+{(s.compute_s / med - 1) * 100 if med > 0 else 0:.0f}%)"
            )
        n = min(self._streak.get(r, 0) for r in named)
        evidence = min(self._streak_s.get(r, 0.0) for r in named)
        summary = "; ".join(parts) + f", {n} windows of {self.every} steps in a row ({evidence:.1f} s)"
        if most_comm is not None and most_comm not in named:
            summary += f"; rank {most_comm} spends the most time in AllReduce because it waits for the straggler"
        return make_finding(
            "straggler",
            rank=self.rank,
            step=self._window_end(w),
            summary=summary,
            data={
                "ranks": named,
                "hosts": hosts,
                "compute_s": compute,
                "allreduce_s": wait,
                "median_others_s": {str(r): slow[r] for r in named if r in slow},
                "margin": self.margin,
                "windows": n,
                "evidence_s": evidence,
                "window_steps": self.every,
                "window": w,
                "ranks_reporting": len(sums),
                "subject": "ranks " + ",".join(str(r) for r in named),  # one episode per set named
            },
        )
