"""stepwatch.log's converter with a CPU tensor's item() read in C (hooks/phases.py cpu_items,
hooks/_ctracker.c CpuItem) gives what _pipeline.loggable gives, value for value and type for type."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stepwatch._pipeline import loggable
from stepwatch.hooks import phases


class Marked(torch.Tensor):
    pass


VALUES = [
    torch.tensor(1.5), torch.tensor(2.0, dtype=torch.float64), torch.tensor(3), torch.tensor(True),
    torch.tensor([4.5]), torch.tensor([[5.5]]), torch.tensor([1.0, 2.0]), torch.tensor([]),
    torch.tensor(0.25, requires_grad=True) * 2, torch.tensor(float("nan")), torch.tensor(float("inf")),
    torch.tensor(1.5, dtype=torch.bfloat16), torch.tensor(1 + 2j), torch.tensor(7.5).as_subclass(Marked),
    np.float32(6.5), np.int64(3), 1.25, 7, True, None, "text", [1.0],
]


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


@pytest.mark.parametrize("i", range(len(VALUES)))
def test_cpu_items_gives_what_loggable_gives(i):
    conv = phases.cpu_items(loggable)
    v = VALUES[i]
    want, got = loggable(v), conv(v)
    assert _same(got, want), (v, want, got)


def test_cpu_items_is_c_where_the_tracker_is_built():
    conv = phases.cpu_items(loggable)
    if phases._Core is phases._PyCore:
        assert conv is loggable
    else:
        assert type(conv).__name__ == "CpuItem" and conv.full is loggable and conv.tensor is torch.Tensor


def test_the_logged_loss_reaches_the_record_through_both_converters(sw):
    stepwatch, mem, start = sw
    start(training_metrics=False, comm=False, gpu_telemetry=False, memory=False, watchdog="off", capture="off")
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, 3)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        stepwatch.log(loss=loss, n=torch.tensor(2), pair=torch.tensor([1.0, 2.0]))
        losses.append(loss.item())
    stepwatch.shutdown()
    recs = sorted(mem.records, key=lambda r: r.step)
    assert [r.scalars["loss"] for r in recs] == losses
    assert all(r.scalars["n"] == 2.0 and r.scalars.get("pair") is None for r in recs)
