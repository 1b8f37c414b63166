"""The hang verdict when the ranks wait in a collective stepwatch does not time.

A 2-rank gloo job without DDP averages its loss with ``dist.all_reduce`` (or meets at a
``dist.barrier``) after each optimizer step: no comm hook sees those, so the progress board has
no open collective, and both ranks show the same step and phase. Rank 1 sleeps in Python before
the collective; rank 0 blocks inside it. Only the stacks tell them apart: rank 0's innermost
frames are in torch.distributed, rank 1's are its own code. The report must name rank 1 the
laggard and rank 0 the one waiting, in the right collective.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from test_hang import ROOT, TIMEOUT_S, stop_job, wait_for

# Found by the stacks, not by time: a busy machine delays the verdict, within the bound it allows.
pytestmark = [pytest.mark.integration, pytest.mark.shares_cores]

JOB = r'''
import stepwatch.auto  # noqa: F401  -- the one line
import argparse, time
import torch, torch.distributed as dist, torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--hang-step", type=int, default=6)
p.add_argument("--barrier", action="store_true")
a = p.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(40):
    loss = model(torch.randn(16, 32)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step == a.hang_step and rank == 1:
        with open("hang_start", "w") as f:
            f.write(repr(time.time()))
        time.sleep(3600)  # SLEEP-HERE
    if a.barrier:
        dist.barrier()  # UNTIMED-BARRIER
    else:
        t = loss.detach().clone()
        dist.all_reduce(t)  # UNTIMED-ALLREDUCE
dist.destroy_process_group()
'''


def line_of(marker):
    return next(i for i, line in enumerate(JOB.splitlines()[1:], 1) if marker in line)


def start(tmp_path, args):
    job = tmp_path / "job.py"
    job.write_text(JOB[1:])
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1", "STEPWATCH_CONSOLE": "off",
                "STEPWATCH_GPU_TELEMETRY": "0", "STEPWATCH_DIR": str(tmp_path / "run"),
                "STEPWATCH_HANG_TIMEOUT": str(TIMEOUT_S)})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(job), *args]
    return subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@pytest.mark.parametrize("kind", ["all_reduce", "barrier"])
def test_sleeping_rank_outside_an_untimed_collective_is_the_laggard(tmp_path, kind):
    proc = start(tmp_path, ["--barrier"] if kind == "barrier" else [])
    run = tmp_path / "run"
    try:
        assert wait_for(run / "hang-1" / "report.json", proc, 60 + TIMEOUT_S + 30), stop_job(proc, run)
        rep = json.loads((run / "hang-1" / "report.json").read_text())
        ranks = {r["rank"]: r for r in rep["ranks"]}
        # The premise: the board cannot tell the ranks apart (same step and phase, nothing open).
        assert ranks[0]["step"] == ranks[1]["step"] and ranks[0]["phase"] == ranks[1]["phase"], rep
        assert rep["verdict"] == "laggard", rep
        assert rep["laggards"] == [1] and rep["waiting"] == [0], rep
        marker = "UNTIMED-BARRIER" if kind == "barrier" else "UNTIMED-ALLREDUCE"
        coll = rep["collective"]
        assert coll["op"] == ("barrier" if kind == "barrier" else "allreduce"), coll
        assert coll["call_site"] and f"job.py:{line_of(marker)})" in coll["call_site"], coll
        assert "Laggard: rank 1" in rep["summary"], rep["summary"]
        assert any(f"job.py:{line_of('SLEEP-HERE')})" in f for f in ranks[1]["top_frames"]), ranks[1]
        hang_start = float((tmp_path / "hang_start").read_text())
        assert rep["time"] - hang_start <= TIMEOUT_S + 30
        findings = [json.loads(x) for x in (run / "findings.watchdog.rank0.jsonl").read_text().splitlines()]
        assert findings[0]["data"]["laggards"] == [1]
    finally:
        stop_job(proc, run)
