"""The 2-rank example's teardown 8 times, 4 without stepwatch and 4 with: every rank must end with 0.

In a fresh-clone run, rank 1 of the example *without* stepwatch once aborted after training
(``terminate called without an active exception``, SIGABRT). The cause: DDP's reducer, the
process group and gloo's pending work were left to the interpreter's exit; freed by the final
garbage collection during finalization, a gloo worker thread that takes the GIL then is ended by
``pthread_exit``, and the forced unwind through a ``noexcept`` frame is ``std::terminate``. The
example now passes a barrier, frees them on the main thread, then destroys the process group.

The race is rare (none in 20 harness runs and 9 torchrun launches of the old example here), so
this test cannot be shown failing on demand; it guards the teardown against coming back. (It ran
16 jobs without stepwatch until the twentieth session, 8 until the thirty-fourth; 4 keep the
suite within its time.)
Each run is a real 2-rank gloo job (``teardown_harness.py``: ranks forked from one process that
imported torch once, leaving through the normal interpreter exit), four jobs side by side.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HARNESS = os.path.join(ROOT, "tests", "integration", "teardown_harness.py")
TINY = ["--steps", "2", "--batch-size", "2", "--seq", "16", "--d-model", "16", "--layers", "1", "--vocab", "64"]
pytestmark = [pytest.mark.integration, pytest.mark.shares_cores]


@pytest.mark.parametrize("runs, stepwatch_args", [(4, ["--no-stepwatch"]), (4, [])], ids=["without", "with"])
def test_the_two_rank_example_tears_down_cleanly_every_time(tmp_path, runs, stepwatch_args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1", "STEPWATCH_CONSOLE": "off"})
    r = subprocess.run([sys.executable, HARNESS, str(runs), "4", *TINY, *stepwatch_args], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=900)
    lines = [x for x in r.stdout.splitlines() if x.startswith("run ")]
    assert len(lines) == runs, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.returncode == 0 and all(x.endswith("rank0 ok rank1 ok") for x in lines), (
        "\n".join(lines) + r.stderr[-3000:])
