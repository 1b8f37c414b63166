"""The hang watchdog's directories across launches into one run directory (a requeued job, a
second torchrun with the same run id): each launch's hangs beside the earlier ones, never over
them, and every rank of a launch in the same place."""

import os
import subprocess
import sys
import time

import pytest

from stepwatch.watchdog.sidecar import Watchdog, parse_args


@pytest.fixture
def trainer():
    """A process standing in for this launch's trainer: the sidecar reads when it started."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p.pid
    p.kill()
    p.wait()


def _sidecar(run, pid, rank=0, attempt=0):
    return Watchdog(parse_args(["--trainer-pid", str(pid), "--board", "/nonexistent", "--run-dir", str(run),
                               "--run-id", "r", "--rank", str(rank), "--world-size", "2", "--attempt", str(attempt)]))


def test_a_later_launch_puts_its_hangs_beside_the_earlier_ones(tmp_path, trainer):
    """A relaunch wrote its first hang into the last launch's hang-1/ (report, snapshots and
    stacks over the earlier ones, both findings pointing at one report) and took the old
    report.json for its own."""
    run = tmp_path / "run"
    run.mkdir()
    assert os.path.basename(_sidecar(run, trainer).hang_dir(1)) == "hang-1"  # the first launch
    for name in ("hang-1", "hang-2"):  # an earlier launch's hangs, written before this trainer started
        (run / name).mkdir()
        (run / name / "report.json").write_text("{}")
        os.utime(run / name, (time.time() - 3600, time.time() - 3600))
    rank0 = _sidecar(run, trainer)
    assert [os.path.basename(rank0.hang_dir(n)) for n in (1, 2)] == ["hang-1.launch1", "hang-2.launch1"]
    os.makedirs(rank0.hang_dir(1))  # rank 0's first hang of this launch, made before rank 1's sidecar started
    assert _sidecar(run, trainer, rank=1).hang_dir(1) == rank0.hang_dir(1)
    assert not rank0.reported_since(time.time() - 60, os.path.join(rank0.hang_dir(1), "report.json"))
    (run / "hang-1.launch1").rename(run / "kept")
    os.utime(run / "kept", (time.time() - 3600, time.time() - 3600))
    (run / "kept").rename(run / "hang-1.launch1")
    assert os.path.basename(_sidecar(run, trainer).hang_dir(1)) == "hang-1.launch2"  # a third launch
    # An elastic restart's attempt keeps its own names, a later launch's beside them.
    assert os.path.basename(_sidecar(run, trainer, attempt=1).hang_dir(3)) == "hang-3.attempt1"
