"""The step tracker's two cores: hooks/_ctracker.c (C, as installed) and phases.py's ``_PyCore``
(Python, where the extension could not be built) are the same tracker. Both run the same random
sequences of hook calls (nesting, evaluation, checkpoints, closures, GradScaler skips, user phases,
explicit steps, the backward boundary, failing collectors) on the same fake clock, and must hand
over the same records, make the same calls on the progress board, NVTX, the device timer and the
listeners, report the same failures, and end in the same state."""

import json
import os
import random

import pytest

from stepwatch.hooks import phases
from stepwatch.record import RawStep
from test_phase_faults import _step0  # step 0 on the fake clock: work 1000-1300

_ctracker = pytest.importorskip("stepwatch.hooks._ctracker", reason="the C tracker is not built here (no C compiler)")

RAW_FIELDS = RawStep.__slots__


class Log:
    """Records every call made on it, by attribute name, with its arguments."""

    def __init__(self, calls, name, returns=None):
        self._calls, self._name, self._returns = calls, name, returns or {}

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def call(*args):
            self._calls.append((self._name, attr, args))
            r = self._returns.get(attr)
            return r() if callable(r) else r

        return call


class FakeNvtx(Log):
    enabled = True
    forward, eval, backward, optimizer = "fwd-range", "eval-range", "bwd-range", "opt-range"


class Collector(phases.Collector):
    def __init__(self, calls, name, fail_at=None, exc=RuntimeError):
        self.calls, self.name, self.n, self.fail_at, self.exc = calls, name, 0, fail_at, exc

    def take(self):
        self.n += 1
        if self.n == self.fail_at:
            raise self.exc(f"{self.name} broke")
        self.calls.append(("take", self.name, self.n))
        return {"n": self.n}


def _clock(seed):
    rng = random.Random(seed)
    t = [10**12]

    def now():
        t[0] += rng.randint(1, 5000)
        return t[0]

    return now


def _make(cls, calls, *, nvtx, device, progress, fail_at=None, exc=RuntimeError):
    slots = iter(range(10**6))
    mem = iter(range(0, 10**9, 4096))
    tr = cls(
        lambda rec: calls.append(("emit", tuple(getattr(rec, f) for f in RAW_FIELDS))),
        step_offset=3,
        nvtx=FakeNvtx(calls, "nvtx") if nvtx else None,
        mem_probe=(lambda: next(mem)),
        on_error=lambda where, e: calls.append(("error", where, type(e).__name__, str(e))),
        progress=Log(calls, "progress") if progress else None,
    )
    if device:
        tr.device = Log(calls, "device", {"begin": lambda: next(slots)})
    tr.collectors.append(Collector(calls, "a"))
    tr.collectors.append(Collector(calls, "b", fail_at, exc))
    tr.listeners.append(lambda n: calls.append(("listener", n)))
    return tr


# What a sequence is made of: the hooks' calls (a few patterns that torch's own nesting makes).
OPS = [
    "fetch", "fetch", "forward", "forward", "forward", "eval", "nested_forward", "backward", "backward",
    "nested_backward", "optimizer", "optimizer", "closure", "scaler_skip", "scaler_step", "checkpoint",
    "phase", "log", "work_begins", "end_step", "exclude", "set_step", "boundary_backward", "half_forward",
    "half_optimizer", "eval_fetch", "eval_fetch", "end_fetch", "iterator",
]


def _run_op(tr, op, rng):
    if op == "fetch":
        t0 = tr.data_begin()
        if rng.random() < 0.3:  # a module called inside the fetch (a Dataset transform)
            tr.forward_begin(True)
            tr.forward_end()
        tr.data_end(t0)
    elif op == "eval_fetch":  # a fetch with grad disabled (an evaluation's)
        tr.data_end(tr.data_begin(), phases.FETCH_NO_GRAD)
    elif op == "end_fetch":  # the fetch that ends an iterator (StopIteration), grad on or off
        tr.data_end(tr.data_begin(), phases.FETCH_END | rng.choice([0, phases.FETCH_NO_GRAD]))
    elif op == "iterator":  # iter(loader); its first fetch may come after other work
        tr.iterator_made(phases._now())
    elif op in ("forward", "eval"):
        tr.forward_begin(op == "forward")
        tr.forward_end()
    elif op == "nested_forward":
        tr.forward_begin(True)
        tr.forward_begin(True)
        tr.forward_end()
        tr.forward_end()
    elif op == "backward":
        tr.backward_begin()
        tr.backward_end()
    elif op == "nested_backward":
        tr.backward_begin()
        tr.backward_begin()
        tr.backward_end()
        tr.backward_end()
    elif op == "optimizer":
        tr.optimizer_begin()
        tr.optimizer_end(object(), (), {})
    elif op == "closure":  # optimizer.step(closure): forward and backward inside the step
        tr.optimizer_begin()
        paused = tr.pause_optimizer()
        tr.forward_begin(True)
        tr.forward_end()
        tr.backward_begin()
        tr.backward_end()
        if paused:
            tr.resume_optimizer()
        tr.optimizer_end()
    elif op == "scaler_skip":
        tr.scaler_end(tr.scaler_begin())
    elif op == "scaler_step":
        t0 = tr.scaler_begin()
        tr.optimizer_begin()
        tr.optimizer_end()
        tr.scaler_end(t0)
    elif op == "checkpoint":
        tr.checkpoint_end(tr.checkpoint_begin(), rng.choice([None, 100, 2**40]))
    elif op == "phase":
        name = rng.choice(["p", "q"])
        tr.phase_begin(name)
        if rng.random() < 0.5:
            tr.forward_begin(True)
            tr.forward_end()
        tr.phase_end(name)
    elif op == "log":
        tr.log({rng.choice(["loss", "lr"]): rng.random()})
        # stepwatch.log's path: plain numbers kept, anything else converted (a bool is not an int)
        tr.log_values({"n": 3, "flag": True, "t": (1, 2), "x": 0.5}, lambda v: ("converted", v))
    elif op == "work_begins":
        tr.work_begins()
    elif op == "end_step":
        tr.end_step()
    elif op == "exclude":
        tr.exclude(rng.randint(0, 50))
    elif op == "set_step":
        tr.set_step(rng.randint(0, 100))
    elif op == "boundary_backward":  # what the hooks set when no torch optimizer exists
        tr.boundary = "backward"
    elif op == "half_forward":  # a forward whose end never comes (it raised past the hook)
        tr.forward_begin(rng.random() < 0.5)
    elif op == "half_optimizer":
        tr.optimizer_begin()


STATE_OUT = [f for f in phases._STATE if f not in ("_emit", "_nvtx", "_mem_probe", "_on_error", "collectors",
                                                   "listeners", "progress", "device")]


def _play(cls, seed, ops, **kw):
    """One sequence on a tracker of ``cls``: every call it made, and its state at the end."""
    calls: list = []
    phases._now = now = _clock(seed)
    _ctracker._set_clock(now)
    try:
        tr = _make(cls, calls, **kw)
        rng = random.Random(seed)
        for op in ops:
            _run_op(tr, op, rng)
            calls.append(("phase_now", tr.phase_now()))
        tr.flush()
        return calls, {f: getattr(tr, f) for f in STATE_OUT}
    finally:
        _ctracker._set_clock(None)


@pytest.fixture
def restore_clock(monkeypatch):
    monkeypatch.setattr(phases, "_now", phases._now)


def test_the_c_core_is_the_one_installed_and_holds_the_python_cores_state():
    assert phases.StepTracker.__mro__[2] is _ctracker.Core
    members = {n for n, v in vars(_ctracker.Core).items() if type(v).__name__ == "member_descriptor"}
    assert members == set(phases._STATE) == set(phases._PyCore.__slots__)
    hot = {n for n, v in vars(phases._PyCore).items() if callable(v)}
    assert hot == {n for n, v in vars(_ctracker.Core).items() if type(v).__name__ == "method_descriptor"}
    assert not hot & set(vars(phases._Methods))  # no cold method shadows a hot one
    # RawStep's slots are filled in C (its __init__ skipped): every record compared below is one.
    assert _ctracker._bound_directly()


def test_the_c_root_call_is_the_one_installed_and_holds_the_python_ones_fields():
    """hooks/install.py's root call (what a root module's ``_compiled_call_impl`` becomes) over
    the same C module; sessions run with both in test_steps, test_real_patterns, test_safety and
    test_pickle_hooks (tests/conftest.py ``both_tracker_cores``)."""
    from stepwatch.hooks import install

    assert install._RootCall.__mro__[2] is _ctracker.RootCall
    members = {n for n, v in vars(_ctracker.RootCall).items() if type(v).__name__ == "member_descriptor"}
    assert members == set(install._PyRootCallCore.__slots__)


SEEDS = range(300)


def _case(seed):
    rng = random.Random(seed)
    ops = [rng.choice(OPS) for _ in range(rng.randint(5, 80))]
    kw = dict(nvtx=rng.random() < 0.5, device=rng.random() < 0.5, progress=rng.random() < 0.7,
              fail_at=rng.choice([None, None, None, 1, 3]))
    return ops, kw


@pytest.mark.parametrize("seed", SEEDS)
def test_both_cores_make_the_same_records_and_calls(seed, restore_clock):
    ops, kw = _case(seed)
    c_calls, c_state = _play(phases.StepTracker, seed, ops, **kw)
    py_calls, py_state = _play(phases.PyStepTracker, seed, ops, **kw)
    assert c_calls == py_calls
    assert c_state == py_state


def test_the_sequences_reach_every_kind_of_step(restore_clock):
    """The comparison above is only as strong as what its sequences reach: over all of them, the
    records include evaluation, checkpoints (sizes known and not), skipped steps, user phases,
    closures' forwards, steps ended by a backward, failures; and most sequences hand over steps."""
    seen = {"eval": 0, "ckpt": 0, "ckpt_bytes": 0, "skipped": 0, "phases": 0, "tail": 0, "errors": 0,
            "emitting": 0, "by_backward": 0}
    for seed in SEEDS:
        ops, kw = _case(seed)
        calls, _ = _play(phases.PyStepTracker, seed, ops, **kw)
        recs = [dict(zip(RAW_FIELDS, c[1])) for c in calls if c[0] == "emit"]
        seen["emitting"] += bool(recs)
        seen["errors"] += any(c[0] == "error" for c in calls)
        for r in recs:
            seen["eval"] += r["eval_ns"] > 0
            seen["ckpt"] += r["checkpoint_ns"] > 0
            seen["ckpt_bytes"] += r["extras"].get("checkpoint_bytes") is not None
            seen["skipped"] += bool(r["skipped"])
            seen["phases"] += bool(r["phases"])
            seen["tail"] += bool(r["tail"])
            seen["by_backward"] += "boundary_backward" in ops and r["optimizer_ns"] == 0 and not r["tail"]
    assert seen["emitting"] > 200, seen
    assert all(v >= 10 for v in seen.values()), seen


def test_a_sequence_without_failures_hands_over_every_step(restore_clock):
    """The differential test above is only as good as what the sequences reach: here a plain
    loop's records, checked by value, so that both cores cannot agree on nothing."""
    ops = ["fetch", "forward", "forward", "backward", "optimizer", "log"] * 4  # log: both ways (_run_op)
    for cls in (phases.StepTracker, phases.PyStepTracker):
        calls, state = _play(cls, 7, ops, nvtx=True, device=True, progress=True)
        recs = [dict(zip(RAW_FIELDS, c[1])) for c in calls if c[0] == "emit"]
        assert [r["step"] for r in recs] == [3, 4, 5, 6]
        for r in recs:
            assert r["step_ns"] > 0 and r["forward_ns"] > 0 and r["backward_ns"] > 0 and r["optimizer_ns"] > 0
            assert r["data_ns"] > 0 and r["mem_peak_bytes"] is not None and not r["skipped"]
            assert set(r["extras"]) == {"backward_spans", "a", "b"} and len(r["extras"]["backward_spans"]) == 1
            assert r["scalars"] == {"loss": r["scalars"]["loss"], "n": 3, "x": 0.5, "flag": ("converted", True),
                                    "t": ("converted", (1, 2))}
        assert ("listener", 6) in calls and ("progress", "set_step", (7,)) in calls
        assert ("nvtx", "push_range", ("fwd-range",)) in calls
        assert state["step"] == 7 and state["enabled"] is True


def _validation_then(tr, at, closer):
    """Step 0 ends at 1300; a validation of 5 fetches and calls (grad disabled) from 2000 to 3000;
    its metric until 4000; then ``closer``."""
    _step0(tr, at)
    at(2000)
    for i in range(5):
        t0 = tr.data_begin()
        at(2000 + 200 * i + 100)
        tr.data_end(t0, phases.FETCH_NO_GRAD)
        tr.forward_begin(False)
        at(2000 + 200 * i + 200)
        tr.forward_end()
    at(4000)  # the metric over the predictions: no hook runs
    if closer == "fetch":  # the next training fetch (500 of data wait), its forward, ...
        t0 = tr.data_begin()
        at(4500)
        tr.data_end(t0)
        tr.forward_begin(True)
    elif closer == "forward":  # a loop over tensors it holds: its next forward
        tr.forward_begin(True)
    elif closer == "checkpoint":
        tr.checkpoint_end(tr.checkpoint_begin(), 10)
        at(4100)
        tr.forward_begin(True)
    elif closer == "end_step":  # stepwatch.step() at the iteration's end
        tr.end_step()
        return
    else:  # shutdown after the last step
        tr.flush()
        return
    at(4700)
    tr.forward_end()
    tr.backward_begin()
    tr.backward_end()
    tr.optimizer_begin()
    tr.optimizer_end()
    tr.flush()


@pytest.mark.parametrize("closer", ["fetch", "forward", "checkpoint", "end_step", "flush"])
def test_an_eval_span_runs_to_where_the_next_training_work_starts(closer, restore_clock):
    """The span ends where the next training work starts or the step's end, on both cores: the
    metric after its last call (3000 to 4000 here) is evaluation. It ended at its last call or
    fetch (eval 1000): the metric was the next step's ``other_s``. A training fetch after it is
    data wait, not the span's (the span ends at that fetch's start, not at the forward that
    closes it): what ending at the last call protected. At shutdown after the last step it ends
    at its last call (eval 1000): what a script does then (plots, uploads) was evaluation."""
    clock = [10**9]
    base = clock[0]
    now = lambda: clock[0]  # noqa: E731

    def at(t):
        clock[0] = base + t

    phases._now = now
    _ctracker._set_clock(now)
    try:
        for cls in (phases.StepTracker, phases.PyStepTracker):
            recs = []
            tr = cls(recs.append)
            _validation_then(tr, at, closer)
            assert [r.step for r in recs] == [0, 1], (cls, recs)
            r = recs[1]
            assert r.eval_ns == (1000 if closer == "flush" else 2000), (cls, closer, r.eval_ns)
            assert r.data_ns == (500 if closer == "fetch" else 0), (cls, closer, r.data_ns)
            assert r.tail is (closer == "flush")
            if closer == "end_step":
                assert r.step_ns == 4000 - 1300 - 2000
            if closer == "checkpoint":
                assert r.checkpoint_ns == 0 and r.step_ns == 4700 - 1300 - 2000
            assert tr.enabled
    finally:
        _ctracker._set_clock(None)


def test_a_failing_collector_disables_both_the_same_way(restore_clock):
    ops = ["forward", "backward", "optimizer"] * 3
    for cls in (phases.StepTracker, phases.PyStepTracker):
        calls, state = _play(cls, 1, ops, nvtx=False, device=False, progress=False, fail_at=2)
        assert [c for c in calls if c[0] == "error"] == [("error", "tracker.forward_begin", "RuntimeError", "b broke")]
        assert len([c for c in calls if c[0] == "emit"]) == 1
        assert state["enabled"] is False


def test_an_interrupt_from_a_collector_passes_through_both(restore_clock):
    """KeyboardInterrupt is not an Exception: neither core swallows it (the user's Ctrl-C)."""
    for cls in (phases.StepTracker, phases.PyStepTracker):
        with pytest.raises(KeyboardInterrupt):
            _play(cls, 1, ["forward", "backward", "optimizer", "forward"], nvtx=False, device=False,
                  progress=False, fail_at=1, exc=KeyboardInterrupt)


def test_bad_state_is_a_failure_not_a_crash():
    """A field holding what no hook would put there (a user poking the tracker) makes the C core
    report and disable itself, as the Python core does, instead of raising into the loop."""
    for cls in (phases.StepTracker, phases.PyStepTracker):
        errors = []
        tr = cls(lambda rec: None, on_error=lambda where, e: errors.append((where, type(e))))
        tr._fwd_depth = "one"
        tr.forward_begin(True)
        assert errors == [("tracker.forward_begin", TypeError)] and tr.enabled is False
        tr.forward_end()  # disabled: nothing more
        assert len(errors) == 1


def test_log_values_converts_what_is_not_a_plain_number_and_passes_its_errors_on():
    for cls in (phases.StepTracker, phases.PyStepTracker):
        tr = cls(lambda rec: None)
        tr.log_values({"a": 1, "b": 2.5, "c": True, "d": None}, lambda v: ["conv", v])
        assert tr._scalars == {"a": 1, "b": 2.5, "c": ["conv", True], "d": ["conv", None]}

        def broken(v):
            raise ValueError("no")

        with pytest.raises(ValueError, match="no"):
            tr.log_values({"e": "x"}, broken)
        assert tr.enabled is True and "e" not in tr._scalars  # the session reports it; tracking goes on
        tr.enabled = False
        tr.log_values({"f": "x"}, broken)  # disabled: nothing is read
        assert "f" not in tr._scalars


def test_state_before_init_raises_attribute_error_as_python_does():
    core = _ctracker.Core()
    with pytest.raises(AttributeError, match="enabled"):
        core.forward_begin(True)
    with pytest.raises(AttributeError):
        core.step  # noqa: B018


def _tiny_loop(steps):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model, lossf = nn.Linear(8, 8), nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(4, 8), torch.randn(4, 8)

    def run(n):
        import stepwatch

        for _ in range(n):
            loss = lossf(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            stepwatch.log(loss=loss)

    run(steps)
    return run


def test_a_steps_record_and_payloads_stay_out_of_the_cyclic_gc(sw):
    """Records wait in the queue for up to a pass (thousands of steps at a fast step): tracked,
    their containers reach the oldest generation and trigger full collections, which walk every
    object of the process (16 us a step measured in the tiny benchmark step). The record, its
    extras, its backward spans and the collectors' payloads are untracked; only the grad-norm
    tensor of each step is left: at most 2 tracked objects a step survive (measured: 1)."""
    import gc

    stepwatch, _, start = sw
    start(training_metrics=True, grad_norm_every=1)
    run = _tiny_loop(5)
    sess = stepwatch.get_session()
    assert sess.pipeline.stop_thread()  # records stay in the queue, as between two passes
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        run(300)
        grown = len(gc.get_objects()) - before
    finally:
        gc.enable()
    recs = list(sess.pipeline._queue)[-300:]
    assert len(recs) == 300
    for rec in recs:
        assert not gc.is_tracked(rec) and not gc.is_tracked(rec.extras)
        assert rec.phases is None  # no user phase ran: no dict made for them
        assert not gc.is_tracked(rec.extras["backward_spans"]) and len(rec.extras["backward_spans"]) == 1
        assert not gc.is_tracked(rec.extras["throughput"]) and not gc.is_tracked(rec.extras["throughput"].items)
        (pending,) = rec.extras["grad_norm"]
        assert not gc.is_tracked(rec.extras["grad_norm"]) and not gc.is_tracked(pending)
    assert grown <= 2 * 300, grown
    sess.pipeline._queue.clear()


def test_untracked_records_are_still_freed(sw):
    """Untracked is not leaked: a record (and all it holds) is freed by its reference count once
    the pipeline is done with it. Each step logs an object that only its record refers to; once
    the records are written, every one of those objects is gone, with or without a collection."""
    import gc
    import weakref

    class Sentinel:
        pass

    stepwatch, mem, start = sw
    start(training_metrics=True, grad_norm_every=1)
    run = _tiny_loop(5)
    pipeline = stepwatch.get_session().pipeline
    assert pipeline.stop_thread()
    refs = []
    for _ in range(200):
        obj = Sentinel()
        refs.append(weakref.ref(obj))
        stepwatch.log(obj=obj)
        del obj
        run(1)
    assert sum(r() is not None for r in refs) >= 199  # waiting in the queue, held by their records
    pipeline.run_pass()
    assert pipeline.drain(10)
    alive = sum(r() is not None for r in refs)
    gc.collect()
    assert alive == 0 and all(r() is None for r in refs), alive
    assert len(mem.records) >= 199


def test_the_root_call_runs_a_tracker_subclass_override(tmp_path):
    """The C root call and optimizer pre-hook read the tracker's fields and call its hot methods
    directly only while the tracker's type is the C core's for them (checked once per type): a
    tracker whose class overrides ``forward_begin`` and ``optimizer_begin`` (a subclass, swapped
    in mid-run) gets its overrides called, and the step is still recorded; the plain class
    afterwards takes the direct path again."""
    import torch
    from torch import nn

    import stepwatch

    s = stepwatch.init(dir=str(tmp_path), console="off", training_metrics=False, comm=False, gpu_telemetry=False,
                       nvtx=False, memory=False, watchdog="off", capture="off", otel=False)
    try:
        model = nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = []

        class Watching(phases.StepTracker):
            def forward_begin(self, grad):
                seen.append(grad)
                return super().forward_begin(grad)

            def optimizer_begin(self):  # what the C optimizer pre-hook calls directly on the plain class
                seen.append("optimizer")
                return super().optimizer_begin()

        def step():
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()

        step()
        plain = type(s.tracker)
        s.tracker.__class__ = Watching
        step()
        step()
        s.tracker.__class__ = plain
        step()
        assert seen == [True, "optimizer", True, "optimizer"]
        run_dir = s.ctx.run_dir
    finally:
        stepwatch.shutdown()
    with open(os.path.join(run_dir, "steps.rank0.jsonl")) as f:
        records = [json.loads(l) for l in f]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["forward_s"] > 0 for r in records[1:])


def test_the_heap_pass_of_module_discovery_is_the_same_in_c_and_python():
    """The scan's pass over ``gc.get_objects()`` (hooks/_ctracker.c's ``instances``, 3x faster than
    the Python reference): the same modules and optimizers, in the same order, subclasses and
    objects of a type seen before included; bad arguments are a TypeError."""
    import gc

    import torch
    from torch.optim import Optimizer

    from stepwatch.hooks import _ctracker
    from stepwatch.hooks.install import _instances, _py_instances

    assert _instances is _ctracker.instances

    class MyModule(torch.nn.Linear):
        pass

    keep = [torch.nn.Linear(2, 2), MyModule(2, 2), torch.nn.Sequential(torch.nn.ReLU())]
    keep.append(torch.optim.SGD(keep[0].parameters(), lr=0.1))
    objects = gc.get_objects()
    c = _ctracker.instances(objects, torch.nn.Module, Optimizer)
    py = _py_instances(objects, torch.nn.Module, Optimizer)
    assert [id(o) for o in c[0]] == [id(o) for o in py[0]] and [id(o) for o in c[1]] == [id(o) for o in py[1]]
    assert all(any(m is k for m in c[0]) for k in keep[:3]) and any(o is keep[3] for o in c[1])
    assert _ctracker.instances([1, "x", keep[1], keep[1], 2.0, keep[3]], torch.nn.Module, Optimizer) == (
        [keep[1], keep[1]], [keep[3]])
    for bad in ((objects,), (tuple(objects), torch.nn.Module, Optimizer), (objects, 1, Optimizer)):
        with pytest.raises(TypeError, match="instances"):
            _ctracker.instances(*bad)
