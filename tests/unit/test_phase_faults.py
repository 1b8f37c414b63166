"""Phases that a fault leaves open, on both tracker cores.

An ``optimizer.step()`` that raises (the job's step pre-hook refusing it, an OOM the loop catches
and skips): torch runs no step post-hook, so the optimizer phase stayed open; the loop's work after
it was ``optimizer_s`` and the failed iteration merged into the next one's record. Now the first
work that finds the phase open with no optimizer step running ends the failed step where its
``step()`` began, marked ``skipped`` (phases.py ``_opt_raised``).

A SIGTERM (preemption) during a checkpoint save: the shutdown runs while the training thread is
still inside ``torch.save``, so the save never ended and was in no record. Now ``flush`` closes it
into the tail record."""

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from stepwatch.hooks import phases

try:
    from stepwatch.hooks import _ctracker
except ImportError:  # the Python core alone
    _ctracker = None

CORES = [phases.PyStepTracker] + ([phases.StepTracker] if phases._Core is not phases._PyCore else [])


@pytest.fixture
def clock(monkeypatch):
    """A fake clock for both cores: ``at(t)`` sets it to ``t`` ns past a base."""
    now = [10**9]
    base = now[0]
    fn = lambda: now[0]  # noqa: E731
    monkeypatch.setattr(phases, "_now", fn)
    if _ctracker is not None:
        _ctracker._set_clock(fn)

    def at(t):
        now[0] = base + t

    yield at
    if _ctracker is not None:
        _ctracker._set_clock(None)


class _Device:
    """A device timer that records what happens to each interval."""

    def __init__(self):
        self.slots, self.ended, self.cancelled = [], [], []

    def begin(self, code):
        self.slots.append(code)
        return len(self.slots) - 1

    def end(self, slot):
        self.ended.append(slot)

    def cancel(self, slot):
        self.cancelled.append(slot)


def _fwd_bwd(tr, at, fwd_end, bwd_end):
    """A forward from now to ``fwd_end``, then a backward to ``bwd_end``."""
    tr.forward_begin(True)
    at(fwd_end)
    tr.forward_end()
    tr.backward_begin()
    at(bwd_end)
    tr.backward_end()


def _step0(tr, at):
    """Step 0: work from 1000, its optimizer step ends at 1300."""
    at(1000)
    _fwd_bwd(tr, at, 1100, 1200)
    tr.optimizer_begin()
    at(1300)
    tr.optimizer_end()


def _failed_iteration(tr, at, scaler=False):
    """Iteration 1: a fetch 2000-2100, forward, backward, then ``optimizer.step()`` at 2300 raises
    (no post-hook); under GradScaler, ``scaler.step`` (2250-2350) ends after it."""
    at(2000)
    t0 = tr.data_begin()
    at(2100)
    tr.data_end(t0)
    _fwd_bwd(tr, at, 2200, 2250)
    s0 = tr.scaler_begin() if scaler else 0
    at(2300)
    tr.optimizer_begin()  # raises in step(): no optimizer_end
    if scaler:
        at(2350)
        tr.scaler_end(s0)  # scaler.step's finally


def _next_iteration(tr, at, first):
    """Iteration 2, after the loop's own work until 3000: a fetch 3000-3200, then ``first``
    (a forward; or the optimizer step of a closure loop; or a save 3000-3100 and no fetch), and
    its step to 3500."""
    if first == "checkpoint":
        at(3000)
        t0 = tr.checkpoint_begin()
        at(3100)
        tr.checkpoint_end(t0, 10)
        at(3200)
    else:
        at(3000)
        t0 = tr.data_begin()
        at(3200)
        tr.data_end(t0)
    if first == "optimizer":  # optimizer.step(closure): the closure's forward and backward inside
        tr.optimizer_begin()
        paused = tr.pause_optimizer()
        _fwd_bwd(tr, at, 3300, 3400)
        if paused:
            tr.resume_optimizer()
    else:
        _fwd_bwd(tr, at, 3300, 3400)
        tr.optimizer_begin()
    at(3500)
    tr.optimizer_end()


@pytest.mark.parametrize("cls", CORES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("first", ["forward", "optimizer", "checkpoint"])
def test_a_failed_optimizer_step_is_its_own_skipped_step_without_optimizer_time(cls, first, clock):
    """The failed step ends where its ``step()`` began (2300), skipped, no optimizer time; the
    loop's work after it and the next batch's fetch are the next step's. It was one record of
    both iterations, with the 900 ns after the raise (to the next forward) as ``optimizer_s``."""
    recs = []
    tr = cls(recs.append)
    dev = tr.device = _Device()
    _step0(tr, clock)
    _failed_iteration(tr, clock)
    _next_iteration(tr, clock, first)
    tr.flush()
    assert tr.enabled
    assert [r.step for r in recs] == [0, 1, 2], recs
    r0, r1, r2 = recs
    assert (r0.step_ns, r0.optimizer_ns, r0.skipped) == (300, 100, False)
    assert (r1.step_ns, r1.data_ns, r1.forward_ns, r1.backward_ns, r1.optimizer_ns, r1.skipped) == (
        1000, 100, 100, 50, 0, True)
    if first == "checkpoint":  # the save after the failed step is the next step's
        assert r1.checkpoint_ns == 0 and r2.checkpoint_ns == 100
        assert (r2.step_ns, r2.data_ns) == (3500 - 2300 - 100, 0)
    else:
        assert (r2.step_ns, r2.data_ns) == (3500 - 2300, 200)
    # the closure loop's step: its forward/backward paused its optimizer phase, as ever
    assert (r2.forward_ns, r2.backward_ns, r2.optimizer_ns, r2.skipped) == (100, 100, 100, False)
    # the failed phase's device interval is given up, not ended at the next work
    failed = [i for i, code in enumerate(dev.slots) if code == phases.PHASE_OPTIMIZER][1]
    assert failed in dev.cancelled and failed not in dev.ended, (dev.slots, dev.ended, dev.cancelled)


@pytest.mark.parametrize("cls", CORES, ids=lambda c: c.__name__)
def test_a_failed_steps_device_interval_is_given_up_not_timed_to_the_next_work(cls):
    """On the device clock (hooks/device.py over a ring; the host ring here, as no GPU is at
    hand): the failed phase's interval was ended at the next forward, so the failed step's
    ``optimizer_s`` on the device clock was the loop's 20 ms after the raise. It is given up: every
    record gets all the intervals it expects, and none of the failed step's is an optimizer's."""
    from stepwatch.cuda_ext._python import PyHostRing
    from stepwatch.hooks import device

    ring = PyHostRing(64)
    recs = []
    tr = cls(recs.append)
    device.install(tr, ring, None)
    at = lambda t: None  # noqa: E731  (the real clock: the ring stamps with it)
    _step0(tr, at)
    _failed_iteration(tr, at)
    time.sleep(0.02)  # the loop's own work after the failed step
    _next_iteration(tr, at, "forward")
    tr.flush()
    assert [(r.step, r.skipped) for r in recs] == [(0, False), (1, True), (2, False)], recs
    polled = ring.poll()
    for r in recs:
        step, expected = r.extras["device_timing"]
        assert len([tag for tag, _, _ in polled if tag[0] == step]) == expected, (r.step, polled)
    assert not [tag for tag, _, _ in polled if tag == (1, phases.PHASE_OPTIMIZER)], polled
    assert all(e < 0.01 for tag, _, e in polled if tag[1] == phases.PHASE_OPTIMIZER), polled


@pytest.mark.parametrize("cls", CORES, ids=lambda c: c.__name__)
def test_a_failed_step_under_grad_scaler_ends_where_the_scaler_step_did(cls, clock):
    """``GradScaler.step`` ends the step when no optimizer step inside it finished (2350,
    skipped, its time ``optimizer_s``): the stale phase is only dropped. The next step's
    ``optimizer_s`` had the 900 ns from the raise to its forward."""
    recs = []
    tr = cls(recs.append)
    _step0(tr, clock)
    _failed_iteration(tr, clock, scaler=True)
    _next_iteration(tr, clock, "forward")
    tr.flush()
    assert [r.step for r in recs] == [0, 1, 2], recs
    r1, r2 = recs[1:]
    assert (r1.step_ns, r1.optimizer_ns, r1.skipped) == (2350 - 1300, 100, True)
    assert (r2.step_ns, r2.data_ns, r2.optimizer_ns, r2.skipped) == (3500 - 2350, 200, 100, False)


@pytest.mark.parametrize("cls", CORES, ids=lambda c: c.__name__)
def test_a_failed_step_under_the_explicit_boundary_keeps_its_time_out_of_the_next(cls, clock):
    """``stepwatch.step()`` ends the failed iteration (at 2800); the phase left open is dropped
    at the next forward, not counted as the next step's optimizer time (900 ns of it)."""
    recs = []
    tr = cls(recs.append)
    tr.boundary = "explicit"
    _step0(tr, clock)
    clock(1400)
    tr.end_step()
    _failed_iteration(tr, clock)
    clock(2800)
    tr.end_step()
    _next_iteration(tr, clock, "forward")
    clock(3600)
    tr.end_step()
    assert [r.step for r in recs] == [0, 1, 2], recs
    r1, r2 = recs[1:]
    assert (r1.step_ns, r1.optimizer_ns) == (2800 - 1400, 0)
    assert (r2.step_ns, r2.data_ns, r2.optimizer_ns) == (3600 - 2800, 200, 100)


@pytest.mark.parametrize("cls", CORES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("end", [(2500, 2700), (2350, 2950)])
def test_an_epochs_end_after_a_failed_step_is_never_counted_past_its_end(cls, end, clock):
    """After the failed step (whose own fetch began at 1400 here), the loader's last fetch
    (StopIteration: its workers' shutdown, ``end``) and the next epoch's first batch (3000-3200).
    Only that batch is known to come after the failed ``step()``: the loader's end stays the
    failed step's where it fits in it, and where it does not (the parts would come to more than
    ``step_s``), the step ends where the next batch's fetch began."""
    recs = []
    tr = cls(recs.append)
    _step0(tr, clock)
    clock(1400)
    t0 = tr.data_begin()
    clock(2100)
    tr.data_end(t0)
    tr.forward_begin(True)
    clock(2200)
    tr.forward_end()
    tr.backward_begin()
    clock(2250)
    tr.backward_end()
    clock(2300)
    tr.optimizer_begin()  # raises
    clock(end[0])
    t0 = tr.data_begin()
    clock(end[1])
    tr.data_end(t0, phases.FETCH_END)
    _next_iteration(tr, clock, "forward")
    tr.flush()
    assert [r.step for r in recs] == [0, 1, 2], recs
    r1, r2 = recs[1:]
    stop = end[1] - end[0]
    t_end = 2300 if 700 + stop + 150 <= 1000 else 3000
    assert (r1.step_ns, r1.data_ns, r1.optimizer_ns, r1.skipped) == (t_end - 1300, 700 + stop, 0, True)
    assert (r2.step_ns, r2.data_ns) == (3500 - t_end, 200)
    for r in recs:
        assert r.data_ns + r.forward_ns + r.backward_ns + r.optimizer_ns <= r.step_ns, r


@pytest.mark.parametrize("cls", CORES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("ends", ["cut", "ends"])
def test_a_save_open_at_shutdown_is_the_tail_records_checkpoint_time(cls, ends, clock):
    """A SIGTERM's shutdown inside ``torch.save`` (2000 to 2500): the save's time so far is the
    tail's ``checkpoint_s``, its bytes unknown, ``checkpoint_interrupted`` in its extras. It was in
    no record. A save that ended is as before: its bytes, no mark."""
    recs = []
    tr = cls(recs.append)
    _step0(tr, clock)
    clock(2000)
    t0 = tr.checkpoint_begin()
    clock(2500)
    if ends == "ends":
        tr.checkpoint_end(t0, 10)
    clock(2600)
    tr.flush()
    assert [(r.step, r.tail) for r in recs] == [(0, False), (1, True)], recs
    tail = recs[1]
    if ends == "cut":
        assert tail.checkpoint_ns == 600 and tail.extras == {"checkpoint_bytes": None, "checkpoint_interrupted": True}
    else:
        assert tail.checkpoint_ns == 500 and tail.extras == {"checkpoint_bytes": 10}


# -- real loops --------------------------------------------------------------------------------

_both_cores = pytest.mark.usefixtures("both_tracker_cores")  # tests/conftest.py

SLEEP = 0.02  # the loop's own work after each optimizer step


class _Slow(Dataset):
    def __len__(self):
        return 7

    def __getitem__(self, i):
        time.sleep(0.004)
        return torch.randn(16), torch.randn(4)


@_both_cores
@pytest.mark.parametrize("loop", ["refused", "oom_in_step", "loader", "save", "explicit", "closure"])
def test_an_optimizer_step_that_raises_is_its_own_record(sw, loop):
    """The tester's loop: the job's step pre-hook refuses the 4th step (or raises an OOM), the loop
    catches it and goes on (20 ms of its own work after each step; a save after the failure; a
    DataLoader; ``stepwatch.step()``; ``step(closure)``). That step's record had the loop's work
    after it as ``optimizer_s`` and the next iteration in it: one record for two iterations."""
    stepwatch, mem, start = sw
    start(step_boundary="explicit") if loop == "explicit" else start()
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    it = [0]

    def refuse(o, a, k):
        if it[0] == 3:
            raise RuntimeError("out of memory (simulated)" if loop == "oom_in_step" else "skip this batch")

    opt.register_step_pre_hook(refuse)
    batches = iter(DataLoader(_Slow(), batch_size=None)) if loop == "loader" else None
    n = 7
    for i in range(n):
        it[0] = i
        if batches is not None:
            x, y = next(batches)
        else:
            x, y = torch.randn(8, 16), torch.randn(8, 4)

        if not step_or_fail(model, opt, x, y, closure=loop == "closure") and loop == "save":
            torch.save(model.state_dict(), io.BytesIO())
        time.sleep(SLEEP)
        if loop == "explicit":
            stepwatch.step()
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert not [r for r in mem.records if r.tail], mem.records
    assert len(recs) == n, [(r.step, r.step_s) for r in recs]  # the old code: n - 1
    failed = recs[3]
    assert failed.skipped is (loop != "explicit"), recs
    assert [r.step for r in recs if r.skipped] == ([] if loop == "explicit" else [failed.step])
    # no record has the loop's work after its step as optimizer time, nor two iterations in it
    assert all(r.optimizer_s < SLEEP / 2 for r in recs), [r.optimizer_s for r in recs]
    assert all(r.step_s < 1.6 * SLEEP + 0.03 for r in recs), [r.step_s for r in recs]
    for r in recs:
        assert r.data_wait_s + r.forward_s + r.backward_s + r.optimizer_s <= r.step_s + 1e-6, r
    if loop == "save":  # the save after the failed step is the next step's
        assert failed.checkpoint_s == 0 and recs[4].checkpoint_s > 0, [r.checkpoint_s for r in recs]
    if loop == "loader":  # each step's own batch (4 ms) is its data wait
        assert all(r.data_wait_s >= 0.003 for r in recs[1:]), [r.data_wait_s for r in recs]


_SAVER = textwrap.dedent(
    """
    import io, os, sys, time, torch, torch.nn as nn
    import stepwatch
    stepwatch.init(dir=sys.argv[1], console="off")
    model = nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Slow(io.RawIOBase):
        def writable(self):
            return True

        def write(self, b):
            if not os.path.exists(sys.argv[2]):
                open(sys.argv[2], "w").close()  # the save is under way
            time.sleep(0.05)
            return len(b)

    for i in range(3):
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    with Slow() as f:
        torch.save({f"t{i}": torch.randn(1000) for i in range(200)}, f)
    print("the save ended", flush=True)
    """
)


def test_a_sigterm_during_a_save_leaves_the_save_in_the_tail_record(tmp_path):
    """Preemption mid-save (``torch.save`` to a slow file): ``ended_by`` was SIGTERM and the last
    record the last step, with no sign of the save cut short (a SIGINT, whose exception ends the
    save first, showed it)."""
    run, marker, script = tmp_path / "run", tmp_path / "saving", tmp_path / "saver.py"
    script.write_text(_SAVER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(phases.__file__))))
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])  # the stepwatch under test
    p = subprocess.Popen([sys.executable, str(script), str(run), str(marker)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert p.poll() is None and time.monotonic() < deadline, p.stdout.read() if p.poll() is not None else "slow"
            time.sleep(0.01)
        time.sleep(0.3)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == -signal.SIGTERM, out
    assert "the save ended" not in out
    recs = [json.loads(line) for line in open(run / "steps.rank0.jsonl") if line.strip()]
    assert [r["step"] for r in recs] == [0, 1, 2, 3], recs
    tail = recs[-1]
    assert tail["tail"] is True and tail["checkpoint_s"] >= 0.25 and tail["checkpoint_bytes"] is None, tail
    assert json.load(open(run / "run.json"))["ended_by"] == "SIGTERM"


# ----------------------------------------------------------------------------- phases of other threads, phases after the last step


@pytest.mark.usefixtures("both_tracker_cores")
def test_a_phase_on_another_thread_neither_moves_the_steps_values_nor_stops_the_tracker(sw, caplog):
    """A background thread running ``with stepwatch.phase("bg"): ...`` while the loop trains:
    each phase ended the training thread's pending step from that thread, so 199 of 200 values
    logged after ``optimizer.step()`` went to the next step; its time went into the training
    step's phases; and, racing the step's end, ``phase_end`` raised and turned the tracker off
    (27 of 300 steps recorded). Another thread's phase is not timed, and said once."""
    import logging
    import threading

    stepwatch, mem, start = sw
    start()
    stop = threading.Event()

    def side():
        while not stop.is_set():
            with stepwatch.phase("bg"):
                pass

    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        th = threading.Thread(target=side, daemon=True)
        th.start()
        try:
            for i in range(150):
                m(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                stepwatch.log(i=i)
        finally:
            stop.set()
            th.join(10)
        stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert [r.scalars.get("i") for r in recs] == list(range(150)), [(r.step, r.scalars) for r in recs][:5]
    assert not any("bg" in (r.phases or {}) for r in recs)
    said = [r.getMessage() for r in caplog.records if "other than the training thread" in r.getMessage()]
    assert len(said) == 1 and "'bg'" in said[0], said
    assert not [r for r in caplog.records if "internal error" in r.getMessage()]


@pytest.mark.usefixtures("both_tracker_cores")
def test_a_phase_and_a_value_after_the_last_step_are_kept_in_the_tail(sw):
    """``with stepwatch.phase("export_model"): ...`` then ``stepwatch.log(final_acc=0.93)`` after
    the last step: the phase's start ended that step, and both went with the unstepped step
    dropped at shutdown, silently (a no-grad evaluation there was kept in a tail record)."""
    stepwatch, mem, start = sw
    start()
    _train_plain(nn.Linear(4, 1), 3)
    with stepwatch.phase("export_model"):
        time.sleep(0.01)
    stepwatch.log(final_acc=0.93)
    stepwatch.shutdown()
    steps = [r for r in mem.records if not r.tail]
    (tail,) = [r for r in mem.records if r.tail]
    assert len(steps) == 3 and tail.scalars == {"final_acc": 0.93}
    assert tail.phases["export_model"] >= 0.01 and tail.step_s == 0


def test_set_step_before_init_numbers_the_sessions_first_step(sw):
    """A resume that numbers its steps before ``stepwatch.init()``: the value was dropped and the
    records numbered 0, 1, 2 with no word. The session init starts numbers from it."""
    stepwatch, mem, start = sw
    stepwatch.set_step(1000)
    start()
    m = nn.Linear(4, 1)
    _train_plain(m, 3)
    stepwatch.shutdown()
    assert [r.step for r in mem.records] == [1000, 1001, 1002]
    start()  # the next session: numbered from 0 again (the value was used once)
    _train_plain(m, 2)
    stepwatch.shutdown()
    assert [r.step for r in mem.records][-2:] == [0, 1]


def _train_plain(m, steps):
    """``steps`` plain SGD steps of ``m`` (a Linear(4, 1)), no DataLoader."""
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for _ in range(steps):
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()


def step_or_fail(model, opt, x, y, *, closure):
    """One iteration's forward, backward and ``opt.step()`` (with them in its closure, or after
    them), as a loop that catches a step that raises writes it: False when the step raised."""
    def run():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    try:
        if closure:
            opt.step(run)
        else:
            run()
            opt.step()
    except RuntimeError:
        return False
    return True
