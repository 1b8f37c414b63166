"""The live console's grad-norm: README "Live console" promises it "when known". With
``STEPWATCH_GRAD_NORM_EVERY`` > 1 only every Nth record carries it, and the line read only the
newest record: the grad norm was missing from most lines and from the final one."""

import torch

from stepwatch.config import Config
from stepwatch.context import RunContext
from stepwatch.exporters.base import Batch
from stepwatch.exporters.console import ConsoleExporter
from stepwatch.record import StepRecord


def _train(steps: int) -> None:
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        m(torch.randn(2, 4)).sum().backward()
        opt.step()


def test_the_final_line_shows_the_last_known_grad_norm_with_grad_norm_every(sw, capfd):
    stepwatch, mem, start = sw
    start(console="on", grad_norm_every=7)
    _train(20)
    stepwatch.shutdown()
    probed = [r for r in mem.records if r.grad_norm is not None]
    assert [r.step for r in probed] == [0, 7, 14], [r.step for r in mem.records]
    done = [line for line in capfd.readouterr().err.splitlines() if "done:" in line]
    assert len(done) == 1 and "| step 19 |" in done[0], done
    assert f"grad-norm {probed[-1].grad_norm:.3g} (step 14)" in done[0], done


def test_the_grad_norm_outlives_the_window_and_is_shown_bare_when_current():
    class Out:
        text = ""

        def write(self, s):
            self.text += s

        def flush(self):
            pass

        def isatty(self):
            return True

    def rec(step, grad_norm=None):
        return StepRecord(step=step, rank=0, time=0.0, step_s=0.1, grad_norm=grad_norm)

    ctx = RunContext(rank=0, local_rank=0, world_size=1, host="h", run_id="r", run_dir="/nonexistent")
    out, now = Out(), [0.0]
    e = ConsoleExporter(Config(console_interval_s=1, window=5), ctx, stream=out, clock=lambda: now[0])
    now[0] += 1
    e.export(Batch(records=[rec(0, 2.5)] + [rec(i) for i in range(1, 20)]))  # step 0 left the window
    line = out.text.splitlines()[-1]
    assert "| step 19 |" in line and "grad-norm 2.5 (step 0)" in line, line
    now[0] += 1
    e.export(Batch(records=[rec(20, 0.75)]))
    line = out.text.splitlines()[-1]
    assert "| step 20 |" in line and line.endswith("grad-norm 0.75"), line


def test_a_job_without_stderr_or_with_a_write_only_one_gets_no_internal_error(sw, monkeypatch):
    """A job started with stderr closed (``2>&-``: ``sys.stderr`` is None), or whose
    ``sys.stderr`` is the user's object with ``write`` and no ``flush``: the live console raised
    on every line, each an ``internal_error`` finding telling the user to report it."""
    import sys

    class WriteOnly:
        def __init__(self):
            self.text = ""

        def write(self, s):
            self.text += s

    stepwatch, mem, start = sw
    for stderr in (None, WriteOnly()):
        monkeypatch.setattr(sys, "stderr", stderr)
        start(console="on", console_interval_s=0.1)
        _train(30)
        sess = stepwatch.get_session()
        stepwatch.shutdown()
        assert dict(sess.failures.counts) == {}, (stderr, dict(sess.failures.counts))
        assert not [f for f in mem.findings if f.kind == "internal_error"]
        if stderr is not None:
            assert "| step 29 |" in stderr.text  # the lines went where the job pointed stderr


def test_the_closing_line_counts_what_other_exporters_dropped_in_the_last_pass(sw, capfd):
    """The closing line's "N dropped" was the count the pipeline made as it built the last pass's
    batch: what another exporter lost in that pass (a destination that is down; a sink that could
    not start) was missing from it, while run.json's exporter_drops had it all. The console now
    shuts down after every other exporter, with the final count."""
    import json
    import os
    import time

    import stepwatch as sw_mod

    class Down(sw_mod.Exporter):  # a destination that is down: every record it is given is lost
        name = "down"

        def __init__(self):
            self.lost = 0

        def export(self, batch):
            time.sleep(0.05)
            self.lost += len(batch.records)

        def dropped(self):
            return self.lost

        def force_flush(self, timeout_s=10.0):
            return True

    stepwatch, mem, start = sw
    s = start(console="on", exporters=[mem, Down()], flush_interval_s=60.0)  # one pass: the last
    _train(20)
    stepwatch.shutdown()
    done = [line for line in capfd.readouterr().err.splitlines() if "done:" in line]
    assert len(done) == 1 and "| 20 dropped |" in done[0], done
    manifest = json.loads(open(os.path.join(s.ctx.run_dir, "run.json")).read())
    assert manifest["exporter_drops"] == {"down": {"points": 20}}, manifest["exporter_drops"]
