"""torch.autograd.backward as stepwatch wraps it (hooks/install.py's _Backward: hooks/_ctracker.c's
BackwardCall, or _PyBackwardCore), in real sessions with both cores (tests/conftest.py
``both_tracker_cores``): it passes for torch's function, an error passes through unchanged with
the exception observers told, the phase is closed after it, and uninstall puts torch's back."""

from __future__ import annotations

import inspect
import json
import os

import pytest
import torch
from torch import nn

from stepwatch.hooks import install

pytestmark = pytest.mark.usefixtures("both_tracker_cores")

FOUNDATION = dict(training_metrics=False, comm=False, gpu_telemetry=False, nvtx=False, memory=False,
                  watchdog="off", capture="off", otel=False, console="off")


def test_the_wrapper_installed_is_the_core_asked_for_and_passes_for_torchs(tmp_path, both_tracker_cores):
    import stepwatch

    orig = torch.autograd.backward
    stepwatch.init(dir=str(tmp_path), **FOUNDATION)
    try:
        b = torch.autograd.backward
        want = install._PyBackward if both_tracker_cores == "python" else install._Backward
        assert type(b) is want
        if both_tracker_cores == "c":
            from stepwatch.hooks import _ctracker

            assert want.__mro__[2] is _ctracker.BackwardCall
        assert b.__wrapped__ is orig and b.__name__ == orig.__name__ and b.__doc__ == orig.__doc__
        assert inspect.signature(b) == inspect.signature(orig)
    finally:
        stepwatch.shutdown()
    assert torch.autograd.backward is orig


def test_an_error_passes_through_and_the_phase_closes(tmp_path, both_tracker_cores):
    import stepwatch

    s = stepwatch.init(dir=str(tmp_path), **FOUNDATION)
    try:
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = []
        s.instrumentation.exception_observers.append(lambda phase, e: seen.append((phase, type(e))))
        for i in range(4):
            loss = model(torch.randn(2, 3)).sum()
            if i == 2:
                no_grad = torch.ones(2).sum()  # nothing requires grad: torch raises
                with pytest.raises(RuntimeError, match="does not require grad") as info:
                    no_grad.backward()
                names = [f.name for f in __import__("traceback").extract_tb(info.value.__traceback__)]
                if both_tracker_cores == "c":
                    assert "__call__" not in names  # no frame of ours
                assert s.tracker._bwd_depth == 0  # closed in spite of the error
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert seen == [("backward", RuntimeError)]
        run_dir = s.ctx.run_dir
    finally:
        stepwatch.shutdown()
    with open(os.path.join(run_dir, "steps.rank0.jsonl")) as f:
        recs = [json.loads(l) for l in f]
    assert len(recs) == 4 and all(r["backward_s"] > 0 for r in recs)


def test_a_loop_without_an_optimizer_is_told_at_the_first_backward(tmp_path, both_tracker_cores):
    import gc

    import stepwatch

    gc.collect()  # optimizers of earlier tests in this process would count as the loop's
    s = stepwatch.init(dir=str(tmp_path), **FOUNDATION)
    try:
        w = torch.randn(3, requires_grad=True)
        for _ in range(3):
            (w * w).sum().backward()
            with torch.no_grad():
                w -= 0.1 * w.grad
            w.grad = None
        assert s.tracker.boundary == "backward"
        run_dir = s.ctx.run_dir
    finally:
        stepwatch.shutdown()
    with open(os.path.join(run_dir, "steps.rank0.jsonl")) as f:
        assert len([json.loads(l) for l in f]) == 3


def test_a_model_built_after_init_without_loader_or_optimizer_starts_step_0_at_its_backward(tmp_path, both_tracker_cores):
    """No DataLoader, no optimizer, the model built after init: its roots are found at the first
    backward, so step 0's forward is in no step (README, "Phases", says so) and later steps
    time theirs."""
    import gc
    import time

    import stepwatch

    class Slow(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x):
            time.sleep(0.03)
            return self.lin(x).sum()

    gc.collect()  # optimizers of earlier tests in this process would count as the loop's
    s = stepwatch.init(dir=str(tmp_path), **FOUNDATION)
    try:
        m = Slow()
        for _ in range(3):
            m(torch.randn(2, 4)).backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
        run_dir = s.ctx.run_dir
    finally:
        stepwatch.shutdown()
    with open(os.path.join(run_dir, "steps.rank0.jsonl")) as f:
        recs = [json.loads(l) for l in f]
    assert len(recs) == 3
    assert recs[0]["forward_s"] == 0 and recs[0]["step_s"] < 0.03
    assert all(r["forward_s"] >= 0.03 for r in recs[1:])
