"""The run directory's files: naming across restarts, rotation under the disk budget, the console."""

import io
import json
import os

from stepwatch.config import Config
from stepwatch.context import RunContext, resolve_run_id
from stepwatch.exporters.base import Batch
from stepwatch.exporters.console import ConsoleExporter, format_line
from stepwatch.exporters.records import RecordsExporter
from stepwatch.record import Finding, StepRecord


def ctx(tmp_path, rank=0, world=1):
    return RunContext(rank=rank, local_rank=rank, world_size=world, host="h", run_id="r", run_dir=str(tmp_path / "run"))


def rec(step, rank=0, **kw):
    base = dict(step=step, rank=rank, time=1000.0 + step, step_s=0.1, data_wait_s=0.01, forward_s=0.03,
                backward_s=0.04, optimizer_s=0.01, other_s=0.01)
    base.update(kw)
    return StepRecord(**base)


def test_run_id_agreed_without_talking():
    assert resolve_run_id({"TORCHELASTIC_RUN_ID": "abc-123"}) == "abc-123"
    # torchrun's static-rendezvous default is the literal "none": not an id.
    assert resolve_run_id({"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}) == "job-10.0.0.1-29500"
    assert resolve_run_id({"TORCHELASTIC_RUN_ID": "../../etc"}) == "_.._etc"  # a path component stays one
    assert resolve_run_id({}).startswith("run-")
    assert resolve_run_id({"TORCHELASTIC_RUN_ID": "x"}, explicit="mine") == "mine"


def test_a_restart_writes_beside_the_old_files_never_over_them(tmp_path):
    c = ctx(tmp_path)
    first = RecordsExporter(c, budget_bytes=10 << 20)
    first.export(Batch(records=[rec(0), rec(1)]))
    first.shutdown()
    second = RecordsExporter(c, budget_bytes=10 << 20)  # e.g. torchrun restarted the worker
    second.export(Batch(records=[rec(2)]))
    second.shutdown()
    run = tmp_path / "run"
    old = [json.loads(x)["step"] for x in (run / "steps.rank0.jsonl").read_text().splitlines()]
    new = [json.loads(x)["step"] for x in (run / "steps.rank0.1.jsonl").read_text().splitlines()]
    assert old == [0, 1] and new == [2]


def test_a_relaunch_says_when_the_earlier_launches_records_pass_the_budget_and_keeps_them(tmp_path, caplog):
    """The budget bounds each launch's own files: a directory resumed into four times held 2.3 MB
    against a 1 MiB budget, and nothing said so (the README said the budget covered the
    directory). The earlier launches' files are kept, and one line says the directory holds more."""
    import logging

    budget = 64 * 1024
    c = ctx(tmp_path)
    first = RecordsExporter(c, budget_bytes=budget)
    for i in range(0, 3000, 10):
        first.export(Batch(records=[rec(s) for s in range(i, i + 10)]))
    first.shutdown()
    run = tmp_path / "run"
    before = {n: (run / n).read_bytes() for n in os.listdir(run)}
    with caplog.at_level(logging.INFO, logger="stepwatch"):
        RecordsExporter(c, budget_bytes=budget).shutdown()
    assert not [r for r in caplog.records if "earlier launches" in r.getMessage()]  # within the budget: quiet
    (run / "steps.rank0.jsonl.old").write_bytes(b"x" * budget)  # an earlier launch's that passed it
    with caplog.at_level(logging.INFO, logger="stepwatch"):
        RecordsExporter(c, budget_bytes=budget).shutdown()
    (said,) = [r.getMessage() for r in caplog.records if "earlier launches" in r.getMessage()]
    assert "STEPWATCH_DISK_BUDGET_MB" in said and "kept" in said, said
    assert all((run / n).read_bytes() == b for n, b in before.items())


def test_rotation_keeps_a_rank_within_its_share_of_the_budget(tmp_path):
    budget = 64 * 1024
    c = ctx(tmp_path, rank=1, world=2)  # share = 32 KiB
    e = RecordsExporter(c, budget_bytes=budget)
    for i in range(0, 3000, 10):
        e.export(Batch(records=[rec(s, rank=1) for s in range(i, i + 10)],
                       findings=[Finding(1.0, i, 1, "data_loading", "warning", "s" * 50, "d", "a")]))
    e.shutdown()
    run = tmp_path / "run"
    names = sorted(os.listdir(run))
    assert names == ["findings.rank1.jsonl", "findings.rank1.jsonl.1", "steps.rank1.jsonl", "steps.rank1.jsonl.1"]
    total = sum(os.path.getsize(run / n) for n in names)
    assert total <= budget // 2
    # The newest steps survive, whole lines only.
    last = [json.loads(x) for x in (run / "steps.rank1.jsonl").read_text().splitlines()]
    assert last[-1]["step"] == 2999


def test_a_batch_larger_than_the_share_still_keeps_the_rank_within_it(tmp_path):
    """A long flush interval (or a slow pass) hands the file thousands of records at once: it
    rotated only before a batch and wrote the whole batch into the new segment (2.7 MB against a
    1 MiB budget). Each segment now rotates within the batch too; the oldest lines go, the newest
    stay whole."""
    budget = 64 * 1024
    c = ctx(tmp_path, rank=0, world=1)
    e = RecordsExporter(c, budget_bytes=budget)
    for start in (0, 3000):  # two passes of 3000 records, each ~10x a segment's cap
        e.export(Batch(records=[rec(s) for s in range(start, start + 3000)],
                       findings=[Finding(1.0, s, 0, "data_loading", "warning", "s" * 50, "d", "a")
                                 for s in range(start, start + 300)]))
    e.shutdown()
    run = tmp_path / "run"
    sizes = {n: os.path.getsize(run / n) for n in os.listdir(run)}
    assert sizes["steps.rank0.jsonl"] <= 0.35 * budget and sizes["steps.rank0.jsonl.1"] <= 0.35 * budget, sizes
    assert sizes["findings.rank0.jsonl"] <= 0.10 * budget, sizes
    assert sum(sizes.values()) <= 0.9 * budget, sizes
    last = [json.loads(x) for x in (run / "steps.rank0.jsonl").read_text().splitlines()]
    older = [json.loads(x) for x in (run / "steps.rank0.jsonl.1").read_text().splitlines()]
    steps = [d["step"] for d in older + last]
    assert steps == list(range(steps[0], 6000))  # whole lines, in order, up to the newest


def test_non_finite_values_stay_valid_json(tmp_path):
    e = RecordsExporter(ctx(tmp_path), budget_bytes=1 << 20)
    e.export(Batch(records=[rec(0, grad_norm=float("inf"), scalars={"loss": float("nan")})]))
    e.shutdown()
    line = (tmp_path / "run" / "steps.rank0.jsonl").read_text()
    d = json.loads(line)  # strict JSON parsers would reject NaN/Infinity
    assert d["grad_norm"] == "inf" and d["scalars"]["loss"] == "nan"
    assert "NaN" not in line and "Infinity" not in line


class FakeTTY(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self._tty = tty

    def isatty(self):
        return self._tty


def test_console_is_quiet_when_not_a_terminal():
    now = [0.0]
    out = FakeTTY(False)
    e = ConsoleExporter(Config(window=10), ctx_stub(), stream=out, clock=lambda: now[0])
    for i in range(50):  # 50 passes, 1 s apart
        now[0] += 1.0
        e.export(Batch(records=[rec(i)]))
    assert out.getvalue().count("\n") == 0  # under a minute: nothing
    now[0] += 60
    e.export(Batch(records=[rec(50)], findings=[Finding(1.0, 50, 0, "data_loading", "warning", "slow data", "d", "add workers")]))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "data_loading" in lines[0] and "add workers" in lines[0]
    assert lines[1].startswith("stepwatch | step 50")


def test_console_on_a_terminal_updates_every_interval():
    now = [0.0]
    out = FakeTTY(True)
    e = ConsoleExporter(Config(console_interval_s=5, window=10), ctx_stub(), stream=out, clock=lambda: now[0])
    for i in range(20):
        now[0] += 1.0
        e.export(Batch(records=[rec(i)]))
    assert out.getvalue().count("\n") == 4


def test_console_line_content():
    window = [rec(i, tokens=1000, mfu=0.4, grad_norm=1.5, mfu_dtype="bf16", peak_tflops=989.0) for i in range(10)]
    line = format_line(window, "NVIDIA H100 80GB HBM3")
    assert "MFU 40.0% (NVIDIA H100 80GB HBM3, bf16, peak 989 TFLOP/s)" in line
    assert "step 9" in line and "p50 100.0ms" in line and "fwd 30%" in line and "bwd 40%" in line
    assert "10.0 steps/s" in line and "10,000 tok/s" in line and "MFU 40.0%" in line and "grad-norm 1.5" in line


def ctx_stub():
    return RunContext(rank=0, local_rank=0, world_size=1, host="h", run_id="r", run_dir="/nonexistent")


def test_console_shows_drops_when_there_are_any():
    now = [0.0]
    out = FakeTTY(True)
    e = ConsoleExporter(Config(console_interval_s=1, window=10), ctx_stub(), stream=out, clock=lambda: now[0])
    now[0] += 2
    e.export(Batch(records=[rec(0)]))
    now[0] += 2
    e.export(Batch(records=[rec(1)], dropped=1234))  # the pipeline's count when it made the batch
    first, second = out.getvalue().splitlines()
    assert "dropped" not in first and second.endswith("| 1,234 dropped")


def test_record_lines_are_byte_identical_to_json_dumps_and_survive_a_non_finite_line():
    """The records file's encoder is made once; each line is what json.dumps(separators=(",", ":"),
    allow_nan=False, default=str) writes, and a NaN line (written as strings) leaves the next intact."""
    from stepwatch.exporters.records import _clean, dumps

    def want(d):
        try:
            return json.dumps(d, separators=(",", ":"), allow_nan=False, default=str)
        except ValueError:
            return json.dumps(_clean(d), separators=(",", ":"), default=str)

    rec = StepRecord(step=3, rank=1, time=1.7e9, step_s=0.0005, forward_s=1e-7, scalars={"loss": 0.25, "lr": 3e-4},
                     phases={"x": 1.0}, gpu={"util": [1, 2.5]}, clock="host")
    cases = [rec.to_dict(), {"n": float("nan"), "c": {"i": float("-inf")}}, rec.to_dict(),
             {"s": "é\"\n", "t": (1, None), "big": 10**30, "o": range(2)}, {}]
    for d in cases:
        assert dumps(d) == want(d)
    assert json.loads(dumps(cases[1])) == {"n": "nan", "c": {"i": "-inf"}}


def test_a_run_id_that_cannot_be_a_folder_name_is_said(caplog):
    """``STEPWATCH_RUN_ID="exp 1"`` silently became ``exp_1``: the user looks for the folder they named."""
    import logging

    logging.getLogger("stepwatch").addHandler(caplog.handler)
    try:
        assert resolve_run_id({}, explicit="exp 1/a") == "exp_1_a"
        assert resolve_run_id({}, explicit="exp-2") == "exp-2"
    finally:
        logging.getLogger("stepwatch").removeHandler(caplog.handler)
    said = [r.getMessage() for r in caplog.records if "run id" in r.getMessage()]
    assert len(said) == 1 and "'exp 1/a'" in said[0] and "'exp_1_a'" in said[0], said
