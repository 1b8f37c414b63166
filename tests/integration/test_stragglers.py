"""The straggler named on a real 2-rank gloo DDP job: rank 1 does extra matmuls in its forward,
so rank 0 waits inside AllReduce every step (the DDP trap: rank 0 has the most comm time)."""

import json
import os

import pytest

from test_comm_ddp import records, torchrun

pytestmark = pytest.mark.integration

# 72 steps in windows of 8 (the first is warm-up, not judged). On this 2-core machine shared with
# other jobs, a balanced rank's window median swings by up to ~30% against its peer's (measured),
# so the margin is 50% instead of the default 20%; the slow rank computes ~3x its peer's.
STEPS = 72
ARGS = ["--steps", str(STEPS), "--width", "256", "--layers", "6", "--batch", "64", "--bucket-cap-mb", "0.05"]
ENV = {"STEPWATCH_STRAGGLER_EVERY": "8", "STEPWATCH_STRAGGLER_WINDOWS": "3", "STEPWATCH_STRAGGLER_MARGIN": "0.5",
       "STEPWATCH_FLUSH_INTERVAL": "0.05"}


def findings(run, rank, kind):
    path = os.path.join(run, f"findings.rank{rank}.jsonl")
    with open(path, encoding="utf-8") as f:
        return [d for d in (json.loads(line) for line in f if line.strip()) if d["kind"] == kind]


def window_compute(run):
    """Per rank, the median compute of each window, as the exchange sees it (for failure messages)."""
    import statistics

    out = {}
    for rank in (0, 1):
        c = [r["step_s"] - r["data_wait_s"] - (r["comm_exposed_s"] or 0) for _, r in sorted(records(run, rank).items())]
        out[rank] = [round(statistics.median(c[i:i + 8]) * 1e3, 1) for i in range(0, len(c), 8)]
    return out


def test_slow_rank_is_named_not_the_rank_waiting_in_allreduce(tmp_path):
    run = tmp_path / "run"
    torchrun([*ARGS, "--slow-rank", "1", "--slow-matmuls", "80"], {"STEPWATCH_DIR": str(run), **ENV}, tmp_path)
    found = findings(run, 0, "straggler")
    assert found, f"no straggler finding on rank 0 (the exchange leader); window medians: {window_compute(run)}"
    assert all(f["data"]["ranks"] == [1] for f in found), found
    f = found[0]
    assert set(f["data"]["hosts"]) == {"1"} and f["data"]["hosts"]["1"]
    c = f["data"]["compute_s"]
    assert c["1"] > c["0"] * 1.5
    # The trap: rank 0, the fast one, is the rank with more AllReduce time.
    r0, r1 = records(run, 0), records(run, 1)
    ar0 = sorted(r["allreduce_s"] for s, r in r0.items() if s >= 4)
    ar1 = sorted(r["allreduce_s"] for s, r in r1.items() if s >= 4)
    assert ar0[len(ar0) // 2] > ar1[len(ar1) // 2]
    # ... and its AllReduce time is waiting, not transfer: comm_wait_s (against the transfer floor
    # the exchange shares, rank 1's time) is the bigger part of rank 0's, a small part of rank 1's.
    late = [s for s in r0 if s >= STEPS // 2 and r0[s]["comm_wait_s"] is not None and r1[s]["comm_wait_s"] is not None]
    assert len(late) >= STEPS // 4
    w0 = sorted(r0[s]["comm_wait_s"] / r0[s]["allreduce_s"] for s in late)
    w1 = sorted(r1[s]["comm_wait_s"] / r1[s]["allreduce_s"] for s in late)
    assert w0[len(w0) // 2] > 0.5 and w0[len(w0) // 2] > 2 * w1[len(w1) // 2], (w0, w1)
    assert not findings(run, 1, "straggler")  # only the leader reports


def test_balanced_job_names_no_one(tmp_path):
    run = tmp_path / "run"
    torchrun(ARGS, {"STEPWATCH_DIR": str(run), **ENV}, tmp_path)
    named = findings(run, 0, "straggler") + findings(run, 1, "straggler")
    assert not named, (named, window_compute(run))
    assert len(records(run, 0)) == STEPS


def test_adaptive_windows_name_the_slow_rank_within_20_steps_of_the_warm_up(tmp_path):
    """The default (STEPWATCH_STRAGGLER_EVERY=0): rank 0 plans the windows from the warm-up's
    step time; the slow rank is named after >= 1 s of evidence, within 20 steps and 60 s. The job
    runs 160 steps: at ~15 ms a step on a fast machine, 72 steps left less than the 1 s of
    evidence after the warm-up's 20, and no one was named."""
    run = tmp_path / "run"
    env = {k: v for k, v in ENV.items() if k != "STEPWATCH_STRAGGLER_EVERY"}
    args = [*ARGS[:ARGS.index("--steps") + 1], "160", *ARGS[ARGS.index("--steps") + 2:]]
    torchrun([*args, "--slow-rank", "1", "--slow-matmuls", "80"], {"STEPWATCH_DIR": str(run), **env}, tmp_path)
    found = findings(run, 0, "straggler")
    assert found and found[0]["data"]["ranks"] == [1], (found, window_compute(run))
    r0 = records(run, 0)
    named = found[0]["step"]
    warm_end = min(s for s in r0 if s >= 3 and (s + 1 >= 20 or r0[s]["time"] - r0[0]["time"] >= 10))
    evidence = r0[named]["time"] - r0[warm_end]["time"]
    step_s = sorted(r0[s]["step_s"] for s in range(warm_end + 1, named + 1))[(named - warm_end) // 2]
    data = found[0]["data"]
    window_s = data["window_steps"] * step_s
    # The streak that named it: its windows' own spans hold >= 1 s, about one window past it,
    # however the pace moved after the warm-up (rank 0's clock here, a few ms from rank 1's). On
    # a loaded machine a window can miss the slowness and restart the streak: counted from there.
    first = named - data["windows"] * data["window_steps"] + 1
    streak_s = r0[named]["time"] - r0[first - 1]["time"]
    assert 0.95 <= streak_s <= 1.0 + 1.5 * window_s + 0.1, (named, first, streak_s, step_s, data)
    assert data["evidence_s"] >= 1.0 - 1e-6
    assert evidence <= 60, evidence
    if 20 * step_s >= 1.2:  # where 20 steps last 1 s or more: within 20 steps of the warm-up
        assert named - warm_end <= 20 + 1, (named, warm_end, step_s)


def test_adaptive_windows_balanced_job_names_no_one(tmp_path):
    run = tmp_path / "run"
    env = {k: v for k, v in ENV.items() if k != "STEPWATCH_STRAGGLER_EVERY"}
    torchrun(ARGS, {"STEPWATCH_DIR": str(run), **env}, tmp_path)
    named = findings(run, 0, "straggler") + findings(run, 1, "straggler")
    assert not named, (named, window_compute(run))


# A DDP job whose rank 1 turns slow at --slow-from and stays slow to the last step (a sleep in its
# forward: compute, as the exchange measures it). Its own script: the shared job script's slow rank
# is slow from the first step.
LATE_JOB = r'''
import stepwatch.auto  # noqa: F401  -- the one line
import argparse, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=70)
p.add_argument("--slow-from", type=int, default=48)
p.add_argument("--slow-s", type=float, default=0.04)
a = p.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))
model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(a.steps):
    x = torch.randn(32, 64)
    if rank == 1 and step >= a.slow_from:
        time.sleep(a.slow_s)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.barrier()
dist.destroy_process_group()
'''


def test_rank_slow_only_after_the_last_exchange_is_named_at_shutdown(tmp_path):
    """Windows of 8 steps, 3 in a row: rank 1 is slow from step 48 to the job's last step 69, in
    windows 6 and 7 and the partial window 8 (steps 64-69) that no exchange follows. The leader
    judges that last window at shutdown and names rank 1 (was: nobody, the job ended first).

    Rank 1 is ~20x slower from step 48 (~43 ms against ~2 ms): a margin of 3 (4x) names it there
    and nowhere before. With the module's 0.5, one noisy window before step 48 (a rank's median of
    ~3 ms against ~2 ms, once in a fresh-clone CI run) made three in a row at window 7."""
    job = tmp_path / "late.py"
    job.write_text(LATE_JOB[1:])
    run = tmp_path / "run"
    env = {"STEPWATCH_DIR": str(run), **ENV, "STEPWATCH_STRAGGLER_MARGIN": "3"}
    r = torchrun(["--steps", "70", "--slow-from", "48"], env, tmp_path, script=str(job))
    found = findings(run, 0, "straggler")
    assert found, (f"no straggler finding on rank 0; window medians: {window_compute(run)}", r.stderr[-2000:])
    assert [f["data"]["ranks"] for f in found] == [[1]], found
    assert found[0]["data"]["window"] == 8 and found[0]["step"] == 69, found
    assert found[0]["data"]["compute_s"]["1"] > 1.5 * found[0]["data"]["compute_s"]["0"]
    assert not findings(run, 1, "straggler")
    assert len(records(run, 0)) == 70 and len(records(run, 1)) == 70
