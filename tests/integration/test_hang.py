"""The hang watchdog on real 2-rank gloo DDP jobs (torchrun), with the one-line import only.

Rank 1 stops before its forward at some step -- sleeping, or holding the GIL in a C call -- while
rank 0 blocks in the gradient AllReduce. Within STEPWATCH_HANG_TIMEOUT + 30 s, report.json must
name rank 1 and the AllReduce, and both ranks' stacks must show where they are.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.integration

# The training job every test of the watchdog and captures runs (written to the test's tmp dir).
JOB = r'''
import stepwatch.auto  # noqa: F401  -- the one line
import argparse, ctypes, os, signal, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--hang-step", type=int, default=-1)
p.add_argument("--gil", action="store_true")
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--first-sleep", type=float, default=0.0)
p.add_argument("--spike-steps", default="")
p.add_argument("--spike-s", type=float, default=0.5)
p.add_argument("--usr1-handler", action="store_true")
p.add_argument("--ready", default="")
a = p.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
got = []
if a.usr1_handler:  # installed after stepwatch's, as a job (SLURM, Lightning) would
    signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
spikes = {int(s) for s in a.spike_steps.split(",") if s}
for step in range(a.steps):
    x = torch.randn(16, 32)
    if step == a.hang_step and rank == 1:
        with open("hang_start", "w") as f:
            f.write(repr(time.time()))
        if a.gil:
            ctypes.PyDLL(None).sleep(3600)  # GIL-HOLD: PyDLL keeps the GIL during the call
        else:
            time.sleep(3600)  # SLEEP-HERE
    if step in spikes:
        time.sleep(a.spike_s)
    if a.step_sleep:
        time.sleep(a.step_sleep)
    loss = model(x).pow(2).mean()
    if step == 0 and a.first_sleep:
        time.sleep(a.first_sleep)  # a long first step (compilation, warm-up)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if a.ready and step == 3:
        with open(f"{a.ready}.rank{rank}", "w") as f:
            f.write(str(os.getpid()))
print(f"rank {rank} done; SIGUSR1 handler calls: {len(got)}", flush=True)
dist.destroy_process_group()
'''


def line_of(marker):
    return next(i for i, line in enumerate(JOB.splitlines()[1:], 1) if marker in line)


def start_job(tmp_path, args, env_extra):
    job = tmp_path / "job.py"
    job.write_text(JOB[1:])
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1", "STEPWATCH_CONSOLE": "off",
                "STEPWATCH_GPU_TELEMETRY": "0", "STEPWATCH_DIR": str(tmp_path / "run")})
    env.update(env_extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(job), *args]
    # Own session: the test can end the whole job (torchrun, ranks, sidecars) by its group id.
    return subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def stop_job(proc, run=None):
    """End the job: torchrun stops its ranks on SIGTERM (they run in sessions of their own, so a
    process-group kill would miss them); any rank still alive after that is killed by its pid."""
    if hasattr(proc, "output"):
        return proc.output
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    for f in (run.glob("rank*.json") if run is not None else []):
        try:
            os.kill(json.loads(f.read_text())["pid"], signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            pass
    proc.output, _ = proc.communicate(timeout=30)
    return proc.output


def wait_for(path, proc, limit_s):
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if path.exists():
            time.sleep(0.5)  # written atomically; let the log line follow
            return True
        if proc.poll() is not None:
            return path.exists()
        time.sleep(0.25)
    return False


TIMEOUT_S = 5.0


def check_report(run, first_line):
    # JOB's source line numbers: the script starts at JOB's second line. The report is rank 0's
    # first hang; each rank's stacks lie in its own episode's dir (rank 1 may have stalled past the
    # timeout once before, waiting for a slow rank 0: then this hang is its hang-2).
    rep = json.loads((run / "hang-1" / "report.json").read_text())
    assert rep["laggards"] == [1], rep
    hang_start = float((run.parent / "hang_start").read_text())
    assert rep["time"] - hang_start <= TIMEOUT_S + 30
    assert rep["waiting"] == [0] and rep["verdict"] == "laggard"
    assert rep["collective"]["op"] == "allreduce"
    assert rep["detected_after_s"] >= TIMEOUT_S
    ranks = {r["rank"]: r for r in rep["ranks"]}
    assert set(ranks) == {0, 1} and ranks[0]["phase"] == "backward" and ranks[1]["phase"] != "backward"
    assert os.path.samefile(ranks[0]["stacks"], run / "hang-1" / "stacks.rank0.txt")
    s1 = open(ranks[1]["stacks"]).read()
    s0 = open(ranks[0]["stacks"]).read()
    assert f"job.py:{first_line})" in s1, s1
    assert f"job.py:{first_line})" in ranks[1]["top_frames"][0] or any(
        f"job.py:{first_line})" in f for f in ranks[1]["top_frames"])
    assert "backward" in s0 and f"job.py:{line_of('loss.backward()')})" in s0, s0
    assert "Laggard: rank 1" in rep["summary"]
    findings = [json.loads(x) for x in (run / "findings.watchdog.rank0.jsonl").read_text().splitlines()]
    assert [f["kind"] for f in findings] == ["hang"] and findings[0]["data"]["laggards"] == [1]
    manifest_hint = json.loads((run / "watchdog.rank1.json").read_text())
    assert manifest_hint["stack_method"] in ("py-spy", "faulthandler")
    return rep


@pytest.mark.shares_cores  # found by the stacks; a busy machine only delays the verdict
def test_sleeping_rank_is_named_and_the_job_keeps_waiting(tmp_path):
    proc = start_job(tmp_path, ["--steps", "40", "--hang-step", "6"], {"STEPWATCH_HANG_TIMEOUT": str(TIMEOUT_S)})
    try:
        t0 = time.monotonic()
        assert wait_for(tmp_path / "run" / "hang-1" / "report.json", proc, 60 + TIMEOUT_S + 30), stop_job(proc, tmp_path / "run")
        rep = check_report(tmp_path / "run", line_of("SLEEP-HERE"))
        assert proc.poll() is None, "the default action (dump) must leave the job running"
        # Rank 0's pipeline still runs (its main thread waits in gloo): the finding joins its stream.
        end = time.monotonic() + 10
        kinds = []
        while "hang" not in kinds and time.monotonic() < end:
            time.sleep(0.5)
            text = (tmp_path / "run" / "findings.rank0.jsonl").read_text()
            kinds = [json.loads(x)["kind"] for x in text.splitlines() if x.strip()]
        assert "hang" in kinds
        # Dumped once per hang: no second snapshot of it (a stall that ended before it may have one).
        hang_start = float((tmp_path / "hang_start").read_text())
        for r in (0, 1):
            snaps = [json.loads(p.read_text()) for p in (tmp_path / "run").glob(f"hang-*/progress.rank{r}.json")]
            assert len([s for s in snaps if s["detected_at"] > hang_start]) == 1, (r, snaps)
        assert time.monotonic() - t0 < 120
    finally:
        out = stop_job(proc, tmp_path / "run")
    assert "Hang 1:" in out and "Laggard: rank 1" in out, out[-3000:]


@pytest.mark.shares_cores  # found by the stacks; a busy machine only delays the verdict
def test_gil_holding_rank_is_named_and_exit_ends_the_job(tmp_path):
    proc = start_job(tmp_path, ["--steps", "40", "--hang-step", "6", "--gil"],
                     {"STEPWATCH_HANG_TIMEOUT": str(TIMEOUT_S), "STEPWATCH_HANG_ACTION": "exit"})
    try:
        assert wait_for(tmp_path / "run" / "hang-1" / "report.json", proc, 60 + TIMEOUT_S + 30), stop_job(proc, tmp_path / "run")
        check_report(tmp_path / "run", line_of("GIL-HOLD"))
        proc.wait(timeout=60)  # STEPWATCH_HANG_ACTION=exit: the sidecars end the ranks; torchrun fails
        assert proc.returncode != 0
    finally:
        stop_job(proc, tmp_path / "run")


def test_slow_steps_and_a_long_first_step_are_no_hang(tmp_path):
    proc = start_job(tmp_path, ["--steps", "4", "--first-sleep", "5", "--step-sleep", "1.6"],
                     {"STEPWATCH_HANG_TIMEOUT": "2.5"})
    try:
        proc.wait(timeout=120)
    finally:
        out = stop_job(proc, tmp_path / "run")
    assert proc.returncode == 0, out[-3000:]
    run = tmp_path / "run"
    assert not list(run.glob("hang-*")), out[-3000:]
    steps = [json.loads(x) for x in (run / "steps.rank1.jsonl").read_text().splitlines()]
    assert len(steps) == 4 and all(s["step_s"] > 1.5 for s in steps[1:])
    manifest = json.loads((run / "run.json").read_text())
    wd = manifest["features"]["capture"]["hang_watchdog"]
    assert wd["enabled"] and wd["timeout_s"] == 2.5 and set(wd["stack_dump"]) == {"0", "1"}
