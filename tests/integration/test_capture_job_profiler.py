"""A job that profiles itself, and stepwatch's captures (real jobs, real torch.profiler).

The job's own profiler wins (docs/hang.md): a capture never crashes it, nor leaves it without its
trace, and `stepwatch capture` says at once when the job's profiler keeps a capture from being
taken, and which steps a capture cut short holds.

1. The job's profiler starts *inside* a step while a capture records -- a scheduled profiler
   stepped per micro-batch (4 a step), or ``with profile(): loss.backward()`` every 5th step. Its
   prepare takes torch's profiler session over, and the capture ran on: its stop found no session
   (torch: "disableProfiler called but no active profiling session found") and its export of
   those empty results was a segmentation fault in ``kineto_results.save`` (exit -11, every run).
   Now the capture is dropped: the job exits 0 with every trace of its own profiler whole, nothing
   is exported, run.json counts it in ``skipped``, and `stepwatch capture` says why.
2. The job's profiler runs around its whole loop: `stepwatch capture` was answered with planned
   steps, then waited its whole --timeout and said "not analysed" without a reason; now it is
   refused at once, naming the job's profiler.
3. The job's profiler starts after the request was answered, before the capture's first step: the
   capture is skipped there, and the command says so as soon as the rank has written why.
4. The job's profiler starts between two captured steps: the capture is cut short, and the command
   ends with the steps it holds (it printed only the planned ones).
"""

import glob
import json
import os
import subprocess
import sys
import time

import pytest

from test_hang import ROOT

# shares_cores: the bounds are the command's answer coming well before its --timeout (20 s): a
# refusal takes ~1 s alone, the bounds 8-15 s; a test beside it is no threat to them.
pytestmark = [pytest.mark.integration, pytest.mark.shares_cores]

TAKEN_OVER = "taken over: the job's own profiler started inside a captured step"
BUSY = "busy: the job's own profiler is running"

JOB = r'''
import glob, json, os, sys, time
import torch, torch.nn as nn
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile, schedule
import stepwatch

mode, run, out = sys.argv[1], sys.argv[2], sys.argv[3]
stop_file = os.path.join(out, "stop")
stepwatch.init(dir=run, console="off")
hub = stepwatch.get_session().hub
torch.manual_seed(0)
model = nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
cycles = []  # what the job's own profiler handed back, each time


def ready(p):
    names = {e.name for e in p.events()}
    cycles.append({"events": len(p.events()), "job": "job_work" in names})


def taken():
    for f in glob.glob(os.path.join(run, "requests", "capture-*.taken.json")):
        return json.load(open(f))
    return None


def micro():
    with record_function("job_work"):
        model(torch.randn(8, 16)).mean().backward()


job, job_from, stopped = None, None, False
if mode == "accum":  # a scheduled profiler stepped per micro-batch: it prepares inside each step
    job = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=2),
                  on_trace_ready=ready)
    job.start()
elif mode == "loop":  # the job's profiler around its whole loop
    job = profile(activities=[ProfilerActivity.CPU])
    job.start()
t0 = time.monotonic()
i = 0
while time.monotonic() - t0 < 60 and not os.path.exists(stop_file):
    if mode in ("after_taken", "cut") and job is None:
        a = taken()
        if a is not None and "capture" in a and (mode == "after_taken" or hub.step >= a["first_step"] + 1):
            job = profile(activities=[ProfilerActivity.CPU])  # at the top of the loop: between steps
            job.start()
            job_from = i
    if mode == "accum":
        for k in range(4):
            micro()
            job.step()
    elif mode == "backward" and i % 5 == 0:
        loss = model(torch.randn(8, 16)).mean()
        with profile(activities=[ProfilerActivity.CPU]) as p:  # inside the step: around its backward only
            with record_function("job_work"):
                loss.backward()
        ready(p)
    else:
        micro()
    opt.step()
    opt.zero_grad()
    if job_from is not None and i == job_from + 3:
        job.stop()
        ready(job)
        stopped = True
    time.sleep(0.01)
    i += 1
if job is not None and not stopped:
    job.stop()
    if mode != "accum":  # a scheduled profiler hands its cycles over by itself
        ready(job)
if job is not None or cycles:
    (job if job is not None else p).export_chrome_trace(os.path.join(out, "job_trace.json"))
stepwatch.shutdown()
json.dump({"cycles": cycles, "steps": i}, open(os.path.join(out, "job.json"), "w"))
print("finished", flush=True)
'''


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env.update({"PYTHONPATH": os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
                "OMP_NUM_THREADS": "1", "STEPWATCH_CONSOLE": "off", "STEPWATCH_GPU_TELEMETRY": "0",
                "STEPWATCH_WATCHDOG": "off", "STEPWATCH_CAPTURE": "on",
                # no automatic capture (a step the job's profiler slowed is a spike): only the one asked for
                "STEPWATCH_CAPTURE_MAX": "0"})
    return env


def _run(tmp_path, mode, steps=3):
    """Start the job, ask for a capture once it runs, let it go on briefly, end it. Returns
    (the command's result, the seconds it took, the job's exit code and output, run dir)."""
    script = tmp_path / "job.py"
    script.write_text(JOB[1:])
    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    job = subprocess.Popen([sys.executable, "-X", "faulthandler", str(script), mode, str(run), str(out)], env=_env(),
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 30
        while not (run / "run.json").exists() and job.poll() is None and time.monotonic() < end:
            time.sleep(0.1)
        time.sleep(0.3)
        t0 = time.monotonic()
        cli = subprocess.run([sys.executable, "-m", "stepwatch", "capture", str(run), "--steps", str(steps),
                              "--timeout", "20"], env=_env(), capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
        time.sleep(0.3)  # a few steps more after the capture
        (out / "stop").write_text("")
        output, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    return cli, took, job.returncode, output, run, out


@pytest.mark.parametrize("mode", ["accum", "backward"])
def test_the_jobs_profiler_started_inside_a_captured_step_crashes_nothing_and_keeps_its_trace(tmp_path, mode):
    cli, took, rc, output, run, out = _run(tmp_path, mode, steps=3 if mode == "accum" else 10)
    assert rc == 0 and "finished" in output, (rc, output[-3000:], cli.stderr[-2000:])
    # The job's own profiler: every trace it handed back holds its work (a scheduled one's last,
    # handed back at its stop, may hold part of a cycle), and its last one exports.
    cycles = json.load(open(out / "job.json"))["cycles"]
    assert len(cycles) >= 5 and all(c["events"] > 0 and c["job"] for c in cycles[:-1]), cycles
    events = json.load(open(out / "job_trace.json"))["traceEvents"]
    assert any(e.get("name") == "job_work" for e in events)
    caps = json.load(open(run / "run.json"))["features"]["capture"]["captures"]
    assert caps["captures"] == [] and caps["skipped"].get(TAKEN_OVER) == 1, caps
    assert not glob.glob(str(run / "captures" / "capture-*.trace.json*")), os.listdir(run / "captures")
    assert output.count("dropped: the job's own profiler started inside step") == 1, output[-3000:]
    assert "no active profiling session" not in output, output[-3000:]  # never stopped a session not ours
    (note,) = glob.glob(str(run / "captures" / "skipped-1.rank0.json"))
    assert json.load(open(note))["skipped"] == TAKEN_OVER
    # The command says why, as soon as the rank has: not after its --timeout.
    assert cli.returncode == 1 and took < 12, (took, cli.stderr)
    assert "rank 0 did not take capture 1: the job's own profiler started inside step" in cli.stderr, cli.stderr


def test_stepwatch_capture_is_refused_at_once_while_the_jobs_profiler_runs(tmp_path):
    cli, took, rc, output, run, out = _run(tmp_path, "loop")
    assert rc == 0, output[-3000:]
    assert cli.returncode == 1 and took < 8, (took, cli.stderr)
    assert "refused the capture: the job's own profiler is running" in cli.stderr, cli.stderr
    assert "capture 1: steps" not in cli.stderr, cli.stderr  # no planned steps for a capture never taken
    caps = json.load(open(run / "run.json"))["features"]["capture"]["captures"]
    assert caps["captures"] == [] and caps["skipped"].get(BUSY) == 1, caps
    assert json.load(open(out / "job.json"))["cycles"][0]["job"]


def test_a_capture_the_jobs_profiler_kept_from_its_first_step_is_said_at_once(tmp_path):
    cli, took, rc, output, run, out = _run(tmp_path, "after_taken")
    assert rc == 0, output[-3000:]
    assert cli.returncode == 1 and took < 12, (took, cli.stderr)
    assert f"rank 0 did not take capture 1: {BUSY}" in cli.stderr, cli.stderr
    assert "not analysed" not in cli.stderr, cli.stderr
    caps = json.load(open(run / "run.json"))["features"]["capture"]["captures"]
    assert caps["captures"] == [] and caps["skipped"].get(BUSY) == 1, caps


def test_stepwatch_capture_ends_with_the_steps_a_capture_cut_short_holds(tmp_path):
    cli, took, rc, output, run, out = _run(tmp_path, "cut")
    assert rc == 0, output[-3000:]
    assert cli.returncode == 0 and took < 15, (took, cli.stderr)
    (meta,) = [json.load(open(p)) for p in glob.glob(str(run / "captures" / "capture-1-steps*.rank0.json"))]
    a, b = meta["first_step"], meta["last_step"]
    assert meta["cut_short"] and b < a + 2, meta  # planned a..a+2
    assert f"capture 1: steps {a}-{a + 2} on 1 rank(s)" in cli.stderr, cli.stderr  # what it planned, first
    assert (f"capture 1: rank 0 captured steps {a}-{b} of {a}-{a + 2}: cut short ({meta['cut_short']})"
            in cli.stderr.splitlines()[-1]), cli.stderr  # and at the end what it holds
