"""The plain-loop patterns the frameworks are built from, without any framework installed:
``optimizer.step(closure)`` (what Lightning and LBFGS do) and a loop without a DataLoader (batches
sliced from a tensor, nanoGPT style). Reference row of docs/frameworks.md. Nothing is mocked.
"""

import pytest
import torch

import stepwatch
from fw_common import batch_of, identity_holds, make_model, no_internal_errors, plain_loop_flops, start, tokens_of

SLEEP = 0.03  # seconds slept in each forward (a Sleep module inside the model)


def test_closure_forward_and_backward_are_not_optimizer_time(tmp_path):
    ref_flops = plain_loop_flops(tmp_path, make_model(), batch_of(range(4)))
    mem = start(tmp_path, "on")
    model = make_model(sleep_s=SLEEP)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(20)), batch_size=4)
    norms = []
    for (idx,) in loader:
        batch = batch_of(idx.tolist())

        def closure():
            opt.zero_grad()
            loss = model(**batch)["loss"]
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
            return loss

        opt.step(closure)
    stepwatch.shutdown()
    no_internal_errors(mem)
    recs = mem.records
    assert len(recs) == 5
    for i, r in enumerate(recs):
        assert identity_holds(r), r
        assert r.forward_s >= SLEEP * 0.95 and r.backward_s > 0
        # The forward inside step() sleeps SLEEP: optimizer_s holds only SGD's own update.
        assert r.optimizer_s < SLEEP, r
        # The grad norm is read after the closure ran (before it, the grads were zero or stale).
        assert r.grad_norm == norms[i]
        assert r.tokens == tokens_of(idx_range(i))
        assert r.flops == pytest.approx(ref_flops, rel=0.02)
        assert r.data_wait_s > 0


def idx_range(i, bs=4):
    return range(i * bs, (i + 1) * bs)


def _closure(opt, model, batch, calls):
    """LBFGS's closure: zero the grads, forward, backward, the loss back; each call counted."""

    def closure():
        opt.zero_grad()
        loss = model(**batch)["loss"]
        loss.backward()
        calls.append(1)
        return loss

    return closure


def test_lbfgs_calls_its_closure_several_times_one_record(tmp_path):
    mem = start(tmp_path, "on")
    model = make_model()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    batch = batch_of(range(4))
    calls = []
    closure = _closure(opt, model, batch, calls)
    for _ in range(3):
        model(**batch)  # a forward before the step, so the roots are known from the start
        opt.step(closure)
    stepwatch.shutdown()
    no_internal_errors(mem)
    assert len(calls) > 3  # LBFGS evaluated more than once per step
    assert len(mem.records) == 3
    assert all(identity_holds(r) for r in mem.records)


def test_lbfgs_loop_with_nothing_outside_the_closure_is_one_record_per_step(tmp_path):
    """torch.optim.LBFGS as its documentation writes the loop: every forward and backward inside
    the closure, batches from a list (no DataLoader fetch), nothing else between two
    ``step(closure)`` calls. Each call is one step: the closure's forward is new work, so the
    step the previous call left pending ends there. (Two optimizer steps with nothing between
    them still make one step: a closure is something between them.) Found by running this loop:
    its ten steps came out as one record."""
    mem = start(tmp_path, "on")
    model = make_model()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    batches = [batch_of(range(i, i + 4)) for i in range(0, 24, 4)]
    calls = []
    for batch in batches:
        opt.step(_closure(opt, model, batch, calls))
        stepwatch.log(step_loss=1.0)
    stepwatch.shutdown()
    no_internal_errors(mem)
    assert len(calls) > len(batches)  # LBFGS evaluated more than once per step
    recs = mem.records
    assert len(recs) == len(batches)
    for r, batch in zip(recs, batches):
        assert identity_holds(r), r
        assert r.forward_s > 0 and r.backward_s > 0, r
        assert r.scalars == {"step_loss": 1.0}
    # Each step's tokens are its own batch's, once for each forward its closure ran.
    for i, r in enumerate(recs):
        assert r.tokens and r.tokens % tokens_of(range(4 * i, 4 * i + 4)) == 0, (i, r.tokens)


def test_loop_without_dataloader_counts_each_step_its_own_batch(tmp_path):
    """No DataLoader fetch ends the previous step: the forward itself does. The FLOPs and tokens
    its hooks count must land in the step that forward opens, not the one before."""
    mem = start(tmp_path, "on")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sizes = [2, 2, 3, 4, 2, 3]
    for n in sizes:
        model(**batch_of(range(n)))["loss"].backward()
        opt.step()
        opt.zero_grad()
    stepwatch.shutdown()
    no_internal_errors(mem)
    recs = mem.records
    assert len(recs) == len(sizes)
    # The root module was found when the optimizer was built: step 0 is counted too (README).
    per_sample = recs[1].flops / sizes[1]
    for r, n in zip(recs, sizes):
        assert r.flops == pytest.approx(per_sample * n, rel=1e-9)
        assert r.tokens == tokens_of(range(n))
