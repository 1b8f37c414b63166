"""The optimizer step pre-hook (hooks/install.py's _OptPre: hooks/_ctracker.c's OptPre, or
_PyOptPreCore) in real sessions, with both cores (tests/conftest.py ``both_tracker_cores``):
observers before the phase opens, one that raises dropped once and the others still called, a
closure step (LBFGS), a second optimizer, a disabled tracker, ``step()`` with keyword arguments."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from stepwatch.hooks import install

pytestmark = pytest.mark.usefixtures("both_tracker_cores")

FOUNDATION = dict(training_metrics=False, comm=False, gpu_telemetry=False, nvtx=False, memory=False,
                  watchdog="off", capture="off", otel=False, console="off")


def _records(run_dir):
    with open(os.path.join(run_dir, "steps.rank0.jsonl")) as f:
        return [json.loads(l) for l in f]


def _session(tmp_path):
    import stepwatch

    return stepwatch, stepwatch.init(dir=str(tmp_path), **FOUNDATION)


def test_observers_run_before_the_phase_and_a_raising_one_is_dropped(tmp_path, both_tracker_cores):
    sw, s = _session(tmp_path)
    try:
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        seen, opened = [], []

        def good(o):
            seen.append(o)
            opened.append(s.tracker._opt_depth)  # the optimizer phase is not open yet

        def bad(o):
            raise ValueError("an observer's bug")

        s.instrumentation.optimizer_observers.extend([bad, good])
        for _ in range(3):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert seen == [opt] * 3 and opened == [0, 0, 0]
        assert bad not in s.instrumentation.optimizer_observers  # dropped at its first error
        assert s.failures.total >= 1
        run_dir = s.ctx.run_dir
    finally:
        sw.shutdown()
    recs = _records(run_dir)
    assert len(recs) == 3 and all(r["optimizer_s"] > 0 for r in recs[1:])


def test_the_hook_installed_is_the_core_asked_for(tmp_path, both_tracker_cores):
    sw, s = _session(tmp_path)
    try:
        from torch.optim.optimizer import _global_optimizer_pre_hooks

        mine = [h for h in _global_optimizer_pre_hooks.values() if isinstance(h, (install._OptPre, install._PyOptPre))]
        assert len(mine) == 1
        want = install._PyOptPre if both_tracker_cores == "python" else install._OptPre
        assert type(mine[0]) is want
        if both_tracker_cores == "c":
            from stepwatch.hooks import _ctracker

            assert want.__mro__[2] is _ctracker.OptPre
    finally:
        sw.shutdown()
    assert not [h for h in _global_optimizer_pre_hooks.values() if isinstance(h, (install._OptPre, install._PyOptPre))]


def test_a_closure_step_a_second_optimizer_and_keyword_arguments(tmp_path):
    sw, s = _session(tmp_path)
    try:
        model = nn.Linear(4, 1)
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01)
        seen = []
        s.instrumentation.optimizer_observers.append(lambda o: seen.append(type(o).__name__))

        def closure():
            lbfgs.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        for _ in range(2):
            lbfgs.step(closure)  # positional closure: args longer than the optimizer
        for _ in range(2):
            lbfgs.step(closure=closure)  # keyword closure
        for _ in range(2):
            nn.functional.mse_loss(model(x), y).backward()
            sgd.step()  # another optimizer: the last-optimizer shortcut misses once
            sgd.zero_grad()
        assert seen == ["LBFGS"] * 4 + ["SGD"] * 2
        run_dir = s.ctx.run_dir
    finally:
        sw.shutdown()
    recs = _records(run_dir)
    # LBFGS steps with nothing between them extend one step (hooks/phases.py); the closure's
    # forward and backward ran inside step() and are counted as forward and backward
    assert recs and recs[0]["forward_s"] > 0 and recs[0]["backward_s"] > 0


def test_a_disabled_tracker_calls_no_observer(tmp_path):
    sw, s = _session(tmp_path)
    try:
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = []
        s.instrumentation.optimizer_observers.append(seen.append)
        s.tracker.enabled = False
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        assert seen == []
        s.tracker.enabled = True
        opt.step()
        assert seen == [opt]
    finally:
        sw.shutdown()
