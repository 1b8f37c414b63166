"""Faults around the job's end and the pipeline's hand-off, each with its bound: a SIGTERM handler
the job installs after stepwatch's is left alone, a SIGTERM during stepwatch's own shutdown still
writes the final manifest, a logged value whose ``float()`` raises anything is null (the record is
kept), a stuck pass counts what it took, and an exporter that consumes its batch costs no other."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from stepwatch._pipeline import Pipeline, to_float
from stepwatch.context import RunContext
from stepwatch.exporters.base import Batch, Exporter, InMemoryExporter
from stepwatch.exporters.builtin import ExporterSpec
from stepwatch.record import RawStep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MS = 1_000_000


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _ctx() -> RunContext:
    return RunContext(rank=0, local_rank=0, world_size=1, host="h", run_id="r", run_dir="/nonexistent")


def _raw(step: int, scalars=None) -> RawStep:
    return RawStep(step, 0, 100 * MS, 10 * MS, 20 * MS, 30 * MS, 15 * MS, 0, 0, {}, dict(scalars or {}), False, 0, {},
                   False)


def _make(*exporters: Exporter, inline: Exporter | None = None, **kw) -> Pipeline:
    specs = [ExporterSpec("records", lambda: inline, inline=True)] if inline is not None else []
    specs += [ExporterSpec(f"e{i}", (lambda e=e: e)) for i, e in enumerate(exporters)]
    return Pipeline(_ctx(), sinks=lambda: specs, **kw)


# -- SIGTERM ------------------------------------------------------------------------------------

OWN_AFTER = r"""
import os, sys, time, signal, threading, torch, stepwatch
stepwatch.init(dir=sys.argv[1], console="off", watchdog="off", capture="off")
stop = []
signal.signal(signal.SIGTERM, lambda s, f: stop.append(1))   # the job's own, installed after init
m = torch.nn.Linear(4, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)
threading.Thread(target=lambda: (time.sleep(0.5), os.kill(os.getpid(), signal.SIGTERM)), daemon=True).start()
while not stop:
    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad(); time.sleep(0.002)
time.sleep(2.5)   # the job's graceful stop: a checkpoint, longer than stepwatch's 1 s "stuck in C" wait
print("checkpoint saved", flush=True)
"""


def test_a_sigterm_handler_the_job_installs_after_init_is_left_alone(tmp_path):
    r = subprocess.run([sys.executable, "-c", OWN_AFTER, str(tmp_path / "run")], env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "checkpoint saved", (r.returncode, r.stderr[-2000:])
    m = json.loads((tmp_path / "run" / "run.json").read_text())
    assert m["end_time"] is not None and m["ended_by"] == "shutdown"  # the job's own exit, atexit


DURING_SHUTDOWN = r"""
import os, sys, time, signal, threading, torch, stepwatch
class Blocked(stepwatch.Exporter):
    name = "blocked"
    def export(self, batch): threading.Event().wait()   # a sink stuck on its network
stepwatch.init(dir=sys.argv[1], console="off", watchdog="off", capture="off", exporters=[Blocked()])
m = torch.nn.Linear(4, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(20):
    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad(); time.sleep(0.002)
def term():
    time.sleep(0.5)
    open(sys.argv[1] + ".sent", "w").write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=term, daemon=True).start()
stepwatch.shutdown()   # what atexit runs: it waits (bounded) on the blocked sink when SIGTERM lands
print("not killed", flush=True)
"""


def test_a_sigterm_during_stepwatchs_shutdown_still_writes_the_final_manifest(tmp_path):
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", DURING_SHUTDOWN, str(run)], env=_env(), capture_output=True,
                       text=True, timeout=120)
    ended = time.time()
    assert r.returncode == -signal.SIGTERM, (r.returncode, r.stdout, r.stderr[-2000:])  # dies of it, as before
    sent = float((tmp_path / "run.sent").read_text())
    assert ended - sent < 3.0 + 1.0  # the 3 s bound (and the interpreter's teardown)
    m = json.loads((run / "run.json").read_text())
    assert m["end_time"] is not None and m["steps"] == 20 and m["ended_by"] == "SIGTERM"
    assert m["end_time"] - sent < 3.0
    assert len((run / "steps.rank0.jsonl").read_text().splitlines()) == 20


DURING_EXIT = r"""
import os, sys, signal, torch, stepwatch
s = stepwatch.init(dir=sys.argv[1], console="off", watchdog="off", capture="off")
s.pipeline.stop_thread()  # no pass before the exit's: the last records all wait in the queue
class TermWhenRead:  # read in the exit's final pass, on the main thread: torchrun's SIGTERM lands there
    def __float__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        return 1.0
m = torch.nn.Linear(4, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for i in range(30):
    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
    stepwatch.log(x=TermWhenRead() if i == 29 else 1.0)
raise RuntimeError("Connection reset by peer")   # a peer rank died: the exit's shutdown runs
"""


def test_a_sigterm_during_the_exits_shutdown_waits_for_its_last_records(tmp_path):
    """A rank whose peer died exits on gloo's error; torchrun's SIGTERM came 26 ms into its exit
    shutdown and the handler wrote the manifest as it stood: 52 to 58 of 60 records, none counted
    as dropped. The signal now waits for the shutdown under way (bounded: ``FINISH_S``), and the
    process still dies of it."""
    run = tmp_path / "run"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", DURING_EXIT, str(run)], env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == -signal.SIGTERM, (r.returncode, r.stderr[-2000:])
    assert "Connection reset by peer" in r.stderr and time.monotonic() - t0 < 60
    assert [json.loads(line)["step"] for line in (run / "steps.rank0.jsonl").read_text().splitlines()] == list(range(30))
    m = json.loads((run / "run.json").read_text())
    assert m["steps"] == 30 and m["dropped_records"] == 0 and m["end_time"] is not None
    assert m["ended_by"].startswith("uncaught RuntimeError: Connection reset by peer")
    mine = json.loads((run / "rank0.json").read_text())  # each rank's own end, for the report
    assert mine["ended_by"] == m["ended_by"] and mine["end_time"] is not None


AT_SHUTDOWN_START = r"""
import _signal, os, sys, signal, torch, stepwatch
s = stepwatch.init(dir=sys.argv[1], console="off", watchdog="off", capture="off")
s.pipeline.stop_thread()  # no pass before the shutdown's: the last records all wait in the queue
m = torch.nn.Linear(4, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for i in range(30):
    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
sent = []
def term(frame, event, arg):
    # The Pool's terminate() lands as the worker starts its exit's shutdown: at the shutdown's
    # first look at SIGTERM's handler (the handler runs right after that call returns).
    if event == "c_call" and arg is _signal.getsignal and not sent:
        sent.append(1)
        os.kill(os.getpid(), signal.SIGTERM)
sys.setprofile(term)
stepwatch.shutdown()
sys.setprofile(None)
print("not killed", flush=True)
"""


def test_a_sigterm_as_the_shutdown_starts_still_writes_every_record(tmp_path):
    """A Pool worker leaving on its end-of-work sentinel starts its exit's shutdown as the Pool's
    ``terminate()`` sends SIGTERM. Landing after the shutdown had marked itself under way and
    before it deferred the signal, the handler wrote the manifest as it stood and the process
    died: 61 to 109 of 120 records, none counted as dropped (one CI run in a few). Now the
    signal is deferred before the shutdown starts, so the shutdown finishes, and the process
    still dies of the signal."""
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", AT_SHUTDOWN_START, str(run)], env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == -signal.SIGTERM and "not killed" not in r.stdout, (r.returncode, r.stderr[-2000:])
    assert [json.loads(line)["step"] for line in (run / "steps.rank0.jsonl").read_text().splitlines()] == list(range(30))
    m = json.loads((run / "run.json").read_text())
    assert m["steps"] == 30 and m["dropped_records"] == 0 and m["end_time"] is not None
    assert m["ended_by"] == "SIGTERM"


# -- the pipeline -------------------------------------------------------------------------------


class _Raises:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __float__(self) -> float:
        raise self.exc


def test_a_logged_value_whose_float_raises_anything_is_null_and_the_record_kept():
    for exc in (ZeroDivisionError("no samples yet"), KeyError("k"), AttributeError("a"), LookupError("x")):
        assert to_float(_Raises(exc)) is None
    out = InMemoryExporter()
    p = _make(inline=out)
    for i in range(3):
        p.enqueue(_raw(i, {"loss": 1.5, "acc": _Raises(ZeroDivisionError("no samples yet"))}))
    p.run_pass()
    assert [r.step for r in out.records] == [0, 1, 2]
    assert all(r.scalars == {"loss": 1.5, "acc": None} for r in out.records)
    assert p.null_scalars == {"acc": 3} and p.dropped == 0 and not p.failures.counts


def test_a_pass_stuck_in_a_record_counts_the_records_it_took_as_dropped():
    release, entered = threading.Event(), threading.Event()

    class Stuck:
        def __float__(self) -> float:
            entered.set()
            release.wait(30)
            return 1.0

    out = InMemoryExporter()
    p = _make(inline=out, flush_interval_s=60.0)
    p.start()
    p.enqueue(_raw(0))  # the first record wakes the thread: exporters open, record 0 written
    deadline = time.monotonic() + 10
    while not out.records and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r.step for r in out.records] == [0]
    # the next pass takes all six and is stuck on the third one's value
    for i in range(1, 7):
        p.enqueue(_raw(i, {"x": Stuck()} if i == 3 else None))
    p._wake.set()
    assert entered.wait(10)
    for i in range(7, 10):
        p.enqueue(_raw(i))  # still on the queue
    try:
        p.shutdown(0.3)
    finally:
        release.set()
    assert p.steps_seen + p.dropped == 10  # every step written or counted: 1 + (6 taken + 3 queued)
    assert p.dropped == 9


def test_an_exporter_that_consumes_its_batch_in_place_costs_no_other():
    class Consuming(Exporter):
        name = "consuming"

        def export(self, batch: Batch) -> None:
            while batch.records:
                batch.records.pop()
            batch.findings.clear()
            batch.samples.clear()

    first, last = InMemoryExporter(), InMemoryExporter()
    inline = InMemoryExporter()
    p = _make(first, Consuming(), last, inline=inline)
    for rnd in range(3):
        for i in range(5):
            p.enqueue(_raw(rnd * 5 + i))
        p.run_pass()
        assert p.drain(10)
    p.shutdown(2.0)
    for e in (inline, first, last):
        assert [r.step for r in e.records] == list(range(15))
    assert first.records[0] is last.records[0]  # the records themselves are shared: only the lists are copies


def test_an_exporter_that_fails_once_is_said_to_be_tried_again_not_disabled(caplog):
    """A sink whose ``export`` raises (W&B's network, a full disk under TensorBoard) is tried again
    with the next batch. The log line and the ``internal_error`` finding said "disabled", and a
    user looking at the sink's data still coming in could not tell which was true."""
    class FlakyOnce(Exporter):
        name = "flaky"

        def __init__(self) -> None:
            self.records: list = []
            self.calls = 0

        def export(self, batch: Batch) -> None:
            self.calls += 1
            if self.calls == 1:
                raise ConnectionError("network is unreachable")
            self.records.extend(batch.records)

    flaky, out = FlakyOnce(), InMemoryExporter()
    p = _make(flaky, inline=out)
    p.enqueue(_raw(0))
    p.run_pass()
    assert p.drain(10)
    p.enqueue(_raw(1))
    p.run_pass()  # writes the first pass's internal_error finding
    assert p.drain(10)
    p.shutdown(5)
    assert [r.step for r in flaky.records] == [1] and p.failures.counts == {"exporter.e0": 1}
    [finding] = [f for f in out.findings if f.kind == "internal_error"]
    assert "disabled" not in finding.summary and "tried again" in finding.summary, finding.summary
    said = [r.getMessage() for r in caplog.records if "exporter.e0" in r.getMessage()]
    assert len(said) == 1 and "disabled" not in said[0] and "tried again" in said[0], said


def test_a_tracking_sink_that_turns_itself_off_is_said_to_be_disabled():
    from stepwatch.exporters.tracking import TrackingExporter

    class Refused(TrackingExporter):
        name = "refused"

        def _export(self, batch: Batch) -> None:
            raise PermissionError("the tracking server refuses writes")

    refused, out = Refused(), InMemoryExporter()
    p = _make(refused, inline=out)
    for i in range(2):
        p.enqueue(_raw(i))
        p.run_pass()
        assert p.drain(10)
    p.shutdown(5)
    assert refused.off and refused.dropped() == 2  # the batch that failed too (it went uncounted)
    [finding] = [f for f in out.findings if f.kind == "internal_error"]
    assert finding.summary.endswith("and was disabled"), finding.summary


def test_a_second_sigterm_handler_nested_in_the_first_does_not_wait_for_its_lock(monkeypatch):
    """Two SIGTERMs microseconds apart (torchrun stopping its ranks while ``scancel`` signals
    every process of the step): the second's handler runs nested in the first, between two of
    its bytecodes. The first took a lock, and waited on an Event (``_done.wait``), in the handler;
    a nested handler that landed while the first held that Event's lock waited for it forever,
    and the job hung instead of dying. Here a thread holds ``_done``'s lock as the interrupted
    first handler would, and runs the handler's finishing as the nested one: it returns within
    the finishing time, and the finishing itself still runs once."""
    import threading

    from stepwatch import _sigterm

    monkeypatch.setattr(_sigterm, "FINISH_S", 0.5)
    calls = []
    fin = _sigterm.SigtermFinisher(lambda timeout_s: calls.append(timeout_s))
    returned = threading.Event()

    def nested():
        with fin._done._cond:  # what the interrupted handler's Event.wait holds between checks
            fin._finish_once()
        returned.set()

    threading.Thread(target=nested, daemon=True).start()
    assert returned.wait(3.0), "the nested handler waited for a lock its own thread holds"
    assert fin._done.wait(3.0) and calls == [0.25]
    fin._finish_once()  # a later one: nothing started again
    assert calls == [0.25]
