"""A loop whose forward runs inside a ``torch.compile``'d *function* (``@torch.compile def
fwd(x): return model(x)``, a compiled ``train_step(x, y)``, or a whole compiled step with its
backward and optimizer step), not ``torch.compile(model)``: dynamo inlines the model's call, so
stepwatch's root call (the module's ``_compiled_call_impl``) never runs. The step's end stayed
pending through the compiled call, so each ``stepwatch.log()`` after it went to the step before
(step 0 held i=1, the last step none), and the forward was ``other_s`` with ``forward_s`` 0.

The compiled function's dynamo context now tells the tracker of each call made at the top of the
loop (hooks/install.py ``_CompiledCall``, phases.py ``compiled_begin``): the call is the step's
work, and its time up to the first backward inside it is ``forward_s``. FLOPs stay null (one line
says so, and what to do). ``backend="eager"``: dynamo traces and inlines the module call as with
inductor (the defect is dynamo's inlining, and reproduces the same with ``aot_eager``), without
inductor's seconds of code generation on CPU.
"""

import logging
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

# Both tracker cores (tests/conftest.py) where the phases' times are read; the hooks' other
# checks (no graph break, which contexts get a hook, FLOPs) do not depend on the core.
both_cores = pytest.mark.usefixtures("both_tracker_cores")

BACKEND = "eager"
STEPS = 5
LINE = "runs the step's forward"  # the compiled function's log line (hooks/install.py _compiled_unseen)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model():
    torch.manual_seed(0)
    return nn.Linear(8, 1)


def _batch():
    return torch.randn(4, 8), torch.randn(4, 1)


def _identity_holds(r, tol=1e-6):
    return abs(r.data_wait_s + r.forward_s + r.backward_s + r.optimizer_s + r.other_s - r.step_s) <= tol


def _check_steps(recs, n=STEPS):
    assert [r.step for r in recs] == list(range(n)), [(r.step, r.scalars) for r in recs]
    # each value logged right after the compiled call is on its own step (was: step k held k+1)
    assert [r.scalars.get("i") for r in recs] == list(range(n)), [(r.step, r.scalars) for r in recs]
    bad = [r for r in recs if not _identity_holds(r)]
    assert not bad, bad[:2]


def _compiled(model, opt):
    """The three compiled functions of the loops under test: ``fwd(x)``, ``train_step(x, y)``
    (forward and loss), and ``whole_step(x, y)`` (with its backward and optimizer step)."""

    @torch.compile(backend=BACKEND)
    def fwd(x):
        return model(x)

    @torch.compile(backend=BACKEND)
    def train_step(x, y):
        return F.mse_loss(model(x), y)

    @torch.compile(backend=BACKEND)
    def whole_step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return fwd, train_step, whole_step


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if LINE in r.getMessage()]


@both_cores
@pytest.mark.parametrize("shape", ["forward", "train_step", "whole_step"])
def test_each_logged_value_lands_on_its_own_step(sw, caplog, shape):
    """The user's loop: ``loss = lossf(fwd(x), y); stepwatch.log(loss=loss, i=i)``; a compiled
    ``train_step(x, y)`` returning the loss; and a compiled step that runs backward and the
    optimizer step too."""
    stepwatch, mem, start = sw
    start()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    fwd, train_step, whole_step = _compiled(model, opt)
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        for i in range(STEPS):
            x, y = _batch()
            if shape == "whole_step":
                loss = whole_step(x, y)
                stepwatch.log(loss=loss, i=i)
                continue
            loss = F.mse_loss(fwd(x), y) if shape == "forward" else train_step(x, y)
            stepwatch.log(loss=loss, i=i)
            loss.backward()
            opt.step()
            opt.zero_grad()
        stepwatch.shutdown()
    recs = mem.records
    _check_steps(recs)
    for r in recs:
        assert r.forward_s > 0 and r.backward_s > 0 and r.optimizer_s > 0, r
        assert r.flops is None  # not counted (the line says so), never a wrong number
    said = _lines(caplog)
    assert len(said) == 1, said
    name = {"forward": "fwd", "train_step": "train_step", "whole_step": "whole_step"}[shape]
    assert f"'{name}'" in said[0] and "torch.compile(model)" in said[0] and "model.compile()" in said[0]


@both_cores
def test_the_compiled_call_is_forward_time_up_to_its_backward(sw):
    """A compiled step: what runs before its backward is ``forward_s``; its backward and
    optimizer step are their own phases; what it runs after its optimizer step (here a sleep
    after ``zero_grad``) comes after the step's end: the next step's ``other_s``, never this
    step's forward as well."""
    stepwatch, mem, start = sw
    start()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    @torch.compile(backend=BACKEND)
    def whole_step(x, y):
        time.sleep(0.006)  # a graph break: dynamo runs it between two graphs
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.012)
        return loss

    for i in range(STEPS):
        x, y = _batch()
        whole_step(x, y)
        stepwatch.log(i=i)
    stepwatch.shutdown()
    recs = mem.records
    _check_steps(recs)
    for r in recs:
        assert r.forward_s >= 0.006 * 0.9 and r.backward_s > 0 and r.optimizer_s > 0, r
    for r in recs[1:]:
        assert r.other_s >= 0.012 * 0.9, r  # the call's tail after the step before's end


def test_a_function_compiled_before_init_is_seen(sw, caplog):
    """``@torch.compile`` at import, ``stepwatch.init()`` later (in ``main()``): the function's
    dynamo context predates stepwatch's patch; the init scan finds it."""
    stepwatch, mem, start = sw
    model = _model()
    _, train_step, _ = _compiled(model, None)
    start()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        for i in range(STEPS):
            loss = train_step(*_batch())
            stepwatch.log(i=i)
            loss.backward()
            opt.step()
            opt.zero_grad()
        stepwatch.shutdown()
    recs = mem.records
    _check_steps(recs)
    assert all(r.forward_s > 0 for r in recs), recs
    said = _lines(caplog)
    assert len(said) == 1 and "compiled before stepwatch started" in said[0], said


@both_cores
def test_a_compiled_call_inside_the_closure_is_forward(sw):
    """``optimizer.step(closure)`` (LBFGS) whose closure calls the compiled function: the
    optimizer phase pauses for it, as for a root's forward."""
    stepwatch, mem, start = sw
    start()
    model = _model()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)

    @torch.compile(backend=BACKEND)
    def fwd(x):
        time.sleep(0.004)
        return model(x)

    for i in range(STEPS):
        x, y = _batch()

        def closure():
            opt.zero_grad()
            loss = F.mse_loss(fwd(x), y)
            loss.backward()
            return loss

        opt.step(closure)
        stepwatch.log(i=i)
    stepwatch.shutdown()
    recs = mem.records
    _check_steps(recs)
    for r in recs:
        assert r.forward_s >= 0.004 * 0.9 and r.backward_s > 0, r
        assert r.optimizer_s < r.forward_s, r  # the closure's compiled call is not the optimizer's


@both_cores
def test_an_evaluation_through_a_compiled_function_is_eval_time(sw):
    """A validation after some steps, through a compiled function under ``torch.no_grad()`` with
    the model in eval mode: ``eval_s``, out of ``step_s``, as an evaluation through the model's
    own call; it ends the step before it, as such an evaluation does."""
    stepwatch, mem, start = sw
    start()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _, train_step, _ = _compiled(model, opt)

    @torch.compile(backend=BACKEND)
    def evaluate(x):
        time.sleep(0.005)
        return model(x)

    for i in range(STEPS):
        loss = train_step(*_batch())
        stepwatch.log(i=i)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i == 1:
            model.eval()
            with torch.no_grad():
                for _ in range(3):
                    evaluate(torch.randn(4, 8))
            model.train()
    stepwatch.shutdown()
    recs = mem.records
    _check_steps(recs)
    assert recs[2].eval_s >= 3 * 0.005 * 0.9, recs[2]
    assert recs[2].step_s < recs[2].eval_s, recs[2]  # not in the step's time
    assert all(r.eval_s == 0 for r in recs if r.step != 2), recs


def test_compiled_work_of_the_model_or_the_optimizer_stays_theirs(sw, caplog):
    """Compiled functions that are not the step's forward: one inside the model's forward (a
    compiled attention function) is the root's forward, whose FLOPs are counted; one inside an
    optimizer's ``step`` (Muon's compiled Newton-Schulz) is ``optimizer_s``; PyTorch's compiled
    optimizer step recipe adds no forward. No line for any of them."""
    stepwatch, mem, start = sw
    start()

    @torch.compile(backend=BACKEND)
    def act(h):
        return torch.tanh(h)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 1)

        def forward(self, x):
            return act(self.lin(x))

    @torch.compile(backend=BACKEND)
    def orthogonalize(g):
        time.sleep(0.005)
        return g * 1.0

    class Muonish(torch.optim.SGD):
        def step(self, closure=None):
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        p.grad.copy_(orthogonalize(p.grad))
            return super().step(closure)

    torch.manual_seed(0)
    model = Net()
    opt = Muonish(model.parameters(), lr=0.01)
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        for i in range(STEPS):
            loss = F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1))
            stepwatch.log(i=i)
            loss.backward()
            opt.step()
            opt.zero_grad()
        tracker = stepwatch.get_session().tracker
        stepwatch.shutdown()
    recs = mem.records
    _check_steps(recs)
    assert "_compiled_fwd" not in tracker.__dict__  # no compiled call was the step's forward
    for r in recs:
        assert r.optimizer_s >= 2 * 0.005 * 0.9, r  # weight and bias, each through the compiled call
    assert all(r.flops for r in recs[1:]), [r.flops for r in recs]
    assert not _lines(caplog)


def test_the_compiled_optimizer_step_recipe_adds_no_forward(sw, caplog):
    """``@torch.compile def opt_step(): opt.step()`` (PyTorch's recipe), the model eager."""
    stepwatch, mem, start = sw
    start()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    @torch.compile(backend=BACKEND)
    def opt_step():
        opt.step()

    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        for i in range(STEPS):
            loss = F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1))
            stepwatch.log(i=i)
            loss.backward()
            opt_step()
            opt.zero_grad()
        tracker = stepwatch.get_session().tracker
        stepwatch.shutdown()
    recs = mem.records
    _check_steps(recs)
    assert "_compiled_fwd" not in tracker.__dict__
    assert all(r.optimizer_s > 0 and r.forward_s > 0 for r in recs), recs
    assert all(r.flops for r in recs[1:]), [r.flops for r in recs]
    assert not _lines(caplog)


def _context_of(compiled):
    """The dynamo context of a compiled callable (its wrapper's closure's ``self``)."""
    return compiled.__closure__[compiled.__code__.co_freevars.index("self")].cell_contents


def _hooked(ctx):
    return [h for h in ctx.enter_exit_hooks if type(h).__name__ == "_CompiledCall"]


@pytest.mark.parametrize("when", ["after_init", "before_init"])
def test_a_compiled_model_gets_no_enter_hook(sw, caplog, when):
    """``torch.compile(model)`` and ``model.compile()``, before ``init`` (found by its scan) or
    after: the root call times them; their contexts get no hook (nothing added to their calls),
    and no line."""
    stepwatch, mem, start = sw
    if when == "after_init":
        start()
    wrapped = torch.compile(_model(), backend=BACKEND)
    in_place = _model()
    in_place.compile(backend=BACKEND)
    if when == "before_init":
        start()
    opt = torch.optim.SGD([*wrapped.parameters(), *in_place.parameters()], lr=0.01)
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        for i in range(STEPS):
            x, y = _batch()
            loss = F.mse_loss(wrapped(x) + in_place(x), y)
            stepwatch.log(i=i)
            loss.backward()
            opt.step()
            opt.zero_grad()
        hooks = _hooked(wrapped.dynamo_ctx) + _hooked(_context_of(in_place.__dict__["_compiled_call_impl"].inner))
        stepwatch.shutdown()
    _check_steps(mem.records)
    assert not hooks
    assert all(r.forward_s > 0 and r.flops for r in mem.records[1:]), mem.records
    assert not _lines(caplog)


def test_stepwatch_adds_no_graph_break_or_graph_and_leaves_the_context_at_shutdown(sw):
    """dynamo's own counters for the compiled ``train_step`` loop, with and without stepwatch; and
    at shutdown the context's hook and the patched ``OptimizeContext.__call__`` are gone."""
    import torch._dynamo
    from torch._dynamo.eval_frame import OptimizeContext
    from torch._dynamo.utils import counters

    stepwatch, mem, start = sw
    call_before = OptimizeContext.__dict__.get("__call__")

    def run():
        torch._dynamo.reset()
        counters.clear()
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        @torch.compile(backend=BACKEND)
        def train_step(x, y):
            return F.mse_loss(model(x), y)

        losses = []
        for bs in (4, 4, 4, 6, 6):
            loss = train_step(torch.randn(bs, 8), torch.randn(bs, 1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        snap = {k: dict(v) for k, v in counters.items() if k in ("graph_break", "recompiles", "stats")}
        return losses, snap, train_step

    torch.manual_seed(1)
    off = run()[:2]
    start()
    torch.manual_seed(1)
    losses, snap, fn = run()
    ctx = _context_of(fn)
    assert len(_hooked(ctx)) == 1
    stepwatch.shutdown()
    assert (losses, snap) == off
    assert not _hooked(ctx)
    assert OptimizeContext.__dict__.get("__call__") is call_before
    assert len(mem.records) == 5 and all(r.forward_s > 0 for r in mem.records)


class _Timer:
    """A stand-in device timer (hooks/device.py's ``DeviceTiming``: ``begin(code) -> slot``,
    ``end(slot)``), as a GPU run attaches at its first step end: the device clock's intervals."""

    def __init__(self):
        self.events = []
        self.open = {}

    def begin(self, code):
        slot = len(self.events)
        self.events.append(("begin", code))
        self.open[slot] = code
        return slot

    def end(self, slot):
        self.events.append(("end", self.open.pop(slot)))


@both_cores
@pytest.mark.parametrize("shape", ["train_step", "whole_step"])
def test_the_device_clock_times_the_compiled_forward_until_the_backward(sw, shape):
    """On a GPU the phases are device intervals (begun and ended through the tracker's
    ``device``): the compiled call's forward is one, ended where its backward's begins (the span
    stands in for the timer until then), so forward and backward never overlap on that clock
    either, and every interval ends."""
    stepwatch, mem, start = sw
    start()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    _, train_step, whole_step = _compiled(model, opt)
    tracker = stepwatch.get_session().tracker
    timer = _Timer()
    tracker.device = timer
    for i in range(STEPS):
        if shape == "whole_step":
            whole_step(*_batch())
        else:
            loss = train_step(*_batch())
            loss.backward()
            opt.step()
            opt.zero_grad()
        stepwatch.log(i=i)
    assert tracker.device is timer  # handed back
    stepwatch.shutdown()
    _check_steps(mem.records)
    assert not timer.open
    fwd, bwd, opt_ = 2, 3, 4  # hooks/phases.py's phase codes
    want = [("begin", fwd), ("end", fwd), ("begin", bwd), ("end", bwd), ("begin", opt_), ("end", opt_)]
    assert timer.events == want * STEPS, timer.events


def test_a_loss_module_outside_the_compiled_forward_does_not_read_as_the_steps_flops(sw):
    """``lossf(fwd(x), y)`` with ``lossf = nn.MSELoss()``: the loss module is a root, called
    outside the compiled function, and its count (0 FLOPs, its batch) was the step's: FLOPs 0.0,
    MFU 0 where the peak is known (a false low-MFU finding on a GPU). The step's forward ran in
    the compiled function, whose modules no count sees: FLOPs, MFU and samples are null."""
    stepwatch, mem, start = sw
    start(peak_tflops=1.0)
    model, lossf = _model(), nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fwd, _, _ = _compiled(model, opt)
    for i in range(STEPS):
        x, y = _batch()
        loss = lossf(fwd(x), y)
        stepwatch.log(i=i)
        loss.backward()
        opt.step()
        opt.zero_grad()
    eager = nn.Linear(8, 1)  # then the same loop uncompiled: counted as ever
    opt2 = torch.optim.SGD(eager.parameters(), lr=0.01)
    for i in range(STEPS, 2 * STEPS):
        x, y = _batch()
        loss = lossf(eager(x), y)
        stepwatch.log(i=i)
        loss.backward()
        opt2.step()
        opt2.zero_grad()
    stepwatch.shutdown()
    recs = mem.records
    assert [(r.flops, r.mfu, r.samples) for r in recs[:STEPS]] == [(None, None, None)] * STEPS, recs[:2]
    assert all(r.flops and r.flops > 0 and r.mfu and r.samples == 4 for r in recs[STEPS + 1:]), recs[STEPS + 1:]
