"""A logged value that does not fit a float (``10**400``, a huge Fraction) is null in its record
and counted in run.json; it never costs another record (issue 14)."""

import json
from fractions import Fraction

import torch
import torch.nn as nn


def _steps(run_dir):
    lines = []
    for p in sorted(run_dir.glob("steps.rank0*.jsonl")):
        lines += [json.loads(line) for line in p.read_text().splitlines()]
    return lines


def test_values_too_big_for_a_float_are_null_and_counted(sw, tmp_path):
    stepwatch, mem, start = sw
    run = tmp_path / "run"
    start(dir=str(run))
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for i in range(60):
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        # every step: an int and a Fraction too big for a float, beside a good value
        stepwatch.log(big=10**400, frac=Fraction(10**400, 3), loss=float(i))
    stepwatch.shutdown()

    assert [r.step for r in mem.records] == list(range(60))
    assert all(r.scalars == {"big": None, "frac": None, "loss": float(i)} for i, r in enumerate(mem.records))
    on_disk = _steps(run)
    assert [r["step"] for r in on_disk] == list(range(60))
    assert all(r["scalars"] == {"big": None, "frac": None, "loss": float(i)} for i, r in enumerate(on_disk))
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["steps"] == 60
    assert manifest["null_scalars"] == {"big": 60, "frac": 60}
    assert manifest["internal_errors"] == {}
