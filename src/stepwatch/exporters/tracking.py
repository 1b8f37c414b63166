"""What the experiment-tracking sinks (TensorBoard, W&B, MLflow) share: the ``stepwatch/<field>``
names of a record, the findings' text and its rate limit, and "a library that fails is counted
and turned off".

Pure Python: importing this module imports none of the tracking libraries.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import sys
import time
import zlib
from collections import deque
from typing import Any, Callable

from .._imports import ImportWatch
from ..record import Finding, StepRecord
from .base import Batch, Exporter
from .names import _tokens_per_s

log = logging.getLogger("stepwatch")

PREFIX = "stepwatch/"
# The x-axis every tool gets: the optimizer step (StepRecord.step).
STEP_KEY = PREFIX + "step"

# Record fields exported as stepwatch/<field>, in the record schema's order. Left out: step (the
# x-axis), rank and time (the series' identity), clock and mfu_dtype (text), peak_tflops (a
# constant of the device); phases, scalars and gpu follow as stepwatch/<group>/<name>.
FIELDS: tuple[str, ...] = (
    "step_s", "data_wait_s", "forward_s", "backward_s", "optimizer_s", "other_s", "eval_s",
    "checkpoint_s", "mem_peak_bytes", "flops", "mfu", "hfu", "tokens", "samples", "grad_norm",
    "comm_s", "comm_exposed_s", "overlap", "allreduce_s", "algbw_gbps", "busbw_gbps",
    "comm_wait_s", "checkpoint_bytes", "checkpoint_gbps",
)
# What a tail record (StepRecord.tail) has of its own.
TAIL_FIELDS: tuple[str, ...] = ("eval_s", "checkpoint_s", "mem_peak_bytes", "checkpoint_bytes", "checkpoint_gbps")

# MLflow accepts alphanumerics, _ - . / and space in a key (mlflow/utils/validation.py,
# _VALID_PARAM_AND_METRIC_NAMES); the other tools accept those too. User-chosen names (phases,
# stepwatch.log keys) get every other character replaced, so one name works in all three.
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-./ ]")


# Which name holds each key (the first one logged): two names that clean up to one key ('a:b'
# and 'a_b') overwrote each other in every sink. A later name gets that key with its own CRC-32
# after it. Bounded: past this many keys, names are no longer told apart.
_MAX_KEYS = 10_000
_holder: dict[str, str] = {}


def _clean(name: str) -> str:
    """``name`` as a key's last part: unsafe characters replaced, at most 200 of them, and a path
    MLflow takes as it is (its keys must be normalized paths): no empty part (``/loss``, ``a//b``,
    ``loss/``, the empty name), no ``.`` or ``..`` part (``./x``, ``a/../b``). MLflow refused such
    a key, and the refusal turned the sink off for the rest of the run."""
    parts = [p if p not in (".", "..") else "_" * len(p) for p in _UNSAFE.sub("_", name)[:200].split("/") if p]
    return "/".join(parts) or "_"


def _key(group: str, name: str) -> str:
    name = str(name)
    key = f"{PREFIX}{group}/{_clean(name)}"
    held = _holder.get(key)
    if held is None:
        if len(_holder) >= _MAX_KEYS:
            return key
        held = _holder.setdefault(key, name)
    if held == name:
        return key
    return f"{key}_{zlib.crc32(name.encode('utf-8', 'surrogatepass')):08x}"


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, str):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return f if math.isfinite(f) else None


def record_scalars(r: StepRecord) -> dict[str, float]:
    """The record as ``{stepwatch/<field>: value}``: unknown (None) and non-finite values left out."""
    out: dict[str, float] = {}
    # A tail record (evaluation or a checkpoint after the last step) is no training step: its
    # training phases are 0 by construction, and were one more point of 0 s at every curve's end.
    for name in TAIL_FIELDS if r.tail else FIELDS:
        v = _num(getattr(r, name, None))
        if v is not None:
            out[PREFIX + name] = v
    if not r.tail:
        tps = _num(_tokens_per_s(r))
        if tps is not None:
            out[PREFIX + "tokens_per_s"] = tps
        out[PREFIX + "skipped"] = 1.0 if r.skipped else 0.0
    for group, values in (("phases", r.phases), ("scalars", r.scalars), ("gpu", r.gpu)):
        for k, v in (values or {}).items():
            f = _num(v) if not isinstance(v, bool) else None
            if f is not None:
                out[_key(group, k)] = f
    return out


def finding_text(f: Finding) -> str:
    """One finding as a short Markdown paragraph (TensorBoard's text plugin renders Markdown)."""
    where = f"step {f.step}" if f.step is not None else "no step"
    return f"**{f.severity.upper()} {f.kind}** (rank {f.rank}, {where}): {f.summary}  \n→ {f.action}"


class FindingGate:
    """At most ``per_window`` findings per ``window_s`` reach a tool; the rest are counted and
    named in the next one that passes (every finding is in ``findings.rank<R>.jsonl``)."""

    def __init__(self, per_window: int = 10, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_window = per_window
        self.window_s = window_s
        self.clock = clock
        self._sent: deque[float] = deque()
        self.suppressed = 0  # not yet reported
        self.suppressed_total = 0

    def admit(self, findings: list[Finding]) -> list[Finding]:
        now = self.clock()
        while self._sent and now - self._sent[0] >= self.window_s:
            self._sent.popleft()
        out = []
        for f in findings:
            if len(self._sent) < self.per_window:
                self._sent.append(now)
                out.append(f)
            else:
                self.suppressed += 1
                self.suppressed_total += 1
        return out

    def note(self) -> str:
        """A line about the findings held back since the last call ('' when none)."""
        n, self.suppressed = self.suppressed, 0
        if not n:
            return ""
        return f"({n} more finding(s) not shown here: see findings.rank<R>.jsonl in the run directory)"


class RowLimiter:
    """A token bucket of rows (records) a second: above the rate, records are sampled evenly,
    the newest always kept. Each tool costs the background thread per row (MLflow's SQL store
    ~200 µs a metric, TensorBoard's pure-Python record checksums ~0.7 ms a row, ``wandb.log``
    ~0.6 ms), and a step of a second or more is always under the rate; every step stays in the
    records file."""

    def __init__(self, per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_s = per_s
        self.burst = burst
        self.clock = clock
        self._tokens = float(burst)
        self._at = clock()
        self.sampled_out = 0

    def admit(self, records: list) -> list:
        now = self.clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.per_s)
        self._at = now
        n = len(records)
        k = min(n, int(self._tokens))
        self._tokens -= k
        if k >= n:
            return records
        self.sampled_out += n - k
        if k <= 0:
            return []
        return [records[n - 1 - (i * n) // k] for i in reversed(range(k))]


_CHANGING = object()  # RunProbe._key after settle(): neither a run nor None


class RunProbe:
    """Training thread: which run of a tracking library is active (MLflow's thread-local active
    run, W&B's ``wandb.run``). ``look()`` says it: the active run's id or the run itself (None: no run), raising
    LookupError while the library is not imported; ``describe(id)`` is what is kept of a run
    (the id itself without it), asked only when the id changes. ``changes`` holds ``(step, run)``
    each time the id changes, so that each record goes to the run that was active when its step
    ended; ``seen`` says it has looked at least once. ``on_run(run)``, when given, is called
    (training thread) at a step end that finds a run other than the one before."""

    __slots__ = ("look", "describe", "on_run", "changes", "_key", "_ended_through")  # _key: an id, None, or _CHANGING

    def __init__(self, look: Callable[[], Any], describe: Callable[[Any], Any] | None = None,
                 on_run: Callable[[Any], None] | None = None) -> None:
        self.look = look
        self.describe = describe
        self.on_run = on_run
        # Bounded: a record older than the oldest change kept goes to the oldest run kept.
        self.changes: deque[tuple[int, Any]] = deque(maxlen=64)
        self._key: Any = None
        self._ended_through = -(2**62)  # settle: steps up to this one have their run

    def settle(self, last: int) -> None:
        """Training thread, as the active run is about to change (``mlflow.start_run`` /
        ``end_run``, W&B's ``Run.finish``; a ``with`` block's exit, the script's call, the
        library's own exit hook): the steps up to ``last`` were trained in the run active now (or
        in none), whenever their records are made. A step's record is made when the next step
        begins or at shutdown: looked for then, the last step of a ``with`` block went nowhere,
        and a step trained with no run went into the next one."""
        if last <= self._ended_through:
            # Settled already (no step since the last change): the next change, the library's
            # exit hook ending a run the script ended, takes nothing from the run they were in.
            return
        try:
            key = self.look()
            current = self._describe(key)
        except Exception:  # not imported, or a library that misbehaves: as on_step_end, nothing known
            return
        if key != self._key or not self.changes:
            self.changes.append((last, current))
        self._key = _CHANGING  # the next step end notes whatever it finds
        self._ended_through = last

    @property
    def seen(self) -> bool:
        return bool(self.changes)

    def on_step_end(self, step: int) -> None:
        if step <= self._ended_through:
            return
        try:
            key = self.look()
            if key == self._key and self.changes:
                return
            current = self._describe(key)
            self._key = key
            self.changes.append((step, current))
        except LookupError:  # the library is not imported
            return
        except Exception:  # a library that misbehaves: no run as far as stepwatch can tell
            if self._key is not None or not self.changes:
                self._key = None
                self.changes.append((step, None))
            return
        if current is not None and self.on_run is not None:
            try:
                self.on_run(current)
            except Exception:  # noqa: BLE001 - a step end is never in its way
                pass

    def _describe(self, key: Any) -> Any:
        return key if self.describe is None or key is None else self.describe(key)

    def run_at(self, step: int | None) -> Any:
        """The run active when ``step`` ended (None: the latest); before the first look, the first."""
        changes = tuple(self.changes)  # one C-level copy: the training thread may append meanwhile
        if not changes:
            return None
        current = changes[0][1]
        for at, c in changes:
            if step is not None and at > step:
                break
            current = c
        return current


def follow_runs(hub: Any, e: Any, library: str, wrap: Callable[[Any], None]) -> None:
    """Training thread, at init, for a sink whose run probe must see every step end (MLflow's,
    W&B's): ``e.probe`` among the step-end listeners and ``wrap(hub)`` (the library's run changes
    wrapped) from the moment ``library`` is imported, now or when the script imports it (an
    ``ImportWatch`` on ``sys.meta_path``, kept as ``e.watch``: nothing a step before)."""

    def watch(name: str = library) -> None:
        hub.add_listener(e.probe.on_step_end)
        wrap(hub)

    if library in sys.modules:
        watch()
    else:
        e.watch = ImportWatch([library], watch).start()


def wait_for_steps(sink: Any, hub: Any, wait_s: float) -> None:
    """Training thread, as the user ends what ``sink`` writes into (W&B's ``Run.finish``, a
    ``SummaryWriter``'s ``close``): the pending step's record is made now, and this waits,
    ``wait_s`` at most, until ``sink._through`` (the last step it has handled) reaches the last
    step trained. No wait before the first step (nothing can come)."""
    last = hub.last_step_trained
    hub.end_pending_step()
    if last < 0:
        return
    deadline = time.monotonic() + wait_s
    while sink._through < last and not sink.off and time.monotonic() < deadline:
        time.sleep(0.01)


def settling(orig: Callable[..., Any], probe: RunProbe, hub: Any) -> Callable[..., Any]:
    """``orig`` (a library's call that changes the active run: ``mlflow.start_run``/``end_run``,
    ``wandb.init``) that first tells ``probe`` the steps trained so far were the run active until
    now (``RunProbe.settle``: up to the step whose end is pending, else the last one made).
    Another thread's call says nothing: its steps are not known there."""

    @functools.wraps(orig)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            if hub.on_training_thread():
                probe.settle(hub.last_step_trained)
        except Exception:  # noqa: BLE001 - never in the way of the user's call
            pass
        return orig(*args, **kwargs)

    call.__stepwatch_wrapped__ = orig  # type: ignore[attr-defined]
    return call


def stop_following(e: Any) -> None:
    """What a sink that follows its library's runs put in place (``follow_runs``; the library's
    functions it wrapped, kept in ``e._wrapped`` as (owner, name, original, ours)) taken out:
    each wrapper that is still the owner's (another library may have wrapped over it since),
    and the import watch while the library was never imported."""
    for owner, name, orig, ours in e._wrapped:
        if getattr(owner, name, None) is ours:
            setattr(owner, name, orig)
    e._wrapped = []
    if e.watch is not None:
        e.watch.stop()


class TrackingExporter(Exporter):
    """Base of the tracking sinks: ``export`` calls :meth:`_export`; the first exception turns
    the sink off for good and is raised once, so the session counts it (``run.json``'s
    ``internal_errors``, an ``internal_error`` finding) and logs it once; later batches are
    counted in :meth:`dropped` (shown by the console)."""

    def __init__(self) -> None:
        self.off = False
        self._dropped = 0

    def export(self, batch: Batch) -> None:
        if self.off:
            self._dropped += len(batch.records)
            return
        try:
            self._export(batch)
        except Exception:
            self.off = True
            self._dropped += len(batch.records)  # the batch that failed is not in the tool either
            raise

    def _export(self, batch: Batch) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def dropped(self) -> int:
        return self._dropped
