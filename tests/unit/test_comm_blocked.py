"""The training thread's time blocked in collectives that stepwatch does not time otherwise
(comm/blocked.py): the job's own ``dist.all_reduce``/``barrier``/object collectives and every
``Work.wait()`` called from Python (FSDP2's, the job's ``async_op=True`` works).

Over a real one-rank gloo group, with the timer alone (a stand-in for the step tracker's state)
and through a real session; then the enricher's arithmetic (no time counted twice) and the
detectors that read it."""

import threading
import time

import pytest

from stepwatch.comm.overlap import CommEnricher
from stepwatch.comm.spans import ALL_GATHER, ALLREDUCE, IF_STEP_WORK, NEXT_STEP, THIS_STEP, CommCollector, Span
from stepwatch.record import StepRecord

MS = 1_000_000  # ns


class FakeTracker:
    """The step tracker's state the timer reads (hooks/phases.py): a step is open on this thread."""

    def __init__(self):
        self._thread = threading.get_ident()
        self.enabled = True
        self._prev_end = 0
        self._pending_end = None
        self.in_data = 0
        self._eval_open = False
        self._ckpt_depth = 0


@pytest.fixture
def timer():
    from stepwatch.comm.blocked import BlockedTimer

    errors = []
    col = CommCollector()
    tr = FakeTracker()
    t = BlockedTimer(col, tr, lambda where, e: errors.append((where, e)))
    yield t, col, tr, errors
    t.uninstall()


def _blocked(col):
    got = col.take()
    return [] if got is None else got["blocked"]


def test_a_synchronous_collective_is_blocked_time_an_async_one_only_at_its_wait(one_rank_group, timer):
    import torch

    dist = one_rank_group
    t, col, tr, errors = timer
    t.install()
    x = torch.ones(4)
    dist.all_reduce(x)
    got = _blocked(col)
    assert len(got) == 1 and got[0][1] >= got[0][0]
    work = dist.all_reduce(x, async_op=True)
    assert isinstance(work, dist.Work)  # the work object is torch's own, not a wrapper
    assert _blocked(col) == []  # issuing it blocks nothing
    work.wait()
    assert len(_blocked(col)) == 1  # its wait does
    dist.barrier()
    assert len(_blocked(col)) == 1  # barrier waits on its work inside: one interval
    assert not errors


def test_nested_collectives_count_once(one_rank_group, timer, monkeypatch):
    """A collective that calls others (all_gather_object calls all_gather, barrier calls wait):
    only the outermost call is timed."""
    import torch

    dist = one_rank_group
    t, col, tr, errors = timer
    orig_broadcast = dist.broadcast

    def slow_broadcast(tensor, src, *a, **k):
        time.sleep(0.03)
        return orig_broadcast(tensor, src, *a, **k)

    def outer_barrier(*a, **k):
        x = torch.ones(2)
        dist.broadcast(x, 0)  # the patched one: 30 ms
        dist.all_reduce(x, async_op=True).wait()
        return None

    monkeypatch.setattr(dist, "broadcast", slow_broadcast)
    monkeypatch.setattr(dist, "barrier", outer_barrier)
    t.install()
    dist.barrier()
    got = _blocked(col)
    assert len(got) == 1, got
    assert got[0][1] - got[0][0] >= 30 * MS
    dist.all_gather_object([None], {"a": 1})
    assert len(_blocked(col)) == 1
    t.uninstall()
    assert dist.barrier is outer_barrier and dist.broadcast is slow_broadcast  # put back as found
    assert not errors


def test_calls_off_the_training_thread_do_not_count(one_rank_group, timer):
    import torch

    dist = one_rank_group
    t, col, tr, errors = timer
    t.install()
    work = dist.all_reduce(torch.ones(4), async_op=True)

    def other():
        dist.all_reduce(torch.ones(4))
        work.wait()

    th = threading.Thread(target=other)
    th.start()
    th.join()
    assert col.take() is None and not errors


def test_what_is_not_the_steps_time_does_not_count(one_rank_group, timer):
    """Before the first step, inside a DataLoader fetch (data_wait_s), an evaluation (eval_s) or
    a checkpoint (checkpoint_s): none is compute, and none is in step_s to be taken out of it."""
    import torch

    dist = one_rank_group
    t, col, tr, errors = timer
    t.install()
    x = torch.ones(4)
    for attr, value, back in (("_prev_end", None, 0), ("in_data", 1, 0), ("_eval_open", True, False),
                              ("_ckpt_depth", 1, 0), ("enabled", False, True)):
        setattr(tr, attr, value)
        dist.all_reduce(x)
        dist.barrier()
        setattr(tr, attr, back)
        assert col.take() is None, attr
    assert not errors


def test_a_wait_after_the_steps_end_belongs_to_the_next_step(one_rank_group, timer):
    """After ``optimizer.step()`` the step's end is pending; what follows until the next training
    work (a barrier after rank 0's save, a logging all_reduce) is the next step's time."""
    import torch

    dist = one_rank_group
    t, col, tr, errors = timer
    t.install()
    dist.all_reduce(torch.ones(4))  # inside the step
    tr._pending_end = 123
    dist.barrier()  # after its end
    first = col.take()["blocked"]  # the tracker finalizes the step
    tr._pending_end = None
    assert len(first) == 1
    second = col.take()["blocked"]  # the next step's end
    assert len(second) == 1 and second[0][0] > first[0][1]
    assert col.take() is None


def test_uninstall_restores_work_wait_and_the_functions(one_rank_group, timer):
    dist = one_rank_group
    t, col, tr, errors = timer
    wait, all_reduce, barrier = dist.Work.__dict__["wait"], dist.all_reduce, dist.barrier
    t.install()
    assert dist.Work.__dict__["wait"] is not wait and dist.all_reduce is not all_reduce
    assert dist.all_reduce.__wrapped__ is all_reduce and dist.all_reduce.__name__ == "all_reduce"
    t.uninstall()
    assert dist.Work.__dict__["wait"] is wait and dist.all_reduce is all_reduce and dist.barrier is barrier


def test_a_failure_inside_the_timer_goes_to_on_error_never_to_the_job(one_rank_group, timer):
    import torch

    dist = one_rank_group
    t, col, tr, errors = timer
    t.install()

    def boom(*a):
        raise RuntimeError("boom")

    col.blocked = boom
    x = torch.ones(4)
    dist.all_reduce(x)  # no exception here
    assert errors and errors[0][0].startswith("comm.blocked") and not t.active
    dist.all_reduce(x)
    dist.all_reduce(x, async_op=True).wait()
    assert len(errors) == 1  # once: the timer is off


def test_the_jobs_own_errors_still_reach_it(one_rank_group, timer):
    import torch

    dist = one_rank_group
    t, col, tr, errors = timer
    t.install()
    with pytest.raises((RuntimeError, ValueError)):
        dist.broadcast(torch.ones(2), src=5)  # no rank 5
    dist.all_reduce(torch.ones(2))
    assert len(_blocked(col)) == 1 and not errors  # and the next call is timed as ever


def test_a_session_counts_the_jobs_collectives_as_exposed_comm_and_shutdown_restores(sw, one_rank_group):
    """Through the public API: a plain model (no DDP) whose loop all-reduces its loss and passes a
    barrier after the optimizer step (the next step's time; the last one's belongs to no step):
    every record carries comm_exposed_s."""
    import torch

    dist = one_rank_group
    stepwatch, mem, start = sw
    wait = dist.Work.__dict__["wait"]
    all_reduce = dist.all_reduce
    start()
    assert dist.Work.__dict__["wait"] is not wait
    m = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(4):
        loss = m(torch.ones(4, 8)).sum()
        dist.all_reduce(loss.detach().clone())
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
    stepwatch.shutdown()
    assert dist.Work.__dict__["wait"] is wait and dist.all_reduce is all_reduce
    recs = mem.records
    assert len(recs) == 4
    for r in recs:
        assert r.comm_exposed_s is not None and r.comm_exposed_s > 0, r
        assert r.comm_s is not None and r.comm_s >= r.comm_exposed_s - 1e-9, r
        assert r.comm_exposed_s <= r.step_s, r
        assert r.overlap is None and r.allreduce_s is None  # no DDP AllReduce in this job


def test_a_collective_after_a_teachers_no_grad_forward_is_the_steps(sw, one_rank_group):
    """Distillation with a logging all_reduce right after the teacher's no_grad forward: the
    teacher's call opens an evaluation span that the student's backward later judges to be the
    step's own work; the all_reduce inside it was dropped (comm_exposed_s null, the waiting rank's
    wait other_s). Through the session: the span listener hands the held interval to the step."""
    import torch

    dist = one_rank_group
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    teacher, student = torch.nn.Linear(8, 2), torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    for _ in range(4):
        x = torch.randn(4, 8)
        with torch.no_grad():
            t = teacher(x)
        dist.all_reduce(t)
        torch.nn.functional.mse_loss(student(x), t).backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 4
    for r in recs[1:]:  # step 0's teacher call comes before the roots are found
        assert r.eval_s == 0 and r.comm_exposed_s is not None and r.comm_exposed_s > 0, r


# -- the enricher: blocked intervals beside the measured spans ---------------------------------


def span(op, t0, t1, nbytes=None, world=2):
    s = Span(op, nbytes, world, 0, "h")
    s.t0, s.t1 = t0, t1
    return s


def rec(step=0, step_s=0.2, **kw):
    return StepRecord(step=step, rank=0, time=0.0, step_s=step_s, **kw)


def test_blocked_time_joins_ddps_exposure_without_counting_twice():
    e = CommEnricher()
    # backward 0-100 ms, one bucket issued at 80 ms running to 120 ms: 80-120 exposed. The job's
    # own all_reduce blocks 110-150 ms (overlapping the bucket's last 10 ms) and 160-170 ms.
    spans = [span(ALLREDUCE, 80 * MS, 120 * MS, 1_000_000)]
    r = rec()
    extras = {"comm": {"spans": spans, "fwd_end_ev": None, "blocked": [(110 * MS, 150 * MS), (160 * MS, 170 * MS)]},
              "backward_spans": [(0, 130 * MS)]}
    assert e.enrich(r, extras, force=False)
    assert r.comm_exposed_s == pytest.approx(0.080)  # 80-150 and 160-170
    assert r.comm_s == pytest.approx(0.080)
    assert r.allreduce_s == pytest.approx(0.040)
    assert r.overlap == pytest.approx(0.0)  # AllReduce's own overlap, as before
    assert e.ddp_exposed_s(r) == pytest.approx(0.040)


def test_blocked_time_alone_is_exposed_comm():
    e = CommEnricher()
    r = rec()
    assert e.enrich(r, {"comm": {"spans": [], "fwd_end_ev": None, "blocked": [(0, 30 * MS)]}}, force=False)
    assert r.comm_exposed_s == pytest.approx(0.030) and r.comm_s == pytest.approx(0.030)
    assert r.overlap is None and r.allreduce_s is None and r.busbw_gbps is None


def test_host_timed_fsdp_spans_are_exposed_where_the_thread_waited_for_them():
    """FSDP2 on gloo: its synchronous all-gather (or its wait) is where the training thread stood;
    the span and the wait are the same time, counted once in comm_s."""
    e = CommEnricher()
    r = rec()
    spans = [span(ALL_GATHER, 0, 10 * MS, 4_000_000), span(ALL_GATHER, 20 * MS, 50 * MS, 4_000_000)]
    extras = {"comm": {"spans": spans, "fwd_end_ev": None, "blocked": [(0, 10 * MS), (45 * MS, 50 * MS)]},
              "backward_spans": [(15 * MS, 60 * MS)]}
    assert e.enrich(r, extras, force=False)
    assert r.comm_s == pytest.approx(0.040)
    assert r.comm_exposed_s == pytest.approx(0.015)
    assert r.overlap is None and r.allreduce_s is None


def test_without_blocked_timing_fsdp_exposure_stays_unknown():
    e = CommEnricher()
    r = rec()
    e.enrich(r, {"comm": {"spans": [span(ALL_GATHER, 0, 10 * MS)], "fwd_end_ev": None}}, force=False)
    assert r.comm_s == pytest.approx(0.010) and r.comm_exposed_s is None


def test_the_collector_hands_blocked_time_over_with_its_step():
    col = CommCollector()
    col.blocked_on = True
    assert col.take() is None
    col.blocked(1, 2, THIS_STEP)
    col.blocked(3, 4, NEXT_STEP)  # after the step's end
    assert col.take() == {"spans": [], "fwd_end_ev": None, "blocked": [(1, 2)]}
    assert col.take() == {"spans": [], "fwd_end_ev": None, "blocked": [(3, 4)]}
    assert col.take() is None


def test_time_inside_an_evaluation_span_waits_for_its_judgement():
    """A frozen teacher's forward under no_grad opens an evaluation span that the step's backward
    later judges to be the step's own work; a logging all_reduce right after it was dropped as
    evaluation time: the waiting rank's wait was other_s, and no straggler was named. Held now:
    the step's when the span was its work, nobody's when it was an evaluation."""
    col = CommCollector()
    col.blocked_on = True
    col.blocked(1, 2, IF_STEP_WORK)
    assert col.take() is None  # not judged yet: in no step
    col.blocked(3, 4, IF_STEP_WORK)
    col.eval_judged(False)  # the teacher's: this step's
    assert col.take() == {"spans": [], "fwd_end_ev": None, "blocked": [(1, 2), (3, 4)]}
    col.blocked(5, 6, IF_STEP_WORK)
    col.eval_judged(True)  # an evaluation: eval_s
    assert col.take() is None


def test_the_jobs_own_gathers_are_kept_in_the_step_whose_time_they_are(one_rank_group):
    """``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (timed as spans, fsdp.py) called by
    the job: before the first step they were step 0's comm_s (303 ms against a 1.5 ms step), a
    gather of predictions inside an evaluation the next step's, one after ``optimizer.step()``
    the step that had ended (and its wait the next one's: counted twice). A group passed by
    position was taken as the world: busbw with the wrong n, and the watchdog's "default" group."""
    import torch

    from stepwatch.comm.fsdp import CollectivePatches

    dist = one_rank_group
    col, tr, errors = CommCollector(), FakeTracker(), []
    p = CollectivePatches(col, lambda where, e: errors.append(e), tr)
    p.install()
    try:
        out, inp = torch.zeros(4), torch.ones(4)

        def gathered():
            got = col.take()
            return [] if got is None else [s.op for s in got["spans"]]

        tr._prev_end = None  # before the first step
        dist.all_gather_into_tensor(out, inp)
        assert gathered() == []
        tr._prev_end = 0
        tr._eval_open = True  # inside an evaluation span, then judged an evaluation
        dist.all_gather_into_tensor(out, inp)
        col.eval_judged(True)
        tr._eval_open = False
        assert gathered() == []
        tr._eval_open = True  # a teacher's span, judged the step's work
        dist.reduce_scatter_tensor(out[:4], inp)
        col.eval_judged(False)
        tr._eval_open = False
        assert gathered() == ["reduce_scatter"]
        tr._pending_end = 5  # after optimizer.step(): the next step's
        dist.all_gather_into_tensor(out, inp)
        assert gathered() == []  # the step ending now has none
        tr._pending_end = None
        assert gathered() == ["all_gather"]
        sub = dist.new_group([0])
        dist.all_gather_into_tensor(out, inp, sub)  # the group by position
        (s,) = col.take()["spans"]
        assert s.group != "default" and s.group == getattr(sub, "group_name", None)
        assert not errors
    finally:
        p.uninstall()


# -- who reads it ------------------------------------------------------------------------------


def test_overlap_finding_counts_allreduce_exposure_only():
    from stepwatch.comm.findings import OverlapDetector

    e = CommEnricher()
    recs = []
    for i in range(4):
        r = rec(step=i, step_s=0.1)
        # one bucket after backward (overlap 0, 5 ms exposed), 60 ms blocked in a logging all_reduce
        e.enrich(r, {"comm": {"spans": [span(ALLREDUCE, 90 * MS, 95 * MS)], "fwd_end_ev": None,
                              "blocked": [(100 * MS, 160 * MS)]}, "backward_spans": [(0, 95 * MS)]}, force=False)
        r.comm_wait_s = 0.0  # the straggler exchange's verdict: no rank waited for another
        recs.append(r)
    assert recs[0].comm_exposed_s == pytest.approx(0.065)
    det = OverlapDetector(window=4, threshold=0.8, exposed_of=e.ddp_exposed_s)
    got = [f for r in recs for f in det.observe(r)]
    assert len(got) == 1 and got[0].data["exposed_s"] == pytest.approx(0.005)


def test_the_straggler_compute_and_the_spike_see_blocked_time():
    from stepwatch.analysis.detectors import collective_s, spike_finding
    from stepwatch.comm.stragglers import summarize

    e = CommEnricher()
    waited = []
    for i in range(3):
        r = rec(step=i, step_s=0.025)
        e.enrich(r, {"comm": {"spans": [], "fwd_end_ev": None, "blocked": [(0, 20 * MS)]}}, force=False)
        waited.append(r)
    assert summarize(waited, 0, "h").compute_s == pytest.approx(0.005)
    spike = rec(step=3, step_s=0.305)
    e.enrich(spike, {"comm": {"spans": [], "fwd_end_ev": None, "blocked": [(0, 300 * MS)]}}, force=False)
    assert collective_s(spike) == pytest.approx(0.300)
    f = spike_finding(spike, median_s=0.005, mad_s=0.001, limit_s=0.01, collective_median_s=0.0)
    assert f.severity == "info" and "waiting in a collective" in f.summary


def test_the_report_says_the_slowest_rank_was_waiting_when_its_excess_is_exposed_comm(tmp_path):
    """`if rank == 0: torch.save(...)`, then `dist.barrier()`: rank 0's save is its checkpoint_s,
    out of its steps; rank 1's wait in the barrier is in its steps, as exposed communication. Its
    mean step time is the longest, and the report says whose time that was; a rank slower by its
    own work keeps the plain mark."""
    import json

    from stepwatch.report import load_run, summarize
    from stepwatch.report.tables import per_rank

    def write(d, slow_is_wait):
        d.mkdir()
        (d / "run.json").write_text(json.dumps({"schema_version": 1, "run_id": d.name, "world_size": 2,
                                                "config": {}, "features": {"records": True}}))
        for r in (0, 1):
            with open(d / f"steps.rank{r}.jsonl", "w", encoding="utf-8") as f:
                for i in range(60):
                    x = rec(step=i, step_s=0.010, other_s=0.008, forward_s=0.002, comm_exposed_s=0.001)
                    x.rank, x.time = r, 1.7e9 + i
                    if r == 0 and i % 20 == 19:
                        x.checkpoint_s = 0.3
                    if r == 1 and i % 20 == 0 and i:
                        x.step_s += 0.3
                        x.other_s += 0.3
                        if slow_is_wait:
                            x.comm_exposed_s += 0.3
                    f.write(json.dumps(x.to_dict()) + "\n")

    write(tmp_path / "wait", True)
    write(tmp_path / "own", False)
    t = per_rank(summarize(load_run(str(tmp_path / "wait"))))
    note = [n for n in t.notes if n.startswith("* rank 1")]
    assert note and "waited in collectives for the other ranks" in note[0], t.notes
    assert t.tags == ["", "info"]
    t = per_rank(summarize(load_run(str(tmp_path / "own"))))
    assert "* rank 1: slowest step time." in t.notes and t.tags == ["", "warn"], t.notes


def test_a_compiled_function_calling_a_wrapped_collective_still_compiles_whole(one_rank_group, timer):
    """torch.compile rewrites dist.all_reduce into a traceable collective by looking the function
    up in its table; the wrapper gets the same entry (it would be traced into, and break the graph
    at threading.get_ident), and leaves the table at uninstall."""
    import torch
    from torch.distributed._functional_collectives import traceable_collective_remaps as remaps

    dist = one_rank_group
    t, col, tr, errors = timer
    t.install()
    assert dist.all_reduce in remaps and dist.all_gather_into_tensor in remaps

    def f(x):
        dist.all_reduce(x)
        return x * 2

    g = torch.compile(f, backend="eager", fullgraph=True)
    assert torch.equal(g(torch.ones(3)), torch.full((3,), 2.0))
    ours = dist.all_reduce
    t.uninstall()
    assert ours not in remaps and not [k for k in remaps if k.__module__.startswith("stepwatch")]


class _DeviceEvent:
    """Stands in for a recorded torch.cuda.Event (no GPU here): a time on the device clock, in ms."""

    def __init__(self, ms):
        self.ms = ms


def test_on_the_device_clock_the_hosts_blocked_time_is_added_and_fsdp_exposure_stays_unknown(monkeypatch):
    """CUDA: spans are device-timed, blocked time is the host's; no common axis, so the two add.
    A step with FSDP's device-timed collectives (waited for by the streams, not the host) keeps
    its exposure unknown."""
    import stepwatch.comm.overlap as overlap
    import stepwatch.comm.spans as spans_mod

    monkeypatch.setattr(spans_mod, "event_done", lambda ev, device: True)
    monkeypatch.setattr(overlap, "event_elapsed_s", lambda a, b, device: (b.ms - a.ms) * 1e-3)
    gpu = span(ALLREDUCE, 0, 0, 4_000_000)
    gpu.ev0, gpu.ev1 = _DeviceEvent(30.0), _DeviceEvent(50.0)  # issued at 30 ms: all 20 ms exposed
    r = rec()
    extras = {"comm": {"spans": [gpu], "fwd_end_ev": _DeviceEvent(0.0), "blocked": [(0, 5 * MS)]}}
    assert CommEnricher().enrich(r, extras, force=False)
    assert r.comm_exposed_s == pytest.approx(0.025) and r.comm_s == pytest.approx(0.025)
    assert r.overlap == pytest.approx(0.0)
    fsdp = span(ALL_GATHER, 0, 0, 4_000_000)
    fsdp.ev0, fsdp.ev1 = _DeviceEvent(10.0), _DeviceEvent(20.0)
    r = rec()
    extras = {"comm": {"spans": [fsdp], "fwd_end_ev": None, "blocked": [(0, 1 * MS)]}}
    assert CommEnricher().enrich(r, extras, force=False)
    assert r.comm_exposed_s is None and r.comm_s == pytest.approx(0.011)
