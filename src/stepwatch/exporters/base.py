"""The exporter contract: three methods, called on stepwatch's background thread only.

Shaped after OpenTelemetry's ``MetricExporter`` (``export``, ``force_flush``, ``shutdown``). A user
forwards records to their own sink (TensorBoard, W&B, ...) by subclassing :class:`Exporter` and
passing it to ``stepwatch.init(exporters=[...])``. The built-in sinks use the same contract.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from ..record import Finding, StepRecord


@dataclass(slots=True)
class Batch:
    """What one background-thread pass hands every exporter. Lists may be empty."""

    records: list[StepRecord] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    # Device telemetry samples (GPU health); plain dicts keyed by field name.
    samples: list[dict[str, Any]] = field(default_factory=list)
    # Records and metric points dropped anywhere so far (the bounded queues, an exporter that
    # could not deliver), as the pipeline counted them when it made this batch.
    dropped: int = 0

    def __bool__(self) -> bool:
        return bool(self.records or self.findings or self.samples)


class Exporter(abc.ABC):
    """Base class for sinks. Never called from the training thread.

    ``export`` may raise: stepwatch counts the failure, logs it once and carries on; the
    training job never sees it.
    """

    #: Shown in logs and in ``run.json``'s feature list.
    name: str = "exporter"
    #: Shut down after every other exporter, with one last batch holding only the final
    #: ``dropped`` count (the console's closing line: what the others lost in the last pass).
    says_totals: bool = False
    #: Set by the session that runs this exporter: its exit shutdown. A sink whose library
    #: finishes its work in an atexit hook of its own, registered after stepwatch's (W&B's
    #: ``wandb.init``), registers this again once it sees that work begin, so that stepwatch's
    #: last records reach the library before its hook closes it (atexit runs the last first).
    exit_first: Callable[[], None] | None = None

    @abc.abstractmethod
    def export(self, batch: Batch) -> None:
        """Consume one batch. Runs on the exporter's own thread. The batch's lists (``records``,
        ``findings``, ``samples``) are this exporter's own to consume or reorder; the
        ``StepRecord`` s, findings and sample dicts in them are shared with every other exporter
        and are read-only."""

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        return True

    def shutdown(self) -> None:
        return None


class InMemoryExporter(Exporter):
    """Keeps everything it is given. The test fixture, and handy in notebooks."""

    name = "memory"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.records: list[StepRecord] = []
        self.findings: list[Finding] = []
        self.samples: list[dict[str, Any]] = []
        self.shut_down = False

    def export(self, batch: Batch) -> None:
        with self._lock:
            self.records.extend(batch.records)
            self.findings.extend(batch.findings)
            self.samples.extend(batch.samples)

    def shutdown(self) -> None:
        self.shut_down = True
