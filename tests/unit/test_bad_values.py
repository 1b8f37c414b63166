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


def _log_each_step(sw, tmp_path, caplog, steps, values):
    """A session over ``steps`` training steps that each log ``values()`` (warnings captured):
    its records and its run.json."""
    import logging

    stepwatch, mem, start = sw
    run = tmp_path / "run"
    start(dir=str(run))
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with caplog.at_level(logging.WARNING, logger="stepwatch"):
        for _ in range(steps):
            m(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            stepwatch.log(**values())
        stepwatch.shutdown()
    return mem.records, json.loads((run / "run.json").read_text())


def test_a_tensor_of_several_values_is_null_and_counted(sw, tmp_path, caplog, both_tracker_cores):
    """``stepwatch.log(per_class_acc=torch.tensor([0.5, 0.7]))``: null in the record, as before,
    and now counted in run.json's null_scalars with one line that says what it was (it was read
    as None on the training thread, which counted as nothing logged)."""
    records, manifest = _log_each_step(sw, tmp_path, caplog, 4, lambda: dict(
        per_class_acc=torch.tensor([0.5, 0.7]), empty=torch.zeros(0), loss=torch.tensor(1.5), lr=[0.1]))
    assert all(r.scalars == {"per_class_acc": None, "empty": None, "loss": 1.5, "lr": None} for r in records)
    assert manifest["null_scalars"] == {"per_class_acc": 4, "empty": 4, "lr": 4}
    lines = {r.getMessage().split("(")[1].split("=")[0]: r.getMessage() for r in caplog.records if "stepwatch.log(" in r.getMessage()}
    assert "tensor of 2 values" in lines["per_class_acc"] and "per_class_acc=values[0]" in lines["per_class_acc"]
    # scheduler.get_last_lr() is a list (one value per parameter group): the line says what to log
    assert "a list is not a number" in lines["lr"] and "lr=values[0], or lr_0=..., lr_1=..." in lines["lr"], lines
    assert "tensor of 0 values" in lines["empty"] and "values[0]" not in lines["empty"]


def test_a_complex_value_is_null_and_counted(sw, tmp_path, caplog, both_tracker_cores):
    """``stepwatch.log(c=torch.tensor(1 + 2j))``: its ``item()`` is a Python complex, which no
    float holds. It was read as None on the training thread (nothing logged): null with no line
    and not in run.json's null_scalars, where a Python ``1 + 2j`` and a string were both."""

    class Marked(torch.Tensor):
        pass

    records, manifest = _log_each_step(sw, tmp_path, caplog, 3, lambda: dict(
        ctensor=torch.tensor(1 + 2j), csub=torch.tensor(3 - 1j).as_subclass(Marked), cpy=1 + 2j,
        loss=torch.tensor(1.5)))
    assert all(r.scalars == {"ctensor": None, "csub": None, "cpy": None, "loss": 1.5} for r in records)
    assert manifest["null_scalars"] == {"ctensor": 3, "csub": 3, "cpy": 3}
    assert any("ctensor" in r.getMessage() and "complex" in r.getMessage() for r in caplog.records)


def test_a_string_is_null_even_when_it_reads_as_a_number_and_a_numpy_array_of_one_value_is_read(sw, tmp_path, caplog):
    """``"0.25"`` became 0.25, ``b"7"`` 7.0 and ``"nan"`` NaN, silently, while ``"hello"`` was null
    with a line: a string is not a number logged (the README: null for a value that is not a
    scalar), whatever it reads as. A one-value numpy array is read as a one-value tensor is (it
    was null with no hint); one of several values says what to log instead."""
    import numpy as np

    records, manifest = _log_each_step(sw, tmp_path, caplog, 3, lambda: dict(
        s="0.25", b=b"7", n="nan", word="hello", one=np.array([5.5]), two=np.array([1.0, 2.0]), i=3))
    assert all(r.scalars == {"s": None, "b": None, "n": None, "word": None, "one": 5.5, "two": None, "i": 3.0}
               for r in records), [r.scalars for r in records]
    assert manifest["null_scalars"] == {"s": 3, "b": 3, "n": 3, "word": 3, "two": 3}
    lines = {r.getMessage().split("(")[1].split("=")[0]: r.getMessage() for r in caplog.records if "stepwatch.log(" in r.getMessage()}
    assert "a str is not a number" in lines["s"] and "a bytes is not a number" in lines["b"], lines
    assert "an ndarray is not a number" in lines["two"] and "two=values[0]" in lines["two"], lines


def test_a_meta_tensor_is_said_to_hold_no_data(sw, tmp_path, caplog):
    """``stepwatch.log(x=torch.empty(1, device="meta"))`` said "a tensor of 1 values ... log one
    value a name: x=values[0]", advice for a tensor of several values; a meta tensor holds none."""
    records, manifest = _log_each_step(sw, tmp_path, caplog, 2, lambda: dict(x=torch.empty(1, device="meta"), y=1.0))
    assert all(r.scalars == {"x": None, "y": 1.0} for r in records)
    (line,) = [r.getMessage() for r in caplog.records if "stepwatch.log(x=" in r.getMessage()]
    assert "meta tensor (no data)" in line and "values[0]" not in line, line
