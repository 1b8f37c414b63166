"""The background pipeline on its own: no Session, no hooks, no torch. Raw steps go in as the
training thread hands them over; what comes out is read from real exporters."""

from __future__ import annotations

import threading
import time

import pytest

from stepwatch import _pipeline as pipeline_mod
from stepwatch.analysis.kinds import make_finding
from stepwatch.context import RunContext
from stepwatch.exporters.base import Batch, Exporter, InMemoryExporter
from stepwatch.exporters.builtin import ExporterSpec
from stepwatch._pipeline import Pending, Pipeline
from stepwatch.record import RawStep

MS = 1_000_000  # ns


def ctx(rank: int = 3) -> RunContext:
    return RunContext(rank=rank, local_rank=0, world_size=4, host="h", run_id="r", run_dir="/nonexistent")


def raw(step: int, *, t_end: int = 0, scalars=None, extras=None, ckpt_ns: int = 0, tail: bool = False) -> RawStep:
    # step 100 ms: data 10, forward 20, backward 30, optimizer 15 -> other 25
    return RawStep(step, t_end, 100 * MS, 10 * MS, 20 * MS, 30 * MS, 15 * MS, 0, ckpt_ns, {"mine": 5 * MS},
                   dict(scalars or {}), False, 123, dict(extras or {}), tail)


class Recording(InMemoryExporter):
    """An in-memory exporter that also keeps each batch as it came (its drop count too)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[Batch] = []

    def export(self, batch: Batch) -> None:
        self.batches.append(batch)
        super().export(batch)


def make(*, inline: Exporter | None = None, others=(), **kw) -> Pipeline:
    specs = []
    if inline is not None:
        specs.append(ExporterSpec("records", lambda: inline, inline=True))
    for name, e in others:
        specs.append(ExporterSpec(name, (lambda e=e: e)))
    return Pipeline(ctx(), sinks=lambda: specs, **kw)


def test_raw_steps_decode_into_records_that_reach_every_exporter():
    inline, other = Recording(), Recording()
    opened = []
    p = make(inline=inline, others=[("other", other)], on_open=lambda: opened.append(list(p.exporter_names)))
    t0 = p.perf_ref_ns
    p.enqueue(raw(7, t_end=t0 + 2_000 * MS, scalars={"loss": 2, "bad": "x"}))
    p.enqueue(raw(8, t_end=t0 + 2_100 * MS, ckpt_ns=500 * MS, extras={"checkpoint_bytes": 2_000_000_000}))
    p.enqueue(RawStep(9, t0 + 2_300 * MS, 0, 0, 0, 0, 0, 40 * MS, 0, {}, {}, False, None, {}, True))
    p.run_pass()
    assert opened == [["records", "other"]]
    assert p.drain(10)
    for e in (inline, other):
        assert [r.step for r in e.records] == [7, 8, 9]
    a, b, tail = inline.records
    assert a.rank == 3 and a.time == pytest.approx(p.wall_ref + 2.0)
    assert (a.step_s, a.data_wait_s, a.forward_s, a.backward_s, a.optimizer_s) == pytest.approx((0.1, 0.01, 0.02, 0.03, 0.015))
    assert a.other_s == pytest.approx(0.025) and a.phases == {"mine": pytest.approx(0.005)} and a.mem_peak_bytes == 123
    assert a.scalars == {"loss": 2.0, "bad": None} and p.null_scalars == {"bad": 1}
    assert a.checkpoint_s == 0 and a.checkpoint_bytes is None and a.checkpoint_gbps is None
    assert b.checkpoint_s == pytest.approx(0.5) and b.checkpoint_bytes == 2_000_000_000
    assert b.checkpoint_gbps == pytest.approx(4.0)
    assert tail.tail and tail.eval_s == pytest.approx(0.04) and tail.step_s == 0 and not a.tail
    assert p.steps_seen == 2 and p.dropped == 0 and not p.failures.counts  # the tail is no step


def test_an_enricher_holds_records_in_order_until_it_is_ready_and_is_forced_at_the_end():
    out = Recording()
    gate = {"open": False}
    seen = []

    class Waits:
        def enrich(self, rec, extras, *, force):
            seen.append((rec.step, force))
            if rec.step == 1 and not (gate["open"] or force):
                return False
            rec.grad_norm = float(extras["n"])
            return True

    p = make(inline=out)
    p.add_enricher(Waits())
    for i in range(4):
        p.enqueue(raw(i, extras={"n": 10 + i}))
    p.run_pass()
    # step 0 leaves; step 1 waits, and holds 2 and 3 behind it (they are not even tried)
    assert [r.step for r in out.records] == [0] and seen == [(0, False), (1, False)]
    p.run_pass()
    assert [r.step for r in out.records] == [0]
    gate["open"] = True
    p.run_pass()
    assert [(r.step, r.grad_norm) for r in out.records] == [(0, 10.0), (1, 11.0), (2, 12.0), (3, 13.0)]
    # one that never gets ready is forced by the final pass
    gate["open"] = False
    p.enqueue(raw(1, extras={"n": 99}))
    p.run_pass()
    assert len(out.records) == 4
    p.shutdown(2.0)
    assert [r.step for r in out.records][-1] == 1 and seen[-1] == (1, True)


def test_pending_device_scalars_wait_for_their_copy(monkeypatch):
    done = {"yes": False}
    monkeypatch.setattr(pipeline_mod, "event_done", lambda event, device: done["yes"])
    out = Recording()
    p = make(inline=out)
    p.enqueue(raw(0, scalars={"loss": Pending(host=1.5, event=object(), device=0)}))
    p.run_pass()
    assert out.records == []
    done["yes"] = True
    p.run_pass()
    assert [r.scalars for r in out.records] == [{"loss": 1.5}]


@pytest.mark.parametrize("found", [1.0, 0.0])
def test_a_skip_read_from_the_device_waits_for_its_copy(monkeypatch, found):
    """A fused optimizer's ``found_inf`` on a CUDA device (hooks/install.py ``_found_inf``)
    reaches the record as a device copy: the record waits for it like a CUDA scalar, then says
    ``skipped`` as the copy reads (the event is faked here: no GPU on this machine)."""
    import torch

    done = {"yes": False}
    monkeypatch.setattr(pipeline_mod, "event_done", lambda event, device: done["yes"])
    out = Recording()
    p = make(inline=out)
    r = raw(0)
    r.skipped = Pending(host=torch.tensor(found), event=object(), device=0)
    p.enqueue(r)
    p.enqueue(raw(1))
    p.run_pass()
    assert out.records == []  # the second waits behind the first: records leave in order
    done["yes"] = True
    p.run_pass()
    assert [(rec.step, rec.skipped) for rec in out.records] == [(0, found > 0), (1, False)]


def test_each_enricher_runs_once_per_record_whether_it_waited_or_not():
    """Records that no enricher holds run every enricher once, in order, with no bookkeeping;
    one that waits keeps which ran (a failed one counts as run), and resumes after them, with
    an enricher added meanwhile run once too. The records behind it wait, untried."""
    out = Recording()
    gate = {"open": False}
    calls = []

    class Named:
        def __init__(self, name, *, waits_on=None, fails=False):
            self.name, self.waits_on, self.fails = name, waits_on, fails

        def enrich(self, rec, extras, *, force):
            calls.append((self.name, rec.step))
            if self.fails:
                raise RuntimeError("enricher bug")
            return rec.step != self.waits_on or gate["open"] or force

    p = make(inline=out)
    for e in (Named("a"), Named("fails", fails=True), Named("waits", waits_on=1), Named("b")):
        p.add_enricher(e)
    for i in range(3):
        p.enqueue(raw(i))
    p.run_pass()
    assert [r.step for r in out.records] == [0]
    assert calls == [("a", 0), ("fails", 0), ("waits", 0), ("b", 0), ("a", 1), ("waits", 1)]
    calls.clear()
    p.add_enricher(Named("new"), first=True)
    gate["open"] = True
    p.enqueue(raw(3))
    p.run_pass()
    assert [r.step for r in out.records] == [0, 1, 2, 3]
    assert calls == [("new", 1), ("waits", 1), ("b", 1)] + [(n, s) for s in (2, 3) for n in ("new", "a", "waits", "b")]
    assert p.failures.counts["enricher.Named"] == 1


def test_a_failing_enricher_detector_or_exporter_is_reported_and_costs_no_other():
    good_inline, good_other = Recording(), Recording()

    class Broken(Exporter):
        name = "broken"

        def export(self, batch):
            raise OSError("sink down")

    class BadEnricher:
        def enrich(self, rec, extras, *, force):
            raise RuntimeError("enricher bug")

    class GoodEnricher:
        def enrich(self, rec, extras, *, force):
            rec.tokens = 42
            return True

    class BadDetector:
        def observe(self, rec):
            raise ValueError("detector bug")

    class GoodDetector:
        def observe(self, rec):
            return [make_finding("internal_error", rank=rec.rank, step=rec.step, summary="seen",
                                 data={"subject": f"s{rec.step}"})]

    p = make(inline=good_inline, others=[("broken", Broken()), ("other", good_other)], step_of=lambda: 77)
    p.add_enricher(BadEnricher())
    p.add_enricher(GoodEnricher())
    p.add_detector(BadDetector())
    p.add_detector(GoodDetector())
    for i in range(3):
        p.enqueue(raw(i))
    p.run_pass()
    p.enqueue(raw(3))
    p.run_pass()
    assert p.drain(10)
    for e in (good_inline, good_other):
        assert [(r.step, r.tokens) for r in e.records] == [(0, 42), (1, 42), (2, 42), (3, 42)]
    counts = p.failures.counts
    assert counts["enricher.BadEnricher"] == 1  # left out after its first failure
    assert counts["detector.BadDetector"] == 4  # one failure per record, the others still observed
    assert counts["exporter.broken"] == 2  # each batch tried
    assert [type(e).__name__ for e in p.enrichers] == ["GoodEnricher"]
    # each place's first failure is a finding, in the pass after it (with the training step)
    # (the broken exporter's own, reported from its thread, may come in the same pass or the next)
    errs = [f for f in good_inline.findings if "where" in f.data and f.data["where"] != "exporter.broken"]
    assert sorted(f.data["where"] for f in errs) == ["detector.BadDetector", "enricher.BadEnricher"]
    assert all(f.step == 77 and f.rank == 3 and f.kind == "internal_error" for f in errs)
    assert len([f for f in good_other.findings if f.summary == "seen"]) == 4
    p.run_pass()  # the exporter's failure, reported on its thread after the last pass
    assert p.drain(10)
    assert any(f.data.get("where") == "exporter.broken" for f in good_inline.findings)


def test_features_collect_and_act_on_the_rate_limited_findings():
    out = Recording()
    acted = []

    class Feat:
        name = "feat"

        def collect(self, records):
            fs = [make_finding("internal_error", rank=3, step=r.step, summary="again", data={"subject": "x"})
                  for r in records]
            return [{"time": 1.0, "gpu_util": 0.5}], fs

        def on_findings(self, findings):
            acted.append([f.step for f in findings])

    class Broken:
        name = "broken"

        def collect(self, records):
            raise RuntimeError("collect bug")

    p = make(inline=out, features=[Broken(), Feat()], window=10, repeat_windows=1)
    for i in range(5):
        p.enqueue(raw(i))
    p.run_pass()
    # one finding per episode: the same kind/rank/subject in the window passes once
    assert acted == [[0]] and [f.step for f in out.findings] == [0]
    assert out.samples == [{"time": 1.0, "gpu_util": 0.5}]
    assert p.failures.counts == {"feature.Broken": 1}


@pytest.mark.parametrize("hot", [False, True], ids=["enqueue", "hot_enqueue"])
def test_the_bounded_queue_counts_what_it_drops_and_the_batch_carries_the_count(hot):
    """``hot_enqueue()`` (the training thread's: _speedups.c's Enqueue where built) does what
    ``enqueue`` does: the same queue, the same drop count, the pipeline woken at the first record."""
    out = Recording()
    p = make(inline=out, queue_size=3)
    put = p.hot_enqueue() if hot else p.enqueue
    if hot and pipeline_mod._CEnqueue is not None:
        assert type(put) is pipeline_mod._CEnqueue
    assert not p._wake.is_set()
    for i in range(5):
        put(raw(i))
    assert p._wake.is_set()
    assert p.dropped == 2 and [r.step for r in p._queue] == [0, 1, 2]
    p.run_pass()
    assert [r.step for r in out.records] == [0, 1, 2]
    assert out.batches[-1].dropped == 2 and p.total_dropped() == 2


class _CountingEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    def set(self) -> None:
        self.sets += 1
        super().set()


@pytest.mark.parametrize("hot", [False, True], ids=["enqueue", "hot_enqueue"])
def test_records_before_the_first_pass_wake_the_thread_once_not_every_step(hot):
    """Until the pipeline's thread has opened its exporters, a record wakes it. Waking is an
    ``Event.set()`` (a lock and a notify, ~7k instructions, more than the rest of the hand-over):
    done once, not at every step that comes before the thread gets the GIL. A pass that found no
    record (its interval ran out first) leaves the exporters closed, and the next record wakes
    it again; once open, no record wakes it."""
    out = Recording()
    p = make(inline=out)
    p._wake = ev = _CountingEvent()
    put = p.hot_enqueue() if hot else p.enqueue
    for i in range(50):
        put(raw(i))
    assert ev.sets == 1 and len(p._queue) == 50

    q = make(inline=Recording())
    q._wake = ev = _CountingEvent()
    put = q.hot_enqueue() if hot else q.enqueue
    q.run_pass()  # the interval ran out before any record: nothing opened
    assert q.exporter_names == []
    put(raw(0))
    put(raw(1))
    assert ev.sets == 1
    q.run_pass()  # takes the records, opens the exporters
    assert q.exporter_names == ["records"]
    for i in range(2, 40):
        put(raw(i))
    assert ev.sets == 1


def test_shutdown_runs_a_final_pass_and_flushes_the_exporters():
    inline, other = Recording(), Recording()
    p = make(inline=inline, others=[("other", other)], flush_interval_s=60.0)
    p.start()
    p.enqueue(raw(0))  # the first record wakes the thread: exporters open now, not in a minute
    deadline = time.monotonic() + 10
    while not inline.records and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r.step for r in inline.records] == [0]
    for i in range(1, 4):
        p.enqueue(raw(i))  # these wait for the next pass: a minute away
    stopped = []
    p.shutdown(2.0, meanwhile=lambda: stopped.append(p.final_pass))
    assert [r.step for r in inline.records] == [0, 1, 2, 3] == [r.step for r in other.records]
    assert inline.shut_down and other.shut_down and stopped == [False]
    assert p.dropped == 0 and p.workers[0].total_dropped() == 0


def test_final_pass_flag_is_set_only_during_the_final_pass():
    seen = []

    class Feat:
        name = "f"

        def collect(self, records):
            seen.append(p.final_pass)
            return [], []

    p = make(inline=Recording(), features=[Feat()])
    p.run_pass()
    p.shutdown(1.0)
    assert seen == [False, True] and p.final_pass is False


def test_a_stuck_pass_costs_shutdown_its_budget_only_and_what_it_held_is_counted():
    release = threading.Event()
    entered = threading.Event()

    class Stuck:
        def observe(self, rec):
            entered.set()
            release.wait(30)
            return []

    out = Recording()
    p = make(inline=out, flush_interval_s=0.01)
    p.add_detector(Stuck())
    p.start()
    p.enqueue(raw(0))
    assert entered.wait(10)
    for i in range(1, 6):
        p.enqueue(raw(i))
    t = time.monotonic()
    try:
        p.shutdown(0.3)
        took = time.monotonic() - t
    finally:
        release.set()
    assert took < 2.0
    assert p.dropped == 6  # the queued records that no pass will take, and the one the stuck pass took


def test_an_exporter_stuck_in_its_flush_at_shutdown_is_not_said_to_have_records_counted(caplog):
    """OTLP with the collector down: every batch was exported (into the SDK), and the exporter's
    own flush was still trying when shutdown's time was up. The warning said what it held was
    counted in ``exporter_drops``, which was empty: nothing was held, the last push was pending."""

    class SlowFlush(Recording):
        def force_flush(self, timeout_s=None):
            time.sleep(1.0)

    class StuckExport(Recording):
        def __init__(self):
            super().__init__()
            self.release = threading.Event()

        def export(self, batch):
            self.release.wait(5)

    slow, stuck = SlowFlush(), StuckExport()
    p = make(others=[("slowflush", slow), ("stuck", stuck)])
    p.start()
    t0 = p.perf_ref_ns
    for i in range(3):
        p.enqueue(raw(i, t_end=t0 + i * MS))
    with caplog.at_level("WARNING", logger="stepwatch"):
        p.shutdown(0.4)
    stuck.release.set()
    said = {r.getMessage().split(" did not finish")[0].rsplit(" ", 1)[-1]: r.getMessage() for r in caplog.records
            if "did not finish" in r.getMessage()}
    assert set(said) == {"slowflush", "stuck"}, said
    assert "counted" not in said["slowflush"] and "still flushing" in said["slowflush"]
    assert "the 3 records, findings and samples it still held are counted" in said["stuck"], said["stuck"]
    assert [r.step for r in slow.records] == [0, 1, 2]
