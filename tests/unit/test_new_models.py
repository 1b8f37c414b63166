"""Scripts that train more than one model in a process: k-fold cross-validation (a new model and
optimizer per fold), resuming from a whole-model ``torch.save`` (the loaded model replaces the
one in memory), a sweep over widths. Every step of every model must be measured as the first
model's are: forward time, samples and its own FLOPs. It used to be the first model only:
samples stayed with the first model called (null for every later one), a new model was hooked
only at its optimizer's first step (after its first forward), and after 8 root scans no new model
was hooked at all."""

import gc
import io
import logging

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from stepwatch.metrics.flops import FlopCache, count_step_flops

pytestmark = pytest.mark.usefixtures("both_tracker_cores")  # tests/conftest.py


def _mlp(hidden=32):
    return nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 4))


def _flops(model, batch=8):
    return count_step_flops(model, (torch.randn(batch, 16),)).total


def _train(model, opt, loader):
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _loader(n=24, batch=8):
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)), batch_size=batch)


def _measured(recs, flops, batch=8):
    """The records whose forward time, samples or FLOPs are missing or wrong."""
    return [r for r in recs if not (r.forward_s > 0 and r.samples == batch and r.flops == flops)]


def test_every_fold_of_a_cross_validation_is_measured_from_its_first_step(sw):
    stepwatch, mem, start = sw
    start()
    folds, loader = 12, _loader()  # more folds than the 8 scans that used to be the limit
    kept = []  # the folds' models stay alive (a script that keeps them to ensemble)
    for _ in range(folds):
        torch.manual_seed(0)
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        _train(model, opt, loader)
        kept.append(model)
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == folds * 3
    assert _measured(recs, _flops(_mlp())) == []


def test_a_model_resumed_from_a_whole_model_torch_save_is_measured(sw):
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    model, loader = _mlp(), _loader()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _train(model, opt, loader)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    model = torch.load(buf, weights_only=False)  # the old one is freed: the new may get its id
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _train(model, opt, loader)
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 6
    assert _measured(recs, _flops(_mlp())) == []


def test_a_sweep_over_widths_gets_each_models_own_flops(sw):
    """Each model freed before the next is built (the next may reuse its id): a count kept
    under a freed model's id must not be served to a new model of another width."""
    stepwatch, mem, start = sw
    start()
    widths = [64, 128, 256, 64, 512]
    loader = _loader()
    for h in widths:
        torch.manual_seed(0)
        model = _mlp(h)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        _train(model, opt, loader)
        del model, opt
        gc.collect()
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 3 * len(widths)
    for i, h in enumerate(widths):
        assert _measured(recs[3 * i:3 * i + 3], _flops(_mlp(h))) == [], h


def test_a_sweeps_models_are_freed_as_the_script_drops_them(sw):
    """A sweep keeps one model at a time: each trial's model, optimizer and grads (GPU memory in a
    real sweep) must be freed when the script drops them, with stepwatch on as off. Its hooks
    held every hooked root until shutdown, so a sweep of N trials held N models: the model and
    its loss module (a root without parameters) each. And freed as they are dropped, not at the
    next full cyclic collection (which rarely reaches a trained model's old generation): a
    root's call held its module (a cycle through the module's own ``_compiled_call_impl``), and so
    did the FLOP replay's class made for it. The cyclic collector is off while the trials run;
    what torch itself frees only by it (an optimizer's own cycles) is the same with stepwatch off."""
    stepwatch, mem, start = sw
    loader = _loader()
    off = _sweep(loader)
    start()
    on = _sweep(loader)
    stepwatch.shutdown()
    # whatever is freed with stepwatch off is freed with it on (the first trial's optimizer can
    # outlive it either way: a first-use cycle of torch's own)
    assert all(o or not f for t_on, t_off in zip(on, off) for o, f in zip(t_on, t_off)), (on, off)
    assert all(model and loss for model, loss, _ in on), on  # nothing of torch's holds a module
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 9 and all(r.samples == 8 for r in recs)


def test_a_sweeps_models_are_freed_with_a_frozen_heap(sw):
    """The same sweep where the heap is frozen: the module discovery then walks its callers'
    locals (``gc.freeze()`` hides what it froze from ``gc.get_objects()``), and so on every Python
    3.12 job, which reports ~375 objects of its own as frozen from its start. The walk read them
    through ``frame.f_locals``: before 3.13 a snapshot dict that the frame keeps, so each trial's
    model, loss module and weights outlived the script's ``del`` (on 3.12.1, every trial of the
    test above, freed with stepwatch off). From 3.12 on they are read without it (C module);
    before 3.12 nothing else can read them, and this is a known limit (README)."""
    import sys

    from stepwatch.hooks import install

    if sys.version_info < (3, 12) or install._frame_values(sys._getframe()) is None:
        pytest.skip("before Python 3.12 (or without the C module) only frame.f_locals reads a caller's locals")
    stepwatch, mem, start = sw
    loader = _loader()
    gc.collect()
    gc.freeze()
    try:
        off = _sweep(loader)
        start()
        on = _sweep(loader)
        stepwatch.shutdown()
    finally:
        gc.unfreeze()
    assert all(o or not f for t_on, t_off in zip(on, off) for o, f in zip(t_on, t_off)), (on, off)
    assert all(model and loss for model, loss, _ in on), on


def _sweep(loader):
    """Three trials, the cyclic collector off: per trial, which of (model, loss module, first
    weight) were freed once the script dropped them."""
    import weakref

    freed = []
    gc.collect()
    gc.disable()
    try:
        for trial in range(3):
            torch.manual_seed(trial)
            model = _mlp(32 * (trial + 1))
            lossf = nn.MSELoss()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            for x, y in loader:
                loss = lossf(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            refs = (weakref.ref(model), weakref.ref(lossf), weakref.ref(model[0].weight))
            del model, lossf, opt, loss, x, y
            freed.append(tuple(r() is None for r in refs))
    finally:
        gc.enable()
    gc.collect()
    return freed


def test_a_freed_modules_counts_are_dropped_and_their_budget_given_back():
    cache = FlopCache(max_misses=2)
    a, b = nn.Linear(4, 4), nn.Linear(4, 8)
    cache.get(a, (torch.randn(2, 4),))
    cache.get(a, (torch.randn(3, 4),))
    assert cache.misses == 2 and cache.get(b, (torch.randn(2, 4),)) is None  # over the budget
    cache.forget(id(a))
    assert cache.misses == 0 and len(cache) == 0 and id(a) not in cache._last
    assert cache.get(b, (torch.randn(2, 4),)).total == count_step_flops(b, (torch.randn(2, 4),)).total


def test_a_collector_forgets_a_root_when_it_is_freed():
    from stepwatch.metrics.tokens import ThroughputCollector

    col = ThroughputCollector()
    m = _mlp()
    col.on_forward(m, (torch.randn(8, 16),), {})
    mid = id(m)
    assert col._token_root == mid and mid in col._hits and len(col.cache) == 1
    del m
    gc.collect()
    assert col._token_root is None and mid not in col._hits and len(col.cache) == 0


def test_functional_training_gets_no_missing_optimizer_warning(sw, caplog):
    """``torch.func.functional_call`` over a dict of tensors that Adam updates: an optimizer
    exists, though it holds none of the module's own parameters. One record per optimizer step
    and no warning that there is no optimizer (one used to say so)."""
    from torch.func import functional_call

    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    model = _mlp()
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    opt = torch.optim.Adam(params.values(), lr=1e-3)
    with caplog.at_level(logging.INFO, logger="stepwatch"):
        for _ in range(4):
            loss = nn.functional.mse_loss(functional_call(model, params, (torch.randn(8, 16),)), torch.randn(8, 4))
            opt.zero_grad()
            loss.backward()
            opt.step()
        stepwatch.shutdown()
    assert [r for r in caplog.records if r.levelno >= logging.WARNING and "optimizer" in r.getMessage()] == []
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 4 and all(r.samples == 8 for r in recs)
