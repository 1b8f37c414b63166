"""MLflow: when an MLflow run is active, step records go into it as ``stepwatch/<field>`` metrics
at the optimizer step, findings as tags (``stepwatch/finding/<kind>``: the latest of each kind)
and a text artifact (``stepwatch/findings.md``). No setting needed; ``STEPWATCH_MLFLOW=0`` turns
it off.

``mlflow.active_run()`` is thread-local: the run the training script started is visible on the
training thread only. :class:`RunProbe` looks there, at each step end once the script has
imported mlflow (~1 µs a step; until then it is not among the step-end listeners: an
``_imports.ImportWatch`` on ``sys.meta_path`` adds it when ``import mlflow`` has run), and keeps
the run id and tracking URI each time they change; the exporter logs each record, with
``MlflowClient`` from stepwatch's background thread, into the run that was active when its step
ended. The exporter is started as a session feature
(:func:`install`, at init on the training thread) so that the probe sees every step end from the
first one; the session then hands it batches like any other exporter.

mlflow is never imported here unless the script imported it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from .._imports import ImportWatch
from .base import Batch
from .tracking import (PREFIX, FindingGate, RowLimiter, RunProbe, TrackingExporter, finding_text, follow_runs,
                       record_scalars, settling, stop_following)

if TYPE_CHECKING:
    from .._feature import Hub
    from ..context import RunContext

# MLflow's limit of metrics per log_batch call (mlflow/utils/validation.py MAX_METRICS_PER_BATCH).
BATCH_METRICS = 1000
# Tag values are capped at 8000 characters (MAX_TAG_VAL_LENGTH); a finding's summary is far less.
TAG_CHARS = 5000
# Records kept while the probe has not looked yet (it looks at the next step end).
HOLD_RECORDS = 4096
FINDINGS_ARTIFACT = "stepwatch/findings.md"
ARTIFACT_FINDINGS = 200
ARTIFACT_EVERY_S = 60.0
# Rows (steps) a second at most (tracking.RowLimiter): MLflow's SQL store takes ~200 µs a metric,
# ~5 ms for a step's ~25. Steps of half a second or more are all logged.
ROWS_PER_S = 2.0
ROWS_BURST = 100


def _active_mlflow_run() -> Any:
    """``RunProbe``'s look for MLflow: the active run's id, or None; LookupError while mlflow is
    not imported."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        raise LookupError("mlflow")
    run = mlflow.active_run()
    return run.info.run_id if run is not None else None


def _with_tracking_uri(rid: str) -> tuple[str, str]:
    """What the MLflow probe keeps of a run: (its id, the tracking URI it is logged to)."""
    return rid, sys.modules["mlflow"].get_tracking_uri()


class MlflowExporter(TrackingExporter):
    name = "mlflow"

    def __init__(self, ctx: "RunContext", *, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.ctx = ctx
        self.clock = clock
        self.probe = RunProbe(_active_mlflow_run, _with_tracking_uri)
        self._held: deque = deque(maxlen=HOLD_RECORDS)
        self._held_findings: deque = deque(maxlen=ARTIFACT_FINDINGS)
        self._clients: dict[str, Any] = {}
        self._tagged: set[str] = set()
        self.gate = FindingGate()
        self.rows = RowLimiter(ROWS_PER_S, ROWS_BURST, clock)
        self._artifact: dict[str, deque[str]] = {}
        self._artifact_dirty: set[tuple[str, str]] = set()
        self._artifact_at: dict[str, float] = {}
        self.watch: ImportWatch | None = None
        self._wrapped: list[tuple[Any, str, Any, Any]] = []  # (module, name, mlflow's function, ours)

    def _client(self, uri: str) -> Any:
        c = self._clients.get(uri)
        if c is None:
            from mlflow import MlflowClient

            c = self._clients[uri] = MlflowClient(tracking_uri=uri)
        return c

    def _export(self, batch: Batch) -> None:
        if sys.modules.get("mlflow") is None:
            return  # the script does not use MLflow (yet): nothing to log into
        self._held.extend(batch.records)
        self._held_findings.extend(batch.findings)
        if self.probe.seen:
            self._deliver(final=False)

    def _deliver(self, *, final: bool) -> None:
        records, findings = self.rows.admit(list(self._held)), list(self._held_findings)
        self._held.clear()
        self._held_findings.clear()
        by_run: dict[tuple[str, str], tuple[list, list]] = {}
        for r in records:
            run = self.probe.run_at(r.step)
            if run is not None:
                by_run.setdefault(run, ([], []))[0].append(r)
        for f in findings:
            run = self.probe.run_at(f.step)
            if run is not None:
                by_run.setdefault(run, ([], []))[1].append(f)
        for (rid, uri), (recs, finds) in by_run.items():
            self._log(rid, uri, recs, finds)
        now = self.clock()
        for rid, uri in list(self._artifact_dirty):
            if final or now - self._artifact_at.get(rid, -ARTIFACT_EVERY_S) >= ARTIFACT_EVERY_S:
                lines = self._artifact[rid]
                self._client(uri).log_text(
                    rid, "# stepwatch findings\n\n" + "\n\n".join(lines) + "\n", FINDINGS_ARTIFACT
                )
                self._artifact_dirty.discard((rid, uri))
                self._artifact_at[rid] = now

    def _log(self, rid: str, uri: str, records: list, findings: list) -> None:
        from mlflow.entities import Metric

        client = self._client(uri)
        if rid not in self._tagged:
            client.set_tag(rid, PREFIX + "run_dir", self.ctx.run_dir)
            self._tagged.add(rid)
        metrics = [
            Metric(key, value, int(r.time * 1000), r.step)
            for r in records
            for key, value in record_scalars(r).items()
        ]
        for i in range(0, len(metrics), BATCH_METRICS):
            client.log_batch(rid, metrics=metrics[i : i + BATCH_METRICS], synchronous=True)
        shown = self.gate.admit(findings)
        if not shown:
            return
        lines = self._artifact.setdefault(rid, deque(maxlen=ARTIFACT_FINDINGS))
        for f in shown:
            client.set_tag(rid, f"{PREFIX}finding/{f.kind}", f"{f.severity}: {f.summary}"[:TAG_CHARS])
            lines.append(finding_text(f))
        note = self.gate.note()
        if note:
            lines.append(note)
        self._artifact_dirty.add((rid, uri))

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """At shutdown. Called from the thread that shuts stepwatch down (usually the training
        thread): look for the run once more there if the probe never ran, then log what waits."""
        if self.off or sys.modules.get("mlflow") is None:
            return True
        if not self.probe.seen and threading.current_thread().name != "stepwatch-pipeline":
            self.probe.on_step_end(-1)
        if self.probe.seen:
            try:
                self._deliver(final=True)
            except Exception:
                self.off = True
                raise
        return True

    # -- as a session feature (started at init, beside the others; see :func:`install`) --------

    def wrap_run_changes(self, hub: "Hub") -> None:
        """``mlflow.start_run`` and ``mlflow.end_run`` (and the names ``ActiveRun.__exit__`` and
        MLflow's exit hook call in ``mlflow.tracking.fluent``) first tell the probe which steps
        were trained under the run active until then: up to the step whose end is pending, else
        the last one made (``RunProbe.settle``). Another thread's call says nothing: its steps
        are not known there."""
        fluent = sys.modules.get("mlflow.tracking.fluent")
        mlflow = sys.modules.get("mlflow")
        probe = self.probe
        for name in ("start_run", "end_run"):
            orig = getattr(fluent, name, None)
            if orig is None or getattr(orig, "__stepwatch_wrapped__", None) is not None:
                continue
            ours = settling(orig, probe, hub)
            self._wrapped.append((fluent, name, orig, ours))
            setattr(fluent, name, ours)
            if mlflow is not None and getattr(mlflow, name, None) is orig:
                setattr(mlflow, name, ours)
                self._wrapped.append((mlflow, name, orig, ours))

    def stop(self) -> None:
        stop_following(self)  # force_flush/shutdown come with the other exporters

    def status(self) -> dict[str, Any]:
        return {"run_seen": self.probe.run_at(None) is not None, "off": self.off}


def install(hub: "Hub") -> MlflowExporter | None:
    """Training thread, at init: the exporter, and its run probe among the step-end listeners
    from the first step on which mlflow is imported (now, or when the script imports it: no call
    a step before), with ``mlflow.start_run`` / ``end_run`` wrapped to tell it when the run changes. The session adds
    it to its exporters."""
    e = MlflowExporter(hub.ctx)
    follow_runs(hub, e, "mlflow", e.wrap_run_changes)
    return e
