"""One exporter on its own thread, fed through a bounded queue.

The pipeline writes the records file itself, on its background thread; every other exporter
(console, OpenTelemetry, a user's sink) runs here, one thread each, so an exporter that is slow
to import, slow to export or stuck in a collector's retries delays no other exporter and never the
records file. It is built on its thread too, and a failure to start is counted under its own
name. What does not fit its queue, and what is still queued when shutdown's time is up, is
dropped and counted (:attr:`ExporterWorker.dropped`, ``run.json``'s ``exporter_drops``).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

from .._os.threads import start
from .base import Batch, Exporter

OnError = Callable[[str, BaseException], None]


def batch_size(batch: Batch) -> int:
    return len(batch.records) + len(batch.findings) + len(batch.samples)


class ExporterWorker:
    """Runs ``build()`` (an exporter, or None for "off") and then its ``export`` on a daemon
    thread named ``stepwatch-export-<name>``. ``capacity`` bounds the items (records, findings,
    samples) waiting for it. ``on_built(exporter)`` runs on the thread once it is built. A failure
    that leaves the exporter off goes to ``on_error``; an ``export`` that raised (the next batch is
    tried) to ``on_retry`` (``on_error`` when not given)."""

    def __init__(
        self,
        name: str,
        build: Callable[[], Exporter | None],
        *,
        capacity: int,
        on_error: OnError,
        on_built: Callable[[Exporter], None] | None = None,
        on_retry: OnError | None = None,
    ) -> None:
        self.name = name
        self.exporter: Exporter | None = None
        self.dropped = {"records": 0, "findings": 0, "samples": 0}
        # What join() counted as dropped when shutdown's time was up (None: it finished). 0: the
        # exporter held no batch, it was still in its own flush or shutdown (a collector down).
        self.left_at_deadline: int | None = None
        self._build = build
        self._cap = capacity
        self._on_error = on_error
        self._on_retry = on_retry or on_error  # an export that raised: the next batch is tried
        self._on_built = on_built
        self._queue: collections.deque[Batch] = collections.deque()
        self._queued = 0
        self._busy: Batch | None = None  # the batch being exported
        self._cv = threading.Condition()
        self._closing = False
        self._gone = False  # failed to start, off, or given up at shutdown: drop what comes
        self._deadline = 0.0
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, name=f"stepwatch-export-{name}", daemon=True)
        if not start(self._thread):
            # The interpreter refuses a new thread (_os/threads.py): a short job's first pass
            # comes at its exit shutdown. This exporter is off, alone: the pass, and the records
            # file it writes, go on.
            self._thread = None
            self._on_error(f"exporter.{name}.start", RuntimeError("the interpreter refused a new thread at its exit "
                                                                 "(Python 3.12.0-3.12.2; fixed in 3.12.3)"))
            self._give_up()

    # -- the pipeline's side (its background thread) ------------------------------------------

    def submit(self, batch: Batch) -> None:
        """Queue ``batch``; never blocks. A batch that does not fit is dropped and counted. An
        empty queue takes any batch: a pass's batch may hold more than the queue's size (records,
        findings and samples together), and an idle exporter refused it whole."""
        n = batch_size(batch)
        if not n:
            return
        with self._cv:
            if self._gone or self._closing or (self._queued and self._queued + n > self._cap):
                self._count(batch)
                return
            self._queue.append(batch)
            self._queued += n
            self._cv.notify()

    def close(self, deadline: float, dropped: int | None = None) -> None:
        """Export what is queued, then flush and shut the exporter down, until ``deadline``
        (``time.monotonic()``). Returns at once; :meth:`join` waits. ``dropped``: one last batch
        with nothing but that count (``Exporter.says_totals``)."""
        with self._cv:
            if dropped is not None and not self._gone and not self._closing:
                self._queue.append(Batch(dropped=dropped))
            self._closing = True
            self._deadline = deadline
            self._cv.notify()

    def join(self, deadline: float) -> bool:
        """Wait for the worker until ``deadline``; True if it finished. If not, what it still
        holds (queued, and the batch in its ``export``) is counted as dropped."""
        if self._thread is None:  # never started (see __init__)
            return True
        self._thread.join(max(deadline - time.monotonic(), 0.0))
        if not self._thread.is_alive():
            return True
        self.left_at_deadline = self._give_up(busy_too=True)
        return False

    def idle(self) -> bool:
        with self._cv:
            return not self._queue and self._busy is None

    def total_dropped(self) -> int:
        with self._cv:
            return sum(self.dropped.values())

    def _count(self, batch: Batch) -> None:  # under self._cv
        self.dropped["records"] += len(batch.records)
        self.dropped["findings"] += len(batch.findings)
        self.dropped["samples"] += len(batch.samples)

    # -- the worker's thread -------------------------------------------------------------------

    def _run(self) -> None:
        # stepwatch's own thread: whatever an exporter raises (SystemExit from a library's
        # sys.exit, KeyboardInterrupt, a cancellation too) is the exporter's failure, counted here;
        # one that is not an Exception leaves the exporter off, and this thread ends quietly.
        try:
            exporter = self._build()
        except BaseException as e:  # noqa: BLE001 - any failure to start leaves this exporter off, alone
            self._on_error(f"exporter.{self.name}.start", e)
            exporter = None
        if exporter is None:
            self._give_up()
            return
        self.exporter = exporter
        if self._on_built is not None:
            try:
                self._on_built(exporter)
            except BaseException as e:  # noqa: BLE001
                self._on_error(f"exporter.{self.name}.start", e)
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if self._gone:  # shutdown's time is up: what was left is counted
                    return
                if not self._queue:  # closing, nothing left
                    break
                batch = self._busy = self._queue.popleft()
                self._queued -= batch_size(batch)
            try:
                exporter.export(batch)
            except Exception as e:  # noqa: BLE001 - counted, logged once; the next batch is tried
                # A sink that turns itself off on a failure (the tracking sinks: ``off``) is said
                # to be off; any other is tried again with the next batch, and said so.
                off = getattr(exporter, "off", False) is True
                (self._on_error if off else self._on_retry)(f"exporter.{self.name}", e)
            except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt: counted, this exporter off
                self._on_error(f"exporter.{self.name}", e)
                self._give_up(busy_too=True)
                self._end(exporter)
                return
            with self._cv:
                self._busy = None
        self._end(exporter)

    def _end(self, exporter: Exporter) -> None:
        try:
            exporter.force_flush(max(self._deadline - time.monotonic(), 0.0))
            exporter.shutdown()
        except BaseException as e:  # noqa: BLE001
            self._on_error(f"exporter.{self.name}", e)

    def _give_up(self, busy_too: bool = False) -> int:
        """Take nothing more; count what is queued (and, ``busy_too``, the batch in ``export``).
        Returns how many records, findings and samples that was."""
        with self._cv:
            before = sum(self.dropped.values())
            self._gone = True
            for b in self._queue:
                self._count(b)
            self._queue.clear()
            self._queued = 0
            if busy_too and self._busy is not None:
                self._count(self._busy)
                self._busy = None
            return sum(self.dropped.values()) - before


def describe_drops(workers: list[ExporterWorker], exporters: Any = ()) -> dict[str, dict[str, Any]]:
    """``run.json``'s ``exporter_drops``: per exporter, what it lost (nonzero counts only);
    ``points`` are what the exporter itself could not deliver (e.g. OTLP with the collector down).
    ``exporters``: any others (the records file, written on the pipeline's thread) whose
    ``drop_counts()`` says what they lost."""
    out: dict[str, dict[str, Any]] = {}
    mine = {id(w.exporter) for w in workers}
    for e in exporters:
        counts = getattr(e, "drop_counts", None)
        if id(e) in mine or not callable(counts):
            continue
        try:
            d = {k: int(v) for k, v in counts().items() if v}
        except Exception:  # noqa: BLE001 - an exporter's counter must not break the manifest
            continue
        if d:
            out[getattr(e, "name", type(e).__name__)] = d
    for w in workers:
        with w._cv:
            d = {k: v for k, v in w.dropped.items() if v}
        own = getattr(w.exporter, "dropped", None)
        if callable(own):
            try:
                n = int(own())
            except Exception:  # noqa: BLE001 - an exporter's counter must not break the manifest
                n = 0
            if n:
                d["points"] = n
        if d:
            out[w.name] = d
    return out
